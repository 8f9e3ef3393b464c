"""Publishing replicas to the Index Service (KVSP §6.1).

Every replica the holder serves is PUT with its record as soon as it is stored, refreshed in
batches well before ttl_ms runs out, and DELETEd before its data is dropped. The index is
advisory, so the publisher never lets an unreachable IS stop the holder: it retries with
backoff, and because each refresh sends every record, an IS that comes back empty is whole
again after the next one.

A holder that publishes its blocks over MOQT too (`relay_url`) has two records per replica
(DESIGN §6): the HTTP one and `moqt_record()` of it through the relay. They are refreshed and
deleted together; the MOQT record is first put only once `moqt_ready` says the relay has
accepted the namespace, since a client that found it earlier would ask the relay for a track
nobody serves there yet.

The IS takes a batch whole or not at all, so one record it refuses (400, 403: a scope or
holder this holder's principal may not publish) would otherwise keep every other record out
of the index, retried forever. A refused batch is split in halves until the refused records
are alone; those are dropped (logged once each, counted in `refused`, not sent again while
the replica is held) and the rest are published.

A block the holder's publisher is producing (`BlockPublisher.produce`, layers still being
computed) gets an in-production record (`"live": true`, a short TTL renewed while it lasts) as
soon as production starts, so that other instances find the block before it is done; the
complete record replaces it when the block is stored, and it is DELETEd if production stops.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from kvsp_moq.errors import ForbiddenRole, KvspError, reason_of
from kvsp_moq.holder.moqt_publisher import BlockPublisher, LiveBlock
from kvsp_moq.holder.store import BlockId, BlockStore, StoredBlock
from kvsp_moq.index_client import IndexClient
from kvsp_moq.naming import moqt_record
from kvsp_moq.protocol.container import format_digest
from kvsp_moq.protocol.records import ReplicaRecord
from kvsp_moq.protocol.urls import base_url
from kvsp_moq.tasks import cancel_and_wait

log = logging.getLogger("kvsp.holder.index_publisher")


def refuses_record(error: KvspError) -> bool:
    """Whether the IS refused what was sent (a record), not who sent it or how it went."""
    return error.status in (400, 403) and not isinstance(error, ForbiddenRole)


def _record_id(record: ReplicaRecord) -> tuple[str, str, str, str]:
    return (record.compat_id, record.scope_id, record.block_key, record.holder)


class IndexPublisher:
    """Keeps the Index Service's records of this holder's replicas alive."""

    def __init__(
        self,
        store: BlockStore,
        index: IndexClient | None,
        *,
        holder_url: str = "",
        record_ttl_ms: int = 60_000,
        refresh_fraction: float = 1 / 3,
        retry_initial_s: float = 0.2,
        retry_max_s: float = 5.0,
        withdraw_timeout_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        relay_url: str | None = None,
    ) -> None:
        self.store = store
        self.index = index
        self.holder_url = holder_url
        self.relay_url = relay_url
        self.record_ttl_ms = record_ttl_ms
        self.refresh_s = record_ttl_ms / 1000 * refresh_fraction
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = min(retry_max_s, max(retry_initial_s, self.refresh_s))
        self.withdraw_timeout_s = withdraw_timeout_s
        self.clock = clock
        self.published = 0
        self.failures = 0
        #: records the IS refused and that were dropped (the metric index_refused_records)
        self.refused = 0
        self._refused: set[tuple[str, str, str, str]] = set()
        self._pending: dict[BlockId, int] = {}  # block -> announcement number
        self._seq = 0
        self._published_at: dict[BlockId, float] = {}
        self._deletes: dict[BlockId, list[ReplicaRecord]] = {}
        self._inflight: set[BlockId] = set()
        self._next_refresh = 0.0
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        #: (compat_id, scope_id) -> whether the relay has accepted that namespace; None: always
        self.moqt_ready: Callable[[str, str], bool] | None = None
        self._moqt_waiting: set[BlockId] = set()  # HTTP record put, MOQT one held back
        self._moqt: BlockPublisher | None = None
        #: in-production records: to put (or renew), by block, and when each was last put
        self.live_ttl_ms = min(record_ttl_ms, 10_000)
        self._live: dict[BlockId, ReplicaRecord] = {}
        self._live_put_at: dict[BlockId, float] = {}
        self._live_deletes: list[ReplicaRecord] = []
        self._sent = asyncio.Event()  # set, then replaced, when a batch has been sent
        #: records_for's, by replica
        self._records: dict[BlockId, tuple[StoredBlock, tuple, tuple, list[ReplicaRecord]]] = {}

    @property
    def holder_url(self) -> str:
        return self._holder_url

    @holder_url.setter
    def holder_url(self, url: str) -> None:
        self._holder_url = base_url(url) if url else url

    # ---------------------------------------------------------------- records

    def record_for(self, entry: StoredBlock) -> ReplicaRecord:
        meta = entry.meta
        return ReplicaRecord(
            block_key=entry.id.block_key,
            compat_id=entry.id.compat_id,
            scope_id=entry.id.scope_id,
            holder=self.holder_url,
            codec=meta.codec,
            size=meta.size,
            digest=format_digest(meta.digest),
            ttl_ms=self.record_ttl_ms,
            layer_digests=tuple(d.hex() for d in meta.layer_digests),
            residency=self.store.residency(entry),
        )

    def records_for(self, entry: StoredBlock) -> list[ReplicaRecord]:
        """Every record of this replica: the HTTP one, and with a relay the MOQT one. Made
        once per replica, holder URL and residency: a refresh sends every record again (and
        each keeps its JSON, `ReplicaRecord.encoded`)."""
        residency = self.store.residency(entry)
        cached = self._records.get(entry.id)
        if (cached is not None and cached[0] is entry and cached[1] == residency
                and cached[2] == (self._holder_url, self.relay_url, self.record_ttl_ms)):
            return cached[3]
        http = self.record_for(entry)
        records = [http] if not self.relay_url else [http, moqt_record(http, self.relay_url)]
        self._records[entry.id] = (entry, residency, (self._holder_url, self.relay_url, self.record_ttl_ms),
                                   records)
        return records

    def _records_to_put(self, entry: StoredBlock) -> list[ReplicaRecord]:
        records = self.records_for(entry)
        if len(records) > 1 and self.moqt_ready is not None and not self.moqt_ready(
                entry.id.compat_id, entry.id.scope_id):
            self._moqt_waiting.add(entry.id)
            records = records[:1]
        else:
            self._moqt_waiting.discard(entry.id)
        if self._refused:
            records = [r for r in records if _record_id(r) not in self._refused]
        return records

    def is_refused(self, record: ReplicaRecord) -> bool:
        """Whether the IS refused this record (it is not sent again while the replica lives)."""
        return _record_id(record) in self._refused

    def _drop_refused(self, record: ReplicaRecord, error: KvspError) -> None:
        rid = _record_id(record)
        if rid in self._refused:
            return
        self._refused.add(rid)
        self.refused += 1
        log.warning("index refused the record of %s/%s/%s at %s (%s); not publishing it",
                    record.compat_id, record.scope_id, record.block_key, record.holder,
                    error.detail)

    async def _put_isolating(self, records: list[ReplicaRecord], *,
                             batch: bool = True) -> set[tuple[str, str, str, str]]:
        """Put these records (one alone with PUT unless `batch`), splitting a refused batch
        until each refused record is alone; those are dropped. Returns the ids of the records
        refused. Other errors propagate."""
        assert self.index is not None
        refused: set[tuple[str, str, str, str]] = set()
        parts = [records]
        # bounded: every split halves a part, so at most 2 * len(records) - 1 requests
        for _ in range(2 * len(records)):
            if not parts:
                break
            part = parts.pop()
            try:
                if len(part) == 1 and not batch:
                    await self.index.put(part[0])
                else:
                    await self.index.put_many(part)
            except KvspError as e:
                if not refuses_record(e):
                    raise
                if len(part) == 1:
                    self._drop_refused(part[0], e)
                    refused.add(_record_id(part[0]))
                    continue
                mid = len(part) // 2
                parts += [part[mid:], part[:mid]]
        return refused

    def remaining_ttl_ms(self, bid: BlockId) -> int:
        """How long the index's record of this replica still lives (the cap on max-age)."""
        if self.index is None:
            return self.record_ttl_ms
        at = self._published_at.get(bid)
        if at is None:
            return 0
        return max(0, int(self.record_ttl_ms - (self.clock() - at) * 1000))

    def is_published(self, bid: BlockId) -> bool:
        """Every record of the replica is in the index (the MOQT one too, with a relay)."""
        return bid in self._published_at and bid not in self._moqt_waiting

    def is_live_published(self, bid: BlockId) -> bool:
        """The in-production record of this block being produced here is in the index."""
        return bid in self._live_put_at

    # ---------------------------------------------------------------- store callbacks

    def use_moqt(self, block_publisher: "BlockPublisher") -> None:
        """Publish through this relay session too: each replica announced here has its
        namespace announced to the relay, and its MOQT record waits until the relay accepts it."""
        self._moqt = block_publisher
        self.moqt_ready = block_publisher.is_announced
        block_publisher.on_live = self.live_changed

    def live_changed(self, live: LiveBlock, stored: bool | None) -> None:
        """A live block started (None), was stored (True) or abandoned (False)."""
        if self.index is None or self._moqt is None:
            return
        bid = live.id
        if stored is None:
            self._live[bid] = self._moqt.live_record(live, ttl_ms=self.live_ttl_ms)
            self._live_put_at.pop(bid, None)
        else:
            record = self._live.pop(bid, None)
            put = self._live_put_at.pop(bid, None)
            # Stored: the complete record (same replica) replaces it when announced.
            if not stored and record is not None and put is not None:
                self._live_deletes.append(record)
        if self._wake is not None:
            self._wake.set()

    def announce(self, entry: StoredBlock) -> None:
        """Publish (or republish, after a tier change) this replica soon."""
        if self._moqt is not None:
            self._moqt.announce(entry.id.compat_id, entry.id.scope_id)
        if self.index is None:
            return
        self._seq += 1
        self._pending[entry.id] = self._seq
        self._deletes.pop(entry.id, None)
        if self._wake is not None:
            self._wake.set()

    async def withdraw(self, entry: StoredBlock) -> None:
        """DELETE the record now; if that fails, keep retrying it in the background."""
        bid = entry.id
        self._pending.pop(bid, None)
        self._published_at.pop(bid, None)
        if self.index is None:
            self._records.pop(bid, None)
            return
        records = [r for r in self.records_for(entry) if _record_id(r) not in self._refused]
        self._refused.difference_update(_record_id(r) for r in self.records_for(entry))
        self._records.pop(bid, None)
        if not records:
            return
        try:
            await asyncio.wait_for(self._delete_all(records), self.withdraw_timeout_s)
        except (KvspError, asyncio.TimeoutError) as e:
            log.warning("withdrawing %s failed (%s); will retry", bid.path, reason_of(e))
            self._deletes[bid] = records
            if self._wake is not None:
                self._wake.set()
            return
        if bid in self._inflight:
            # A refresh carrying these records is on its way; delete again once it has landed.
            self._deletes[bid] = records

    async def _delete_all(self, records: list[ReplicaRecord]) -> None:
        assert self.index is not None
        for record in records:
            try:
                await self.index.delete(record)
            except KvspError as e:
                if not refuses_record(e):
                    raise
                # Refused for good (not ours to delete): retrying would stall the others.
                log.warning("index refused deleting the record of %s at %s: %s",
                            record.block_key, record.holder, e.detail)

    # ---------------------------------------------------------------- the loop

    async def start(self) -> None:
        if self.index is None or self._task is not None:
            return
        self._wake = asyncio.Event()
        self._next_refresh = 0.0
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvsp-publisher")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def _run(self) -> None:
        assert self._wake is not None
        backoff = self.retry_initial_s
        while True:
            self._wake.clear()
            try:
                await self.step()
            except (KvspError, asyncio.TimeoutError) as e:
                self.failures += 1
                log.warning("index %s: %s; retrying in %.1fs", self.index.base if self.index
                            else "-", reason_of(e), backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.retry_max_s)
                continue
            except Exception:  # never let a bug here stop the holder from serving
                log.exception("publisher step failed")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.retry_max_s)
                continue
            backoff = self.retry_initial_s
            delay = max(0.0, self._next_refresh - self.clock())
            if self._moqt_waiting:
                delay = min(delay, 0.05)  # soon after the relay accepts the namespace
            live = self.live_delay()
            if live is not None:
                delay = min(delay, live)
            if self._live_deletes:
                delay = 0.0
            try:
                await asyncio.wait_for(self._wake.wait(), delay)
            except asyncio.TimeoutError:
                pass

    async def step(self) -> None:
        """One round: pending deletes, then a full refresh when due, else new records."""
        assert self.index is not None
        await self._step_live()
        for bid, records in list(self._deletes.items()):
            await self._delete_all(records)
            if self._deletes.get(bid) is records:
                del self._deletes[bid]
        if self._moqt_waiting and self.moqt_ready is not None:
            for bid in list(self._moqt_waiting):
                if self.store.get(bid) is None:
                    self._moqt_waiting.discard(bid)
                elif self.moqt_ready(bid.compat_id, bid.scope_id):
                    self._moqt_waiting.discard(bid)
                    self._seq += 1
                    self._pending.setdefault(bid, self._seq)
        now = self.clock()
        if now >= self._next_refresh:
            await self._publish(self.store.blocks(), full=True)
            self._next_refresh = now + self.refresh_s
        elif self._pending:
            entries = [e for bid in list(self._pending) if (e := self.store.get(bid)) is not None]
            stale = [bid for bid in self._pending if self.store.get(bid) is None]
            for bid in stale:
                self._pending.pop(bid, None)
            await self._publish(entries, full=False)

    async def _step_live(self) -> None:
        """Put new in-production records, renew those a third of their TTL old, delete those
        of abandoned blocks."""
        assert self.index is not None
        deletes, self._live_deletes = self._live_deletes, []
        if deletes:
            await self._delete_all(deletes)
        now = self.clock()
        renew_s = self.live_ttl_ms / 1000 / 3
        due = [bid for bid in self._live
               if bid not in self._live_put_at or now - self._live_put_at[bid] >= renew_s]
        if not due:
            return
        records = [self._live[bid] for bid in due]
        refused = await self._put_isolating(records, batch=len(records) > 1)
        for bid, record in zip(due, records):
            if _record_id(record) in refused:
                if self._live.get(bid) is record:
                    del self._live[bid]  # not sent again (the refusal is logged once)
            elif self._live.get(bid) is record:
                self._live_put_at[bid] = now
            elif self.store.get(bid) is None:
                self._live_deletes.append(record)  # abandoned while being put

    def live_delay(self) -> float | None:
        """Seconds until an in-production record needs renewing (None: there is none)."""
        if not self._live:
            return None
        renew_s = self.live_ttl_ms / 1000 / 3
        now = self.clock()
        return max(0.0, min(self._live_put_at[bid] + renew_s - now if bid in self._live_put_at else 0.0
                            for bid in self._live))

    async def sent(self, timeout: float) -> None:
        """Until the next batch of records was sent to the IS (whatever it answered), or
        `timeout` seconds: a caller waiting for records to be published looks again then."""
        sent = self._sent
        try:
            async with asyncio.timeout(timeout):
                await sent.wait()
        except TimeoutError:
            pass

    def _wake_sent(self) -> None:
        self._sent.set()
        self._sent = asyncio.Event()

    async def _publish(self, entries: list[StoredBlock], *, full: bool) -> None:
        assert self.index is not None
        if not entries:
            return
        try:
            await self._publish_entries(entries, full=full)
        finally:
            self._wake_sent()

    async def _publish_entries(self, entries: list[StoredBlock], *, full: bool) -> None:
        to_put = {e.id: self._records_to_put(e) for e in entries}
        records = [r for rs in to_put.values() for r in rs]
        sent = {e.id: self._pending.get(e.id) for e in entries}
        self._inflight = set(sent)
        started = self.clock()
        try:
            refused = (await self._put_isolating(records, batch=full or len(records) > 1)
                       if records else set())
        finally:
            self._inflight = set()
        self.published += len(records) - len(refused)
        for entry in entries:
            bid = entry.id
            if self.store.get(bid) is not entry:
                continue  # withdrawn meanwhile; a delete is queued
            mine = to_put[bid]
            if mine and not any(_record_id(r) in refused for r in mine) and not (self._refused and any(
                    self.is_refused(r) for r in self.records_for(entry))):
                self._published_at[bid] = started
            if bid in self._pending and self._pending[bid] == sent[bid]:
                del self._pending[bid]
        if self._deletes and self._wake is not None:
            self._wake.set()
