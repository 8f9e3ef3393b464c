"""An agent with a relay publishes its own blocks over MOQT (DESIGN §4, §6), as a holder with a
relay does: after a prefill and after each completed block of generated tokens, every block gets
a MOQT record beside its HTTP record, and its track through the relay delivers the same octets
as HTTP. Prefetch directives (§6.5) load such blocks over MOQT first, HTTP as the fallback."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import httpx

from agent.service import Agent, AgentSettings
from kvsp_moq.fetch.http import HttpFetcher
from kvsp_moq.fetch.moqt import MoqtBlockFetcher
from kvsp_moq.holder.store import BlockId
from kvsp_moq.index_client import IndexClient
from kvsp_moq.naming import BlockTrack
from kvsp_moq.protocol.keys import scope_id
from kvsp_moq.protocol.records import ReplicaRecord
from kvsp_moq.scope_keys import OPEN_SCOPE_KEY
from relay.service import BackgroundRelay
from tests.agent.conftest import tokens
from tests.polling import wait_until

B = 16
PROMPT = 128
SCOPE = scope_id(OPEN_SCOPE_KEY).hex()
STEP = 20.0


def settings(model_dir: Path, index_url: str, relay: str, **kw: object) -> AgentSettings:
    return AgentSettings(listen="127.0.0.1:0", model=str(model_dir), index_url=index_url,
                         relay=relay, relay_timeout_s=2.0, block_tokens=B, warmup_tokens=0, **kw)


def records(index_url: str, compat: str, keys: list[str]) -> list[list[ReplicaRecord]]:
    """The replicas the IS lists for each key (one lookup per key: no chain gaps matter)."""
    async def look() -> list[list[ReplicaRecord]]:
        async with IndexClient(index_url) as index:
            out = []
            for key in keys:
                result = await index.lookup(SCOPE, compat, [key])
                out.append(list(result.blocks[0].replicas) if result.matched else [])
            return out

    return asyncio.run(look())


def generate(agent: Agent, toks: list[int], new: int) -> list[str]:
    """The keys of the complete blocks of the session's sequence, once they are published."""
    r = httpx.post(agent.url + "generate", json={"tokens": toks, "max_new_tokens": new}, timeout=60)
    assert r.status_code == 200, r.text
    session = agent.engine.sessions[r.json()["session"]]
    return [k.hex() for k in session.sequence.chain.keys[:session.exported]]


def stored(agent: Agent, compat: str, key: str) -> bytes:
    entry = agent.context.store.get(BlockId(compat, SCOPE, key))
    assert entry is not None and entry.host is not None
    return bytes(entry.host.buffer)


def test_agent_publishes_its_blocks_over_moqt(model_dir: Path, index_url: str,
                                              relay: BackgroundRelay) -> None:
    with Agent(settings(model_dir, index_url, relay.url)) as a:
        compat = a.context.compat_id
        # A prefill of 8 blocks, then 17 generated tokens: a ninth block, completed in decoding.
        keys = generate(a, tokens(PROMPT, 61), B + 1)
        assert len(keys) == PROMPT // B + 1
        moqt = a.context.moqt_publisher
        assert moqt is not None
        wait_until(lambda: (compat, SCOPE) in moqt.announced, timeout=STEP, what="the agent's namespace at the relay")

        found = wait_until(lambda: (lambda rs: rs if all(len(r) == 2 for r in rs) else None)(
            records(index_url, compat, keys)), timeout=STEP, what="an HTTP and a MOQT record per block")
        by_kind = [{("moqt" if r.is_moqt else "http"): r for r in rs} for rs in found]
        for key, kinds in zip(keys, by_kind):
            http, mrec = kinds["http"], kinds["moqt"]
            assert http.holder == a.url
            assert mrec.holder == relay.url and mrec.http_holder == a.url
            track = BlockTrack.for_holder(compat, SCOPE, key, a.url, http.codec)
            assert mrec.moqt_namespace == track.moqt_namespace
            assert (mrec.digest, mrec.layer_digests, mrec.size) == (http.digest, http.layer_digests,
                                                                     http.size)

        async def fetch_both() -> list[tuple[bytes, bytes]]:
            out = []
            async with MoqtBlockFetcher(verify=False, timeout=5.0) as mf, HttpFetcher() as hf:
                for kinds in by_kind:
                    over_moqt = await mf.fetch_block([relay.url], kinds["moqt"])
                    over_http = await hf.fetch_block([a.url], kinds["http"])
                    assert over_moqt.served_by == [(relay.url, 0, a.context.adapter.num_layers - 1)]
                    out.append((bytes(over_moqt.container.buffer), bytes(over_http.container.buffer)))
            return out

        before = relay.snapshot()["fetches"]
        copies = asyncio.run(fetch_both())
        assert relay.snapshot()["fetches"] >= before + len(keys)
        assert a.context.moqt_publisher.stats.fetches >= 1
        for key, (over_moqt, over_http) in zip(keys, copies):
            assert over_moqt == over_http == stored(a, compat, key)


def directive(agent: Agent, keys: list[str], sources: list[str]) -> dict:
    return {"directive": str(uuid.uuid4()), "scope_id": SCOPE, "compat_id": agent.context.compat_id,
            "blocks": [{"block_key": k, "sources": sources} for k in keys],
            "layer_order": "ascending", "deadline_ms": 30_000, "lease_ms": 5000}


def prefetch(agent: Agent, body: dict) -> dict:
    r = httpx.post(agent.url + "prefetch", json=body, timeout=10)
    assert r.status_code == 202, r.text
    location = r.headers["location"]
    return wait_until(lambda: (lambda s: s if s["state"] != "pending" else None)(
        httpx.get(location, timeout=10).json()), timeout=40.0, what="the directive to finish")


def test_prefetch_loads_over_moqt_then_falls_back_to_http(model_dir: Path, index_url: str,
                                                          relay: BackgroundRelay) -> None:
    with Agent(settings(model_dir, index_url, relay.url)) as a, \
            Agent(settings(model_dir, index_url, relay.url)) as b:
        compat = a.context.compat_id
        keys = generate(a, tokens(PROMPT, 62), 1)
        assert len(keys) == PROMPT // B
        wait_until(lambda: all(len(r) == 2 for r in records(index_url, compat, keys)),
                   timeout=STEP, what="A's HTTP and MOQT records")
        wait_until(lambda: (compat, SCOPE) in a.context.moqt_publisher.announced,
                   timeout=STEP, what="A's namespace at the relay")
        fetches = relay.snapshot()["fetches"]
        leases = a.app.state.metrics.requests[("POST", "/leases", 201)]

        done = prefetch(b, directive(b, keys, [a.url]))
        assert done["state"] == "complete", done
        assert sorted(done["loaded"]) == sorted(keys)
        assert done["sources"] == {"moqt": len(keys)}
        assert b.context.prefetcher.stats == {"moqt": len(keys), "http": 0}
        assert relay.snapshot()["fetches"] >= fetches + len(keys)
        # Leased at the listed source (the MOQT replica's HTTP holder) before loading, all at once.
        assert a.app.state.metrics.requests[("POST", "/leases", 201)] == leases + 1
        for key in keys:  # verified and stored whole: the same octets as at the source
            assert stored(b, compat, key) == stored(a, compat, key)

        # The relay goes away while A's records still name MOQT replicas; HTTP takes over.
        # (The records go in first: with its relay gone, A holds back MOQT records of new blocks.)
        more = generate(a, tokens(PROMPT, 63), 1)
        wait_until(lambda: all(len(r) == 2 for r in records(index_url, compat, more)),
                   timeout=STEP, what="A's records of the second prompt")
        relay.stop()
        started = time.monotonic()
        done = prefetch(b, directive(b, more, [a.url]))
        assert done["state"] == "complete", done
        assert sorted(done["loaded"]) == sorted(more)
        assert done["sources"] == {"http": len(more)}
        assert b.context.prefetcher.stats == {"moqt": len(keys), "http": len(more)}
        # One failed connection attempt (relay_timeout_s) is shared by every block.
        assert time.monotonic() - started < 15
        for key in more:
            assert stored(b, compat, key) == stored(a, compat, key)
