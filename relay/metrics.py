"""The relay's HTTP metrics: `kvsp relay --metrics HOST:PORT` serves GET /metrics
(Prometheus text) and GET /healthz.

The relay runs on its own event loop; the HTTP server (kvsp_moq.web's BackgroundServer)
runs on another thread. Each scrape takes one snapshot of the relay's counters on the
relay's loop, so the figures of one scrape are consistent with each other and no relay
state is read from the wrong thread.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from kvsp_moq.auth import Action, Authenticator
from kvsp_moq.web import BackgroundServer, build_app, principal

from .relay import Relay

__all__ = ["PREFIX", "create_metrics_app", "render", "snapshot_on_loop", "start_metrics_server"]

PREFIX = "kvsp_relay"

# Relay counters under the names an operator looks for; the rest keep their own names.
_RENAMED = {
    "objects_out": "objects_forwarded",
    "bytes_out": "bytes_forwarded",
    "objects_in": "objects_received",
    "bytes_in": "bytes_received",
}
# Figures that go up and down; every other figure only grows (a counter).
_GAUGES = {
    "cache_bytes": "octets the object cache holds",
    "cache_budget_bytes": "the object cache's budget (--cache-bytes)",
    "cache_objects": "objects the cache holds",
    "cache_tracks": "tracks the cache holds objects of",
    "sessions": "MOQT sessions open (clients and the upstream relay)",
    "feeds": "tracks with an upstream subscription",
    "routes": "announced namespaces",
    "subscribers": "downstream subscriptions being fed",
    "subscriber_queue_peak_bytes": "the most octets ever queued for one subscriber",
}


def render(snapshot: dict[str, int], prefix: str = PREFIX) -> str:
    """Prometheus text exposition of a relay snapshot: counters get a `_total` suffix."""
    lines: list[str] = []
    for key in sorted(snapshot):
        value = snapshot[key]
        if key in _GAUGES:
            name = f"{prefix}_{key}"
            lines.append(f"# HELP {name} {_GAUGES[key]}")
            lines.append(f"# TYPE {name} gauge")
        else:
            name = f"{prefix}_{_RENAMED.get(key, key)}_total"
            lines.append(f"# TYPE {name} counter")
        lines.append(f"{name} {int(value)}")
    return "\n".join(lines) + "\n"


def snapshot_on_loop(
    relay: Relay, loop: asyncio.AbstractEventLoop, timeout: float = 5.0
) -> Callable[[], dict[str, int]]:
    """A function, callable from any other thread, that takes `relay.snapshot()` on `loop`."""

    async def take() -> dict[str, int]:
        return relay.snapshot()

    def snapshot() -> dict[str, int]:
        return asyncio.run_coroutine_threadsafe(take(), loop).result(timeout)

    return snapshot


def create_metrics_app(snapshot: Callable[[], dict[str, int]],
                       auth: Authenticator | None = None) -> Starlette:
    """/metrics (the relay's figures, then the HTTP server's own) and /healthz; /metrics needs
    a "metrics" principal of `auth` (the relay's principals), as at every other server."""

    async def metrics(request: Request) -> Response:
        principal(request, Action.SCRAPE)
        figures = await asyncio.to_thread(snapshot)  # waits on the relay's loop, not this one
        text = render(figures) + request.app.state.metrics.render()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    # Listed first, this /metrics answers before the generic one build_app adds.
    return build_app([Route("/metrics", metrics)], name=PREFIX,
                     auth=auth if auth is not None else Authenticator.open())


async def start_metrics_server(relay: Relay, host: str = "127.0.0.1", port: int = 0) -> BackgroundServer:
    """Serve the relay's metrics on a background thread; `.url` is the server's base URL."""
    loop = asyncio.get_running_loop()
    server = BackgroundServer(create_metrics_app(snapshot_on_loop(relay, loop), relay.settings.authenticator),
                              host, port)
    await loop.run_in_executor(None, server.start)
    return server
