"""Leases outlive slow loads (KVSP §6.6): a load that takes longer than its lease's term renews
the lease (PUT leases/{id}) before it runs out, and releases it (DELETE, answered 204 because it
was still alive) when done; for a prefetch directive and for a request's prefix load alike."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agent.service import Agent, AgentSettings
from kvsp_moq.holder.service import Holder, HolderSettings
from kvsp_moq.protocol.keys import scope_id
from kvsp_moq.scope_keys import OPEN_SCOPE_KEY
from tests.agent.conftest import tokens

B = 16
PROMPT = 128
SCOPE = scope_id(OPEN_SCOPE_KEY).hex()
LEASE_MS = 800
#: a pause per 4 KiB chunk of a block response: a 64 KiB block takes about 2.4 s, 3 terms
CHUNK_DELAY_S = 0.15

RENEWED = ("PUT", "/leases/{lease}", 200)
RELEASED = ("DELETE", "/leases/{lease}", 204)
GONE = ("DELETE", "/leases/{lease}", 404)
EXPIRED = ("PUT", "/leases/{lease}", 404)
TAKEN = ("POST", "/leases", 201)



class Throttle:
    """Slows the body of every block response (a slow link to the holder)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/blocks/") \
                or scope["method"] != "GET":
            await self.app(scope, receive, send)
            return

        async def slow(message: Message) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                await asyncio.sleep(CHUNK_DELAY_S)
            await send(message)

        await self.app(scope, receive, slow)




@pytest.fixture(scope="module")
def holder(index_url: str) -> Iterator[Holder]:
    """The only source of the blocks: a holder behind a slow link."""
    h = Holder(HolderSettings(listen="127.0.0.1:0", index_url=index_url, chunk_bytes=4096))
    h.app.add_middleware(Throttle)
    with h:
        yield h


@pytest.fixture(scope="module")
def maker(model_dir: Path, holder: Holder) -> Iterator[Agent]:
    """Computes blocks and stores them at the holder only (it publishes nothing itself)."""
    with Agent(AgentSettings(listen="127.0.0.1:0", model=str(model_dir), block_tokens=B,
                             warmup_tokens=0, replicate_to=[holder.url])) as a:
        yield a


def seed_holder(maker: Agent, holder: Holder, toks: list[int]) -> list[str]:
    r = httpx.post(maker.url + "generate", json={"tokens": toks, "max_new_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text
    session = maker.engine.sessions[r.json()["session"]]
    keys = [k.hex() for k in session.sequence.chain.keys[:PROMPT // B]]
    deadline = time.monotonic() + 20
    while not all(holder.publisher.is_published(e.id) for e in holder.store.blocks()
                  if e.id.block_key in keys) or \
            len({e.id.block_key for e in holder.store.blocks()} & set(keys)) < len(keys):
        assert time.monotonic() < deadline, "the holder never stored and published the blocks"
        time.sleep(0.02)
    return keys


def counts(holder: Holder) -> dict[tuple[str, str, int], int]:
    requests = holder.app.state.metrics.requests
    return {k: requests[k] for k in (TAKEN, RENEWED, RELEASED, GONE, EXPIRED)}


def agent_settings(model_dir: Path, index_url: str) -> AgentSettings:
    return AgentSettings(listen="127.0.0.1:0", model=str(model_dir), index_url=index_url,
                         block_tokens=B, warmup_tokens=0, lease_ms=LEASE_MS)


def test_prefetch_renews_its_leases_while_loading(model_dir: Path, index_url: str, holder: Holder,
                                                 maker: Agent) -> None:
    keys = seed_holder(maker, holder, tokens(PROMPT, 71))
    before = counts(holder)
    with Agent(agent_settings(model_dir, index_url)) as b:
        body = {"directive": str(uuid.uuid4()), "scope_id": SCOPE,
                "compat_id": b.context.compat_id,
                "blocks": [{"block_key": k, "sources": [holder.url]} for k in keys],
                "layer_order": "ascending", "deadline_ms": 30_000, "lease_ms": LEASE_MS}
        r = httpx.post(b.url + "prefetch", json=body, timeout=10)
        assert r.status_code == 202, r.text
        deadline = time.monotonic() + 40
        while (done := httpx.get(r.headers["location"], timeout=10).json())["state"] == "pending":
            assert time.monotonic() < deadline, "the directive never finished"
            time.sleep(0.05)
        assert done["state"] == "complete", done
        assert sorted(done["loaded"]) == sorted(keys)
        assert done["sources"] == {"http": len(keys)}
        assert done["elapsed_ms"] > 2 * LEASE_MS  # the load outlasted the lease's term
    after = counts(holder)
    assert after[TAKEN] - before[TAKEN] == 1  # one lease for all the blocks at the listed source
    assert after[RENEWED] - before[RENEWED] >= 2, (before, after)  # renewed while loading
    assert after[RELEASED] - before[RELEASED] == 1, (before, after)  # while alive
    assert after[GONE] == before[GONE] and after[EXPIRED] == before[EXPIRED]
    assert len(holder.leases) == 0


def test_prefix_load_renews_its_lease_while_loading(model_dir: Path, index_url: str,
                                                   holder: Holder, maker: Agent) -> None:
    prompt = tokens(PROMPT, 72)
    seed_holder(maker, holder, prompt)
    before = counts(holder)
    with Agent(agent_settings(model_dir, index_url)) as c:
        out = httpx.post(c.url + "generate", json={"tokens": prompt + [5, 6], "max_new_tokens": 2},
                         timeout=60).json()
        assert out["cached_tokens"] == PROMPT, out
        assert out["sources"]["http"] == PROMPT // B and out["load"]["failures"] == []
        assert out["load"]["seconds"] * 1000 > 2 * LEASE_MS
        deadline = time.monotonic() + 10
        while counts(holder)[RELEASED] == before[RELEASED]:  # released in the background
            assert time.monotonic() < deadline, "the lease was never released"
            time.sleep(0.02)
    after = counts(holder)
    taken = after[TAKEN] - before[TAKEN]
    assert taken >= 1  # one batch lease for the whole prefix (a lease per block at worst)
    assert after[RENEWED] - before[RENEWED] >= taken, (before, after)
    assert after[RELEASED] - before[RELEASED] == taken, (before, after)
    assert after[GONE] == before[GONE] and after[EXPIRED] == before[EXPIRED]
    assert len(holder.leases) == 0
