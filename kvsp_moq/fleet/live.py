"""Part `live` of `kvsp bench fleet`: prefill and decode apart on real links (DESIGN §9).

Two inference instances (`kvsp agent`, the tiny model): the producer on a link of
`PRODUCER_MBIT`, the consumer on one of `CONSUMER_MBIT`, the relay and the front end's host on
1 Gbit/s. Per round, three fresh prompts of `PROMPT_TOKENS` each, as the front end sees them
from its host:

single              the consumer runs the whole request alone;
streamed            `POST {producer}prefill`, then the consumer's generate with "prefill_at":
                    it subscribes to the prompt's layers through the relay while the producer
                    computes them, and decodes when the last one is in;
load_after_prefill  the producer runs the request first (its blocks stored and indexed), then
                    the consumer runs it and loads the finished blocks (as before live KV).

TTFT runs from the front end's first request to the consumer's first token. The octets out of
the producer's interface while a prompt streams say how many copies left it (one expected: the
relay fans out).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import httpx

from kvsp_moq.fleet.placement import EDGE, FrontEnd, compat_id
from kvsp_moq.fleet.services import Fleet
from kvsp_moq.fleet.topology import Link, Topology
from kvsp_moq.frontend import decode_at

PRODUCER = "producer"
CONSUMER = "consumer"
PRODUCER_MBIT = 1000.0
CONSUMER_MBIT = 400.0
PROMPT_TOKENS = 1024
#: The tiny model's KV per token: 8 layers x (K, V) x 2 heads x 32 x float32.
KV_OCTETS_PER_TOKEN = 4096


def topology(*, mtu: int = 1500) -> Topology:
    topo = Topology()
    topo.add("index", "index", Link(mtu=mtu, rate_mbit=1000.0))
    topo.add("relay", "relay", Link(mtu=mtu, rate_mbit=1000.0))
    topo.add(PRODUCER, "agent", Link(mtu=mtu, rate_mbit=PRODUCER_MBIT))
    topo.add(CONSUMER, "agent", Link(mtu=mtu, rate_mbit=CONSUMER_MBIT))
    topo.add(EDGE, "client", Link(mtu=mtu, rate_mbit=1000.0))
    return topo


def _round(fe: FrontEnd, fleet: Fleet) -> dict[str, Any]:
    producer, consumer = fleet.agent_url(PRODUCER), fleet.agent_url(CONSUMER)
    out: dict[str, Any] = {}

    def single(client: httpx.Client) -> tuple[dict[str, Any], float]:
        return fe._first_token(client, consumer, fe.tokens(PROMPT_TOKENS))

    def streamed(client: httpx.Client) -> tuple[dict[str, Any], float]:
        tokens = fe.tokens(PROMPT_TOKENS)
        started = time.perf_counter()
        answer = fe._ok(client.post(producer + "prefill", headers=fe.user, json={"tokens": tokens}))
        return fe._first_token(client, consumer, tokens, extra=decode_at(producer, answer), started=started)

    def after(client: httpx.Client) -> tuple[dict[str, Any], float]:
        tokens = fe.tokens(PROMPT_TOKENS)
        started = time.perf_counter()
        # Answered once the producer's blocks are stored and indexed.
        fe._ok(client.post(producer + "generate", headers=fe.user,
                           json={"tokens": tokens, "max_new_tokens": 1}))
        return fe._first_token(client, consumer, tokens, started=started)

    for name, run in (("single", single), ("streamed", streamed), ("load_after_prefill", after)):
        before = fleet.net.counters(PRODUCER)
        summary, seconds = fe._in_edge(run)
        sent = fleet.net.counters(PRODUCER).tx_bytes - before.tx_bytes
        out[name] = {"ttft_ms": round(seconds * 1000, 1), "sources": summary.get("sources"),
                     "producer_egress_bytes": sent}
    return out


def live(*, rounds: int = 2, engine: str | None = None) -> dict[str, Any]:
    """The `live` part (see the module's docstring): medians over `rounds`."""
    with Fleet(topology(), engine=engine, unplaced_agents=(PRODUCER, CONSUMER)) as fleet:
        fe = FrontEnd(fleet, compat_id(fleet))
        for agent in (PRODUCER, CONSUMER):  # one-time costs out of the measured requests
            fe.generate(agent, fe.tokens(PROMPT_TOKENS))
        runs = [_round(fe, fleet) for _ in range(rounds)]

    def median(kind: str, key: str) -> float:
        return round(statistics.median(r[kind][key] for r in runs), 1)

    prefix = (PROMPT_TOKENS - 1) // 16 * 16 * KV_OCTETS_PER_TOKEN
    ttft = {kind: median(kind, "ttft_ms") for kind in ("single", "streamed", "load_after_prefill")}
    return {
        "prompt_tokens": PROMPT_TOKENS,
        "links_mbit": {PRODUCER: PRODUCER_MBIT, CONSUMER: CONSUMER_MBIT},
        "ttft_ms": ttft,
        "streamed_vs_single": round(ttft["streamed"] / ttft["single"], 3),
        "streamed_vs_load_after_prefill": round(ttft["streamed"] / ttft["load_after_prefill"], 3),
        "producer_egress_copies": round(median("streamed", "producer_egress_bytes") / prefix, 3),
        "rounds": runs,
    }
