"""The tiered store and the lease table as plain objects (no HTTP)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

from kvsp_moq.errors import BadContainer, LayersUnavailable, LeaseQuota, NotFound, PreconditionFailed
from kvsp_moq.holder.leases import LeaseLimits, LeaseTable
from kvsp_moq.holder.store import BlockStore, StoreFull, write_block_file
from kvsp_moq.protocol.compat import CompatDescriptor
from kvsp_moq.protocol.container import Container
from tests.fixtures import DESCRIPTOR
from tests.holder.conftest import OTHER_SCOPE, SCOPE, FakeClock, make_block

SIZE = len(make_block(0).data)


def store_with(leases: LeaseTable | None = None, withdrawn: list | None = None, **kw) -> BlockStore:
    async def withdraw(entry) -> None:
        # The data must still be there when the record is withdrawn.
        assert store.holds_data(entry.id)
        if withdrawn is not None:
            withdrawn.append(entry.id)

    store = BlockStore(is_protected=(leases.is_protected if leases is not None else lambda k: False),
                       withdraw=withdraw, **kw)
    return store


async def test_put_read_whole_and_range() -> None:
    store = store_with(host_bytes=1 << 20)
    block = make_block(1)
    entry = await store.put(block.bid, bytearray(block.data))
    assert [d.hex() for d in entry.meta.layer_digests] == block.layer_digests
    assert entry.container_digest is None  # made on the first whole read that needs it
    with await store.open_read(block.bid) as read:
        assert b"".join(bytes(c) for c in read.chunks(100)) == block.data
        assert await read.digest() == hashlib.sha256(block.data).digest()
    assert entry.container_digest == hashlib.sha256(block.data).digest()
    with await store.open_read(block.bid, 1, 2) as read:
        body = b"".join(bytes(c) for c in read.chunks())
        assert body == Container(block.data).slice(1, 2)
        assert await read.digest() == hashlib.sha256(body).digest()
    assert entry.readers == 0
    with pytest.raises(LayersUnavailable):
        await store.open_read(block.bid, 2, 4)
    with pytest.raises(NotFound):
        await store.open_read(make_block(2).bid)
    with pytest.raises(PreconditionFailed):
        await store.put(block.bid, bytearray(block.data))


async def test_refuses_what_cannot_be_a_stored_block() -> None:
    store = store_with(host_bytes=1 << 20,
                       descriptors={"ab" * 32: CompatDescriptor.from_dict(DESCRIPTOR)})
    block = make_block(1)
    with pytest.raises(BadContainer):
        await store.put(block.bid, block.data[:-1])
    with pytest.raises(BadContainer, match="layer 0"):
        await store.put(block.bid, Container(block.data).slice(1, 3))
    # DESCRIPTOR: 4 layers, 16 tokens, 2 heads x 8 dims of float32 = 1024 octets a section.
    with pytest.raises(BadContainer, match="tokens"):
        await store.put(block.bid, make_block(1, tokens=8).data)
    with pytest.raises(BadContainer, match="sections"):
        await store.put(block.bid, make_block(1, section=512).data)
    await store.put(block.bid, block.data)
    assert len(store) == 1


async def test_lru_eviction_withdraws_before_dropping() -> None:
    withdrawn: list = []
    store = store_with(host_bytes=3 * SIZE, withdrawn=withdrawn)
    blocks = [make_block(i) for i in range(4)]
    for b in blocks[:3]:
        await store.put(b.bid, b.data)
    (await store.open_read(blocks[0].bid)).release()  # block 0 is now the most recent
    await store.put(blocks[3].bid, blocks[3].data)
    assert withdrawn == [blocks[1].bid]
    assert store.get(blocks[1].bid) is None and not store.holds_data(blocks[1].bid)
    assert store.used["host"] == 3 * SIZE


async def test_leased_and_busy_replicas_stay_until_the_lease_expires() -> None:
    clock = FakeClock()
    leases = LeaseTable(clock=clock)
    withdrawn: list = []
    store = store_with(leases, withdrawn, host_bytes=2 * SIZE)
    a, b, c, d = (make_block(i) for i in range(4))
    await store.put(a.bid, a.data)
    await store.put(b.bid, b.data)
    leases.create("client", [a.bid.block_key], SIZE, 5_000)
    reading = await store.open_read(b.bid)
    with pytest.raises(StoreFull):
        await store.put(c.bid, c.data)  # a is leased, b is being read
    reading.release()
    await store.put(c.bid, c.data)
    assert withdrawn == [b.bid]
    clock.advance(5.001)
    await store.put(d.bid, d.data)
    assert withdrawn == [b.bid, a.bid]


async def test_host_overflow_demotes_to_disk_and_reads_promote(tmp_path) -> None:
    changes: list = []
    withdrawn: list = []
    store = store_with(withdrawn=withdrawn, host_bytes=2 * SIZE, disk_bytes=10 * SIZE,
                       data_dir=tmp_path)
    store.on_change = lambda e: changes.append((e.id, e.tiers))
    blocks = [make_block(i) for i in range(3)]
    for b in blocks:
        await store.put(b.bid, b.data)
    await store.flush()
    first = store.get(blocks[0].bid)
    assert first.tiers == ("disk",) and not withdrawn
    assert [r.tier for r in store.residency(first)] == ["disk"]
    assert store.residency(first)[0].layers == (0, 3)
    with await store.open_read(blocks[0].bid, 0, 1) as read:  # promoted back to host
        assert b"".join(bytes(c) for c in read.chunks()) == Container(blocks[0].data).slice(0, 1)
    assert first.tiers == ("host", "disk")
    assert store.used["host"] == 2 * SIZE and store.used["disk"] == 3 * SIZE
    assert store.get(blocks[1].bid).tiers == ("disk",)


async def test_without_promotion_a_disk_copy_is_served_from_a_map(tmp_path) -> None:
    store = store_with(host_bytes=0, disk_bytes=10 * SIZE, data_dir=tmp_path,
                       promote_on_read=False)
    block = make_block(5)
    await store.put(block.bid, block.data)
    assert store.get(block.bid).tiers == ("disk",)
    with await store.open_read(block.bid) as read:
        assert b"".join(bytes(c) for c in read.chunks()) == block.data


async def test_restart_finds_complete_blocks_and_ignores_partial_ones(tmp_path) -> None:
    store = store_with(host_bytes=1 << 20, disk_bytes=1 << 20, data_dir=tmp_path)
    a, b = make_block(1), make_block(2)
    await store.put(a.bid, a.data)
    await store.put(b.bid, b.data)
    await store.flush()
    folder = tmp_path / "blocks" / a.bid.compat_id / a.bid.scope_id
    # What a crash leaves behind: an unfinished temporary file and a truncated block.
    leftover = folder / f".{make_block(3).bid.block_key}.kvb.0000.tmp"
    leftover.write_bytes(make_block(3).data[:100])
    truncated = folder / (make_block(4).bid.block_key + ".kvb")
    truncated.write_bytes(make_block(4).data[:-7])

    again = store_with(host_bytes=1 << 20, disk_bytes=1 << 20, data_dir=tmp_path)
    loaded = await again.load()
    assert {e.id for e in loaded} == {a.bid, b.bid}
    assert not leftover.exists()
    entry = again.get(a.bid)
    assert entry.meta == store.get(a.bid).meta
    with await again.open_read(a.bid) as read:
        assert b"".join(bytes(c) for c in read.chunks()) == a.data


async def test_restart_serves_only_the_scopes_still_served(tmp_path) -> None:
    store = store_with(host_bytes=1 << 20, disk_bytes=1 << 20, data_dir=tmp_path)
    mine, theirs = make_block(1), make_block(2, scope=OTHER_SCOPE)
    await store.put(mine.bid, mine.data)
    await store.put(theirs.bid, theirs.data)
    await store.flush()
    again = store_with(host_bytes=1 << 20, disk_bytes=1 << 20, data_dir=tmp_path)
    loaded = await again.load(keep=lambda bid: bid.scope_id == SCOPE)
    assert [e.id for e in loaded] == [mine.bid] and again.get(theirs.bid) is None
    assert again.scope_bytes == {SCOPE: len(mine.data)}


def test_block_files_appear_whole_or_not_at_all(tmp_path, monkeypatch) -> None:
    path = tmp_path / "x" / "block.kvb"

    def failing_fsync(fd: int) -> None:
        raise OSError("disk gone")

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", failing_fsync)
        with pytest.raises(OSError):
            write_block_file(path, b"abc" * 1000)
    assert not path.exists() and list(path.parent.iterdir()) == []
    write_block_file(path, b"abc")
    assert path.read_bytes() == b"abc" and len(list(path.parent.iterdir())) == 1


async def test_a_block_larger_than_host_memory_goes_straight_to_disk(tmp_path) -> None:
    store = store_with(host_bytes=SIZE // 2, disk_bytes=4 * SIZE, data_dir=tmp_path)
    block = make_block(1)
    entry = await store.put(block.bid, block.data)
    assert entry.tiers == ("disk",)
    store_no_disk = store_with(host_bytes=SIZE // 2)
    with pytest.raises(StoreFull):
        await store_no_disk.put(block.bid, block.data)


# --------------------------------------------------------------------------- leases


def test_lease_quota_on_octets_and_ttl() -> None:
    clock = FakeClock()
    table = LeaseTable(limits=LeaseLimits(max_ttl_ms=10_000, max_octets=1000), clock=clock,
                       per_client={"big": LeaseLimits(max_ttl_ms=60_000, max_octets=10_000)})
    first = table.create("c", ["aa" * 32], 600, 1_000)
    with pytest.raises(LeaseQuota):
        table.create("c", ["bb" * 32], 600, 1_000)
    with pytest.raises(LeaseQuota):
        table.create("c", ["bb" * 32], 100, 10_001)
    table.create("other", ["bb" * 32], 600, 1_000)  # quotas are per client
    table.create("big", ["bb" * 32], 6000, 60_000)
    assert table.leased_octets("c") == 600
    clock.advance(1.0)
    assert not table.is_protected("aa" * 32)
    with pytest.raises(NotFound):
        table.renew(first.id, "c")
    table.create("c", ["bb" * 32], 900, 1_000)  # the expired lease no longer counts


def test_lease_renew_release_and_ownership() -> None:
    clock = FakeClock()
    table = LeaseTable(limits=LeaseLimits(max_ttl_ms=10_000), clock=clock)
    lease = table.create("c", ["aa" * 32, "aa" * 32], 10, 2_000)
    assert lease.block_keys == ("aa" * 32,)
    clock.advance(1.5)
    table.renew(lease.id, "c")
    clock.advance(1.5)
    assert table.is_protected("aa" * 32)
    with pytest.raises(LeaseQuota):
        table.renew(lease.id, "c", 20_000)
    with pytest.raises(NotFound):
        table.release(lease.id, "someone else")
    table.release(lease.id, "c")
    assert not table.is_protected("aa" * 32) and len(table) == 0
    with pytest.raises(NotFound):
        table.release(lease.id, "c")


async def test_a_scope_over_its_quota_evicts_its_own_blocks_only() -> None:
    """A scope writing past its quota makes room from its own oldest replicas; another scope
    within its quota keeps every block, and the first scope's leased blocks make it 507."""
    clock = FakeClock()
    leases = LeaseTable(clock=clock)
    withdrawn: list = []
    store = store_with(leases, withdrawn, host_bytes=6 * SIZE,
                       scope_quota=lambda scope: 3 * SIZE)
    mine = [make_block(i, scope=SCOPE) for i in range(3)]
    theirs = [make_block(10 + i, scope=OTHER_SCOPE) for i in range(6)]
    for b in mine:
        await store.put(b.bid, b.data)
    for b in theirs:
        await store.put(b.bid, b.data)
    assert all(store.get(b.bid) is not None for b in mine)
    assert withdrawn == [b.bid for b in theirs[:3]]
    assert store.scope_bytes == {SCOPE: 3 * SIZE, OTHER_SCOPE: 3 * SIZE}
    for b in theirs[3:]:
        leases.create("them", [b.bid.block_key], SIZE, 5_000)
    with pytest.raises(StoreFull):
        await store.put(make_block(20, scope=OTHER_SCOPE).bid, make_block(20, scope=OTHER_SCOPE).data)
    assert all(store.get(b.bid) is not None for b in mine)
    big = make_block(21, scope=SCOPE, layers=16)
    with pytest.raises(StoreFull, match="quota"):
        await store.put(big.bid, big.data)


async def test_room_is_not_taken_from_another_scope_within_its_share(tmp_path) -> None:
    """Another scope within its share keeps every replica (its host copies may go where the
    disk keeps one): a writing scope makes room from its own; a scope over its share gives way."""
    quota = {SCOPE: 4 * SIZE, OTHER_SCOPE: 4 * SIZE}
    withdrawn: list = []
    store = store_with(withdrawn=withdrawn, host_bytes=2 * SIZE, disk_bytes=4 * SIZE,
                       data_dir=tmp_path, scope_quota=quota.get)
    mine = [make_block(i, scope=SCOPE) for i in range(4)]
    for b in mine:
        await store.put(b.bid, b.data)
    await store.flush()
    others = [make_block(30 + i, scope=OTHER_SCOPE) for i in range(4)]
    for b in others:
        await store.put(b.bid, b.data)
    assert all(store.get(b.bid) is not None for b in mine)
    assert withdrawn and {bid.scope_id for bid in withdrawn} == {OTHER_SCOPE}
    assert store.get(others[-1].bid) is not None
    evicted = len(withdrawn)
    quota[SCOPE] = 2 * SIZE  # now over its share: its blocks give way
    late = make_block(40, scope=OTHER_SCOPE)
    await store.put(late.bid, late.data)
    await store.flush()
    assert store.get(late.bid) is not None
    assert withdrawn[evicted:] and {bid.scope_id for bid in withdrawn[evicted:]} == {SCOPE}


def test_lease_count_caps_per_client_and_in_all() -> None:
    table = LeaseTable(limits=LeaseLimits(max_leases=2), max_total=3, clock=FakeClock())
    table.create("b", ["aa" * 32], 1, 1_000)
    table.create("b", ["bb" * 32], 1, 1_000)
    with pytest.raises(LeaseQuota, match="2 leases"):
        table.create("b", ["cc" * 32], 1, 1_000)
    table.create("a", ["cc" * 32], 1, 1_000)  # per client: another may still lease
    with pytest.raises(LeaseQuota, match="3 leases"):
        table.create("c", ["dd" * 32], 1, 1_000)


def test_leases_pin_no_more_than_the_scope_may_hold() -> None:
    """Octets pinned per scope are bounded by its share; a block leased twice counts once."""
    table = LeaseTable(clock=FakeClock(), scope_limit=lambda scope: 100)
    keys = ["aa" * 32, "bb" * 32, "cc" * 32]
    first = table.create("a", keys[:2], 80, 1_000, pins={k: (SCOPE, 40) for k in keys[:2]})
    table.create("a2", keys[:1], 40, 1_000, pins={keys[0]: (SCOPE, 40)})  # already pinned
    with pytest.raises(LeaseQuota, match="share"):
        table.create("a", keys[2:], 40, 1_000, pins={keys[2]: (SCOPE, 40)})
    table.create("b", keys[2:], 40, 1_000, pins={keys[2]: (OTHER_SCOPE, 40)})  # another scope
    assert table.pinned_octets(SCOPE) == 80
    table.release(first.id, "a")
    assert table.pinned_octets(SCOPE) == 40  # keys[0] is still leased by a2
    table.create("a", keys[1:2], 40, 1_000, pins={keys[1]: (SCOPE, 40)})


def test_holder_modules_do_not_import_torch() -> None:
    code = ("import sys, kvsp_moq.holder.service, kvsp_moq.fetch.http, "
            "kvsp_moq.bench.http_blocks; sys.exit('torch' in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60,
                   cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))



async def test_responses_share_the_stored_buffer() -> None:
    store = store_with(host_bytes=4 << 20)
    block = make_block(1, section=300_000)
    entry = await store.put(block.bid, bytearray(block.data))
    stored = entry.host.buffer.obj
    for first, last in ((0, 3), (1, 2)):
        with await store.open_read(block.bid, first, last) as read:
            chunks = list(read.chunks())
            views = [c for c in chunks if isinstance(c, memoryview)]
            assert all(c.obj is stored for c in views)
            assert sum(len(c) for c in views) >= read.size - 1024  # all but a new header
            assert max(len(c) for c in chunks) <= 1 << 20


class StandInDevice:
    """The device tier's interface over host bytes, to exercise its bookkeeping without CUDA."""

    def __init__(self, budget: int) -> None:
        self.budget = budget

    def upload(self, payload: memoryview) -> bytes:
        return bytes(payload)

    def download(self, tensor: bytes, start: int, end: int) -> memoryview:
        return memoryview(tensor)[start:end]


async def test_leading_layers_on_the_device_split_the_residency() -> None:
    layer = 2 * 1024
    store = store_with(host_bytes=4 * SIZE, device_layers=2)
    store.device = StandInDevice(3 * layer)  # room for three layers in all
    store.budget["device"] = 3 * layer
    a, b = make_block(1), make_block(2)
    await store.put(a.bid, a.data)
    entry = store.get(a.bid)
    assert [(r.tier, r.layers) for r in store.residency(entry)] == [
        ("device", (0, 1)), ("host", (2, 3))]
    await store.put(b.bid, b.data)  # b's two layers push a's off the device (LRU)
    assert [r.tier for r in store.residency(entry)] == ["host"]
    assert store.get(b.bid).tiers == ("device", "host") and store.used["device"] == 2 * layer


async def test_device_layers_are_served_when_host_memory_let_go(tmp_path) -> None:
    store = store_with(host_bytes=SIZE, disk_bytes=10 * SIZE, data_dir=tmp_path,
                       promote_on_read=False, device_layers=2)
    layer = 2 * 1024
    store.device = StandInDevice(4 * layer)
    store.budget["device"] = 4 * layer
    a, b = make_block(1), make_block(2)
    await store.put(a.bid, a.data)
    await store.put(b.bid, b.data)  # a leaves host memory for disk; its device layers stay
    await store.flush()
    entry = store.get(a.bid)
    assert entry.tiers == ("device", "disk")
    assert [(r.tier, r.layers) for r in store.residency(entry)] == [
        ("device", (0, 1)), ("disk", (2, 3))]
    for first, last in ((0, 3), (0, 0), (1, 2), (3, 3)):
        with await store.open_read(a.bid, first, last) as read:
            body = b"".join(bytes(c) for c in read.chunks())
            assert body == Container(a.data).slice(first, last)
            assert await read.digest() == hashlib.sha256(body).digest()


async def test_a_put_with_the_layer_digests_takes_them_without_reading_the_layers() -> None:
    """A caller that verified (or produced) the layers hands their digests over: they go into
    the block's metadata as given, so digests that do not match the octets are what readers
    would check the layers against; a count that does not match the layers is refused."""
    store = store_with(host_bytes=1 << 20)
    block = make_block(2)
    given = [hashlib.sha256(b"not the layer %d" % i).digest() for i in range(len(block.layer_digests))]
    entry = await store.put(block.bid, bytearray(block.data), layer_digests=given)
    assert list(entry.meta.layer_digests) == given
    assert entry.meta.digest == hashlib.sha256(b"".join(given)).digest()
    other = make_block(3)
    with pytest.raises(ValueError):
        await store.put(other.bid, bytearray(other.data), layer_digests=given[:-1])
    assert store.get(other.bid) is None
    entry = await store.put(other.bid, bytearray(other.data),
                            layer_digests=[bytes.fromhex(d) for d in other.layer_digests])
    assert [d.hex() for d in entry.meta.layer_digests] == other.layer_digests
