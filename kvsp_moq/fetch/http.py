"""Block retrieval over HTTP (KVSP §6.7): verified layers, in ascending order, from the first
source that delivers them.

    stream = HttpFetcher().layers(sources, record, (a, b))
    async for layer in stream:      # kvsp_moq.protocol.container.Layer, verified
        ...
    stream.failures                 # [(source, reason), ...] for sources that were skipped

The body is parsed as it arrives (`kvsp_moq.protocol.container_parser.ContainerParser`): once
the header, the length table and a layer's octets are in, that layer is checked against the
Replica Record's layer digest and handed out, so a caller can start on layer l while l+1 is
still on the wire. The Repr-Digest of the whole response is computed alongside and checked
before the response's last layer is handed out: layer digests do not cover the container
header (Token Count, codec, the K/V split of each layer), and §6.7 requires clients to verify
Repr-Digest. No layer is handed out before its own digest has been checked.

Verifying thus means two SHA-256 passes over the body, which cost more CPU than receiving it,
so they run side by side while the next octets arrive (hashlib releases the GIL): the
Repr-Digest on a hash worker, piece by piece in order. Layer digests of bodies under
INLINE_BODY_BELOW are computed on the event loop thread; for larger bodies they go to the
hash workers in one batch per receive, except the first layer, which is hashed inline so that
it comes out without a thread hop.

Plain http:// sources are read with the lean HTTP/1.1 client in `http1` (the body goes
straight from the socket into the container's buffer); https://, and fetchers given their own
httpx client, use httpx.

A 404, a timeout, a broken connection or a digest mismatch moves on to the next source, which
is asked only for the layers still missing. A plain static web server works as a source: it
sends no Repr-Digest and ignores `layers=`, so the whole block is fetched and checked against
the record's digests, and the result's `notes` say so.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import importlib.util
import re
import sys
import time
from concurrent.futures import Future
from typing import AsyncGenerator, AsyncIterator, Sequence
from urllib.parse import urlsplit

import httpcore
import httpx

from kvsp_moq.allocator import receive_buffer
from kvsp_moq.errors import BadContainer, reason_of
from kvsp_moq.fetch import http1
from kvsp_moq.fetch.stream import FailureKind, FetchedBlock, SourceFailed, VerifiedLayerStream, record_layer_digests
from kvsp_moq.hashing import hash_pool
from kvsp_moq.protocol.container import (
    MEDIA_TYPE,
    Container,
    Layer,
    encode,
    layer_digest,
    replica_digest,
)
from kvsp_moq.protocol.container_parser import ContainerParser
from kvsp_moq.protocol.records import ReplicaRecord

#: Octets hashed per worker call for the Repr-Digest; fewer calls, same cache behaviour.
HASH_STEP = 1 << 20
#: Pieces smaller than this are hashed on the event loop thread.
INLINE_HASH_BELOW = 256 << 10
#: Layer digests of bodies smaller than this are computed on the event loop thread: handing
#: their layers to the workers cost more in thread hops than it saved (measured on two busy
#: cores), while the Repr-Digest beside them still runs on a worker.
INLINE_BODY_BELOW = 4 << 20
#: httpcore reads at most 64 KiB per call, and anyio splits each larger socket read by copying
#: its tail, so a 16 MiB body is copied many times over; 1 MiB reads measured ~1.5x faster.
READ_BYTES = 1 << 20
_REPR_SHA256 = re.compile(r"(?:^|,)\s*sha-256\s*=\s*:([A-Za-z0-9+/=]+):", re.IGNORECASE)


def tune_httpcore_reads(size: int = READ_BYTES) -> None:
    """Let httpcore read up to `size` octets per call (an upper bound; nothing is preallocated).

    Also remember that sniffio is absent: httpcore imports it on every request to detect the
    async library, and each failed import searches sys.path again (~0.2 ms, four per request).
    """
    cls = getattr(httpcore, "AsyncHTTP11Connection", None)
    if cls is not None and getattr(cls, "READ_NUM_BYTES", size) < size:
        cls.READ_NUM_BYTES = size
    if "sniffio" not in sys.modules and importlib.util.find_spec("sniffio") is None:
        sys.modules["sniffio"] = None  # type: ignore[assignment]  # import now fails at once


def parse_repr_digest(value: str | None) -> bytes | None:
    """The SHA-256 of an RFC 9530 Repr-Digest field, or None when it carries none."""
    if not value:
        return None
    m = _REPR_SHA256.search(value)
    if not m:
        return None
    try:
        digest = base64.b64decode(m.group(1), validate=True)
    except (binascii.Error, ValueError):
        return None
    return digest if len(digest) == 32 else None


# --------------------------------------------------------------------------- internals


class _SerialHash:
    """SHA-256 over pieces submitted in order, computed on the worker threads.

    Each step waits for its predecessor, which the FIFO pool always started earlier.
    """

    def __init__(self) -> None:
        self.hash = hashlib.sha256()
        self._last: Future | None = None

    def update(self, piece: memoryview) -> None:
        if len(piece) < INLINE_HASH_BELOW and (self._last is None or self._last.done()):
            self.hash.update(piece)  # a thread hop costs more than hashing this here
            return
        self._last = hash_pool().submit(self._step, self._last, piece)

    def _step(self, prev: Future | None, piece: memoryview) -> None:
        if prev is not None:
            prev.result()
        self.hash.update(piece)

    async def digest(self) -> bytes:
        if self._last is not None:
            await asyncio.wrap_future(self._last)
        return self.hash.digest()


# --------------------------------------------------------------------------- the stream


class HttpLayerStream(VerifiedLayerStream):
    """Verified layers a..b of one block, in ascending order, from a list of HTTP sources."""

    def __init__(self, fetcher: "HttpFetcher", sources: Sequence[str], record: ReplicaRecord,
                 layers: tuple[int, int] | None) -> None:
        super().__init__(sources, record, layers)
        self.fetcher = fetcher
        self._current: ContainerParser | None = None
        self._delivered: list[ContainerParser] = []
        self._start()

    # ---------------------------------------------------------------- the source loop

    async def _run(self) -> AsyncGenerator[Layer, None]:
        record = self.record
        digests = record_layer_digests(record)
        want = self.range
        next_layer = want[0] if want else 0
        for source in self.sources:
            if want is not None and next_layer > want[1]:
                break
            if not source.lower().startswith(("http://", "https://")):
                self._fail(source, FailureKind.REFUSED, "not an HTTP source")
                continue
            base = source if source.endswith("/") else source + "/"
            start_layer = next_layer
            try:
                async for layer in self._from_source(base, next_layer, digests):
                    if self.first_layer_seconds is None:
                        self.first_layer_seconds = time.perf_counter() - self.started
                    next_layer = layer.index + 1
                    yield layer
                if want is None:
                    want = self.range  # learnt from a whole-block response
                    next_layer = want[1] + 1 if want else 0
            except SourceFailed as e:
                self._fail(source, e.kind, e.reason)
            except (httpx.TimeoutException, http1.ReadTimeout, http1.ConnectTimeout) as e:
                self._fail(source, FailureKind.TRANSPORT, f"timed out ({type(e).__name__})")
            except (httpx.HTTPError, http1.Http1Error, OSError) as e:
                self._fail(source, FailureKind.TRANSPORT, reason_of(e, named=True))
            finally:
                if next_layer > start_layer:
                    self.served_by.append((source, start_layer, next_layer - 1))
                    if self._current is not None:
                        self._delivered.append(self._current)
                self._current = None
        if want is None or next_layer <= want[1]:
            raise self._exhausted()

    # ---------------------------------------------------------------- one source

    async def _from_source(self, base: str, first: int,
                           digests: list[bytes] | None) -> AsyncIterator[Layer]:
        record = self.record
        want = self.range
        url = f"{base}blocks/{record.compat_id}/{record.scope_id}/{record.block_key}"
        if want is not None and digests is not None and (first, want[1]) != (0, len(digests) - 1):
            url += f"?layers={first}-{want[1]}"
        fetcher = self.fetcher
        if fetcher.pool is not None and fetcher.lean_for(base):
            async with await fetcher.pool.get(url, fetcher.headers) as resp:
                async for layer in self._from_response(base, first, digests, resp, True):
                    yield layer
            return
        async with fetcher.client.stream("GET", fetcher.url(url),
                                         headers=fetcher.headers) as hresp:
            async for layer in self._from_response(base, first, digests, hresp, False):
                yield layer

    async def _from_response(self, base: str, first: int, digests: list[bytes] | None,
                             resp: "httpx.Response | http1.Response",
                             lean: bool) -> AsyncIterator[Layer]:
        """Layers from one response, whichever client received it."""
        record = self.record
        if resp.status_code != 200:
            raise SourceFailed(*await _describe_refusal(resp))
        expected_repr = parse_repr_digest(resp.headers.get("repr-digest"))
        if expected_repr is None:
            self._note(f"{base} sent no usable Repr-Digest; layers were checked against "
                       f"the record's digests only")
        ctype = resp.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != MEDIA_TYPE:
            self._note(f"{base} labelled the block {ctype or 'without a media type'}")
        max_size = record.size if record.size else self.fetcher.max_block_bytes
        declared = resp.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_size:
            raise SourceFailed(FailureKind.MALFORMED, f"a body of {declared} octets is larger than "
                                             f"the replica's {max_size}")
        parser = ContainerParser(max_size=max_size, allocate=receive_buffer)
        self._current = parser
        steps: AsyncGenerator[list[Layer], None]
        if lean and isinstance(resp, http1.Response) and resp.content_length is not None:
            steps = self._steps_in_place(parser, resp, resp.content_length)
        else:
            steps = self._steps_fed(parser, resp.aiter_raw())
        small = declared is not None and declared.isdigit() and int(declared) < INLINE_BODY_BELOW
        stream_hash = _SerialHash() if expected_repr is not None else None
        hashed = 0
        last_wanted: int | None = None
        held: Layer | None = None  # the last wanted layer waits for the Repr-Digest check
        checks = _LayerChecks(digests, inline=small) if digests is not None else None
        done = False
        try:
            async for completed in steps:
                if parser.buffer is None:
                    continue
                if last_wanted is None:
                    last_wanted = self._check_response(base, parser, first, digests)
                if stream_hash is not None and (
                        small or parser.received - hashed >= HASH_STEP
                        or parser.complete):
                    stream_hash.update(parser.buffer[hashed:parser.received])
                    hashed = parser.received
                if checks is None:
                    continue  # only the whole replica can be checked, at the end
                checks.submit([layer for layer in completed
                               if first <= layer.index <= last_wanted])
                for layer in checks.ready():
                    if stream_hash is not None and layer.index == last_wanted:
                        held = layer
                    else:
                        yield layer
                if stream_hash is None and parser.last_complete_layer >= last_wanted:
                    done = True  # nothing after the wanted layers can be checked anyway
                    break
            if checks is not None:
                async for layer in checks.rest():
                    if stream_hash is not None and layer.index == last_wanted:
                        held = layer
                    else:
                        yield layer
        except BadContainer as e:
            raise SourceFailed(FailureKind.MALFORMED, f"{base}: {e}") from None
        finally:
            await steps.aclose()
        if not done:
            try:
                whole = parser.close()
            except BadContainer as e:
                raise SourceFailed(FailureKind.TRANSPORT, reason_of(e)) from None
            if stream_hash is not None:
                if hashed < parser.received and parser.buffer is not None:  # close() left it set
                    stream_hash.update(parser.buffer[hashed:parser.received])
                if await stream_hash.digest() != expected_repr:
                    raise SourceFailed(FailureKind.DIGEST, "Repr-Digest does not match the body")
            if digests is None:
                self.token_count = whole.token_count
                computed = whole.layer_digests()
                if whole.first_layer != 0 or replica_digest(computed).hex() != record.digest[8:]:
                    raise SourceFailed(FailureKind.DIGEST, "the block does not match the replica digest")
                self.range = (0, whole.layer_count - 1) if self.range is None else self.range
                for layer in whole.layers():
                    if self.range[0] <= layer.index <= self.range[1]:
                        yield layer
                return
        self.token_count = parser.token_count
        if held is not None:
            yield held

    async def _steps_fed(self, parser: ContainerParser,
                         pieces: AsyncIterator[bytes]) -> AsyncGenerator[list[Layer], None]:
        """Feed the parser each piece received; the layers each one completed."""
        async for piece in pieces:
            self.bytes_received += len(piece)
            yield parser.feed(piece)

    async def _steps_in_place(self, parser: ContainerParser,
                              resp: http1.Response, size: int) -> AsyncGenerator[list[Layer], None]:
        """Receive straight into the block's buffer (`size`: the body's Content-Length); the
        layers each socket read completed."""
        buffer = receive_buffer(size)
        parser.attach(buffer)
        before = 0
        async for received in resp.body_into(buffer):
            self.bytes_received += received - before
            before = received
            yield parser.advance(received)

    def _check_response(self, base: str, parser: ContainerParser, first: int,
                        digests: list[bytes] | None) -> int:
        """Check the response's header against the request; the last layer wanted from it."""
        if parser.codec != self.record.codec:
            raise SourceFailed(FailureKind.MALFORMED, f"codec {parser.codec} returned, the replica has "
                                             f"codec {self.record.codec}")
        last_in = parser.first_layer + parser.layer_count - 1
        if digests is None:
            return last_in
        assert self.range is not None  # layer digests come with the layer count
        want_last = self.range[1]
        if parser.first_layer > first or last_in < want_last:
            raise SourceFailed(FailureKind.MALFORMED, f"response holds layers {parser.first_layer}-"
                                             f"{last_in}, not {first}-{want_last}")
        if (parser.first_layer, last_in) != (first, want_last):
            self._note(f"{base} ignored layers={first}-{want_last} and sent layers "
                       f"{parser.first_layer}-{last_in}")
        return want_last

    def container_if_single(self) -> Container | None:
        """The one response's container, when it alone delivered every layer (no copy)."""
        if len(self._delivered) != 1 or not self._delivered[0].complete:
            return None
        return self._delivered[0].close()


def _verify_layer(layer: Layer, digests: list[bytes]) -> None:
    if layer_digest(layer.k, layer.v) != digests[layer.index]:
        raise SourceFailed(FailureKind.DIGEST, f"layer {layer.index} does not match its layer digest")


def _layer_digests(layers: list[Layer]) -> list[bytes]:
    return [layer_digest(layer.k, layer.v) for layer in layers]


class _LayerChecks:
    """Layer digests checked as layers complete; layers come out verified and in order.

    With `inline`, every layer is hashed on the event loop. Otherwise only the first is, so
    that it is handed out without a thread hop; later ones go to the workers in one batch per
    receive, leaving the event loop free to keep the socket drained.
    """

    def __init__(self, digests: list[bytes], *, inline: bool = False) -> None:
        self.digests = digests
        self.inline = inline
        self._pending: list[tuple[list[Layer], Future]] = []
        self._verified: list[Layer] = []
        self._started = False

    def submit(self, layers: list[Layer]) -> None:
        if not layers:
            return
        if self.inline or not self._started:
            self._started = True
            n = len(layers) if self.inline else 1
            for layer in layers[:n]:
                _verify_layer(layer, self.digests)
            self._verified += layers[:n]
            layers = layers[n:]
            if not layers:
                return
        self._pending.append((layers, hash_pool().submit(_layer_digests, layers)))

    def ready(self) -> list[Layer]:
        """The layers verified so far and not yet handed out (without waiting)."""
        out, self._verified = self._verified, []
        while self._pending and self._pending[0][1].done():
            layers, fut = self._pending.pop(0)
            out += self._check(layers, fut.result())
        return out

    async def rest(self) -> AsyncIterator[Layer]:
        """Every remaining layer, waiting for the workers."""
        for layer in self.ready():
            yield layer
        while self._pending:
            layers, fut = self._pending.pop(0)
            for layer in self._check(layers, await asyncio.wrap_future(fut)):
                yield layer

    def _check(self, layers: list[Layer], computed: list[bytes]) -> list[Layer]:
        for layer, digest in zip(layers, computed):
            if digest != self.digests[layer.index]:
                raise SourceFailed(FailureKind.DIGEST, f"layer {layer.index} does not match its "
                                              f"layer digest")
        return layers


async def _describe_refusal(resp: "httpx.Response | http1.Response") -> tuple[FailureKind, str]:
    """(kind, reason) for a non-200 answer, naming its problem type when it has one."""
    body = b""
    async for piece in resp.aiter_raw():
        body += piece
        if len(body) > 65536:
            break
    name = ""
    if resp.headers.get("content-type", "").startswith("application/problem+json"):
        m = re.search(rb'"type"\s*:\s*"urn:kvsp:problem:([a-z0-9-]+)"', body)
        if m:
            name = " " + m.group(1).decode()
    kind = FailureKind.MISS if resp.status_code in (404, 410) else FailureKind.REFUSED
    return kind, f"HTTP {resp.status_code}{name}"


# --------------------------------------------------------------------------- the fetcher


class HttpFetcher:
    """Fetches blocks from holders with one shared connection pool."""

    def __init__(self, *, client: httpx.AsyncClient | None = None, token: str | None = None,
                 timeout: float = 10.0, max_block_bytes: int = 1 << 30,
                 large_reads: bool = True, lean: bool | None = None) -> None:
        if large_reads:
            tune_httpcore_reads()
        self._own = client is None
        #: Plain http:// GETs go through the lean client (`http1`). By default only when the
        #: fetcher owns its httpx client: one handed in may carry a transport or limits of
        #: its own that the caller wants used; lean=True uses the lean client even then.
        if lean is None:
            lean = client is None
        self.pool = (http1.Http1Pool(timeout=timeout, connect_timeout=min(timeout, 5.0))
                     if lean else None)
        self.client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=min(timeout, 5.0)), trust_env=False,
            limits=httpx.Limits(max_connections=128, max_keepalive_connections=64))
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.max_block_bytes = max_block_bytes
        self._urls: dict[str, httpx.URL] = {}
        self._lean: dict[str, bool] = {}

    def lean_for(self, base: str) -> bool:
        """Whether a source is read with the lean client: plain http://, no credentials."""
        ok = self._lean.get(base)
        if ok is None:
            parts = urlsplit(base)
            ok = (parts.scheme.lower() == "http" and parts.username is None
                  and parts.password is None)
            if len(self._lean) >= 4096:
                self._lean.clear()
            self._lean[base] = ok
        return ok

    def url(self, text: str) -> httpx.URL:
        """A parsed URL, cached: httpx checks every character of our long hex paths."""
        url = self._urls.get(text)
        if url is None:
            if len(self._urls) >= 4096:
                self._urls.clear()
            url = self._urls[text] = httpx.URL(text)
        return url

    async def aclose(self) -> None:
        if self.pool is not None:
            await self.pool.aclose()
        if self._own:
            await self.client.aclose()

    async def __aenter__(self) -> "HttpFetcher":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def layers(self, sources: Sequence[str], record: ReplicaRecord,
               layers: tuple[int, int] | None = None) -> HttpLayerStream:
        """Layers a..b (default all) of the record's block, verified, in ascending order."""
        return HttpLayerStream(self, sources, record, layers)

    async def fetch_block(self, sources: Sequence[str], record: ReplicaRecord,
                          layers: tuple[int, int] | None = None) -> FetchedBlock:
        """The requested layers as one verified container."""
        stream = self.layers(sources, record, layers)
        got = [layer async for layer in stream]
        container = stream.container_if_single()
        first, last = got[0].index, got[-1].index
        if container is None or (container.first_layer, container.last_layer) != (first, last):
            container = Container(encode(first, stream.token_count or 0,
                                         [(layer.k, layer.v) for layer in got],
                                         codec=record.codec))
        return FetchedBlock.of(stream, container)


async def fetch_block(sources: Sequence[str], record: ReplicaRecord,
                      layers: tuple[int, int] | None = None, *,
                      client: httpx.AsyncClient | None = None, token: str | None = None,
                      timeout: float = 10.0) -> FetchedBlock:
    """One block from the first of `sources` that delivers it verified."""
    async with HttpFetcher(client=client, token=token, timeout=timeout) as fetcher:
        return await fetcher.fetch_block(sources, record, layers)
