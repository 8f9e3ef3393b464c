"""Sequence-sharded contexts (agent/shards.py, §6.9): the ranges an instance holds are the KV
of a prefill of the whole context; a reshard plan fetches ranges from another instance, checked
by Repr-Digest, and a commit installs them and drops the released ones, an abort drops what
was fetched, a stale plan is refused."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest
import torch

from agent.model import ModelAdapter
from agent.pool import tensor_from_octets
from agent.shards import ShardKeeper
from kvsp_moq.auth import OPEN
from kvsp_moq.errors import BadRecord, NotFound, StaleEpoch
from kvsp_moq.holder.api import repr_digest
from kvsp_moq.protocol.container import Container
from tests.agent.conftest import tokens

MAP = "ctx"
OTHER = "http://other.test/"
CONTEXT = tokens(48, 11)


@pytest.fixture(scope="module")
def adapter(model_dir: Path) -> ModelAdapter:
    return ModelAdapter.load(model_dir)


@pytest.fixture(scope="module")
def reference(adapter: ModelAdapter) -> Any:
    """The decode state of the whole context, prefilled in one pass."""
    return adapter.prefill(CONTEXT, return_kv=False).state


async def on_thread(fn: Callable[[], Any]) -> Any:
    return await asyncio.to_thread(fn)


def serving(keeper: ShardKeeper, *, corrupt: bool = False) -> httpx.AsyncClient:
    """A client whose GET {OTHER}kv is answered by `keeper`, as that instance's app answers it."""
    def handle(request: httpx.Request) -> httpx.Response:
        a, b = (int(x) for x in request.url.params["tokens"].split("-"))
        body = keeper.container(request.url.params["map"], a, b, OPEN)
        digest = hashlib.sha256(body + (b"x" if corrupt else b"")).digest()
        return httpx.Response(200, content=body, headers={"Repr-Digest": repr_digest(digest)})

    return httpx.AsyncClient(transport=httpx.MockTransport(handle))


def same_kv(adapter: ModelAdapter, octets: bytes, reference: Any, a: int, b: int) -> None:
    block = Container(octets)
    assert (block.token_count, block.layer_count) == (b - a, adapter.num_layers)
    for layer, (k, v) in zip(block.layers(), adapter.kv_for_range(reference, a, b)):
        assert torch.allclose(tensor_from_octets(layer.k, adapter.dtype).view(k.shape), k, atol=1e-5)
        assert torch.allclose(tensor_from_octets(layer.v, adapter.dtype).view(v.shape), v, atol=1e-5)


async def seeded(adapter: ModelAdapter, ranges: list[list[int]], client: httpx.AsyncClient | None = None,
                 version: int = 1) -> ShardKeeper:
    keeper = ShardKeeper(adapter, on_thread, client or httpx.AsyncClient())
    await keeper.seed(MAP, {"version": version, "tokens": CONTEXT, "ranges": ranges})
    return keeper


def plan(**members: Any) -> dict[str, Any]:
    return {"map": MAP, "from": 1, "to": 2, "deadline_ms": 5000, **members}


async def test_seeded_ranges_hold_the_kv_of_the_whole_context(adapter, reference) -> None:
    keeper = await seeded(adapter, [[0, 16], [16, 48]])
    assert keeper.status(MAP) == {"map": MAP, "version": 1, "ranges": [[0, 16], [16, 48]], "pending": [],
                                  "pending_to": None, "last": {}}
    same_kv(adapter, keeper.container(MAP, 20, 30, OPEN), reference, 20, 30)  # any part of a held range
    same_kv(adapter, keeper.container(MAP, 0, 16, OPEN), reference, 0, 16)
    with pytest.raises(NotFound):
        keeper.container(MAP, 10, 20, OPEN)  # across two ranges: held, but not as one
    with pytest.raises(NotFound):
        keeper.container("other", 0, 4, OPEN)
    with pytest.raises(NotFound):
        keeper.status("other")


@pytest.mark.parametrize("ranges, member", [([[0, 49]], "ranges"), ([[8, 8]], "ranges[0]"),
                                            ([[9, 3]], "ranges[0]")])
async def test_ranges_outside_the_context_or_empty_are_refused(adapter, ranges, member) -> None:
    keeper = ShardKeeper(adapter, on_thread, httpx.AsyncClient())
    with pytest.raises(BadRecord) as e:
        await keeper.seed(MAP, {"version": 1, "tokens": CONTEXT, "ranges": ranges})
    assert e.value.member == member
    assert MAP not in keeper.maps


async def test_a_reshard_fetches_retains_and_releases_on_commit(adapter, reference) -> None:
    source = await seeded(adapter, [[0, 48]])
    async with serving(source) as client:
        keeper = await seeded(adapter, [[0, 16]], client)
        status, body = await keeper.handle(plan(retain=[[0, 16]], fetch=[{"tokens": [16, 40], "from": OTHER}]))
        assert status == 200
        assert (body["version"], body["ranges"], body["pending"], body["pending_to"]) == (1, [[0, 16]],
                                                                                         [[16, 40]], 2)
        last = body["last"]
        assert last["state"] == "acknowledged" and last["retained"] == [[0, 16]] and last["retained_missing"] == []
        assert [f["tokens"] for f in last["fetched"]] == [[16, 40]] and last["transferred_bytes"] > 0
        with pytest.raises(NotFound):
            keeper.container(MAP, 16, 40, OPEN)  # not before the commit
        status, body = await keeper.handle({"map": MAP, "commit": 2})
    assert status == 200 and body["version"] == 2 and body["ranges"] == [[0, 16], [16, 40]]
    assert body["last"]["state"] == "committed"
    assert keeper.container(MAP, 16, 40, OPEN) == source.container(MAP, 16, 40, OPEN)  # the octets it was sent
    same_kv(adapter, keeper.container(MAP, 20, 24, OPEN), reference, 20, 24)
    assert (await keeper.handle({"map": MAP, "commit": 2}))[1]["version"] == 2  # delivered twice

    # The source releases part of what it held: the rest on either side stays.
    status, _ = await source.handle(plan(retain=[[0, 8], [24, 48]], release=[[8, 24]]))
    assert status == 200
    _, body = await source.handle({"map": MAP, "commit": 2})
    assert body["ranges"] == [[0, 8], [24, 48]]
    same_kv(adapter, source.container(MAP, 0, 8, OPEN), reference, 0, 8)
    same_kv(adapter, source.container(MAP, 30, 48, OPEN), reference, 30, 48)
    with pytest.raises(NotFound):
        source.container(MAP, 8, 9, OPEN)


async def test_an_abort_drops_what_was_fetched(adapter) -> None:
    source = await seeded(adapter, [[0, 48]])
    async with serving(source) as client:
        keeper = await seeded(adapter, [[0, 16]], client)
        await keeper.handle(plan(fetch=[{"tokens": [16, 32], "from": OTHER}]))
        _, body = await keeper.handle({"map": MAP, "abort": 2})
    assert (body["version"], body["ranges"], body["pending"], body["pending_to"]) == (1, [[0, 16]], [], None)
    assert body["last"]["state"] == "aborted"
    with pytest.raises(StaleEpoch):
        await keeper.handle({"map": MAP, "commit": 2})  # nothing to commit any more


async def test_stale_plans_and_unchecked_octets_are_refused(adapter) -> None:
    source = await seeded(adapter, [[0, 48]])
    async with serving(source, corrupt=True) as client:
        keeper = await seeded(adapter, [[0, 16]], client)
        with pytest.raises(StaleEpoch):
            await keeper.handle({**plan(), "from": 4, "to": 5})
        status, body = await keeper.handle(plan(fetch=[{"tokens": [16, 32], "from": OTHER}]))
    assert status == 502 and body["last"]["state"].startswith("failed")
    assert body["pending"] == [] and body["ranges"] == [[0, 16]]
    with pytest.raises(BadRecord):
        await keeper.handle({**plan(), "to": 3})  # a plan moves one version at a time
