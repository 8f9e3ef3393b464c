"""Benchmark 2 of `kvsp bench fleet`: placement on real links.

Inference instances (`kvsp agent`, the tiny model) sit on links of different rates; a cached
prefix lives at a source instance that reports to no PC (it computed the prefix and serves its
blocks as every agent does, through the relay over MOQT and over HTTP). For each request the
front end asks the PC where to run it (`POST {pc}route`, §6.4) and runs it there; then the
same request (a prefix of the same length cached at the source, a fresh suffix) runs on every
instance in turn, directly, which gives each candidate's measured time to first token: the
best choice in hindsight. The PC knows the links only from what each instance measured and
reported (§6.3): nothing is configured at the PC, and no instance reports a link it has not
measured.

Two phases: the links as set (by default 1 Gbit/s, 400 Mbit/s and 50 Mbit/s), then the
fastest instance's link dropped (to 50 Mbit/s) while the fleet runs. The second shows the PC
following a change it can only know from the instances' reports.

Per request: the PC's choice, its estimates, the front end's TTFT through the PC (route and
generation), every candidate's TTFT, `regret` = the TTFT of the PC's choice (measured directly,
as the others) / the best candidate's, and `regret_routed` = the TTFT through the PC / the best
candidate's (what the user got against the best there was). A choice counts as the best when
its TTFT is within `TIE` of the best one's, since two candidates that both recompute tie within
noise.
"""

from __future__ import annotations

import functools
import random
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any, Callable

import httpx

from kvsp_moq.errors import Failed
from kvsp_moq.fleet.services import SCOPE, Fleet, process_environment
from kvsp_moq.fleet.topology import Link, Topology
from kvsp_moq.protocol.keys import block_keys

#: Where the cached prefixes are computed and served from; it reports to no PC.
SOURCE = "source"
#: The front end's host.
EDGE = "edge"
#: The candidates' links (Mbit/s), in the order the PC should prefer them for a long prefix.
RATES = {"agent1": 1000.0, "agent2": 400.0, "agent3": 50.0}
#: The link change of the second phase.
DROP = ("agent1", 50.0)
#: A prompt: a prefix of PREFIX_TOKENS cached at the source, a fresh suffix.
PREFIX_TOKENS = 1920
SUFFIX_TOKENS = 128
BLOCK_TOKENS = 16
#: The tiny model's KV per token: 8 layers x (K, V) x 2 heads x 32 x float32.
KV_OCTETS_PER_TOKEN = 4096
#: Two TTFTs within this factor are a tie.
TIE = 1.15
#: How long the PC may take to hear every instance's measured links.
REPORT_S = 30.0
VOCAB = 4096


def topology(rates: dict[str, float] | None = None, *, mtu: int = 1500) -> Topology:
    """index, relay, the source, the candidates on their links, the front end's host."""
    topo = Topology()
    topo.add("index", "index", Link(mtu=mtu, rate_mbit=1000.0))
    topo.add("relay", "relay", Link(mtu=mtu, rate_mbit=1000.0))
    topo.add(SOURCE, "agent", Link(mtu=mtu, rate_mbit=1000.0))
    for name, rate in (rates or RATES).items():
        topo.add(name, "agent", Link(mtu=mtu, rate_mbit=rate))
    topo.add(EDGE, "client", Link(mtu=mtu, rate_mbit=1000.0))
    return topo


class FrontEnd:
    """The front end's HTTP, from the edge host's namespace (each call on a fresh connection,
    so that every TTFT includes the same connection set-up)."""

    def __init__(self, fleet: Fleet, compat_id: str) -> None:
        self.fleet = fleet
        self.compat_id = compat_id
        self.user = {"Authorization": f"Bearer {fleet.token('frontend')}"}
        self.reader = {"Authorization": f"Bearer {fleet.token(EDGE)}"}
        self.observer = {"Authorization": f"Bearer {fleet.token('pc')}"}
        self.rng = random.Random(0x6b7673)

    def _in_edge(self, fn: Callable[[httpx.Client], Any]) -> Any:
        def call() -> Any:
            with httpx.Client(trust_env=False, timeout=600) as client:
                return fn(client)

        return self.fleet.net.in_host(EDGE, call)

    @staticmethod
    def _ok(r: httpx.Response) -> Any:
        if r.status_code >= 300:
            raise Failed(f"{r.request.method} {r.request.url}: {r.status_code} {r.text[:300]}")
        return r.json()

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, VOCAB) for _ in range(n)]

    def _first_token(self, client: httpx.Client, url: str, tokens: list[int], *,
                     extra: dict[str, Any] | None = None,
                     started: float | None = None) -> tuple[dict[str, Any], float]:
        """Run a prompt at an instance, streamed as a front end reads it: the seconds until its
        first token arrives (from `started`, default now), and the session's summary once it
        has ended. `extra`: more members of the generate."""
        session = str(uuid.uuid4())
        started = time.perf_counter() if started is None else started
        first = None
        with client.stream("POST", url + "generate", headers=self.user, json={
                "tokens": tokens, "max_new_tokens": 1, "session": session, "stream": True,
                **(extra or {})}) as r:
            if r.status_code >= 300:
                r.read()
                self._ok(r)
            for line in r.iter_lines():
                if first is None and '"token"' in line:
                    first = time.perf_counter() - started
        if first is None:
            raise Failed(f"{url}: no token for session {session}")
        return self._ok(client.get(f"{url}sessions/{session}", headers=self.user)), first

    def generate(self, agent: str, tokens: list[int]) -> tuple[dict[str, Any], float]:
        """One request run on `agent` directly: its session and the front end's TTFT (ms)."""
        def call(client: httpx.Client) -> tuple[dict[str, Any], float]:
            summary, first = self._first_token(client, self.fleet.agent_url(agent), tokens)
            return summary, first * 1000

        return self._in_edge(call)

    def routed(self, tokens: list[int]) -> tuple[dict[str, Any], dict[str, Any], float, float]:
        """One request as a front end runs it: the PC's route, then the instance it names.
        The route's answer, the session's summary, the route's time and the TTFT (ms)."""
        def call(client: httpx.Client) -> tuple[dict[str, Any], dict[str, Any], float, float]:
            started = time.perf_counter()
            decision = self._ok(client.post(self.fleet.index_url + "route", headers=self.user, json={
                "tokens": tokens, "scope": SCOPE, "compat_id": self.compat_id,
                "block_tokens": BLOCK_TOKENS}))
            route_s = time.perf_counter() - started
            summary, first = self._first_token(client, decision["instance"], tokens)
            return decision, summary, route_s * 1000, (route_s + first) * 1000

        return self._in_edge(call)

    def seed(self, count: int) -> list[list[int]]:
        """`count` fresh prefixes computed at the source, each block indexed over HTTP and
        over MOQT before this returns."""
        prefixes = [self.tokens(PREFIX_TOKENS) for _ in range(count)]
        for prefix in prefixes:
            self.generate(SOURCE, prefix)
        keys = [[k.hex() for k in block_keys(self.fleet.scope_key, bytes.fromhex(self.compat_id),
                                             p, BLOCK_TOKENS)] for p in prefixes]
        deadline = time.monotonic() + 60

        def lookup(client: httpx.Client, want: list[str]) -> Any:
            return self._ok(client.post(self.fleet.index_url + "lookup", headers=self.reader, json={
                "scope_id": self.fleet.scope_id, "compat_id": self.compat_id, "block_keys": want}))

        for want in keys:
            while True:
                found = self._in_edge(functools.partial(lookup, want=want))
                blocks = found.get("blocks", [])
                kinds = [{str(r.get("holder", "")).startswith("moqt://") for r in b.get("replicas", [])}
                         for b in blocks]
                if found.get("matched") == len(want) and all(k == {True, False} for k in kinds):
                    break
                if time.monotonic() > deadline:
                    raise Failed(f"the source's blocks were not indexed in 60 s: {found.get('matched')}"
                                 f" of {len(want)}\n{self.fleet.logs()}")
                time.sleep(0.1)
        return prefixes

    def instances(self) -> dict[str, dict[str, Any]]:
        """The PC's view of every instance (its last status record), by agent name."""
        found = self._in_edge(lambda c: self._ok(c.get(self.fleet.index_url + "instances",
                                                       headers=self.observer)))
        by_url = {self.fleet.agent_url(name): name for name in self.fleet.topology.nodes}
        return {by_url[i["instance"]]: i for i in found["instances"] if i["instance"] in by_url}


def compat_id(fleet: Fleet) -> str:
    """The Compatibility ID of the source's model, as `kvsp descriptor` computes it."""
    out = subprocess.run([sys.executable, "-m", "kvsp_moq.cli", "descriptor", "tiny", "--compat-id",
                          "--data", str(fleet.workdir / f"data-{SOURCE}")],
                         capture_output=True, text=True, env=process_environment({}), timeout=300)
    if out.returncode != 0:
        raise Failed(f"kvsp descriptor: {out.stderr.strip()}")
    return out.stdout.strip()


def reported_links(view: dict[str, Any]) -> dict[str, float]:
    """An instance's reported link rates (Mbit/s) by holder."""
    return {link["holder"]: link["mbit_per_s"] for link in view.get("status", view).get("links", [])}


def _wait_for_reports(fe: FrontEnd, agents: list[str]) -> dict[str, dict[str, Any]]:
    deadline = time.monotonic() + REPORT_S
    while True:
        views = fe.instances()
        if all(reported_links(views.get(a, {})) for a in agents):
            return views
        if time.monotonic() > deadline:
            raise Failed(f"the PC did not hear measured links from every instance in {REPORT_S:g} s: "
                         f"{ {a: reported_links(views.get(a, {})) for a in agents} }")
        time.sleep(0.2)


def _trial(fe: FrontEnd, agents: list[str], order: list[str]) -> dict[str, Any]:
    prefixes = fe.seed(1 + len(agents))
    decision, answer, route_ms, pc_ttft = fe.routed(prefixes[0] + fe.tokens(SUFFIX_TOKENS))
    names = {fe.fleet.agent_url(a): a for a in agents}
    chosen = names.get(decision["instance"], decision["instance"])
    measured: dict[str, dict[str, Any]] = {}
    for agent, prefix in zip(order, prefixes[1:]):
        got, ttft = fe.generate(agent, prefix + fe.tokens(SUFFIX_TOKENS))
        measured[agent] = {"ttft_ms": round(ttft, 1), "cached_tokens": got.get("cached_tokens", 0)}
    best = min(measured, key=lambda a: measured[a]["ttft_ms"])
    ttft_chosen = measured[chosen]["ttft_ms"] if chosen in measured else None
    regret = round(ttft_chosen / measured[best]["ttft_ms"], 3) if ttft_chosen else None
    return {
        "pc_chose": chosen,
        "pc_reason": decision.get("reason"),
        "pc_estimates_ms": {names.get(e["instance"], e["instance"]): round(e["cost_us"] / 1000, 1)
                            for e in decision.get("estimates", []) if e.get("cost_us") is not None},
        "routed": {"route_ms": round(route_ms, 1), "ttft_ms": round(pc_ttft, 1),
                   "cached_tokens": answer.get("cached_tokens", 0)},
        "candidates": measured,
        "best": best,
        "regret": regret,
        "regret_routed": round(pc_ttft / measured[best]["ttft_ms"], 3),
        "pc_chose_best": regret is not None and regret <= TIE,
    }


def placement(*, trials: int = 4, rates: dict[str, float] | None = None,
              drop: tuple[str, float] | None = DROP, engine: str | None = None) -> dict[str, Any]:
    """Benchmark 2 (see the module's docstring): `trials` requests per phase."""
    rates = dict(rates or RATES)
    agents = list(rates)
    with Fleet(topology(rates), engine=engine, unplaced_agents=(SOURCE,),
               agent_args=("--status-ttl-ms", "1500")) as fleet:
        fe = FrontEnd(fleet, compat_id(fleet))
        # Each instance measures its link once (it loads a prefix: with no prefill rate
        # measured yet it uses the cache) and its prefill rate (a prompt with nothing cached).
        for agent, prefix in zip(agents, fe.seed(len(agents))):
            fe.generate(agent, prefix + fe.tokens(SUFFIX_TOKENS))
            fe.generate(agent, fe.tokens(PREFIX_TOKENS + SUFFIX_TOKENS))
        phases = []
        steps: list[tuple[str, tuple[str, float] | None]] = [("links as set", None)]
        if drop is not None:
            steps.append((f"{drop[0]}'s link dropped to {drop[1]:g} Mbit/s", drop))
        for name, change in steps:
            if change is not None:
                fleet.net.set_rate(*change)
                rates[change[0]] = change[1]
            before = _wait_for_reports(fe, agents)
            runs = []
            for t in range(trials):
                order = agents[t % len(agents):] + agents[:t % len(agents)]
                runs.append(_trial(fe, agents, order))
            after = fe.instances()
            phases.append({
                "phase": name,
                "link_mbit": dict(rates),
                "reported_mbit_before": {a: reported_links(before.get(a, {})) for a in agents},
                "reported_mbit_after": {a: reported_links(after.get(a, {})) for a in agents},
                "trials": runs,
                "pc_chose_best": sum(r["pc_chose_best"] for r in runs),
                "regret_median": _median([r["regret"] for r in runs if r["regret"] is not None]),
                "regret_routed_median": _median([r["regret_routed"] for r in runs]),
            })
    regrets = [r["regret"] for p in phases for r in p["trials"] if r["regret"] is not None]
    total = sum(len(p["trials"]) for p in phases)
    return {
        "agents": len(agents),
        "prompt_tokens": PREFIX_TOKENS + SUFFIX_TOKENS,
        "cached_tokens": PREFIX_TOKENS,
        "prefix_bytes": PREFIX_TOKENS * KV_OCTETS_PER_TOKEN,
        "phases": phases,
        "pc_chose_best": sum(p["pc_chose_best"] for p in phases),
        "requests": total,
        "regret_median": _median(regrets),
        "regret_max": max(regrets) if regrets else None,
        "regret_routed_median": _median([r["regret_routed"] for p in phases for r in p["trials"]]),
    }


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None
