"""Publishing and withdrawing replica records (§6.1) against a recording Index Service."""

from __future__ import annotations

import httpx

from kvsp_moq.errors import ForbiddenScope
from kvsp_moq.protocol.records import ReplicaRecord
from kvsp_moq.web import BackgroundServer
from tests.holder.conftest import OTHER_SCOPE, FakeClock, FakeIndex, make_block
from tests.polling import wait_until

PUT = {"If-None-Match": "*"}


def put(holder, block) -> httpx.Response:
    r = httpx.put(holder.url + block.path, content=block.data, headers=PUT, trust_env=False)
    assert r.status_code == 201, r.text
    return r


def test_records_are_put_with_the_replicas_metadata(start_holder, fake_index) -> None:
    index, index_url = fake_index
    holder = start_holder(index_url=index_url, record_ttl_ms=30_000)
    block = make_block(1, layers=5)
    put(holder, block)
    record = wait_until(lambda: index.record(block.bid.block_key), timeout=5.0, what="the record")
    parsed = ReplicaRecord.from_json(record)
    assert parsed.holder == holder.url and holder.url.endswith("/")
    assert parsed.compat_id == block.bid.compat_id and parsed.scope_id == block.bid.scope_id
    assert list(parsed.layer_digests) == block.layer_digests
    assert parsed.size == len(block.data) and parsed.codec == 1 and parsed.ttl_ms == 30_000
    assert [r.to_json() for r in parsed.residency] == [
        {"tier": "host", "layers": [0, 4], "read_mbit_per_s": 400_000.0}]
    # Once published, max-age is bounded by what is left of the record's TTL.
    r = httpx.get(holder.url + block.path, trust_env=False)
    max_age = int(r.headers["cache-control"].rsplit("max-age=", 1)[1])
    assert 25 <= max_age <= 30


def test_records_are_refreshed_in_batches(start_holder, fake_index) -> None:
    index, index_url = fake_index
    holder = start_holder(index_url=index_url, record_ttl_ms=900)  # refresh every 0.3 s
    blocks = [make_block(i) for i in range(3)]
    for b in blocks:
        put(holder, b)
    wait_until(lambda: any(n == 3 for n in index.batches), timeout=5.0, what="a batch of all three")
    assert index.keys() == {b.bid.block_key for b in blocks}


def test_eviction_deletes_the_record_before_dropping_the_data(start_holder, fake_index) -> None:
    index, index_url = fake_index
    size = len(make_block(0).data)
    holder = start_holder(index_url=index_url, host_bytes=2 * size)
    a, b, c = (make_block(i) for i in range(3))
    bids = {x.bid.block_key: x.bid for x in (a, b, c)}
    present_at_delete: dict[str, bool] = {}
    index.on_delete = lambda key: present_at_delete.setdefault(
        key, holder.store.holds_data(bids[key]))
    put(holder, a)
    put(holder, b)
    wait_until(lambda: len(index.keys()) == 2, timeout=5.0, what="two records")
    put(holder, c)  # evicts a, the least recently used
    assert index.deleted() == [a.bid.block_key]
    assert present_at_delete == {a.bid.block_key: True}
    assert httpx.get(holder.url + a.path, trust_env=False).status_code == 404
    wait_until(lambda: index.keys() == {b.bid.block_key, c.bid.block_key}, timeout=5.0, what="records")


def test_a_leased_replica_is_not_evicted_until_its_lease_expires(start_holder,
                                                                 fake_index) -> None:
    index, index_url = fake_index
    clock = FakeClock()
    size = len(make_block(0).data)
    holder = start_holder(clock=clock, index_url=index_url, host_bytes=3 * size)
    a, b, c, d, e = (make_block(i) for i in range(5))
    put(holder, a)
    r = httpx.post(holder.url + "leases", trust_env=False,
                   json={"block_keys": [a.bid.block_key], "ttl_ms": 10_000})
    assert r.status_code == 201
    for block in (b, c, d):
        put(holder, block)  # d evicts b, not the leased a
    assert index.deleted() == [b.bid.block_key]
    assert holder.store.get(a.bid) is not None
    clock.advance(10.001)  # the lease has expired: a is fair game again
    put(holder, e)
    assert index.deleted() == [b.bid.block_key, a.bid.block_key]
    assert httpx.get(holder.url + a.path, trust_env=False).status_code == 404


def test_all_leased_means_no_room(start_holder) -> None:
    size = len(make_block(0).data)
    holder = start_holder(host_bytes=size)
    a, b = make_block(1), make_block(2)
    put(holder, a)
    httpx.post(holder.url + "leases", trust_env=False,
               json={"block_keys": [a.bid.block_key], "ttl_ms": 10_000})
    r = httpx.put(holder.url + b.path, content=b.data, headers=PUT, trust_env=False)
    assert r.status_code == 507
    assert httpx.get(holder.url + a.path, trust_env=False).content == a.data


def test_demotion_to_disk_republishes_the_residency(start_holder, fake_index, tmp_path) -> None:
    index, index_url = fake_index
    size = len(make_block(0).data)
    holder = start_holder(index_url=index_url, host_bytes=size, data_dir=tmp_path,
                          disk_bytes=10 * size)
    a, b = make_block(1), make_block(2)
    put(holder, a)
    put(holder, b)  # a moves to disk; its replica stays
    wait_until(lambda: (index.record(a.bid.block_key) or {}).get("residency", [{}])[0]
               .get("tier") == "disk", timeout=5.0, what="a disk residency")
    assert index.deleted() == []
    assert httpx.get(holder.url + a.path, trust_env=False).content == a.data


def test_restart_on_the_same_data_serves_and_republishes(start_holder, fake_index,
                                                         tmp_path) -> None:
    index, index_url = fake_index
    blocks = [make_block(i) for i in range(3)]
    first = start_holder(index_url=index_url, data_dir=tmp_path)
    digests = {}
    for b in blocks:
        put(first, b)
        digests[b.bid] = httpx.get(first.url + b.path, trust_env=False).headers["repr-digest"]
    first.call(first.store.flush())
    first.stop()

    fresh = FakeIndex()
    with BackgroundServer(fresh.app()) as server:
        second = start_holder(index_url=server.url, data_dir=tmp_path)
        wait_until(lambda: fresh.keys() == {b.bid.block_key for b in blocks},
                   timeout=5.0, what="records re-published")
        assert all(r["holder"] == second.url for r in fresh.records.values())
        for b in blocks:
            r = httpx.get(second.url + b.path, trust_env=False)
            assert r.content == b.data and r.headers["repr-digest"] == digests[b.bid]
        assert {r["residency"][0]["tier"] for r in fresh.records.values()} <= {"disk", "host"}


def test_an_unreachable_index_is_retried_and_refilled_when_back(start_holder) -> None:
    index = FakeIndex(failing=True)
    server = BackgroundServer(index.app()).start()
    port = server.port
    holder = start_holder(index_url=server.url, record_ttl_ms=1_500)
    a = make_block(1)
    put(holder, a)
    wait_until(lambda: holder.publisher.failures >= 1, timeout=5.0, what="a failed publish")
    server.stop()  # the index goes away entirely
    b = make_block(2)
    put(holder, b)
    assert httpx.get(holder.url + "healthz", trust_env=False).status_code == 200

    restarted = FakeIndex()  # comes back on the same address, empty
    with BackgroundServer(restarted.app(), port=port):
        wait_until(lambda: restarted.keys() == {a.bid.block_key, b.bid.block_key},
                   timeout=8, what="everything re-published")


async def test_the_moqt_record_waits_for_the_relay_to_accept_the_namespace() -> None:
    """A MOQT record found before the relay knows the namespace would send clients to a track
    nobody serves there yet: it is put only once the announcement is accepted."""
    import asyncio

    from kvsp_moq.holder.index_publisher import IndexPublisher
    from kvsp_moq.holder.store import BlockStore

    class RecordingIndex:
        base = "http://index.invalid/"

        def __init__(self) -> None:
            self.put_records: list[ReplicaRecord] = []

        async def put(self, record: ReplicaRecord) -> None:
            self.put_records.append(record)

        async def put_many(self, records: list[ReplicaRecord]) -> None:
            self.put_records.extend(records)

        async def delete(self, record: ReplicaRecord) -> None:
            pass

    async def until(predicate, what: str) -> None:
        for _ in range(200):
            if predicate():
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"{what} did not happen within 2 s")

    index = RecordingIndex()
    store = BlockStore(is_protected=lambda k: False, host_bytes=1 << 20)
    publisher = IndexPublisher(store, index, holder_url="http://holder.invalid/",  # type: ignore[arg-type]
                          relay_url="moqt://relay.invalid:4443", record_ttl_ms=60_000)
    accepted: set[tuple[str, str]] = set()
    publisher.moqt_ready = lambda c, s: (c, s) in accepted
    await publisher.start()
    try:
        block = make_block(7)
        publisher.announce(await store.put(block.bid, bytearray(block.data)))
        await until(lambda: index.put_records, "the HTTP record")
        await asyncio.sleep(0.2)
        assert [r.is_moqt for r in index.put_records] == [False]
        accepted.add((block.bid.compat_id, block.bid.scope_id))
        await until(lambda: any(r.is_moqt for r in index.put_records), "the MOQT record")
        moqt = [r for r in index.put_records if r.is_moqt]
        assert moqt[0].http_holder == "http://holder.invalid/"
        assert moqt[0].block_key == block.bid.block_key
    finally:
        await publisher.stop()


class RefusingIndex:
    """An Index Service that takes a batch whole or refuses it whole (as the IS does), and
    refuses every record of `refused_scope` (403), the way a principal's scopes would."""

    base = "http://index.invalid/"

    def __init__(self, refused_scope: str) -> None:
        self.refused_scope = refused_scope
        self.records: dict[str, ReplicaRecord] = {}
        self.requests = 0
        self.deletes: list[str] = []

    def _check(self, records: list[ReplicaRecord]) -> None:
        self.requests += 1
        for i, r in enumerate(records):
            if r.scope_id == self.refused_scope:
                raise ForbiddenScope("not authorized for the scope", member=f"records[{i}].scope_id")

    async def put(self, record: ReplicaRecord) -> None:
        await self.put_many([record])

    async def put_many(self, records: list[ReplicaRecord]) -> None:
        self._check(records)
        self.records.update({r.block_key: r for r in records})

    async def delete(self, record: ReplicaRecord) -> None:
        self.deletes.append(record.block_key)
        if record.scope_id == self.refused_scope:
            raise ForbiddenScope("not authorized for the scope")
        self.records.pop(record.block_key, None)


async def test_one_refused_record_does_not_keep_the_others_out() -> None:
    """The refused record is isolated by halving the batch, dropped once (counted, not sent
    again), and every other record is published, on the first round and on refreshes."""
    from kvsp_moq.holder.index_publisher import IndexPublisher
    from kvsp_moq.holder.store import BlockStore

    index = RefusingIndex(OTHER_SCOPE)
    store = BlockStore(is_protected=lambda k: False, host_bytes=1 << 20)
    clock = FakeClock()
    publisher = IndexPublisher(store, index, holder_url="http://holder.invalid/",  # type: ignore[arg-type]
                               record_ttl_ms=60_000, clock=clock)
    store.withdraw = publisher.withdraw
    mine = [make_block(i) for i in range(12)]
    foreign = make_block(50, scope=OTHER_SCOPE)
    for b in mine[:5] + [foreign] + mine[5:]:
        publisher.announce(await store.put(b.bid, bytearray(b.data)))
    await publisher.step()
    assert set(index.records) == {b.bid.block_key for b in mine}
    assert publisher.refused == 1 and index.requests <= 2 * 4 + 1  # log2(13) rounds of halving
    assert all(publisher.is_published(b.bid) for b in mine) and not publisher.is_published(foreign.bid)
    clock.advance(30)  # a full refresh: the refused record is not sent again
    before = index.requests
    await publisher.step()
    assert index.requests == before + 1 and publisher.refused == 1
    late = make_block(60)
    publisher.announce(await store.put(late.bid, bytearray(late.data)))
    await publisher.step()
    assert late.bid.block_key in index.records
    # Withdrawing the refused replica deletes nothing it never published, and stalls nothing.
    entry = store.get(foreign.bid)
    assert entry is not None
    assert await store.evict(entry)
    assert foreign.bid.block_key not in index.deletes
    gone = store.get(mine[0].bid)
    assert gone is not None and await store.evict(gone)
    assert mine[0].bid.block_key not in index.records
    await publisher.step()


async def test_a_waiter_for_sent_records_wakes_when_a_batch_is_sent() -> None:
    """`sent()` returns once the next batch has gone to the IS (an agent answering a request
    waits so for its blocks' records), and after its timeout when nothing is sent."""
    import asyncio
    import time

    from kvsp_moq.holder.index_publisher import IndexPublisher
    from kvsp_moq.holder.store import BlockStore

    index = RefusingIndex("none")
    store = BlockStore(is_protected=lambda k: False, host_bytes=1 << 20)
    publisher = IndexPublisher(store, index, holder_url="http://holder.invalid/",  # type: ignore[arg-type]
                               record_ttl_ms=60_000, clock=FakeClock())
    t0 = time.monotonic()
    await publisher.sent(0.05)  # nothing to send: the timeout
    assert time.monotonic() - t0 >= 0.04
    block = make_block(3)
    entry = await store.put(block.bid, bytearray(block.data))
    publisher.announce(entry)
    waiter = asyncio.ensure_future(publisher.sent(30.0))
    await asyncio.sleep(0)
    assert not waiter.done()
    await publisher.step()
    await asyncio.wait_for(waiter, 1.0)  # woken by the batch, long before its 30 s
    assert publisher.is_published(block.bid) and block.bid.block_key in index.records
