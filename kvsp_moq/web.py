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
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, Sequence

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvsp_moq.arguments import parse_listen
from kvsp_moq.auth import Action, Authenticator, Principal
from kvsp_moq.errors import BadRecord, KvspError
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
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
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


async def read_json(request: Request, *, max_bytes: int = 64 << 20) -> Any:
    """The request body as JSON; anything else is a 400 problem, never a 500."""
    try:
        body = await request.body()
    except ClientDisconnect:
        raise BadRecord("the client went away before the body was complete", member="body") from None
    if len(body) > max_bytes:
        raise BadRecord(f"body exceeds {max_bytes} octets", member="body")
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BadRecord(f"body is not valid JSON: {e}", member="body") from None


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


class ProblemHttpProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol, refusing a request it cannot parse (a bad Transfer-Encoding,
    a broken request line) with a problem document like every other 4xx, not uvicorn's bare text.
    """

    def send_400_response(self, msg: str) -> None:
        body = problem_for_status(400, msg).to_bytes()
        head = [b"HTTP/1.1 400 Bad Request\r\n"]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [b"content-type: ", PROBLEM_MEDIA_TYPE.encode(), b"\r\n",
                 b"content-length: ", str(len(body)).encode(), b"\r\n",
                 b"connection: close\r\n\r\n", body]
        self.transport.write(b"".join(head))
        self.transport.close()


def uvicorn_config(app: ASGIApp, **kwargs: Any) -> uvicorn.Config:
    return uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                          http=ProblemHttpProtocol, loop="auto", timeout_keep_alive=30, **kwargs)


def run(app: ASGIApp, listen: str, default_port: int) -> None:
    """Serve until interrupted (the `main()` of each service)."""
    host, port = parse_listen(listen, default_port)
    sock = bind_tcp(host, port)
    server = uvicorn.Server(uvicorn_config(app))
    server.run(sockets=[sock])


class BackgroundServer:
    """A uvicorn server on its own thread and loop, on 127.0.0.1 and a free port (tests, demo)."""

    def __init__(self, app: ASGIApp, host: str = "127.0.0.1", port: int = 0) -> None:
        self.sock = bind_tcp(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.server = uvicorn.Server(uvicorn_config(app))
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
