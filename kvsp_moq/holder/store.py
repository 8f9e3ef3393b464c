"""The holder's tiered block store (KVSP §4.3, §6.1, §6.7).

A replica is kept whole in host memory, in a file under the data directory, or both; its
leading layers may also sit in accelerator memory. Each tier has a byte budget and its own LRU
order. Room is made by dropping a copy that another tier also holds, by demoting a host copy
to disk, and only as a last resort by evicting the replica, which withdraws its record first
(§6.1). A replica covered by a live lease, or one that is being read, is never evicted.

Each scope may have a quota (`scope_quota`, from `kvsp_moq.holder.tenancy`): a block that
would take its scope over it first evicts that scope's own least recently used replicas, and
is refused (507) when they cannot go. Room for a scope is never made by taking replicas from
another scope within its quota, so one tenant's writes cannot push another's blocks out.

Bookkeeping runs on the event loop thread; hashing and file I/O run in worker threads.
Files are written to a temporary name, synced and renamed, so a crash never leaves a partial
block visible, and a restarted store finds every block it had completed.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
import mmap
import os
import re
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence

from kvsp_moq.allocator import receive_buffer
from kvsp_moq.errors import (
    BadContainer,
    KvspError,
    LayersUnavailable,
    NotFound,
    PreconditionFailed,
    StoreFull,
)
from kvsp_moq.hashing import hash_pool
from kvsp_moq.protocol.compat import CODECS, CompatDescriptor
from kvsp_moq.protocol.container import Buffer, Container, encode_header
from kvsp_moq.protocol.records import BlockId, Residency

log = logging.getLogger("kvsp.holder.store")

TIERS = ("device", "host", "disk")
#: Size of the pieces hashed and streamed; large enough to amortise per-call overhead.
CHUNK = 1 << 20
_HEX = re.compile(r"^[0-9a-f]+$")
_RANGE_DIGESTS_KEPT = 32
#: write errors that mean "no room": a full filesystem, a quota, a file size limit
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}



@dataclass(frozen=True)
class BlockMeta:
    """What the store knows of a replica without touching its data."""

    codec: int
    token_count: int
    lengths: tuple[tuple[int, int], ...]
    layer_digests: tuple[bytes, ...]
    digest: bytes  #: replica digest (§4.3)
    size: int

    @property
    def layer_count(self) -> int:
        return len(self.lengths)


@dataclass
class TierRates:
    """read_mbit_per_s reported per tier; a tier left None is measured on its reads."""

    device: float | None = 800_000.0
    host: float | None = 400_000.0
    disk: float | None = None
    #: used for disk until a read has been measured
    disk_default: float = 16_000.0

    def of(self, tier: str, measured_disk: float | None) -> float | None:
        if tier == "disk" and self.disk is None:
            return round(measured_disk or self.disk_default, 1)
        return getattr(self, tier)


def _hash_pieces(pieces: Iterable[Buffer]) -> bytes:
    h = hashlib.sha256()
    for piece in pieces:
        h.update(piece)
    return h.digest()


def analyze(buffer: Buffer, layer_digests: Sequence[bytes] | None = None) -> tuple[Container, BlockMeta]:
    """Parse a container and compute its layer and replica digests.

    `layer_digests`, when the caller has them (it verified the layers against them, or
    computed them as it produced the layers), are taken as they are: the octets are then not
    read at all. The whole container's digest (a full GET's Repr-Digest) is made on the first
    such GET (`BlockRead.digest`): most blocks are read by layers over MOQT, never whole.
    """
    container = Container(buffer)
    if layer_digests is None:
        digests = tuple(container.layer_digests())
    else:
        digests = tuple(layer_digests)
        if len(digests) != container.layer_count:
            raise ValueError(f"{len(digests)} layer digests for {container.layer_count} layers")
    replica = hashlib.sha256(b"".join(digests)).digest()
    meta = BlockMeta(container.codec, container.token_count, tuple(container.lengths()),
                     digests, replica, len(container))
    return container, meta


def _slices(view: memoryview, size: int) -> Iterator[memoryview]:
    for i in range(0, len(view), size):
        yield view[i:i + size]


def check_block(container: Container, descriptor: CompatDescriptor | None) -> None:
    """Refuse a container that cannot be a whole stored replica (and, given the descriptor
    of its compat ID, one whose geometry differs from it)."""
    if container.first_layer != 0:
        raise BadContainer(f"a stored block must start at layer 0, not {container.first_layer}",
                           member="body")
    if container.layer_count == 0:
        raise BadContainer("a stored block needs at least one layer", member="body")
    if container.codec not in CODECS:
        raise BadContainer(f"unknown codec {container.codec}", member="body")
    if container.flags:
        raise BadContainer("flags are reserved and must be zero", member="body")
    if descriptor is None:
        return
    if container.layer_count != descriptor.layers:
        raise BadContainer(f"{container.layer_count} layers, the descriptor has "
                           f"{descriptor.layers}", member="body")
    if container.token_count != descriptor.block_tokens:
        raise BadContainer(f"{container.token_count} tokens, a block has "
                           f"{descriptor.block_tokens}", member="body")
    if container.codec == 1:
        section = descriptor.section_bytes(container.token_count)
        for i, (k, v) in enumerate(container.lengths()):
            if k != section or v != section:
                raise BadContainer(f"layer {i}: sections of {k} and {v} octets, raw layout "
                                   f"needs {section} each", member="body")


# --------------------------------------------------------------------------- device tier


class DeviceTier:
    """Leading layers of replicas in accelerator memory.

    torch is imported only here and only when a device budget is configured, so a holder
    without an accelerator never loads it.
    """

    def __init__(self, budget: int, device: str = "cuda") -> None:
        import torch  # optional and heavy

        self._torch = torch
        self.budget = budget
        self.device = device

    @staticmethod
    def available() -> bool:
        try:
            import torch
        except ImportError:
            return False
        return bool(torch.cuda.is_available())

    def upload(self, payload: memoryview) -> Any:
        torch = self._torch
        host = torch.frombuffer(payload, dtype=torch.uint8)
        return host.to(self.device, non_blocking=False)

    def download(self, tensor: Any, start: int, end: int) -> memoryview:
        return memoryview(tensor[start:end].cpu().numpy()).cast("B")


@dataclass
class DeviceCopy:
    tensor: Any
    layers: int  #: layers 0..layers-1 are on the device
    nbytes: int


# --------------------------------------------------------------------------- entries


@dataclass(eq=False)
class StoredBlock:
    """One replica and where its copies are."""

    id: BlockId
    meta: BlockMeta
    host: Container | None = None
    disk: Path | None = None
    device: DeviceCopy | None = None
    readers: int = 0
    evicting: bool = False
    persisting: asyncio.Task | None = None
    #: SHA-256 of the whole container, made on the first full read that needs it
    container_digest: bytes | None = None
    range_digests: "OrderedDict[tuple[int, int], bytes]" = field(default_factory=OrderedDict)

    @property
    def size(self) -> int:
        return self.meta.size

    @property
    def tiers(self) -> tuple[str, ...]:
        return tuple(t for t, held in (("device", self.device), ("host", self.host),
                                       ("disk", self.disk)) if held is not None)

    def whole_copies(self) -> int:
        return (self.host is not None) + (self.disk is not None)


class BlockRead:
    """Layers first..last of a replica pinned for one response; release() unpins them.

    The chunks are memoryviews into the stored buffer (or a read-only map of its file), so
    a response never holds a second copy of the block.
    """

    def __init__(self, store: "BlockStore", entry: StoredBlock, first: int, last: int,
                 header: Buffer, segments: Sequence[memoryview]) -> None:
        self.store = store
        self.entry = entry
        self.first = first
        self.last = last
        self.header = header
        self.segments = list(segments)
        self.size = len(header) + sum(len(s) for s in self.segments)
        self._released = False

    @property
    def whole(self) -> bool:
        return self.first == 0 and self.last == self.entry.meta.layer_count - 1

    def chunks(self, size: int = CHUNK) -> Iterator[Buffer]:
        yield self.header
        for segment in self.segments:
            yield from _slices(segment, size)

    async def digest(self) -> bytes:
        """SHA-256 of the returned container: cached for the whole block and recent ranges."""
        entry = self.entry
        if self.whole and entry.container_digest is not None:
            return entry.container_digest
        key = (self.first, self.last)
        cached = entry.range_digests.get(key)
        if cached is not None:
            entry.range_digests.move_to_end(key)
            return cached
        pieces = [self.header, *(c for s in self.segments for c in _slices(s, CHUNK))]
        if self.size > CHUNK:
            loop = asyncio.get_running_loop()
            value = await loop.run_in_executor(hash_pool(), _hash_pieces, pieces)
        else:
            value = _hash_pieces(pieces)
        if self.whole:
            entry.container_digest = value
            return value
        entry.range_digests[key] = value
        while len(entry.range_digests) > _RANGE_DIGESTS_KEPT:
            entry.range_digests.popitem(last=False)
        return value

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.entry.readers -= 1
            self.segments = []

    def __enter__(self) -> "BlockRead":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# --------------------------------------------------------------------------- files


def _block_file(root: Path, bid: BlockId) -> Path:
    return root / bid.compat_id / bid.scope_id / (bid.block_key + ".kvb")


def write_block_file(path: Path, data: Buffer) -> None:
    """Write, fsync, rename, fsync the directory: the block appears whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        view = memoryview(data)
        written = 0
        while written < len(view):
            written += os.write(fd, view[written:written + (16 << 20)])
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def map_file(path: Path) -> memoryview:
    """A read-only map of a block file; the map lives as long as views of it do."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return memoryview(b"")
        return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))


def read_file(path: Path) -> tuple[memoryview, float]:
    """The file's bytes and the seconds the read took (to measure the disk tier)."""
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        buf = view = receive_buffer(size)
        got = 0
        while got < size:
            n = f.readinto(view[got:])
            if not n:
                raise OSError(f"{path} shrank while being read")
            got += n
    return buf, time.perf_counter() - start


def scan_block_files(root: Path) -> list[tuple[BlockId, Path, BlockMeta]]:
    """Every complete block file under root, checked and digested; leftovers are removed."""
    found: list[tuple[BlockId, Path, BlockMeta]] = []
    if not root.is_dir():
        return found
    for path in sorted(root.glob("*/*/*")):
        name = path.name
        if name.startswith(".") and name.endswith(".tmp"):
            log.info("removing unfinished block file %s", path)
            path.unlink(missing_ok=True)
            continue
        compat, scope = path.parent.parent.name, path.parent.name
        key = name[:-4] if name.endswith(".kvb") else ""
        if not (len(compat) == 64 and len(scope) == 32 and len(key) == 64
                and all(_HEX.match(x) for x in (compat, scope, key))):
            log.warning("ignoring unexpected file %s", path)
            continue
        try:
            container, meta = analyze(map_file(path))
            check_block(container, None)
        except (OSError, KvspError) as e:
            log.warning("ignoring unreadable block file %s: %s", path, e)
            continue
        found.append((BlockId(compat, scope, key), path, meta))
    return found


# --------------------------------------------------------------------------- the store


Withdraw = Callable[[StoredBlock], Awaitable[None]]


class BlockStore:
    """Replicas keyed by (compat_id, scope_id, block_key) over device, host and disk tiers."""

    def __init__(
        self,
        *,
        host_bytes: int,
        disk_bytes: int = 0,
        data_dir: str | Path | None = None,
        device_bytes: int = 0,
        rates: TierRates | None = None,
        is_protected: Callable[[str], bool] = lambda block_key: False,
        withdraw: Withdraw | None = None,
        on_change: Callable[[StoredBlock], None] | None = None,
        descriptors: Mapping[str, CompatDescriptor] | None = None,
        promote_on_read: bool = True,
        device_layers: int | None = None,
        scope_quota: Callable[[str], int | None] | None = None,
    ) -> None:
        self.root = Path(data_dir) / "blocks" if data_dir is not None and disk_bytes > 0 else None
        self.budget = {"host": max(0, host_bytes),
                       "disk": max(0, disk_bytes) if self.root else 0,
                       "device": 0}
        self.device: DeviceTier | None = None
        if device_bytes > 0 and DeviceTier.available():
            self.device = DeviceTier(device_bytes)
            self.budget["device"] = device_bytes
        self.used = {t: 0 for t in TIERS}
        self.lru: dict[str, OrderedDict[BlockId, StoredBlock]] = {t: OrderedDict() for t in TIERS}
        self.rates = rates or TierRates()
        self.measured_disk_mbit: float | None = None
        self.is_protected = is_protected
        self.withdraw = withdraw
        self.on_change = on_change
        self.descriptors = dict(descriptors or {})
        self.promote_on_read = promote_on_read
        #: at most this many leading layers of a block go to the device (None: all that fit)
        self.device_layers = device_layers
        self.evictions = 0
        self.demotions = 0
        #: octets a scope may hold (None: no limit of its own); set by the holder's tenancy
        self.scope_quota: Callable[[str], int | None] = scope_quota or (lambda scope_id: None)
        #: octets of replicas held per scope (each replica counted once, whatever its copies)
        self.scope_bytes: dict[str, int] = {}
        self._placing: str | None = None  # the scope a put is making room for
        self._blocks: dict[BlockId, StoredBlock] = {}
        self._incoming: set[BlockId] = set()
        self._space = asyncio.Lock()

    # ---------------------------------------------------------------- lookup

    def get(self, bid: BlockId) -> StoredBlock | None:
        entry = self._blocks.get(bid)
        return None if entry is None or entry.evicting else entry

    def __contains__(self, bid: object) -> bool:
        return bid in self._blocks or bid in self._incoming

    def __len__(self) -> int:
        return len(self._blocks)

    def holds_data(self, bid: BlockId) -> bool:
        """Whether some copy of the replica is still present, even while it is evicted."""
        entry = self._blocks.get(bid)
        return entry is not None and bool(entry.tiers)

    def blocks(self) -> list[StoredBlock]:
        return [e for e in self._blocks.values() if not e.evicting]

    def by_key(self, block_key: str) -> list[StoredBlock]:
        return [e for e in self._blocks.values() if e.id.block_key == block_key and not e.evicting]

    @property
    def capacity(self) -> int:
        """Octets of replicas the store can keep: its largest whole-copy tier."""
        return max(self.budget["host"], self.budget["disk"])

    def over_quota(self, scope_id: str, extra: int = 0) -> bool:
        """Whether the scope holds (or with `extra` more octets would hold) more than its quota."""
        quota = self.scope_quota(scope_id)
        return quota is not None and self.scope_bytes.get(scope_id, 0) + extra > quota

    def _add(self, entry: StoredBlock) -> None:
        self._blocks[entry.id] = entry
        scope = entry.id.scope_id
        self.scope_bytes[scope] = self.scope_bytes.get(scope, 0) + entry.size

    def _remove(self, entry: StoredBlock) -> None:
        del self._blocks[entry.id]
        scope = entry.id.scope_id
        left = self.scope_bytes.get(scope, 0) - entry.size
        if left > 0:
            self.scope_bytes[scope] = left
        else:
            self.scope_bytes.pop(scope, None)

    @property
    def disk_enabled(self) -> bool:
        return self.root is not None and self.budget["disk"] > 0

    def _disk_file(self, bid: BlockId) -> Path:
        """A block's file on the disk tier (only written when there is one)."""
        assert self.root is not None, "no disk tier"
        return _block_file(self.root, bid)

    def residency(self, entry: StoredBlock) -> tuple[Residency, ...]:
        """Each layer at its fastest tier, as inclusive, non-overlapping ranges (§4.4)."""
        n = entry.meta.layer_count
        out = []
        on_device = entry.device.layers if entry.device is not None else 0
        if on_device:
            out.append(Residency("device", (0, on_device - 1), self._rate("device")))
        if on_device < n:
            tier = "host" if entry.host is not None else "disk"
            out.append(Residency(tier, (on_device, n - 1), self._rate(tier)))
        return tuple(out)

    def _rate(self, tier: str) -> float | None:
        return self.rates.of(tier, self.measured_disk_mbit)

    def _note_disk_read(self, nbytes: int, seconds: float) -> None:
        if nbytes < CHUNK or seconds <= 0:
            return
        mbit = nbytes * 8 / seconds / 1e6
        prev = self.measured_disk_mbit
        self.measured_disk_mbit = mbit if prev is None else 0.8 * prev + 0.2 * mbit

    def _touch(self, entry: StoredBlock) -> None:
        for tier in entry.tiers:
            lru = self.lru[tier]
            if entry.id in lru:
                lru.move_to_end(entry.id)

    def _changed(self, entry: StoredBlock) -> None:
        if self.on_change is not None and not entry.evicting:
            self.on_change(entry)

    # ---------------------------------------------------------------- reading

    async def open_read(self, bid: BlockId, first: int | None = None,
                        last: int | None = None) -> BlockRead:
        """Pin layers first..last (inclusive; default all) for a response."""
        entry = self.get(bid)
        if entry is None:
            raise NotFound("no replica of this block here")
        n = entry.meta.layer_count
        first = 0 if first is None else first
        last = n - 1 if last is None else last
        if not 0 <= first <= last < n:
            raise LayersUnavailable(f"layers {first}-{last} are not held; this replica has "
                                    f"layers 0-{n - 1}")
        if entry.host is None and self.promote_on_read:
            await self._promote(entry)
            if self.get(bid) is not entry:
                raise NotFound("the replica was evicted while being read")
        entry.readers += 1
        try:
            self._touch(entry)
            header, segments = self._segments(entry, first, last)
        except BaseException:
            entry.readers -= 1
            raise
        return BlockRead(self, entry, first, last, header, segments)

    def _segments(self, entry: StoredBlock, first: int, last: int) -> tuple[Buffer, list[memoryview]]:
        """The header and payload pieces of layers first..last, from the fastest copies."""
        meta = entry.meta
        host = entry.host
        if host is not None and first == 0 and last == meta.layer_count - 1:
            return host.buffer[:host.data_offset], [host.buffer[host.data_offset:]]
        header = encode_header(first, meta.token_count, meta.lengths[first:last + 1],
                               codec=meta.codec)
        if host is not None:
            return header, [host.payload(first, last)]
        segments: list[memoryview] = []
        dev = entry.device
        if dev is not None and self.device is not None and first < dev.layers:
            offsets = _payload_offsets(meta.lengths)
            end = min(last, dev.layers - 1)
            segments.append(self.device.download(dev.tensor, offsets[first], offsets[end + 1]))
            first = end + 1
        if first <= last:
            if entry.disk is None:
                raise NotFound("the replica has no copy left to read")
            try:
                on_disk = Container(map_file(entry.disk))
            except (OSError, KvspError) as e:
                raise NotFound(f"the stored copy cannot be read: {e}") from None
            segments.append(on_disk.payload(first, last))
        return header, segments

    async def _promote(self, entry: StoredBlock) -> None:
        """Bring a disk copy into host memory when that costs no replica its place."""
        if entry.disk is None or not self._can_fit_cheaply("host", entry.size):
            return
        try:
            buf, seconds = await asyncio.to_thread(read_file, entry.disk)
            container = Container(buf)
        except (OSError, KvspError) as e:
            log.warning("cannot read %s: %s", entry.disk, e)
            return
        self._note_disk_read(len(buf), seconds)
        async with self._space:
            if entry.host is not None or entry.evicting or not self._can_fit_cheaply(
                    "host", entry.size):
                return
            await self._make_room("host", entry.size, exclude=entry.id, cheap_only=True)
            self._attach(entry, "host", container)
            self._changed(entry)

    def _can_fit_cheaply(self, tier: str, need: int) -> bool:
        """Whether `need` octets fit by dropping only copies that another tier also holds."""
        if need > self.budget[tier]:
            return False
        free = self.budget[tier] - self.used[tier]
        for e in self.lru[tier].values():
            if free >= need:
                break
            if e.readers == 0 and not e.evicting and e.whole_copies() > 1:
                free += e.size
        return free >= need

    # ---------------------------------------------------------------- writing

    async def put(self, bid: BlockId, buffer: Buffer, *,
                  layer_digests: Sequence[bytes] | None = None) -> StoredBlock:
        """Store a new replica; 412 when one exists (the copy held is kept, §6.7).

        `layer_digests`: the layers' digests when the caller has them already, as a block
        loaded from verified layers or produced here has; they go into its records as given
        (`analyze`), and the octets are not read again."""
        if bid in self:
            raise PreconditionFailed("a replica of this block is already held")
        self._incoming.add(bid)
        try:
            if layer_digests is not None:
                container, meta = analyze(buffer, layer_digests)  # the header only: no thread
            else:
                container, meta = await asyncio.to_thread(analyze, buffer)
            check_block(container, self.descriptors.get(bid.compat_id))
            entry = StoredBlock(bid, meta)
            async with self._space:
                self._placing = bid.scope_id
                try:
                    await self._place(entry, container)
                finally:
                    self._placing = None
            return entry
        finally:
            self._incoming.discard(bid)

    async def _place(self, entry: StoredBlock, container: Container) -> None:
        """Find room for a new replica within its scope's quota and the tiers' budgets."""
        bid, meta = entry.id, entry.meta
        await self._fit_quota(bid.scope_id, meta.size)
        in_host = False
        if meta.size <= self.budget["host"]:
            try:
                await self._make_room("host", meta.size, exclude=bid)
                in_host = True
            except StoreFull:
                if not self.disk_enabled:
                    raise
        if in_host:
            self._add(entry)
            self._attach(entry, "host", container)
            if self.disk_enabled:
                await self._schedule_persist(entry)
        elif self.disk_enabled and meta.size <= self.budget["disk"]:
            await self._make_room("disk", meta.size, exclude=bid)
            path = await self._write(entry, container.buffer)
            self._add(entry)
            self._attach(entry, "disk", path)
        else:
            raise StoreFull(f"a block of {meta.size} octets exceeds every tier's budget")
        if self.device is not None:
            await self._place_on_device(entry, container)

    async def _fit_quota(self, scope_id: str, need: int) -> None:
        """Evict the scope's own least recently used replicas until `need` more octets fit
        its quota; StoreFull (507) when they cannot (leased, being read) or `need` never fits."""
        quota = self.scope_quota(scope_id)
        if quota is None:
            return
        if need > quota:
            raise StoreFull(f"a block of {need} octets exceeds this scope's quota of {quota}")
        own = [e for tier in ("disk", "host") for e in self.lru[tier].values()
               if e.id.scope_id == scope_id]
        for entry in dict.fromkeys(own):  # bounded: each replica of the scope once
            if not self.over_quota(scope_id, need):
                return
            await self.evict(entry)
        if self.over_quota(scope_id, need):
            raise StoreFull(f"this scope's quota of {quota} octets is full of leased or busy "
                            f"replicas ({self.scope_bytes.get(scope_id, 0)} octets held)")

    async def _write(self, entry: StoredBlock, data: memoryview) -> Path:
        """Write a block file, its octets reserved in the disk budget meanwhile."""
        path = self._disk_file(entry.id)
        self.used["disk"] += entry.size
        try:
            await asyncio.to_thread(write_block_file, path, data)
        except OSError as e:
            if e.errno not in _NO_SPACE:
                raise
            # The filesystem is fuller than the disk budget assumed (shared disk, quota): a
            # PUT answers 507 with a problem document, not a 500; the partial file is gone.
            raise StoreFull(f"the disk tier could not take {entry.size} octets: "
                            f"{os.strerror(e.errno)}") from None
        finally:
            self.used["disk"] -= entry.size
        return path

    async def _schedule_persist(self, entry: StoredBlock) -> None:
        """Make disk room now (the space lock is held) and write in the background.

        When disk room would cost leased or busy replicas, the block stays in host memory
        only; it is written later if it has to leave host memory.
        """
        try:
            await self._make_room("disk", entry.size, exclude=entry.id)
        except StoreFull:
            log.info("disk tier full; %s stays in host memory only", entry.id.path)
            return
        assert entry.host is not None
        self.used["disk"] += entry.size  # reserved until the task attaches the file
        entry.persisting = asyncio.get_running_loop().create_task(
            self._persist(entry, entry.host.buffer))

    async def _persist(self, entry: StoredBlock, data: memoryview) -> None:
        path = self._disk_file(entry.id)
        try:
            await asyncio.to_thread(write_block_file, path, data)
        except OSError as e:
            log.warning("cannot write %s to disk: %s", entry.id.path, e)
            return
        finally:
            self.used["disk"] -= entry.size
            entry.persisting = None
        if entry.evicting or self._blocks.get(entry.id) is not entry:
            path.unlink(missing_ok=True)
            return
        self._attach(entry, "disk", path)
        self._changed(entry)

    async def flush(self) -> None:
        """Wait until every pending disk write has finished."""
        tasks = [e.persisting for e in self._blocks.values() if e.persisting is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _place_on_device(self, entry: StoredBlock, container: Container) -> None:
        """Copy the leading layers (up to `device_layers`) that fit the device budget to the
        accelerator, so that a loader can start on them while the rest streams from host."""
        assert self.device is not None
        offsets = _payload_offsets(entry.meta.lengths)
        cap = entry.meta.layer_count if self.device_layers is None else min(
            self.device_layers, entry.meta.layer_count)
        layers = 0
        while layers < cap and offsets[layers + 1] <= self.budget["device"]:
            layers += 1
        nbytes = offsets[layers]
        if nbytes == 0:
            return
        try:
            await self._make_room("device", nbytes, exclude=entry.id)
        except StoreFull:
            return
        tensor = self.device.upload(container.payload(0, layers - 1))
        self._attach(entry, "device", DeviceCopy(tensor, layers, nbytes))

    def _attach(self, entry: StoredBlock, tier: str, copy: Any) -> None:
        setattr(entry, tier, copy)
        self.used[tier] += copy.nbytes if tier == "device" else entry.size
        self.lru[tier][entry.id] = entry

    def _detach(self, entry: StoredBlock, tier: str) -> None:
        copy = getattr(entry, tier)
        if copy is None:
            return
        setattr(entry, tier, None)
        self.used[tier] -= copy.nbytes if tier == "device" else entry.size
        self.lru[tier].pop(entry.id, None)
        if tier == "disk":
            try:
                copy.unlink(missing_ok=True)
            except OSError as e:
                log.warning("cannot remove %s: %s", copy, e)

    # ---------------------------------------------------------------- loading

    async def load(self, keep: Callable[[BlockId], bool] | None = None) -> list[StoredBlock]:
        """Index the blocks found under the data directory (after a restart); those `keep`
        refuses (a scope the holder no longer serves) stay on disk, neither served nor counted."""
        if self.root is None:
            return []
        found = await asyncio.to_thread(scan_block_files, self.root)
        loaded = []
        skipped = 0
        async with self._space:
            for bid, path, meta in found:
                if bid in self._blocks:
                    continue
                if keep is not None and not keep(bid):
                    skipped += 1
                    continue
                entry = StoredBlock(bid, meta)
                self._add(entry)
                self._attach(entry, "disk", path)
                loaded.append(entry)
            if self.used["disk"] > self.budget["disk"]:
                try:
                    await self._make_room("disk", 0)
                except StoreFull:
                    log.warning("disk tier holds more than its budget of %d octets",
                                self.budget["disk"])
        loaded = [e for e in loaded if self.get(e.id) is e]
        if skipped:
            log.warning("left %d block files of scopes this holder does not serve in %s",
                        skipped, self.root)
        log.info("loaded %d blocks (%d octets) from %s", len(loaded),
                 sum(e.size for e in loaded), self.root)
        return loaded

    # ---------------------------------------------------------------- eviction

    def _evictable(self, entry: StoredBlock, tier: str) -> bool:
        """Whether the copy of `entry` in `tier` may go now (maybe by demotion)."""
        if entry.readers or entry.evicting:
            return False
        if tier == "device" or entry.whole_copies() > 1:
            return True
        if tier == "host" and self.disk_enabled and entry.size <= self.budget["disk"]:
            return True  # demoted to disk, the replica stays
        return not self.is_protected(entry.id.block_key)

    def _may_displace(self, entry: StoredBlock, tier: str) -> bool:
        """Whether room for the scope being placed may come from this copy: always when the
        replica keeps another copy, else only from the same scope or a scope over its quota."""
        placing = self._placing
        if placing is None or entry.id.scope_id == placing:
            return True
        if tier == "device" or entry.whole_copies() > 1:
            return True
        quota = self.scope_quota(entry.id.scope_id)
        return quota is None or self.scope_bytes.get(entry.id.scope_id, 0) > quota

    async def _make_room(self, tier: str, need: int, *, exclude: BlockId | None = None,
                         cheap_only: bool = False) -> None:
        """Free `need` octets in `tier`; the caller holds the space lock."""
        budget = self.budget[tier]
        if need > budget:
            raise StoreFull(f"{need} octets exceed the {tier} budget of {budget}")
        tried: set[BlockId] = set()
        for _ in range(len(self.lru[tier]) + 1):
            if self.used[tier] + need <= budget:
                return
            victim = None
            for candidate in self.lru[tier].values():
                if candidate.id == exclude or candidate.id in tried:
                    continue
                if cheap_only and candidate.whole_copies() < 2:
                    continue
                if not self._may_displace(candidate, tier):
                    continue
                if self._evictable(candidate, tier):
                    victim = candidate
                    break
            if victim is None:
                break
            tried.add(victim.id)
            await self._free_copy(victim, tier)
        if self.used[tier] + need > budget:
            raise StoreFull(f"the {tier} tier is full of leased or busy replicas")

    async def _free_copy(self, entry: StoredBlock, tier: str) -> None:
        if tier == "device" or entry.whole_copies() > 1:
            self._detach(entry, tier)
            self._changed(entry)
            return
        if tier == "host" and self.disk_enabled and entry.size <= self.budget["disk"]:
            try:
                await self._demote(entry)
                return
            except (StoreFull, OSError) as e:
                if self.is_protected(entry.id.block_key):
                    log.warning("cannot demote leased %s: %s", entry.id.path, e)
                    return
                log.info("cannot demote %s (%s); evicting it", entry.id.path, e)
        await self.evict(entry)

    async def _demote(self, entry: StoredBlock) -> None:
        """Move a host copy to disk (writing it unless a background write already has)."""
        if entry.persisting is not None:
            await asyncio.shield(entry.persisting)
        if entry.disk is None:
            assert entry.host is not None
            await self._make_room("disk", entry.size, exclude=entry.id)
            path = await self._write(entry, entry.host.buffer)
            if entry.evicting:
                path.unlink(missing_ok=True)
                return
            self._attach(entry, "disk", path)
        if entry.readers == 0 and entry.host is not None:
            self._detach(entry, "host")
            self.demotions += 1
        self._changed(entry)

    async def evict(self, entry: StoredBlock) -> bool:
        """Evict a replica: withdraw its record first, then drop every copy (§6.1).

        Returns False (and keeps it) when it is leased or being read.
        """
        if entry.evicting or self._blocks.get(entry.id) is not entry:
            return False
        if entry.readers or self.is_protected(entry.id.block_key):
            return False
        entry.evicting = True  # no new readers, leases or refreshes from here on
        if self.withdraw is not None:
            try:
                await self.withdraw(entry)
            except Exception as e:  # the index is advisory; data is not kept for it
                log.warning("withdrawing %s failed: %s", entry.id.path, e)
        for tier in TIERS:
            self._detach(entry, tier)
        self._remove(entry)
        self.evictions += 1
        log.info("evicted %s", entry.id.path)
        return True

    async def discard(self, bid: BlockId) -> bool:
        """Evict one replica on request (an operator, a test, a detected fault)."""
        entry = self.get(bid)
        if entry is None:
            return False
        async with self._space:
            return await self.evict(entry)

    async def close(self) -> None:
        await self.flush()

    def stats(self) -> dict[str, int]:
        out = {"blocks": len(self._blocks), "evictions": self.evictions,
               "demotions": self.demotions}
        for tier in TIERS:
            out[f"{tier}_bytes"] = self.used[tier]
            out[f"{tier}_budget_bytes"] = self.budget[tier]
        return out


def _payload_offsets(lengths: Sequence[tuple[int, int]]) -> list[int]:
    """Offset of each layer within the data section, and the end of the last one."""
    out = [0]
    for k, v in lengths:
        out.append(out[-1] + k + v)
    return out
