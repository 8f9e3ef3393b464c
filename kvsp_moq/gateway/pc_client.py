"""The gateway's `POST {pc}route`: HTTP/1.1 on kept-alive connections, with little per call.

Every request the gateway serves waits for one route decision, so the PC call is most of the
gateway's own time. Through httpx it cost ~1 ms more than the PC's own answer on two cores
(its request and response models, httpcore's pool, anyio's streams, headers and body sent
apart); `kvsp bench gateway --overhead-only` measures both paths. `PCClient` writes each
request in one send on a connection kept open for the next, and parses the answer with
httptools, the parser uvicorn uses. It is plain HTTP to the PC, the same bytes on the wire
(the §6.4 request and decision are unchanged); an `https` PC URL, or a Python without
httptools, goes through httpx as before.

Several PC URLs (comma-separated, `kvsp_moq.pc_endpoints`) are several PC processes on one
store: a PC that cannot be reached or answers 503 is left for the next, within the same call.
A connection the PC closed while it was idle (its keep-alive timeout) is found closed before it
is used, or fails before any byte of an answer; the call is then sent once more on a new one.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Mapping, cast
from urllib.parse import urlsplit

import httpx

from kvsp_moq.errors import KvspError, TransportError, reason_of
from kvsp_moq.index_client import raise_for_problem
from kvsp_moq.pc_endpoints import PCEndpoints

try:
    import httptools
except ImportError:  # uvicorn[standard] brings it; without it, httpx carries the calls
    httptools = None  # type: ignore[assignment]

__all__ = ["MAX_ANSWER", "PCClient"]

#: The longest answer read from the PC (a decision is a few KiB).
MAX_ANSWER = 4 << 20
#: Idle connections kept per PC: enough for the route calls in flight at once.
MAX_IDLE = 32


class _Stale(Exception):
    """The connection ended before any byte of the answer: the PC closed it while idle."""


class _Answer:
    __slots__ = ("status", "content_type", "body")

    def __init__(self, status: int, content_type: str, body: bytes) -> None:
        self.status, self.content_type, self.body = status, content_type, body


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection to a PC, one request at a time."""

    def __init__(self) -> None:
        assert httptools is not None
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reusable = False
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[_Answer] | None = None
        self._received = False
        self._content_type = ""
        self._body: list[bytes] = []
        self._size = 0

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if self._waiter is None or self._waiter.done():  # nothing asked: the PC is confused
            self.close()
            return
        self._received = True
        try:
            self._parser.feed_data(data)
        except Exception as e:  # httptools' parser errors, or the size limit below
            self._fail(TransportError(f"the PC's answer is not HTTP/1.1: {reason_of(e)}"))

    def eof_received(self) -> bool:
        return False  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.reusable = False
        if self._waiter is not None and not self._waiter.done():
            if not self._received:
                self._waiter.set_exception(_Stale())
            else:
                self._waiter.set_exception(TransportError("the PC closed the connection "
                                                          "before its answer was complete"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self._content_type = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > MAX_ANSWER:
            raise ValueError(f"an answer over {MAX_ANSWER} octets")
        self._body.append(body)

    def on_message_complete(self) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        self.reusable = bool(self._parser.should_keep_alive())
        waiter.set_result(_Answer(self._parser.get_status_code(), self._content_type,
                                  b"".join(self._body)))

    # use
    def _fail(self, error: Exception) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(error)
        self.close()

    def close(self) -> None:
        self.closed = True
        self.reusable = False
        if self.transport is not None:
            self.transport.close()

    async def exchange(self, request: bytes) -> _Answer:
        """Send one whole request; its answer. `_Stale` when the connection ended before any
        of it came back; anything else leaves the connection closed."""
        assert self.transport is not None
        if self.closed:
            raise _Stale()
        self._waiter = asyncio.get_running_loop().create_future()
        self._received = False
        self._content_type = ""
        self._body = []
        self._size = 0
        self.reusable = False
        self.transport.write(request)
        try:
            return await self._waiter
        except BaseException:
            self.close()
            raise
        finally:
            self._waiter = None


class PCClient:
    """Calls to one PC, or several PC processes on one store (`PCEndpoints`)."""

    def __init__(self, pc_urls: str | PCEndpoints, *, token: str | None = None,
                 timeout_s: float = 60.0, client: httpx.AsyncClient | None = None,
                 lean: bool = True) -> None:
        self.pcs = pc_urls if isinstance(pc_urls, PCEndpoints) else PCEndpoints(pc_urls)
        self.token = token
        self.timeout_s = timeout_s
        #: httpx carries the calls that the lean path does not (https, no httptools)
        self.client = client
        self._own = client is None
        #: False: every call through httpx (the path this one replaced; the benchmark's baseline)
        self.lean = lean and httptools is not None
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._closed = False
        if token and not token.isprintable():
            raise ValueError("the PC token must be printable (no line breaks)")
        self._auth = f"Authorization: Bearer {token}\r\n" if token else ""

    # --------------------------------------------------------------------- the PC's route
    async def route(self, body: Mapping[str, Any]) -> tuple[dict[str, Any], float]:
        """`POST {pc}route`: the decision and the ms the call took. A PC that cannot be
        reached or answers 503 is left for the next one, each tried once; KvspError (the PC's
        problem, or TransportError) when none answers."""
        t0 = time.perf_counter()
        payload = json.dumps(body, separators=(",", ":")).encode()
        answer = await self.call("POST", "route", payload)
        try:
            decision = json.loads(answer.body)
        except ValueError:
            decision = None
        if not isinstance(decision, dict):
            raise TransportError(f"the PC's route decision is not a JSON object: "
                                 f"{answer.body[:80]!r}")
        return decision, (time.perf_counter() - t0) * 1000

    async def call(self, method: str, path: str, payload: bytes | None = None) -> _Answer:
        """`method {pc}path` at the PC in use, then the next ones; the first answer that is not
        a 503, raised as the project's error when it is a problem (>= 400)."""
        last: KvspError | None = None
        for _ in range(len(self.pcs.urls)):
            pc = self.pcs.url
            try:
                answer = await self._call(pc, method, path, payload)
            except TransportError as e:
                self.pcs.failed(pc)
                last = e
                continue
            if answer.status == 503:
                self.pcs.failed(pc)
                try:
                    _raise_for(answer)
                except KvspError as e:
                    last = e
                continue
            _raise_for(answer)
            return answer
        assert last is not None
        raise last

    async def _call(self, pc: str, method: str, path: str, payload: bytes | None) -> _Answer:
        url = urlsplit(pc)
        if not self.lean or url.scheme != "http":
            return await self._call_httpx(pc, method, path, payload)
        host = url.hostname or "127.0.0.1"
        port = url.port or 80
        head = (f"{method} {url.path or '/'}{path} HTTP/1.1\r\nHost: {url.netloc}\r\n"
                f"Accept: application/json\r\n{self._auth}")
        if payload is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        request = (head + "\r\n").encode("latin-1") + (payload or b"")
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._exchange((host, port), request)
        except TimeoutError:
            raise TransportError(f"the PC {pc} is unreachable: no answer in "
                                 f"{self.timeout_s:g} s") from None
        except OSError as e:
            raise TransportError(f"the PC {pc} is unreachable: {reason_of(e, named=True)}") from None

    async def _exchange(self, key: tuple[str, int], request: bytes) -> _Answer:
        for _ in range(2):
            conn = self._take(key)
            fresh = conn is None
            if conn is None:
                conn = await self._connect(key)
            try:
                answer = await conn.exchange(request)
            except _Stale:
                if fresh:
                    raise ConnectionResetError("the PC closed the connection without an answer")
                continue  # closed while idle: once more on a new connection
            if conn.reusable:
                self._give(key, conn)
            else:
                conn.close()
            return answer
        raise ConnectionResetError("the PC closed two connections without an answer")

    async def _connect(self, key: tuple[str, int]) -> _Connection:
        transport, conn = await asyncio.get_running_loop().create_connection(_Connection, *key)
        conn.transport = transport  # uvloop calls connection_made later
        return conn

    def _take(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
        return None

    def _give(self, key: tuple[str, int], conn: _Connection) -> None:
        idle = self._idle.setdefault(key, [])
        if len(idle) < MAX_IDLE and not self._closed:
            idle.append(conn)
        else:
            conn.close()

    async def _call_httpx(self, pc: str, method: str, path: str, payload: bytes | None) -> _Answer:
        if self.client is None:
            self.client = httpx.AsyncClient(trust_env=False)
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        if payload is not None:
            headers["Content-Type"] = "application/json"
        try:
            r = await self.client.request(method, f"{pc}{path}", content=payload, headers=headers,
                                          timeout=self.timeout_s)
        except httpx.HTTPError as e:
            raise TransportError(f"the PC {pc} is unreachable: {reason_of(e, named=True)}") from None
        return _Answer(r.status_code, r.headers.get("content-type", ""), r.content)

    async def aclose(self) -> None:
        """Close the idle connections; those in use close when their call ends."""
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
        if self._own and self.client is not None:
            await self.client.aclose()
            self.client = None


def _raise_for(answer: _Answer) -> None:
    """A problem answer (>= 400) as the project's error, as for any other call."""
    if answer.status >= 400:
        raise_for_problem(httpx.Response(answer.status, content=answer.body,
                                         headers={"content-type": answer.content_type}))
