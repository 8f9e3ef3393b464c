"""An `agent.engine.Engine` on the tiny model with nothing around it: its own block store, no
Index Service, and a Placement Controller answered in process (httpx's mock transport), so that
the engine's tests run in milliseconds per request and see every request the engine makes."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import httpx

from agent.engine import Engine
from agent.model import ModelAdapter
from agent.options import EngineOptions
from agent.sessions import Session
from kvsp_moq.fetch.leases import LeaseClient
from kvsp_moq.fetch.sources import LocalLayerSource
from kvsp_moq.holder.index_publisher import IndexPublisher
from kvsp_moq.holder.store import BlockStore, StoredBlock

B = 16
SELF = "http://agent.test/"
PC = "http://pc.test/"
SCOPE_KEY = bytes(range(40, 72))
STEP = 30.0  # seconds a session may take on the tiny model, at most


@dataclass
class FakePC:
    """The PC's session endpoints: takes checkpoints (or refuses them as stale), records the
    deletes; and the `replicate_to` holders, which take every block."""

    stale: bool = False
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    replicated: list[str] = field(default_factory=list)

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "PUT" and path.endswith("/checkpoint"):
            if self.stale:
                return httpx.Response(409, headers={"content-type": "application/problem+json"},
                                      json={"type": "urn:kvsp:problem:kvsp-stale-epoch", "status": 409,
                                            "title": "Stale epoch", "detail": "moved on"})
            self.checkpoints.append(json.loads(request.content))
            return httpx.Response(200, json={})
        if request.method == "DELETE" and path.startswith("/sessions/"):
            self.deleted.append(path)
            return httpx.Response(204)
        if request.method == "PUT" and path.startswith("/blocks/"):
            self.replicated.append(f"{request.url.host}{path}")
            return httpx.Response(201)
        return httpx.Response(404)


@dataclass
class Running:
    engine: Engine
    store: BlockStore
    announced: list[StoredBlock]


@asynccontextmanager
async def running_engine(adapter: ModelAdapter, *, store: BlockStore | None = None,
                         pc: FakePC | None = None, **options: Any) -> AsyncIterator[Running]:
    """An engine serving as SELF with the scope "tenant"; with `pc`, its sessions that name
    themselves are tracked there."""
    store = store if store is not None else BlockStore(host_bytes=64 << 20)
    publisher = IndexPublisher(store, None, holder_url=SELF)
    announced: list[StoredBlock] = []
    transport = httpx.MockTransport(pc.handle if pc is not None else FakePC().handle)
    async with httpx.AsyncClient(transport=transport) as client:
        engine = Engine(adapter, store=store, announce=announced.append, is_published=lambda bid: True,
                        record_for=publisher.record_for, client=client, index=None,
                        leases=LeaseClient(client), sources=[], local=LocalLayerSource(store, lambda: SELF),
                        scope_keys={"tenant": SCOPE_KEY}, default_scope="tenant", self_url=lambda: SELF,
                        pc_url=PC if pc is not None else None,
                        options=EngineOptions(block_tokens=B, **options))
        try:
            yield Running(engine, store, announced)
        finally:
            await engine.close()


async def finished(session: Session) -> Session:
    """The session, once it ended (bounded)."""
    await asyncio.wait_for(session.done.wait(), STEP)
    return session
