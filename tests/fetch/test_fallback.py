"""The fallback of kvsp_moq.fetch without any network: candidates tried in order, each under a
lease, and a failure mid-block continued by the next candidate at the first undelivered layer."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import pytest

from kvsp_moq.errors import LeaseQuota, NotFound, TransportError
from kvsp_moq.fetch import (
    BlockCandidates,
    CandidatesExhausted,
    LayerTuple,
    LeaseKeeper,
    SourceCandidate,
    fetch_layers,
    lease_first_candidates,
    order_candidates,
)
from kvsp_moq.protocol.records import ReplicaRecord

KEY = "aa" * 32
LAYERS = 8


def record(holder: str, key: str = KEY) -> ReplicaRecord:
    return ReplicaRecord(block_key=key, compat_id="bb" * 32, scope_id="cc" * 16, holder=holder,
                         codec=1, size=1, digest="sha-256:" + "00" * 32, ttl_ms=1000)


def octets(index: int) -> tuple[bytes, bytes]:
    return bytes([index]) * 4, bytes([index + 100]) * 4


class Fake:
    """A source that delivers layers until `fail_at` (then raises), or misses entirely."""

    needs_lease = True

    def __init__(self, kind: str, *, fail_at: int | None = None, miss: bool = False) -> None:
        self.kind = kind
        self.fail_at = fail_at
        self.miss = miss
        self.asked: list[tuple[int, int]] = []

    def accepts(self, record: ReplicaRecord) -> bool:
        return record.holder.startswith(self.kind)

    async def layers(self, record: ReplicaRecord, first: int, last: int) -> AsyncIterator[LayerTuple]:
        self.asked.append((first, last))
        if self.miss:
            raise NotFound("not here")
        for index in range(first, last + 1):
            if index == self.fail_at:
                raise TransportError("cut off")
            await asyncio.sleep(0)
            yield (index, *octets(index))


class Leases:
    """A LeaseClient double: grants, or refuses with the given error."""

    def __init__(self, refuse: dict[str, Exception] | None = None) -> None:
        self.refuse = refuse or {}
        self.acquired: list[tuple[str, list[str]]] = []

    async def acquire(self, holder: str, keys: list[str], ttl_ms: int) -> str:
        if holder in self.refuse:
            raise self.refuse[holder]
        self.acquired.append((holder, list(keys)))
        return f"lease-{len(self.acquired)}"

    async def renew(self, holder: str, lease: str, ttl_ms: int) -> int:
        return ttl_ms

    async def release(self, holder: str, lease: str) -> None:
        pass


async def collect(stream) -> list[tuple[int, str]]:
    out = []
    async with stream:
        async for layer in stream:
            assert (bytes(layer.k), bytes(layer.v)) == octets(layer.index)
            out.append((layer.index, layer.candidate.source.kind))
    return out


async def test_a_source_failing_mid_block_is_continued_by_the_next_at_the_first_missing_layer() -> None:
    moqt, http = Fake("moqt", fail_at=3), Fake("http")
    candidates = order_candidates([record("http://b/"), record("moqt://r/")], [moqt, http])
    assert [c.source.kind for c in candidates] == ["moqt", "http"]
    stream = fetch_layers(candidates, 0, LAYERS - 1)
    got = await collect(stream)
    assert got == [(i, "moqt") for i in range(3)] + [(i, "http") for i in range(3, LAYERS)]
    assert http.asked == [(3, LAYERS - 1)]
    assert [(a.first, a.last, a.error) for a in stream.attempts] == [(0, 2, "cut off"), (3, 7, None)]


def test_blocks_in_production_come_after_stored_ones_and_by_their_producer() -> None:
    """Of two instances producing one block, every reader takes the one whose URL sorts first:
    the one that keeps producing when both find out (`agent.live.watch_rivals`)."""
    import dataclasses

    from kvsp_moq.protocol.records import LIVE_DIGEST

    def live(producer: str) -> ReplicaRecord:
        return dataclasses.replace(record("moqt://r/"), digest=LIVE_DIGEST, size=0, live=True,
                                   moqt_namespace=f"kvsp/{producer}", http_holder=producer)

    stored = dataclasses.replace(record("moqt://r/"), moqt_namespace="kvsp/stored")
    records = [live("http://b.test/"), stored, live("http://a.test/")]
    candidates = order_candidates(records, [Fake("moqt")])
    assert [c.record.http_holder for c in candidates] == [None, "http://a.test/", "http://b.test/"]


async def test_every_candidate_failing_raises_with_the_failures() -> None:
    candidates = [SourceCandidate(Fake("http", miss=True), record("http://a/")),
                  SourceCandidate(Fake("http", fail_at=0), record("http://b/"))]
    with pytest.raises(CandidatesExhausted) as e:
        await collect(fetch_layers(candidates, 0, LAYERS - 1))
    assert e.value.failures == [("http://a/", "not here"), ("http://b/", "cut off")]


async def test_a_layer_the_caller_refuses_fails_its_source() -> None:
    first, second = Fake("http"), Fake("http")
    candidates = [SourceCandidate(first, record("http://a/")), SourceCandidate(second, record("http://b/"))]

    def deliver(layer) -> None:
        if layer.index == 2 and layer.candidate.source is first:
            raise ValueError("wrong size")

    got = await collect(fetch_layers(candidates, 0, 4, deliver=deliver))
    assert [i for i, _ in got] == list(range(5)) and second.asked == [(2, 4)]


async def test_leases_are_taken_before_reading_and_a_refusal_moves_on() -> None:
    client = Leases(refuse={"http://a/": LeaseQuota("too many"),
                            "http://c/": TransportError("no lease endpoint")})
    keeper = LeaseKeeper(client, 10_000)  # type: ignore[arg-type]
    a, c = Fake("http"), Fake("http")
    failures: list[tuple[str, str]] = []
    block = BlockCandidates(KEY, [SourceCandidate(a, record("http://a/")), SourceCandidate(c, record("http://c/"))],
                            keeper=keeper, on_failure=lambda key, cand, why: failures.append((cand.record.holder, why)))
    got = await collect(block.layers(0, 3))
    await keeper.release()
    assert a.asked == [] and failures == [("http://a/", "lease refused: too many")]
    assert [i for i, _ in got] == [0, 1, 2, 3]  # read from c without a lease: none to be had there
    assert block.leases == {"http://c/": None}


async def test_ranges_of_one_block_share_its_candidates_and_batch_leases() -> None:
    client = Leases()
    keeper = LeaseKeeper(client, 10_000)  # type: ignore[arg-type]
    bad, good = Fake("http", fail_at=1), Fake("http")
    blocks = [BlockCandidates(key, [SourceCandidate(bad, record("http://a/", key)),
                                    SourceCandidate(good, record("http://b/", key))], keeper=keeper)
              for key in ("aa" * 32, "dd" * 32)]
    await lease_first_candidates(blocks, keeper)
    assert client.acquired == [("http://a/", ["aa" * 32, "dd" * 32])]
    await collect(blocks[0].layers(0, 3))
    assert blocks[0].current == 1
    got = await collect(blocks[0].layers(4, 7))  # the failed candidate is not tried again
    assert bad.asked == [(0, 3)] and good.asked == [(1, 3), (4, 7)] and len(got) == 4
    assert client.acquired[-1] == ("http://b/", ["aa" * 32])
    await keeper.release()


async def test_a_holder_whose_leases_are_unreachable_is_asked_once_per_load() -> None:
    """An unreachable lease endpoint costs a load one timeout, not one per block: its blocks
    are read without a lease (a relay's cache may still serve them while the holder is away)."""

    class Counting(Leases):
        calls = 0

        async def acquire(self, holder: str, keys: list[str], ttl_ms: int) -> str:
            self.calls += 1
            return await super().acquire(holder, keys, ttl_ms)

    client = Counting(refuse={"http://a/": TransportError("timed out")})
    keeper = LeaseKeeper(client, 10_000)  # type: ignore[arg-type]
    source = Fake("http")
    blocks = [BlockCandidates(key, [SourceCandidate(source, record("http://a/", key))], keeper=keeper)
              for key in ("aa" * 32, "dd" * 32, "ee" * 32)]
    await lease_first_candidates(blocks, keeper)
    assert client.calls == 1 and keeper.unavailable == {"http://a/"}
    for block in blocks:
        assert len(await collect(block.layers(0, 3))) == 4
        assert block.leases == {"http://a/": None}
    assert client.calls == 1  # no block asked again
    # A refusal that is an answer (a quota) still leaves each block to lease its own.
    client = Counting(refuse={"http://a/": LeaseQuota("too many")})
    keeper = LeaseKeeper(client, 10_000)  # type: ignore[arg-type]
    blocks = [BlockCandidates(key, [SourceCandidate(Fake("http"), record("http://a/", key))],
                              keeper=keeper) for key in ("aa" * 32, "dd" * 32)]
    await lease_first_candidates(blocks, keeper)
    assert keeper.unavailable == set()
    with pytest.raises(CandidatesExhausted):
        await collect(blocks[0].layers(0, 3))
    assert client.calls == 2
    await keeper.release()


async def test_a_lease_slower_than_the_patience_is_not_waited_for_but_kept() -> None:
    """A lease endpoint that does not answer within the keeper's patience holds the load up
    that long, not for the request's own timeout; a lease granted later is still kept and
    released with the others, and one never granted is given up when the load stops."""

    class Slow(Leases):
        def __init__(self, delay: float) -> None:
            super().__init__()
            self.delay = delay
            self.released: list[str] = []

        async def acquire(self, holder: str, keys: list[str], ttl_ms: int) -> str:
            await asyncio.sleep(self.delay)
            return await super().acquire(holder, keys, ttl_ms)

        async def release(self, holder: str, lease: str) -> None:
            self.released.append(lease)

    client = Slow(delay=0.4)
    keeper = LeaseKeeper(client, 10_000, patience_s=0.1)  # type: ignore[arg-type]
    blocks = [BlockCandidates(key, [SourceCandidate(Fake("http"), record("http://a/", key))],
                              keeper=keeper) for key in ("aa" * 32, "dd" * 32)]
    loop = asyncio.get_running_loop()
    started = loop.time()
    await lease_first_candidates(blocks, keeper)
    for block in blocks:
        assert len(await collect(block.layers(0, 3))) == 4
    assert loop.time() - started < 0.35 and keeper.unavailable == {"http://a/"}
    await asyncio.sleep(0.5)  # the lease arrives after the reads began
    assert keeper.leases == [("http://a/", "lease-1")]
    await keeper.release()
    assert client.released == ["lease-1"]

    never = Slow(delay=30)
    keeper = LeaseKeeper(never, 10_000, patience_s=0.05)  # type: ignore[arg-type]
    assert await keeper.take("http://b/", ["aa" * 32]) is None
    [pending] = keeper._late
    await keeper.release()
    assert pending.cancelled() and keeper.leases == [] and not keeper._late
