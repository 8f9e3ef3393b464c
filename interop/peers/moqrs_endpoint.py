"""How a moq-rs peer (moqrs_pub.py, moqrs_sub.py) reaches the other side: as a client of a
relay at a moqt:// URL, or (--serve) as a moq-rs server (moq.Server) on a local address that
the other side connects to. Runs with the moq-rs virtual environment (interop/.venv-moqrs).

Either way the peer gets an object with create_broadcast(path) (to publish) and
announced_broadcast(path) / request_broadcast(path) (to consume). A server prints
"LISTEN moqt://HOST:PORT" once it is bound, before anything else.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import AsyncIterator

import moq


class _Served:
    """A moq-rs server's side of the sessions it accepts: one origin, published to and
    consumed from (what a connecting client announces lands in it, what is created in it is
    offered to the client)."""

    def __init__(self, origin: moq.OriginProducer) -> None:
        self._origin = origin
        self._consumer = origin.consume()

    def create_broadcast(self, path: str):
        return self._origin.create_broadcast(path)

    def announced_broadcast(self, path: str):
        return self._consumer.announced_broadcast(path)

    async def request_broadcast(self, path: str):
        return await self._consumer.request_broadcast(path)


@asynccontextmanager
async def endpoint(url: str, serve: bool) -> AsyncIterator[object]:
    if not serve:
        async with moq.Client(url, tls_verify=False, websocket_enabled=False, reconnect=False) as client:
            yield client
        return
    origin = moq.OriginProducer()
    async with moq.Server(url, tls_generate=["localhost"], publish=origin, subscribe=origin) as server:
        print(f"LISTEN moqt://{server.local_addr}", flush=True)
        serving = asyncio.ensure_future(server.serve())
        try:
            yield _Served(origin)
        finally:
            serving.cancel()
