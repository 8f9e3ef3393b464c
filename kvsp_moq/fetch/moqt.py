"""Blocks over MOQT (DESIGN §4), client side: verified layers through relays.

`MoqtBlockFetcher.layers()` mirrors `kvsp_moq.fetch.http.HttpFetcher.layers()`: layers a..b
of a block through a relay, verified against the Replica Record's layer digests before each is
yielded, in ascending order. It FETCHes the range; when the block is still being produced
(the FETCH is refused with INVALID_RANGE or ends early) it SUBSCRIBEs for the rest, and a gap
between the layers it has and the first one the subscription delivers (a subscription
joined mid-way at a relay) is FETCHed. A digest mismatch raises `DigestMismatch`; the bad
layer is never yielded.

A block still in production (an in-production record, `live`, DESIGN §9) is SUBSCRIBEd at once,
with a rendezvous timeout; its record lists no digests, so each layer is checked against the
digest it carries. A subscriber its relay drops as too far behind catches up by FETCH and
subscribes again; a producer that stops sending for `live_layer_timeout` is a missed source.

The track naming and the layer objects' payload and properties are `kvsp_moq.naming`'s, shared
with the holder's publisher.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncGenerator, AsyncIterator, Callable, Sequence

from kvsp_moq.errors import BadRecord, KvspError, LayersUnavailable, reason_of
from kvsp_moq.fetch.stream import FailureKind, FetchedBlock, SourceFailed, VerifiedLayerStream, record_layer_digests
from kvsp_moq.moqt.certs import CertificateRejected, ClientTls, check_trusted
from kvsp_moq.moqt.errors import (
    DataStreamReset,
    DoesNotExist,
    InvalidRange,
    MoqtError,
    PublishDoneCode,
    PublishDoneError,
    RequestError,
    RequestErrorCode,
)
from kvsp_moq.moqt.quic import MoqtConnection, MoqtObject, QuicSettings, connect
from kvsp_moq.moqt.wire import SubscriptionFilter
from kvsp_moq.naming import (
    GROUP,
    BlockTrack,
    PassSlot,
    carried_digest,
    decode_namespace,
    pass_track_name,
    split_layer,
    split_pass,
)
from kvsp_moq.protocol.container import Container, Layer, encode, layer_digest, replica_digest
from kvsp_moq.protocol.records import ReplicaRecord

__all__ = ["MoqtBlockFetcher", "MoqtLayerStream"]

#: how many times a subscriber dropped by its relay as too far behind catches up and subscribes again
CATCH_UPS = 3


def _failure_of(error: BaseException) -> SourceFailed:
    if isinstance(error, SourceFailed):
        return error
    if isinstance(error, DoesNotExist):
        return SourceFailed(FailureKind.MISS, f"DOES_NOT_EXIST: {error.reason}")
    if isinstance(error, RequestError):
        name = RequestErrorCode(error.error_code).name if error.error_code in RequestErrorCode._value2member_map_ \
            else hex(int(error.error_code))
        return SourceFailed(FailureKind.REFUSED, f"{name}: {error.reason}")
    if isinstance(error, asyncio.TimeoutError):
        return SourceFailed(FailureKind.TRANSPORT, "timed out")
    if isinstance(error, KvspError):
        kind = FailureKind.MALFORMED if isinstance(error, BadRecord) else FailureKind.TRANSPORT
        return SourceFailed(kind, reason_of(error))
    return SourceFailed(FailureKind.TRANSPORT, reason_of(error, named=True))


class MoqtLayerStream(VerifiedLayerStream):
    """Verified layers a..b of one block, in ascending order, through MOQT relays."""

    def __init__(self, fetcher: "MoqtBlockFetcher", sources: Sequence[str], record: ReplicaRecord,
                 layers: tuple[int, int] | None, live: bool | None) -> None:
        if not record.moqt_namespace:
            raise BadRecord("a MOQT replica needs moqt_namespace", member="moqt_namespace")
        self.track = BlockTrack.from_record_namespace(record.moqt_namespace, record.codec)
        super().__init__(list(sources) or [record.holder], record, layers)
        self.fetcher = fetcher
        self.live = live if not record.live else True
        #: the digests live layers carried, by layer (checked later against the complete record)
        self.carried: dict[int, bytes] = {}
        if self.range is None:
            raise LayersUnavailable("the record lists no layer digests; give the layer range")
        self._start()

    # ---------------------------------------------------------------- the source loop

    async def _run(self) -> AsyncGenerator[Layer, None]:
        record = self.record
        digests = record_layer_digests(record)
        assert self.range is not None
        first, last = self.range
        next_layer = first
        for source in self.sources:
            if next_layer > last:
                break
            if not source.lower().startswith("moqt://"):
                self._fail(source, FailureKind.REFUSED, "not a moqt:// source")
                continue
            start_layer = next_layer
            try:
                if digests is None and not record.live:
                    layers = [layer async for layer in self._from_source(source, next_layer, last, None)]
                    self._check_whole(layers)
                    for layer in layers:
                        next_layer = layer.index + 1
                        yield layer
                else:
                    async for layer in self._from_source(source, next_layer, last, digests):
                        if self.first_layer_seconds is None:
                            self.first_layer_seconds = time.perf_counter() - self.started
                        next_layer = layer.index + 1
                        yield layer
            except SourceFailed as e:
                self._fail(source, e.kind, e.reason)
            except (MoqtError, KvspError, OSError, asyncio.TimeoutError, ConnectionError) as e:
                failure = _failure_of(e)
                self._fail(source, failure.kind, failure.reason)
                if failure.kind is FailureKind.TRANSPORT:
                    await self.fetcher.drop_if_dead(source)
            finally:
                if next_layer > start_layer:
                    self.served_by.append((source, start_layer, next_layer - 1))
        if next_layer <= last:
            raise self._exhausted()

    def _check_whole(self, layers: list[Layer]) -> None:
        """Without layer digests only a whole replica can be checked, by its replica digest."""
        if not layers or layers[0].index != 0 or len(layers) != layers[-1].index + 1:
            raise SourceFailed(FailureKind.DIGEST, "without layer digests only the whole block can be verified")
        if replica_digest([layer.digest() for layer in layers]).hex() != self.record.digest[8:]:
            raise SourceFailed(FailureKind.DIGEST, "the block does not match the replica digest")
        if self.first_layer_seconds is None:
            self.first_layer_seconds = time.perf_counter() - self.started

    # ---------------------------------------------------------------- one source

    def _verified(self, obj: MoqtObject, expected: int, digests: list[bytes] | None) -> Layer:
        if obj.group_id != GROUP or obj.object_id != expected:
            raise SourceFailed(FailureKind.MALFORMED,
                               f"object {obj.group_id}/{obj.object_id} where layer {expected} was due")
        self.bytes_received += len(obj.payload)
        try:
            layer, tokens = split_layer(obj.object_id, obj.payload, obj.properties)
        except BadRecord as e:
            raise SourceFailed(FailureKind.MALFORMED, str(e)) from None
        if digests is not None:
            if layer_digest(layer.k, layer.v) != digests[obj.object_id]:
                raise SourceFailed(FailureKind.DIGEST, f"layer {obj.object_id} does not match its layer digest")
        else:
            # A live block's record lists no layer digests yet: the layer's own must match, and
            # the complete record that replaces it is held to the same (`carried`).
            carried = carried_digest(obj.properties)
            if carried is None:
                raise SourceFailed(FailureKind.DIGEST, f"layer {obj.object_id} of a live block carries no digest")
            if layer_digest(layer.k, layer.v) != carried:
                raise SourceFailed(FailureKind.DIGEST, f"layer {obj.object_id} does not match the digest it carries")
            self.carried[obj.object_id] = carried
        if tokens is not None:
            if self.token_count is None:
                self.token_count = tokens
            elif tokens != self.token_count:
                raise SourceFailed(FailureKind.MALFORMED, f"layer {obj.object_id} has another token count")
        return layer

    async def _fetch_range(self, connection: MoqtConnection, first: int, last: int,
                           digests: list[bytes] | None) -> AsyncIterator[Layer]:
        """Layers first..(at most) last by one standalone FETCH; it may end early."""
        fetcher = self.fetcher
        result = await connection.fetch(self.track.namespace, self.track.track_name, (GROUP, first),
                                        (GROUP, last), authorization=fetcher.token, timeout=fetcher.timeout)
        try:
            expected = first
            while expected <= last:
                obj = await result.next_object(fetcher.layer_timeout)
                if obj is None:
                    return
                yield self._verified(obj, expected, digests)
                expected += 1
        finally:
            await result.aclose()

    async def _from_source(self, source: str, first: int, last: int,
                           digests: list[bytes] | None) -> AsyncIterator[Layer]:
        fetcher = self.fetcher
        connection = await fetcher.connection(source)
        next_layer = first
        if self.live is not True:
            try:
                async for layer in self._fetch_range(connection, next_layer, last, digests):
                    next_layer = layer.index + 1
                    yield layer
            except InvalidRange:
                pass  # nothing of the range exists yet: the block is being produced
            if next_layer > last:
                return
            self._note(f"{source}: layers from {next_layer} were not there yet; subscribed for them")
        for attempt in range(CATCH_UPS + 1):
            try:
                async for layer in self._subscribe_range(connection, next_layer, last, digests):
                    next_layer = layer.index + 1
                    yield layer
                return
            except (PublishDoneError, DataStreamReset) as e:
                # A relay drops a subscriber too far behind: its streams are reset, then the
                # subscription ends with TOO_FAR_BEHIND (whichever the subscriber sees first).
                behind = isinstance(e, DataStreamReset) or e.error_code == PublishDoneCode.TOO_FAR_BEHIND
                if not behind or attempt == CATCH_UPS:
                    raise
            # Too slow for the relay's queue (it never slows the producer for us): what exists
            # by FETCH, then a new subscription for the rest.
            self._note(f"{source}: dropped as too far behind at layer {next_layer}; catching up by FETCH")
            try:
                async for layer in self._fetch_range(connection, next_layer, last, digests):
                    next_layer = layer.index + 1
                    yield layer
            except InvalidRange:
                pass
            if next_layer > last:
                return

    async def _subscribe_range(self, connection: MoqtConnection, first: int, last: int,
                               digests: list[bytes] | None) -> AsyncIterator[Layer]:
        """Layers first..last of a block being produced, by SUBSCRIBE (gaps by FETCH)."""
        fetcher = self.fetcher

        def stalled(layer: int) -> SourceFailed:
            # The relay is fine; the block's producer stalled or is gone.
            return SourceFailed(FailureKind.MISS, f"layer {layer} of the block in production did not "
                                f"come within {fetcher.live_layer_timeout:g} s")

        # A block in production may not be announced at the relay yet: the relay holds the
        # SUBSCRIBE until its publisher appears (rendezvous), within the request's timeout. A
        # producer that stops (or dies) mid-block must not hold its subscribers for long.
        objects = fetcher.track_objects(connection, self.track.namespace, self.track.track_name, first, last,
                                        rendezvous=bool(self.live), stalled=stalled if self.live else None)
        try:
            async for obj in objects:
                yield self._verified(obj, obj.object_id, digests)
        finally:
            await objects.aclose()


@dataclass
class _Pool:
    connections: dict[str, MoqtConnection] = field(default_factory=dict)
    locks: dict[str, asyncio.Lock] = field(default_factory=dict)


class MoqtBlockFetcher:
    """Fetches blocks through MOQT relays over one session per relay."""

    def __init__(self, *, token: str | None = None, settings: QuicSettings | None = None,
                 verify: bool = True, cadata: bytes | None = None, cafile: str | None = None,
                 tls: ClientTls | None = None, timeout: float = 10.0, layer_timeout: float = 30.0,
                 probe_timeout: float = 2.0, live_layer_timeout: float = 10.0) -> None:
        self.token = token
        self.probe_timeout = probe_timeout
        self.settings = settings or QuicSettings()
        if tls is not None:  # `client_tls`'s decision; it also names the options in errors
            verify, cafile = tls.verify, tls.cafile
        self.verify, self.cadata, self.cafile, self.tls = verify, cadata, cafile, tls
        #: relay URL -> the line of its last rejected certificate (until a session opens)
        self.untrusted: dict[str, str] = {}
        self.timeout = timeout
        self.layer_timeout = layer_timeout
        #: the longest wait for the next layer of a block in production (its producer's pace)
        self.live_layer_timeout = live_layer_timeout
        self._pool = _Pool()

    async def connection(self, url: str) -> MoqtConnection:
        """The session to a relay, opened on first use and after it was lost."""
        pool = self._pool
        lock = pool.locks.setdefault(url, asyncio.Lock())
        async with lock:
            connection = pool.connections.get(url)
            if connection is None or connection.is_closed:
                try:
                    connection = await connect(url, settings=self.settings, verify=self.verify, cadata=self.cadata,
                                               cafile=self.cafile, authorization=self.token, timeout=self.timeout)
                except MoqtError as e:
                    try:
                        check_trusted(e, url, self.tls)
                    except CertificateRejected as rejected:
                        self.untrusted[url] = str(rejected)
                        raise
                    raise
                self.untrusted.pop(url, None)
                pool.connections[url] = connection
            return connection

    async def drop_if_dead(self, url: str) -> bool:
        """After a transport failure: forget the session to `url` unless it answers a PING.

        A relay that died without closing leaves the session open until the QUIC idle timeout
        (30 s); without this, every request until then would fail on it. True when dropped.
        """
        connection = self._pool.connections.get(url)
        if connection is None or connection.is_closed:
            self._pool.connections.pop(url, None)
            return connection is not None
        try:
            if await connection.liveness(self.probe_timeout) != "silent":
                return False
        except (MoqtError, OSError, ConnectionError):
            pass
        if self._pool.connections.get(url) is connection:
            del self._pool.connections[url]
        connection.close()
        return True

    async def aclose(self) -> None:
        connections = list(self._pool.connections.values())
        self._pool.connections.clear()
        await asyncio.gather(*(c.aclose() for c in connections), return_exceptions=True)

    async def __aenter__(self) -> "MoqtBlockFetcher":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def layers(self, sources: Sequence[str], record: ReplicaRecord, layers: tuple[int, int] | None = None,
               *, live: bool | None = None) -> MoqtLayerStream:
        """Layers a..b (default all) of the record's block, verified, in ascending order.

        `sources` are moqt:// relay URIs (default: the record's holder). `live` True goes
        straight to SUBSCRIBE (a block known to be in production); None FETCHes first.
        """
        return MoqtLayerStream(self, sources, record, layers, live)

    async def pass_layers(self, source: str, moqt_namespace: str, codec: int, first: int,
                          last: int) -> AsyncIterator[tuple[int, list[PassSlot]]]:
        """Layers first..last of a pass track (DESIGN §9.6) through the relay `source`, each as
        (layer, its slots); the caller checks every slot's block key and its layer against the
        digest it carries. SourceFailed when the track ends early or its producer stalls; layers
        missed by joining late come by FETCH, as a block's do."""
        def stalled(layer: int) -> SourceFailed:
            return SourceFailed(FailureKind.MISS, f"layer {layer} of the pass did not come within "
                                f"{self.live_layer_timeout:g} s")

        objects = self.track_objects(await self.connection(source), decode_namespace(moqt_namespace),
                                     pass_track_name(codec), first, last, rendezvous=True, stalled=stalled)
        try:
            async for obj in objects:
                yield obj.object_id, self._pass_slots(obj)
        finally:
            await objects.aclose()

    async def track_objects(self, connection: MoqtConnection, namespace: tuple[bytes, ...], track_name: bytes,
                            first: int, last: int, *, rendezvous: bool,
                            stalled: Callable[[int], SourceFailed] | None) -> AsyncGenerator[MoqtObject, None]:
        """Objects first..last of group 0 of a track, in order: by SUBSCRIBE from `first`, and
        those the subscription does not bring (a late join, a track that ends first) by FETCH.

        `rendezvous`: the relay may hold the SUBSCRIBE (the request's timeout) for a publisher
        that has not announced yet. With `stalled`, no object within `live_layer_timeout` is the
        SourceFailed it makes (a producer that stopped); without, `layer_timeout` and a
        TimeoutError. A track that ends before `last` is a MISS."""
        subscription = await connection.subscribe(
            namespace, track_name, subscription_filter=SubscriptionFilter.absolute_start(GROUP, first),
            forward=True, authorization=self.token,
            rendezvous_timeout=int(self.timeout * 1000) if rendezvous else None, timeout=self.timeout)
        wait = self.live_layer_timeout if stalled is not None else self.layer_timeout
        next_object = first
        try:
            while next_object <= last:
                try:
                    # a timer armed only while no object is queued (not one per object)
                    obj = await subscription.next_object(wait)
                except asyncio.TimeoutError:
                    if stalled is None:
                        raise
                    raise stalled(next_object) from None
                if obj is not None and (obj.group_id != GROUP or obj.object_id < next_object):
                    continue  # one we already have
                stop = last if obj is None else min(last, obj.object_id - 1)
                if next_object <= stop:
                    # Joined mid-way (or the track ended first): the missing objects by FETCH.
                    fetched = await connection.fetch(namespace, track_name, (GROUP, next_object), (GROUP, stop),
                                                     authorization=self.token, timeout=self.timeout)
                    try:
                        while next_object <= stop:
                            got = await fetched.next_object(self.layer_timeout)
                            if got is None:
                                break
                            if got.group_id != GROUP or got.object_id != next_object:
                                raise SourceFailed(FailureKind.MALFORMED, f"object {got.group_id}/"
                                                   f"{got.object_id} where layer {next_object} was due")
                            yield got
                            next_object += 1
                    finally:
                        await fetched.aclose()
                    if next_object <= stop:
                        raise SourceFailed(FailureKind.MISS, f"layers {next_object}-{stop} were not delivered")
                if obj is None or next_object > last:
                    break
                yield obj
                next_object += 1
        finally:
            await subscription.aclose()
        if next_object <= last:
            raise SourceFailed(FailureKind.MISS, f"the track ended before layer {next_object}")

    @staticmethod
    def _pass_slots(obj: MoqtObject) -> list[PassSlot]:
        try:
            return split_pass(obj.object_id, obj.payload, obj.properties)
        except BadRecord as e:
            raise SourceFailed(FailureKind.MALFORMED, str(e)) from None

    async def fetch_block(self, sources: Sequence[str], record: ReplicaRecord,
                          layers: tuple[int, int] | None = None) -> FetchedBlock:
        """The requested layers as one verified container."""
        stream = self.layers(sources, record, layers)
        got = [layer async for layer in stream]
        container = Container(encode(got[0].index, stream.token_count or 0,
                                     [(layer.k, layer.v) for layer in got], codec=record.codec))
        return FetchedBlock.of(stream, container)
