"""Prefetch directives (KVSP §6.5): 202 with a status resource; blocks leased at a listed source,
verified, stored at the agent and published as its replicas; "partial" when the deadline cuts
loading short; a later request is served from the prefetched blocks."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from agent.model import ModelAdapter
from agent.service import Agent, AgentSettings
from kvsp_moq.index_client import IndexClient
from kvsp_moq.protocol.keys import scope_id
from kvsp_moq.scope_keys import OPEN_SCOPE_KEY
from tests.agent.conftest import tokens

B = 16
PROMPT = 128
SCOPE = scope_id(OPEN_SCOPE_KEY).hex()





@pytest.fixture(scope="module")
def agents(model_dir: Path, index_url: str) -> Iterator[tuple[Agent, Agent]]:
    def settings() -> AgentSettings:
        return AgentSettings(listen="127.0.0.1:0", model=str(model_dir), index_url=index_url,
                             block_tokens=B, warmup_tokens=0)

    with Agent(settings()) as a, Agent(settings()) as b:
        yield a, b


def computed_keys(agent: Agent, toks: list[int]) -> list[str]:
    r = httpx.post(agent.url + "generate", json={"tokens": toks, "max_new_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text
    session = agent.engine.sessions[r.json()["session"]]
    return [k.hex() for k in session.sequence.chain.keys]


def directive(agent: Agent, keys: list[str], sources: list[str], **kw: object) -> dict:
    return {"directive": str(uuid.uuid4()), "request_ref": "ref-1", "scope_id": SCOPE,
            "compat_id": agent.context.compat_id,
            "blocks": [{"block_key": k, "sources": sources} for k in keys],
            "layer_order": "ascending", "deadline_ms": 5000, "lease_ms": 2000, **kw}


def wait_done(location: str) -> dict:
    for _ in range(200):
        body = httpx.get(location).json()
        if body["state"] != "pending":
            return body
        time.sleep(0.02)
    raise AssertionError("the directive never finished")


def test_prefetch_loads_stores_and_publishes(agents: tuple[Agent, Agent], model_dir: Path,
                                             index_url: str) -> None:
    a, b = agents
    prompt = tokens(PROMPT, 21)
    keys = computed_keys(a, prompt)
    leases_before = a.app.state.metrics.requests[("POST", "/leases", 201)]
    body = directive(b, keys, ["http://127.0.0.1:9/", a.url])  # the first source is dead
    r = httpx.post(b.url + "prefetch", json=body)
    assert r.status_code == 202
    location = r.headers["location"]
    assert location == f"{b.url}prefetch/{body['directive']}"
    done = wait_done(location)
    assert done["state"] == "complete"
    assert sorted(done["loaded"]) == sorted(keys)
    assert done["request_ref"] == "ref-1"
    assert a.app.state.metrics.requests[("POST", "/leases", 201)] >= leases_before + len(keys)

    async def replicas() -> list[set[str]]:
        async with IndexClient(index_url) as index:
            result = await index.lookup(SCOPE, b.context.compat_id, keys)
        return [{r.holder for r in blk.replicas} for blk in result.blocks]

    for _ in range(100):  # B publishes its new replicas
        holders = b.call(replicas())
        if len(holders) == len(keys) and all(b.url in h for h in holders):
            break
        time.sleep(0.02)
    assert all({a.url, b.url} <= h for h in holders)

    # The request that follows is served from the blocks B now holds.
    out = httpx.post(b.url + "generate", json={"tokens": prompt + [5, 6, 7], "max_new_tokens": 3},
                     timeout=60).json()
    assert out["cached_tokens"] == PROMPT and out["sources"].get("local") == PROMPT // B
    reference = ModelAdapter.load(model_dir)
    assert out["tokens"] == reference.generate_greedy(prompt + [5, 6, 7], 3)


def test_prefetch_partial_at_deadline_and_failed_without_sources(agents: tuple[Agent, Agent]) -> None:
    a, b = agents
    keys = computed_keys(a, tokens(PROMPT, 22))
    r = httpx.post(b.url + "prefetch", json=directive(b, keys, [a.url], deadline_ms=1))
    assert r.status_code == 202
    done = wait_done(r.headers["location"])
    assert done["state"] == "partial"
    assert len(done["loaded"]) < len(keys)

    missing = ["ab" * 32, "cd" * 32]
    r = httpx.post(b.url + "prefetch", json=directive(b, missing, [a.url]))
    done = wait_done(r.headers["location"])
    assert done["state"] == "failed" and done["loaded"] == []
    assert httpx.get(b.url + "prefetch/" + str(uuid.uuid4())).status_code == 404


def test_a_request_right_behind_its_directive_waits_for_the_prefetch_instead_of_loading_again(
        agents: tuple[Agent, Agent], model_dir: Path) -> None:
    """The PC sends the directive, then the request: the request takes the blocks the
    prefetch is loading, so each crosses the network once, and it reports the transport
    they came by."""
    a, b = agents
    prompt = tokens(PROMPT, 23)
    keys = computed_keys(a, prompt)
    gets = ("GET", "/blocks/{compat}/{scope}/{key}", 200)
    before = a.app.state.metrics.requests[gets]
    r = httpx.post(b.url + "prefetch", json=directive(b, keys, [a.url]))
    assert r.status_code == 202
    out = httpx.post(b.url + "generate", json={"tokens": prompt + [9], "max_new_tokens": 2},
                     timeout=60).json()
    assert wait_done(r.headers["location"])["state"] == "complete"
    assert out["cached_tokens"] == PROMPT
    # (by HTTP when the request waited for them; local when the prefetch was done first)
    assert out["sources"]["http"] + out["sources"].get("local", 0) == PROMPT // B
    assert a.app.state.metrics.requests[gets] - before == len(keys)  # once each
    reference = ModelAdapter.load(model_dir)
    assert out["tokens"] == reference.generate_greedy(prompt + [9], 2)


def test_prefetch_takes_one_lease_per_source_for_all_its_blocks(agents: tuple[Agent, Agent]) -> None:
    """One round trip for the leases of every block at a source, not one per block, and
    the lease is released once the blocks are loaded."""
    a, b = agents
    keys = computed_keys(a, tokens(PROMPT, 27))
    metrics = a.app.state.metrics.requests
    taken = [k for k in metrics if k[:2] == ("POST", "/leases")]
    before = sum(metrics[k] for k in taken)
    released = sum(v for k, v in metrics.items() if k[0] == "DELETE" and "leases" in k[1])
    r = httpx.post(b.url + "prefetch", json=directive(b, keys, [a.url]))
    assert wait_done(r.headers["location"])["state"] == "complete"
    assert sum(v for k, v in metrics.items() if k[:2] == ("POST", "/leases")) == before + 1
    for _ in range(100):  # released after the last block, in the background
        if sum(v for k, v in metrics.items() if k[0] == "DELETE" and "leases" in k[1]) > released:
            break
        time.sleep(0.02)
    else:
        raise AssertionError("the batch lease was not released")


def test_prefetch_measures_each_source_s_link_once_over_the_whole_directive(
        agents: tuple[Agent, Agent]) -> None:
    """A link's rate is what the directive's parallel requests reached together: one
    observation per source, all its octets over the span of all its requests. One per block
    would measure a round trip each (a block's request lasts about one, whatever the link)."""
    a, b = agents
    keys = computed_keys(a, tokens(PROMPT, 31))
    prefetcher = b.context.prefetcher
    seen: list[tuple[str, int, float]] = []
    observe = prefetcher.on_transfer
    prefetcher.on_transfer = lambda holder, octets, seconds: seen.append((holder, octets, seconds))
    try:
        r = httpx.post(b.url + "prefetch", json=directive(b, keys, [a.url]))
        assert wait_done(r.headers["location"])["state"] == "complete"
        for _ in range(100):  # reported when the last block's task has ended
            if seen:
                break
            time.sleep(0.02)
    finally:
        prefetcher.on_transfer = observe
    sizes = [len(bytes(e.host.buffer)) for e in a.context.store.blocks() if e.id.block_key in keys]
    assert len(sizes) == len(keys)
    assert len(seen) == 1, seen
    holder, octets, seconds = seen[0]
    assert holder == a.url
    assert octets >= sum(sizes) and seconds > 0


def test_prefetch_refused_when_not_active(agents: tuple[Agent, Agent]) -> None:
    a, b = agents
    epoch = b.context.epoch
    assert httpx.put(b.url + "state", json={"state": "draining", "epoch": epoch}).status_code == 200
    try:
        r = httpx.post(b.url + "prefetch", json=directive(b, ["ab" * 32], [a.url]))
        assert r.status_code == 503
    finally:
        httpx.put(b.url + "state", json={"state": "active", "epoch": epoch})
