"""A lean HTTP/1.1 client for block retrieval from plain http:// sources (KVSP §6.7), and
for the small JSON calls every instance makes often: the gateway's route calls to the PC
(`kvsp_moq.gateway.pc_client`) and a holder's records and lookups at the Index Service
(`kvsp_moq.index_client`).

Why it exists: through httpx, each received piece of a block is copied several times (anyio
splits large reads by copying their tail, h11 buffers them again, every piece becomes a new
bytes object) and passes through dozens of Python calls. On loopback that alone held a GET to
about half the rate of raw asyncio TCP, before any digest was computed. Here the socket reads
straight into the container's buffer (asyncio.BufferedProtocol), so the body's octets are
copied once, by the kernel, and the caller is woken once per socket read.

It speaks only what a block GET (or a small POST) needs: one request at a time per connection,
kept alive between requests, and Content-Length, chunked or close-delimited bodies. https:// sources, and
fetchers given their own httpx client, use httpx.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator, cast
from urllib.parse import urlsplit

from kvsp_moq.errors import ConnectError, ConnectTimeout, Http1Error, ReadTimeout, RemoteProtocolError, reason_of

__all__ = ["Answer", "Http1Error", "Http1Pool", "ConnectError", "ConnectTimeout", "ReadTimeout",
           "RemoteProtocolError"]

#: Octets held for a response head and for bodies that are not read into a caller's buffer.
SCRATCH_BYTES = 256 << 10
#: The largest response head accepted.
MAX_HEAD_BYTES = 64 << 10
#: Octets asked of the socket per read. Smaller reads wake the caller sooner, so it can hand
#: each completed piece to the hash workers while the sender refills the socket buffer.
READ_BYTES = 1 << 20
#: Idle connections kept per host and port.
MAX_IDLE_PER_HOST = 8



class _Protocol(asyncio.BufferedProtocol):
    """Receives into a scratch buffer, or into the caller's buffer once it gives one."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.scratch = bytearray(SCRATCH_BYTES)
        self.scratch_view = memoryview(self.scratch)
        self.held = 0  # octets in scratch
        self.dest: memoryview | None = None
        self.dest_pos = 0
        self.eof = False
        self.error: BaseException | None = None
        self.paused = False
        self._waiter: asyncio.Future | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a TCP connection's

    def get_buffer(self, sizehint: int) -> memoryview:
        dest = self.dest
        if dest is not None and self.dest_pos < len(dest):
            return dest[self.dest_pos:self.dest_pos + READ_BYTES]
        return self.scratch_view[self.held:]

    def buffer_updated(self, nbytes: int) -> None:
        dest = self.dest
        if dest is not None and self.dest_pos < len(dest):
            self.dest_pos += nbytes
        else:
            self.held += nbytes
            if self.held == len(self.scratch) and not self.paused:
                self.paused = True
                assert self.transport is not None  # octets arrive only once connected
                self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.error = exc
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, timeout: float) -> None:
        """Until more octets, the end of the stream, or a ReadTimeout."""
        if self.eof:
            return
        waiter = self._waiter = self.loop.create_future()
        timer = self.loop.call_later(timeout, _expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def take(self, n: int) -> bytes:
        """The first n octets of scratch, removed from it."""
        out = bytes(self.scratch_view[:n])
        rest = self.held - n
        if rest:
            self.scratch[:rest] = self.scratch_view[n:self.held]
        self.held = rest
        if self.paused:
            self.paused = False
            assert self.transport is not None  # it was paused, so connected
            self.transport.resume_reading()
        return out


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_exception(ReadTimeout("no octets within the read timeout"))


class Connection:
    def __init__(self, key: tuple[str, int], transport: asyncio.Transport,
                 protocol: _Protocol) -> None:
        self.key = key
        self.transport = transport
        self.protocol = protocol

    @property
    def usable(self) -> bool:
        p = self.protocol
        return not p.eof and p.held == 0 and not self.transport.is_closing()

    def close(self) -> None:
        try:
            self.transport.close()
        except RuntimeError:  # its event loop is already closed
            pass


@dataclass(frozen=True, slots=True)
class Answer:
    """A whole (small) response, as `Http1Pool.call` reads it."""

    status: int
    content_type: str
    body: bytes


class Response:
    """A response's status and head; its body is read once, by one of the two readers."""

    def __init__(self, pool: "Http1Pool", conn: Connection, status: int, version: str,
                 headers: dict[str, str], timeout: float) -> None:
        self._pool = pool
        self._conn: Connection | None = conn
        self.status_code = status
        self.headers = headers
        self._timeout = timeout
        self._done = False
        self.slots: asyncio.Semaphore | None = None  # released when the response is closed
        te = headers.get("transfer-encoding", "").lower()
        self.chunked = "chunked" in te
        self.content_length: int | None = None
        if status in (204, 304):
            self.content_length = 0
        elif not self.chunked and "content-length" in headers:
            values = {v.strip() for v in headers["content-length"].split(",")}
            value = values.pop()
            if values or not value.isdigit():
                raise RemoteProtocolError(f"bad Content-Length {headers['content-length']!r}")
            self.content_length = int(value)
        conn_hdr = headers.get("connection", "").lower()
        self._keep_alive = version == "HTTP/1.1" and "close" not in conn_hdr

    def _protocol(self) -> _Protocol:
        conn = self._conn
        assert conn is not None, "the response is closed"
        return conn.protocol

    async def body_into(self, buffer: bytearray | memoryview) -> AsyncIterator[int]:
        """Receive a Content-Length body of len(buffer) octets into buffer, with no copy.

        Yields the number of octets received so far, whenever that grew.
        """
        proto = self._protocol()
        size = len(buffer)
        if self.content_length != size:
            raise ValueError("body_into needs a buffer of the Content-Length")
        view = memoryview(buffer)
        early = min(proto.held, size)
        if early:
            view[:early] = proto.take(early)
        proto.dest, proto.dest_pos = view, early
        if proto.paused:
            proto.paused = False
            assert proto.transport is not None  # it was paused, so connected
            proto.transport.resume_reading()
        seen = 0
        try:
            while True:
                got = proto.dest_pos
                if got >= size:
                    self._done = True  # whole, even if the caller stops at the last yield
                if got > seen:
                    seen = got
                    yield got
                if got >= size:
                    break
                if proto.eof:
                    raise RemoteProtocolError(f"connection closed after {got} of {size} "
                                              f"body octets")
                await proto.wait(self._timeout)
        finally:
            proto.dest = None

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body in pieces (copied out of the scratch buffer), however it is delimited."""
        proto = self._protocol()
        if self.chunked:
            async for piece in self._chunks(proto):
                yield piece
        else:
            left = self.content_length
            while left is None or left > 0:
                if proto.held:
                    n = proto.held if left is None else min(proto.held, left)
                    if left is not None:
                        left -= n
                    yield proto.take(n)
                    continue
                if proto.eof:
                    if left is None:
                        self._keep_alive = False
                        break
                    raise RemoteProtocolError(f"connection closed with {left} body octets "
                                              f"to come")
                await proto.wait(self._timeout)
        self._done = True

    async def _chunks(self, proto: _Protocol) -> AsyncIterator[bytes]:
        async def line() -> bytes:
            while True:
                end = proto.scratch.find(b"\r\n", 0, proto.held)
                if end >= 0:
                    text = proto.take(end + 2)[:-2]
                    return text
                if proto.held >= 4096:
                    raise RemoteProtocolError("chunk size line too long")
                if proto.eof:
                    raise RemoteProtocolError("connection closed inside a chunked body")
                await proto.wait(self._timeout)

        while True:
            size_text = (await line()).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise RemoteProtocolError(f"bad chunk size {size_text[:20]!r}") from None
            if size == 0:
                while await line():  # trailers, up to the empty line
                    pass
                return
            while size:
                if proto.held:
                    n = min(size, proto.held)
                    size -= n
                    yield proto.take(n)
                    continue
                if proto.eof:
                    raise RemoteProtocolError("connection closed inside a chunk")
                await proto.wait(self._timeout)
            if await line() != b"":
                raise RemoteProtocolError("chunk not followed by CRLF")

    def close(self) -> None:
        """Return the connection to the pool when the body was read whole, else close it."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self.slots is not None:
            self.slots.release()
            self.slots = None
        if self._done and self._keep_alive and conn.usable:
            self._pool.release(conn)
        else:
            conn.close()

    async def __aenter__(self) -> "Response":
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class Http1Pool:
    """Kept-alive connections per host and port, for sequential GETs on each, and at most
    `max_connections` open at once."""

    def __init__(self, *, timeout: float, connect_timeout: float,
                 max_connections: int = 128) -> None:
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.max_connections = max_connections
        self._idle: dict[tuple[str, int], list[Connection]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots: asyncio.Semaphore | None = None

    def _bind(self) -> asyncio.Semaphore:
        """Connections belong to one event loop; a pool used from another starts afresh."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop or self._slots is None:
            for idle in self._idle.values():
                for conn in idle:
                    conn.close()
            self._idle.clear()
            self._loop = loop
            self._slots = asyncio.Semaphore(self.max_connections)
        return self._slots

    async def get(self, url: str, headers: dict[str, str]) -> Response:
        """Send GET url and read the response head; use the result with `async with`."""
        return await self.request("GET", url, headers)

    async def request(self, method: str, url: str, headers: dict[str, str],
                      body: bytes | None = None) -> Response:
        """Send one request (the head and `body` in one write) and read the response head;
        use the result with `async with`. A kept-alive connection the server closed before
        any octet of the answer is replaced and the request sent once more."""
        parts = urlsplit(url)
        if parts.scheme.lower() != "http" or not parts.hostname:
            raise ValueError(f"not a plain http:// URL: {url}")
        host, port = parts.hostname, parts.port or 80
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        host_field = f"[{host}]" if ":" in host else host
        if parts.port:
            host_field += f":{port}"
        lines = [f"{method} {target} HTTP/1.1", f"Host: {host_field}", "Accept: */*",
                 "Accept-Encoding: identity", "User-Agent: kvsp-moq"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        if body is not None:
            lines.append(f"Content-Length: {len(body)}")
        request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")
        key = (host, port)
        slots = self._bind()
        await slots.acquire()
        try:
            while True:
                conn = self._reuse(key)
                reused = conn is not None
                if conn is None:
                    conn = await self._connect(key)
                try:
                    resp = await self._exchange(conn, request)
                except (RemoteProtocolError, ConnectionError) as e:
                    conn.close()
                    if reused and getattr(e, "before_head", False):
                        continue  # a kept-alive connection the server closed: again, on a new one
                    raise
                except BaseException:
                    conn.close()
                    raise
                resp.slots = slots
                return resp
        except BaseException:
            slots.release()
            raise

    async def call(self, method: str, url: str, headers: dict[str, str], body: bytes | None = None,
                   *, max_answer: int) -> Answer:
        """`request`, then its whole answer; RemoteProtocolError for one over `max_answer`
        octets (its connection is closed, not kept), ReadTimeout past the pool's timeout."""
        try:
            async with asyncio.timeout(self.timeout):
                async with await self.request(method, url, headers, body) as response:
                    got = bytearray()
                    async for piece in response.aiter_raw():
                        got += piece
                        if len(got) > max_answer:
                            raise RemoteProtocolError(f"an answer of over {max_answer} octets")
                    return Answer(response.status_code, response.headers.get("content-type", ""),
                                  bytes(got))
        except TimeoutError:
            raise ReadTimeout(f"no answer within {self.timeout:g} s") from None
        except OSError as e:
            raise ConnectError(reason_of(e)) from None

    def _reuse(self, key: tuple[str, int]) -> Connection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if conn.usable:
                return conn
            conn.close()
        return None

    async def _connect(self, key: tuple[str, int]) -> Connection:
        loop = asyncio.get_running_loop()
        proto = _Protocol(loop)
        try:
            transport, _ = await asyncio.wait_for(
                loop.create_connection(lambda: proto, key[0], key[1]), self.connect_timeout)
        except asyncio.TimeoutError:
            raise ConnectTimeout(f"no connection to {key[0]}:{key[1]} within "
                                 f"{self.connect_timeout} s") from None
        except OSError as e:
            raise ConnectError(reason_of(e)) from None
        return Connection(key, transport, proto)

    async def _exchange(self, conn: Connection, request: bytes) -> Response:
        conn.transport.write(request)
        while True:
            resp = await self._head(conn)
            if not 100 <= resp.status_code < 200:
                return resp
            # an interim response (100 Continue, 103 Early Hints): the final one follows

    async def _head(self, conn: Connection) -> Response:
        proto = conn.protocol
        searched = 0
        while True:
            end = proto.scratch.find(b"\r\n\r\n", max(0, searched - 3), proto.held)
            if end >= 0:
                break
            searched = proto.held
            if proto.held >= MAX_HEAD_BYTES:
                raise RemoteProtocolError("response head too large")
            if proto.eof:
                err = RemoteProtocolError("connection closed before a complete response head")
                err.before_head = proto.held == 0
                raise err
            await proto.wait(self.timeout)
        head = proto.take(end + 4)[:-4].decode("latin-1")
        status_line, *fields = head.split("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise RemoteProtocolError(f"not an HTTP/1.x status line: {status_line[:60]!r}")
        headers: dict[str, str] = {}
        for field in fields:
            name, sep, value = field.partition(":")
            if not sep:
                raise RemoteProtocolError(f"malformed header line {field[:60]!r}")
            name = name.strip().lower()
            value = value.strip()
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        return Response(self, conn, int(parts[1]), parts[0], headers, self.timeout)

    def release(self, conn: Connection) -> None:
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) < MAX_IDLE_PER_HOST:
            idle.append(conn)
        else:
            conn.close()

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
