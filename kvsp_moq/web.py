"""What every HTTP server of the project shares: problem responses, health, metrics, logging,
authentication, and running uvicorn on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from collections import defaultdict
from http import HTTPStatus
from typing import Any, AsyncIterator, Awaitable, Callable, ClassVar, Iterator, Sequence

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvsp_moq.allocator import receive_buffer
from kvsp_moq.arguments import parse_listen
from kvsp_moq.auth import Action, Authenticator, Principal
from kvsp_moq.errors import (
    BadContainer,
    BadRecord,
    KvspError,
    LengthRequired,
    Overloaded,
    PayloadTooLarge,
)
from kvsp_moq.http_limits import HttpLimits
from kvsp_moq.openapi import openapi_route
from kvsp_moq.protocol.problems import MEDIA_TYPE as PROBLEM_MEDIA_TYPE
from kvsp_moq.protocol.problems import Problem, problem_for_status

KVSP_JSON = "application/kvsp+json"
log = logging.getLogger("kvsp.http")


class ProblemResponse(Response):
    media_type = PROBLEM_MEDIA_TYPE

    def __init__(self, problem: Problem, headers: dict[str, str] | None = None) -> None:
        super().__init__(problem.to_bytes(), status_code=problem.status, headers=headers)


def error_response(err: KvspError, request: Request | None = None) -> ProblemResponse:
    headers: dict[str, str] | None = None
    if err.status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    elif isinstance(err, Overloaded):
        headers = {"Retry-After": str(err.retry_after)}
    return ProblemResponse(
        Problem.from_error(err, instance=str(request.url.path) if request else None), headers
    )


async def _kvsp_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, KvspError)
    return error_response(exc, request)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return ProblemResponse(problem_for_status(exc.status_code, str(exc.detail)))


EXCEPTION_HANDLERS = {KvspError: _kvsp_error, HTTPException: _http_error}


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(data, separators=(",", ":")).encode(), status_code=status,
                    media_type=KVSP_JSON, headers=headers)


def declared_length(request: Request, limit: int, *, required: bool = False) -> int | None:
    """The request's Content-Length, checked before any of the body is read: 413 when it is
    over `limit`, 411 when it is missing and `required`, 400 when it is not a number."""
    declared = request.headers.get("content-length")
    if declared is None:
        if required:
            raise LengthRequired("this request needs a Content-Length", member="content-length")
        return None
    declared = declared.strip()
    if not declared.isdigit() or len(declared) > 20:
        raise BadRecord("Content-Length must be a number", member="content-length")
    size = int(declared)
    if size > limit:
        raise PayloadTooLarge(f"a body of {size} octets exceeds the limit of {limit}",
                              member="body")
    return size


async def read_body(request: Request, limit: int, *, length_required: bool = False,
                    preallocate: bool = False) -> bytearray | memoryview:
    """The request body, refused (413) as soon as it is known to exceed `limit`: from its
    Content-Length before anything is read, else (a chunked body) counted as it streams, so
    no more than `limit` octets are ever held. `preallocate` receives a body of declared
    length into one buffer of that size (one copy, never two); only for callers that bound
    what such buffers reserve, since a slow client would hold the whole declared size."""
    size = declared_length(request, limit, required=length_required)
    try:
        if size is not None and preallocate:
            buf = receive_buffer(size)
            pos = 0
            async for chunk in request.stream():
                end = pos + len(chunk)
                if end > size:
                    raise BadContainer("body longer than its Content-Length", member="body")
                buf[pos:end] = chunk
                pos = end
            if pos != size:
                raise BadContainer(f"body ended after {pos} of {size} octets", member="body")
            return buf
        body = bytearray()
        async for chunk in request.stream():
            if len(body) + len(chunk) > limit:
                raise PayloadTooLarge(f"the body exceeds the limit of {limit} octets",
                                      member="body")
            body += chunk
        return body
    except ClientDisconnect:
        raise BadRecord("the client went away before the body was complete",
                        member="body") from None


def parse_json(body: bytes | bytearray | memoryview) -> Any:
    """`body` as JSON; anything else is a 400 problem, never a 500."""
    try:
        return json.loads(bytes(body) if isinstance(body, memoryview) else body)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BadRecord(f"body is not valid JSON: {e}", member="body") from None


async def read_json(request: Request, *, max_bytes: int = 64 << 20) -> Any:
    """The request body as JSON, read as it streams and refused (413) at `max_bytes`, before
    reading when Content-Length says so; anything that is not JSON is a 400 problem."""
    return parse_json(await read_body(request, max_bytes))


def principal(request: Request, action: Action) -> Principal:
    """The authenticated principal of a request (the app's Authenticator in app.state.auth),
    once one of its roles is found to permit `action` (401 without a valid token, 403 without
    such a role); scope and holder checks are the handler's."""
    auth: Authenticator = request.app.state.auth
    return auth.authenticate(request.headers.get("authorization")).require(action)


class Metrics:
    """Prometheus text metrics: request counts and summed latency per route and status."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.requests: dict[tuple[str, str, int], int] = defaultdict(int)
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.gauges: dict[str, Callable[[], float]] = {}
        self.counters: dict[str, int] = defaultdict(int)

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        self.requests[(method, route, status)] += 1
        self.seconds[(method, route)] += seconds

    def render(self) -> str:
        p = self.prefix
        lines = [f"# TYPE {p}_http_requests_total counter"]
        for (method, route, status), n in sorted(self.requests.items()):
            lines.append(f'{p}_http_requests_total{{method="{method}",route="{route}",'
                         f'status="{status}"}} {n}')
        lines.append(f"# TYPE {p}_http_request_seconds_total counter")
        for (method, route), s in sorted(self.seconds.items()):
            lines.append(f'{p}_http_request_seconds_total{{method="{method}",route="{route}"}} {s:.6f}')
        for name, n in sorted(self.counters.items()):
            lines.append(f"# TYPE {p}_{name} counter")
            lines.append(f"{p}_{name} {n}")
        for name, fn in sorted(self.gauges.items()):
            lines.append(f"# TYPE {p}_{name} gauge")
            lines.append(f"{p}_{name} {fn()}")
        return "\n".join(lines) + "\n"


class AccessLog:
    """One INFO line per request, and the request metrics."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            elapsed = time.perf_counter() - start
            route = scope.get("route")
            name = getattr(route, "path", None) or "unmatched"
            self.metrics.observe(scope["method"], name, status, elapsed)
            log.info("%s %s %d %.1fms", scope["method"], scope["path"], status, elapsed * 1000)


def service_routes(metrics: Metrics) -> list[Route]:
    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def metrics_endpoint(request: Request) -> Response:
        principal(request, Action.SCRAPE)
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    return [Route("/healthz", healthz), Route("/metrics", metrics_endpoint)]


def build_app(routes: Sequence[BaseRoute], *, name: str, auth: Authenticator,
              on_startup: list[Callable[[], Awaitable[None]]] | None = None,
              on_shutdown: list[Callable[[], Awaitable[None]]] | None = None,
              state: dict[str, Any] | None = None, openapi: str | None = None) -> Starlette:
    """A Starlette app with the shared routes, problem handlers, access log and metrics."""
    metrics = Metrics(name)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        for fn in on_startup or []:
            await fn()
        try:
            yield
        finally:
            for fn in on_shutdown or []:
                await fn()

    all_routes = [*routes, *service_routes(metrics), *([openapi_route(openapi)] if openapi else [])]
    app = Starlette(routes=all_routes, exception_handlers=EXCEPTION_HANDLERS, lifespan=lifespan)
    app.state.auth = auth
    app.state.metrics = metrics
    for key, value in (state or {}).items():
        setattr(app.state, key, value)
    app.add_middleware(AccessLog, metrics=metrics)
    return app


def bind_tcp(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening TCP socket; IPPROTO_TCP so that uvicorn sets TCP_NODELAY on connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def _status_line(status: int) -> bytes:
    return f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n".encode()


class ProblemHttpProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol with the bounds of `limits` (`kvsp_moq.http_limits`), and
    every refusal of its own a problem document like every other 4xx, not uvicorn's bare text:
    a request it cannot parse (400), a head not complete within the header deadline (408) or
    larger than the cap (431), a connection beyond the connection cap (503, Retry-After).
    A body that stops arriving for the body idle deadline closes the connection, which the
    handler reading it sees as the client going away.
    """

    limits: ClassVar[HttpLimits] = HttpLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._in_head = True
        self._head_octets = 0
        self._over_cap = False
        self._body_seen = 0.0

    # -- deadlines

    def _arm(self, seconds: float, expired: Callable[[], None]) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_expired(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if self.flow.read_paused:  # a pipelined request waits for ours: not the client's delay
            self._arm(self.limits.header_timeout_s, self._head_expired)
            return
        self._send_problem(408, f"the request head did not arrive within "
                                f"{self.limits.header_timeout_s:g} s")

    def _body_expired(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        # Re-armed rather than restarted on every part of the body: one timer per deadline.
        now = self.loop.time()
        if self.flow.read_paused:  # the handler is not reading: not the client's delay
            self._body_seen = now
        idle = now - self._body_seen
        if idle < self.limits.body_idle_timeout_s:
            self._arm(self.limits.body_idle_timeout_s - idle, self._body_expired)
            return
        log.info("closing a connection whose request body stalled for %g s",
                 self.limits.body_idle_timeout_s)
        self.transport.close()

    # -- protocol events

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._over_cap = len(self.connections) > self.limits.max_connections
        self._arm(self.limits.header_timeout_s, self._head_expired)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._head_octets += len(data)
        super().data_received(data)
        if (self._in_head and self._head_octets > self.limits.max_header_bytes
                and not self.transport.is_closing()):
            self._send_problem(431, f"the request head exceeds {self.limits.max_header_bytes} octets")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        if self._timer is None:
            self._arm(self.limits.header_timeout_s, self._head_expired)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()
        head = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
        refusal: ASGIApp | None = None
        if self._over_cap:
            log.warning("more than %d connections: a request is answered 503",
                        self.limits.max_connections)
            refusal = _refusal(Overloaded(f"more than {self.limits.max_connections} "
                                          "connections are open",
                                          retry_after=self.limits.retry_after_s))
        elif head > self.limits.max_header_bytes:
            refusal = _refusal(None, 431, f"the request head exceeds "
                                          f"{self.limits.max_header_bytes} octets")
        if refusal is None:
            super().on_headers_complete()
        else:
            app, self.app = self.app, refusal
            try:
                super().on_headers_complete()
            finally:
                self.app = app
        self._body_seen = self.loop.time()
        self._arm(self.limits.body_idle_timeout_s, self._body_expired)

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        self._body_seen = self.loop.time()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()
        self._in_head = True
        self._head_octets = 0

    # -- refusals

    def send_400_response(self, msg: str) -> None:
        self._send_problem(400, msg)

    def _send_problem(self, status: int, detail: str) -> None:
        """Answer with a problem document and close: for what is refused before a request
        can reach the app."""
        self._disarm()
        body = _plain_problem(status, detail).to_bytes()
        head = [_status_line(status)]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [b"content-type: ", PROBLEM_MEDIA_TYPE.encode(), b"\r\n",
                 b"content-length: ", str(len(body)).encode(), b"\r\n",
                 b"connection: close\r\n\r\n", body]
        self.transport.write(b"".join(head))
        self.transport.close()


def _plain_problem(status: int, detail: str) -> Problem:
    """A problem of no type of ours, for what HTTP itself refuses (408, 431, a bad request)."""
    if status in (400, 404, 405, 413):
        return problem_for_status(status, detail)
    return Problem("about:blank", HTTPStatus(status).phrase, status, detail)


def _refusal(err: KvspError | None, status: int = 0, detail: str = "") -> ASGIApp:
    """An ASGI app answering every request with one problem and closing the connection."""
    problem = Problem.from_error(err) if err is not None else _plain_problem(status, detail)
    body = problem.to_bytes()
    headers = [(b"content-type", PROBLEM_MEDIA_TYPE.encode()),
               (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
    if isinstance(err, Overloaded):
        headers.append((b"retry-after", str(err.retry_after).encode()))

    async def refuse(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": problem.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return refuse


def uvicorn_config(app: ASGIApp, *, limits: HttpLimits | None = None,
                   **kwargs: Any) -> uvicorn.Config:
    """uvicorn's configuration for every server of the project: its HTTP/1.1 protocol with the
    bounds of `limits` (by default `HttpLimits.from_env()`, the KVSP_HTTP_* variables)."""
    limits = limits if limits is not None else HttpLimits.from_env()
    protocol = type("LimitedHttpProtocol", (ProblemHttpProtocol,), {"limits": limits})
    return uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                          http=protocol, loop="auto",
                          timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]
                          h11_max_incomplete_event_size=limits.max_header_bytes, **kwargs)


def run(app: ASGIApp, listen: str, default_port: int, *, limits: HttpLimits | None = None) -> None:
    """Serve until interrupted (the `main()` of each service)."""
    host, port = parse_listen(listen, default_port)
    sock = bind_tcp(host, port)
    server = uvicorn.Server(uvicorn_config(app, limits=limits))
    server.run(sockets=[sock])


class BackgroundServer:
    """A uvicorn server on its own thread and loop, on 127.0.0.1 and a free port (tests, demo)."""

    def __init__(self, app: ASGIApp, host: str = "127.0.0.1", port: int = 0, *,
                 limits: HttpLimits | None = None) -> None:
        self.sock = bind_tcp(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.server = uvicorn.Server(uvicorn_config(app, limits=limits))
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"http-{self.port}")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/"

    def _run(self) -> None:
        asyncio.run(self.server.serve(sockets=[self.sock]))

    def start(self, timeout: float = 10.0) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def serving(app: ASGIApp) -> Iterator[str]:
    with BackgroundServer(app) as server:
        yield server.url
