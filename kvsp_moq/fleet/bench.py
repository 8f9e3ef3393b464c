"""`kvsp bench fleet`: a fleet on one machine, where links and not loopback decide.

fanout  N fetch clients (default 4) load the same prefix (64 MiB: four 16 MiB blocks of 32
        layers) at the same instant, through the relay over MOQT, then directly from the holder
        over HTTP, each a fresh prefix (the relay's cache cold). Per transport: seconds until
        every client has the whole prefix, verified, and the octets that left the holder's and
        the relay's interfaces meanwhile (interface counters, Ethernet headers included). The
        relay fetches each block from the holder once for all clients, so MOQT costs the
        holder's link about one copy where HTTP costs N. Links: holder 200 Mbit/s, relay,
        index and clients 1 Gbit/s, MTU 1,500.
mtu     one client loads 16 MiB blocks, one at a time, cold, through the relay and over HTTP,
        on unshaped links of MTU 1,500 and 9,000: what the datagram size does once the CPUs,
        not the links, are the limit. Every MOQT endpoint sends datagrams of its path's size
        (MTU - 28, KVSP_MOQT_DATAGRAM_SIZE set from the topology).
placement
        inference instances (`kvsp agent`, the tiny model) on links of 1 Gbit/s, 400 Mbit/s
        and 50 Mbit/s; a 2,048-token prompt whose first 1,920 tokens are cached at another
        instance. Per request, the PC's choice against the best in hindsight (every
        candidate's measured TTFT for the same request), with the links as set and after the
        fastest link drops to 50 Mbit/s (`kvsp_moq.fleet.placement`).
loss    one client on the fan-out's links loads a 16 MiB prefix with no loss and with 5% of
        the frames dropped each way on its link, over HTTP and as an agent with a relay does
        (MOQT first, HTTP from the layer where MOQT failed): loads complete, verified, the
        slowdown, and which source delivered the layers.

live    prefill and decode apart across links (`kvsp_moq.fleet.live`): a prompt prefilled at a
        producer and decoded at a consumer that subscribes to its layers while they are
        computed, against the consumer alone and against loading the blocks once stored.

The fan-out is also drawn (clients done over time, octets out of the holder and the relay;
`kvsp_moq.bench.figures`) and the PNG's path reported as `fanout.fanout_png`.

Rounds alternate the transports, and figures are medians over rounds, so a neighbour on the
machine slows both alike. A client is a process in its own namespace that loads as an agent
does (leases, layers verified against their records, MOQT first where allowed); it has no
model, so what is measured is the data path.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from kvsp_moq.bench import figures
from kvsp_moq.errors import Failed, NamespaceError
from kvsp_moq.fleet.live import live
from kvsp_moq.fleet.network import fleet_unavailable
from kvsp_moq.fleet.placement import placement
from kvsp_moq.fleet.services import Fleet, terminate_as_interrupt
from kvsp_moq.fleet.topology import fleet_topology

MiB = 1 << 20
MB = 1e6
#: How long one load may take before the run is called failed.
LOAD_TIMEOUT_S = 300.0
#: Seconds between sending the clients their load and its start (they all get it first).
START_MARGIN_S = 0.5

NOTE = (
    "fanout: N clients load one prefix at the same instant; seconds_all runs from that instant "
    "until the last client has every layer, verified against its record (median over rounds); "
    "holder_egress_bytes and relay_egress_bytes are the tx octets of their interfaces over that "
    "time (Ethernet, IP and transport headers included), so 1.0x the prefix is one copy. "
    "block_bytes is the prefix: blocks x bytes_per_block of layer payload. "
    "ratio_time_moqt_vs_http = MOQT seconds_all / HTTP seconds_all. mtu: one client, unshaped "
    "links, blocks loaded one at a time with a cold relay cache; MB/s = 10^6 octets/s of payload. "
    "loss: one client, the fan-out's links, loss_percent of the frames dropped at random each way "
    "on its link (nftables; frames_dropped counts them); moqt is the agent's order (MOQT, then "
    "HTTP from the layer where MOQT failed: layers_with_loss says which delivered what); "
    "slowdown = seconds with loss / seconds without. placement: regret = TTFT of the PC's choice "
    "/ the best candidate's TTFT, both measured directly for the same request (a fresh prefix "
    "of the same length each); pc_chose_best counts regrets within 1.15 (a tie within noise); "
    "routed.ttft_ms is what the front end saw through the PC (route, then generation), and "
    "regret_routed = routed.ttft_ms / the best candidate's TTFT; reported_mbit is what each "
    "instance measured and reported to the PC. "
    "live: TTFT from the front end's first request to the consumer's first token; "
    "producer_egress_copies = octets out of the producer's interface while a prompt streams / "
    "the prompt's KV (headers included). "
    "There is no delay on any link (no netem here): round trips are the machine's. "
    "The machine's CPUs are shared with other work: "
    "figures vary from run to run.")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def _cpu_ns(pid: int) -> int:
    """CPU time of a process's threads so far (schedstat: nanoseconds); 0 where unknown."""
    total = 0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                pass  # a thread that ended meanwhile
    except OSError:
        pass
    return total


def _cpu(fleet: Fleet) -> dict[str, int]:
    out = {name: _cpu_ns(proc.pid) for name, (proc, _) in fleet.servers.items()}
    out["clients"] = sum(_cpu_ns(c.proc.pid) for c in fleet.clients.values())
    return out


def load_all(fleet: Fleet, keys: list[str], transport: str, digests: list[str] | None = None) -> dict[str, Any]:
    """Every client loads `keys` at the same instant; the run's figures."""
    clients = list(fleet.clients.values())
    holder = fleet.topology.of_role("holder")[0].name
    relay = fleet.topology.of_role("relay")[0].name
    before = {name: fleet.net.counters(name) for name in (holder, relay)}
    cpu_before = _cpu(fleet)
    start_at = time.monotonic() + START_MARGIN_S
    for client in clients:
        client.send("load", keys=keys, transport=transport, start_at=start_at, digest=digests is not None)
    answers = [client.receive(LOAD_TIMEOUT_S) for client in clients]
    cpu_after = _cpu(fleet)
    after = {name: fleet.net.counters(name) for name in (holder, relay)}
    for client, answer in zip(clients, answers):
        if not answer.get("ok") or answer["errors"]:
            raise Failed(f"{client.name} could not load over {transport}: "
                         f"{answer.get('error') or answer['errors']}\n{fleet.logs()}")
        if digests is not None and [answer["digests"].get(k) for k in keys] != digests:
            raise Failed(f"{client.name} loaded other bytes than were stored")
    return {
        "seconds_all": round(max(a["finished"] for a in answers) - start_at, 3),
        "seconds_each": [round(a["finished"] - start_at, 3) for a in answers],
        "holder_egress_bytes": after[holder].tx_bytes - before[holder].tx_bytes,
        "relay_egress_bytes": after[relay].tx_bytes - before[relay].tx_bytes,
        "layers": _sum_layers(answers),
        "fallbacks": sum(len(a["failures"]) for a in answers),
        # what the processes spent meanwhile: near 2 x seconds_all on two cores means that
        # the CPUs, not the links, set the pace
        "cpu_seconds": {name: round((cpu_after[name] - cpu_before[name]) / 1e9, 2)
                        for name in cpu_after if name in (holder, relay, "clients")},
    }


def _sum_layers(answers: list[dict[str, Any]]) -> dict[str, int]:
    """Layers delivered by each kind of source, over clients' answers or runs."""
    out: dict[str, int] = {}
    for answer in answers:
        for kind, n in answer["layers"].items():
            out[kind] = out.get(kind, 0) + n
    return out


def prepare(fleet: Fleet, seed: str, blocks: int, block_bytes: int) -> tuple[list[str], list[str]]:
    """Store `blocks` blocks at the holder (from its own namespace: no link carries them) and
    let every client look them up: (keys, payload digests)."""
    seeder = fleet.seeder()
    try:
        seeded = seeder.request("seed", timeout=LOAD_TIMEOUT_S, holder=fleet.holder_url(), blocks=blocks,
                                block_bytes=block_bytes, seed=seed)
    finally:
        fleet.host(fleet.topology.of_role("holder")[0].name).stop(seeder.proc)
    for client in fleet.clients.values():
        client.send("lookup", keys=seeded["keys"], timeout=60)
    for client in fleet.clients.values():
        answer = client.receive(90)
        if not answer.get("ok"):
            raise Failed(f"{client.name}: {answer.get('error')}\n{fleet.logs()}")
    return seeded["keys"], seeded["digests"]


def connect(fleet: Fleet) -> None:
    """Every client opens its MOQT session to the relay, as an agent keeps one open."""
    for client in fleet.clients.values():
        client.send("connect")
    for client in fleet.clients.values():
        answer = client.receive(60)
        if not answer.get("ok"):
            raise Failed(f"{client.name}: {answer.get('error')}\n{fleet.logs()}")


def fanout(*, clients: int = 4, blocks: int = 4, block_bytes: int = 16 * MiB, rounds: int = 2,
           holder_rate: float | None = 200.0, relay_rate: float | None = 1000.0,
           client_rate: float | None = 1000.0, mtu: int = 1500, engine: str | None = None,
           verify_digests: bool = True) -> dict[str, Any]:
    """Figures of benchmark 1 (see the module's docstring)."""
    topology = fleet_topology(clients=clients, mtu=mtu, holder_rate=holder_rate, relay_rate=relay_rate,
                              client_rate=client_rate)
    prefix = blocks * block_bytes
    runs: dict[str, list[dict[str, Any]]] = {"moqt": [], "http": []}
    with Fleet(topology, engine=engine) as fleet:
        # a fresh prefix for each load, so that the relay's cache is cold for every MOQT one
        keys, digests = prepare(fleet, os.urandom(4).hex(), 2 * rounds * blocks, block_bytes)
        prefixes = {}
        for i, (r, t) in enumerate((r, t) for r in range(rounds) for t in ("moqt", "http")):
            prefixes[(r, t)] = (keys[i * blocks:(i + 1) * blocks], digests[i * blocks:(i + 1) * blocks])
        connect(fleet)
        for r in range(rounds):
            for transport in ("moqt", "http") if r % 2 == 0 else ("http", "moqt"):
                keys, digests = prefixes[(r, transport)]
                runs[transport].append(load_all(fleet, keys, transport, digests if verify_digests else None))
        datagram = fleet.datagram_size(topology.of_role("relay")[0].name)

    def summary(transport: str) -> dict[str, Any]:
        rs = runs[transport]
        out: dict[str, Any] = {
            "seconds_all": round(_median([r["seconds_all"] for r in rs]), 3),
            "holder_egress_bytes": round(_median([r["holder_egress_bytes"] for r in rs])),
        }
        if transport == "moqt":
            out["relay_egress_bytes"] = round(_median([r["relay_egress_bytes"] for r in rs]))
        out["holder_egress_vs_prefix"] = round(out["holder_egress_bytes"] / prefix, 3)
        out["runs"] = rs
        return out

    moqt, http = summary("moqt"), summary("http")
    return {
        "agents": clients,
        "block_bytes": prefix,
        "blocks": blocks,
        "bytes_per_block": block_bytes,
        "moqt": moqt,
        "http": http,
        "ratio_time_moqt_vs_http": _ratio(moqt["seconds_all"], http["seconds_all"]),
        "ratio_holder_egress_moqt_vs_http": _ratio(moqt["holder_egress_bytes"], http["holder_egress_bytes"]),
        "links": {"mtu": mtu, "holder_mbit": holder_rate, "relay_mbit": relay_rate, "client_mbit": client_rate},
        "datagram_size": datagram,
        "rounds": rounds,
    }


def mtu_rates(mtu: int, *, blocks: int = 3, block_bytes: int = 16 * MiB, engine: str | None = None) -> dict[str, Any]:
    """Benchmark 3 at one MTU: one client, unshaped links, blocks one at a time, turns taken."""
    topology = fleet_topology(clients=1, mtu=mtu, holder_rate=None, relay_rate=None, client_rate=None,
                              index_rate=None)
    times: dict[str, list[float]] = {"moqt": [], "http": []}
    with Fleet(topology, engine=engine) as fleet:
        # a warm-up block of each kind, then `blocks` fresh blocks per transport
        keys, digests = prepare(fleet, os.urandom(4).hex(), 2 * blocks + 2, block_bytes)
        connect(fleet)
        for i, key in enumerate(keys):
            transport = "moqt" if i % 2 == 0 else "http"
            run = load_all(fleet, [key], transport, [digests[i]])
            if i >= 2:
                times[transport].append(run["seconds_all"])
        datagram = fleet.datagram_size(topology.of_role("relay")[0].name)
    moqt = round(block_bytes / _median(times["moqt"]) / MB, 1)
    http = round(block_bytes / _median(times["http"]) / MB, 1)
    return {"mtu": mtu, "datagram_size": datagram, "moqt_mb_per_s": moqt, "http_mb_per_s": http,
            "moqt_vs_http": _ratio(moqt, http), "blocks": blocks, "bytes_per_block": block_bytes}


def loss(*, percent: float = 5.0, blocks: int = 2, block_bytes: int = 8 * MiB, rounds: int = 2,
         engine: str | None = None) -> dict[str, Any]:
    """One client on the fan-out's links loads a prefix with no loss and with `percent` lost
    each way on its link: over HTTP, and as an agent does with a relay (MOQT first, the rest
    over HTTP from the layer where MOQT failed). Loads complete, verified; how much slower,
    and how many layers still came over MOQT."""
    topology = fleet_topology(clients=1)
    runs: dict[tuple[float, str], list[dict[str, Any]]] = {}
    dropped = 0
    with Fleet(topology, engine=engine) as fleet:
        cases = [(p, t) for _ in range(rounds) for p in (0.0, percent) for t in ("moqt", "http")]
        keys, digests = prepare(fleet, os.urandom(4).hex(), len(cases) * blocks, block_bytes)
        connect(fleet)
        for i, (p, transport) in enumerate(cases):
            if fleet.net.links["client1"].loss_percent != p:
                dropped += fleet.net.dropped("client1")
                fleet.net.set_loss("client1", p)
            part = slice(i * blocks, (i + 1) * blocks)
            run = load_all(fleet, keys[part], "any" if transport == "moqt" else "http", digests[part])
            runs.setdefault((p, transport), []).append(run)
        dropped += fleet.net.dropped("client1")
    prefix = blocks * block_bytes
    out: dict[str, Any] = {"percent": percent, "prefix_bytes": prefix, "frames_dropped": dropped}
    for transport in ("moqt", "http"):
        clean = _median([r["seconds_all"] for r in runs[(0.0, transport)]])
        lossy = _median([r["seconds_all"] for r in runs[(percent, transport)]])
        out[transport] = {"seconds": round(clean, 3), "seconds_with_loss": round(lossy, 3),
                          "mb_per_s": round(prefix / clean / MB, 1),
                          "mb_per_s_with_loss": round(prefix / lossy / MB, 1),
                          "slowdown": _ratio(lossy, clean),
                          "layers_with_loss": _sum_layers(runs[(percent, transport)]),
                          "fallbacks_with_loss": sum(r["fallbacks"] for r in runs[(percent, transport)])}
    return out


def run(*, quick: bool = False) -> dict[str, Any]:
    from kvsp_moq.bench.moqt import cpu_parallelism

    reason = fleet_unavailable()
    if reason is not None:  # before anything is measured
        raise NamespaceError(f"cannot build a fleet here: {reason}")
    started = time.perf_counter()
    with terminate_as_interrupt():
        parallelism = cpu_parallelism()
        if quick:
            fan = fanout(clients=4, blocks=2, block_bytes=8 * MiB, rounds=1)
            placed = placement(trials=2)
            mtus = [mtu_rates(m, blocks=1, block_bytes=8 * MiB) for m in (1500, 9000)]
            lossy = loss(blocks=1, rounds=1)
            streamed = live(rounds=1)
        else:
            fan = fanout()
            placed = placement()
            mtus = [mtu_rates(m) for m in (1500, 9000)]
            lossy = loss()
            streamed = live()
    by_mtu = {str(m["mtu"]): m for m in mtus}
    fan["fanout_png"] = figures.write(figures.out_dir() / "kvsp-bench-fleet-fanout.png",
                                      figures.fanout_figure, fan)
    return {
        "benchmark": "fleet",
        "quick": quick,
        "machine": {"cpus": os.cpu_count(), "cpu_parallelism": parallelism,
                    "load_average": [round(x, 2) for x in os.getloadavg()]},
        "fanout": fan,
        "placement": placed,
        "mtu": {**by_mtu, "ratio_moqt_9000_vs_1500": _ratio(by_mtu["9000"]["moqt_mb_per_s"],
                                                             by_mtu["1500"]["moqt_mb_per_s"])},
        "loss": lossy,
        "live": streamed,
        "targets": {"moqt_holder_egress_vs_prefix": "<= 1.2 (HTTP: N)",
                    "ratio_time_moqt_vs_http": "<= 0.6"},
        "seconds": round(time.perf_counter() - started, 1),
        "note": NOTE,
    }
