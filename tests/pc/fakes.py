"""Fake inference instances and PC servers on 127.0.0.1 for the PC tests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvsp_moq.protocol.instances import instance_id
from kvsp_moq.protocol.records import ReplicaRecord
from kvsp_moq.web import BackgroundServer
from pc.app import PCSettings, create_pc_app
from pc.lifecycle import LifecycleSettings
from pc.placement import MemoryIndex, PlacementSettings, ScopeKeys

COMPAT = "c0" * 32
SCOPE_KEY = bytes(range(32))
LOG_LOCK = threading.Lock()


@dataclass
class FakeAgent:
    """An instance that records what the PC sends it; behaviour set per test."""

    name: str
    log: list = field(default_factory=list)
    """Shared across agents of a test: (time, agent, kind, body) in arrival order."""
    reshard_delay_s: float = 0.0
    reshard_status: int = 200
    resume_status: int = 200
    stream: Callable[[Request, int], Any] | None = None
    url: str = ""

    def received(self, kind: str) -> list[Any]:
        with LOG_LOCK:
            return [body for _, who, k, body in self.log if who == self.name and k == kind]

    def _record(self, kind: str, body: Any) -> None:
        with LOG_LOCK:
            self.log.append((time.monotonic(), self.name, kind, body))

    def app(self) -> Starlette:
        async def prefetch(request: Request) -> Response:
            body = await request.json()
            self._record("prefetch", body)
            return JSONResponse({"state": "pending"}, status_code=202,
                                headers={"Location": f"{self.url}prefetch/{body['directive']}"})

        async def resume(request: Request) -> Response:
            body = await request.json()
            self._record("resume", {"session": request.path_params["session"], **body})
            return Response(status_code=self.resume_status)

        async def state(request: Request) -> Response:
            self._record("state", await request.json())
            return JSONResponse({"state": "ok"})

        async def reshard(request: Request) -> Response:
            body = await request.json()
            if "commit" in body or "abort" in body:
                self._record("decision", body)
                return JSONResponse({})
            self._record("plan", body)
            if self.reshard_delay_s:
                await asyncio.sleep(self.reshard_delay_s)
            self._record("ack", body)
            return Response(status_code=self.reshard_status)

        async def stream(request: Request) -> Response:
            start = int(request.query_params.get("from", "0"))
            self._record("stream", start)
            assert self.stream is not None
            return StreamingResponse(self.stream(request, start),
                                     media_type="application/x-ndjson")

        return Starlette(routes=[
            Route("/prefetch", prefetch, methods=["POST"]),
            Route("/sessions/{session}/resume", resume, methods=["POST"]),
            Route("/sessions/{session}/stream", stream, methods=["GET"]),
            Route("/state", state, methods=["PUT"]),
            Route("/reshard", reshard, methods=["POST"]),
        ])


@contextlib.contextmanager
def fake_agents(n: int, **kwargs: Any) -> Iterator[list[FakeAgent]]:
    shared: list = []
    agents = [FakeAgent(f"ii{i + 1}", shared, **kwargs) for i in range(n)]
    servers = []
    try:
        for a in agents:
            s = BackgroundServer(a.app()).start()
            a.url = s.url
            servers.append(s)
        yield agents
    finally:
        for s in servers:
            s.stop()


@dataclass
class PC:
    url: str
    server: BackgroundServer
    index: MemoryIndex
    pc: Any
    """The PlacementController (it runs on the server's thread)."""


@contextlib.contextmanager
def pc_server(db: str, *, index: MemoryIndex | None = None, start_hook=None,
              lifecycle: LifecycleSettings | None = None,
              placement: PlacementSettings | None = None, **kwargs: Any) -> Iterator[PC]:
    index = index or MemoryIndex()
    settings = PCSettings(database=db, lifecycle=lifecycle or LifecycleSettings(),
                          placement=placement or PlacementSettings(), sweep_interval_s=0.05,
                          **kwargs)
    app = create_pc_app(settings, lookup=index.lookup, start_hook=start_hook,
                        keys=ScopeKeys.from_mapping({"tenant": SCOPE_KEY.hex()}))
    with BackgroundServer(app) as server:
        yield PC(server.url, server, index, app.state.pc)


def status(url: str, *, epoch: int = 1, state: str = "active", ttl_ms: int = 60_000,
           **extra: Any) -> dict:
    body = {"instance": url, "epoch": epoch, "state": state, "running": 0, "queued": 0,
            "batch_size": 8, "kv_utilization": 0.1, "prefill_tokens_per_s": 10_000,
            "decode_tokens_per_s": 500, "links": [], "requested_state": None, "ttl_ms": ttl_ms}
    body.update(extra)
    return body


def status_path(url: str) -> str:
    return f"instances/{instance_id(url)}/status"


def replica(block_key: str, holder: str, *, scope_id: str, size: int = 1 << 20) -> ReplicaRecord:
    return ReplicaRecord(block_key=block_key, compat_id=COMPAT, scope_id=scope_id, holder=holder,
                         codec=1, size=size, digest="sha-256:" + "00" * 32, ttl_ms=600_000)


def checkpoint(session: str, *, epoch: int = 1, offset: int = 3, instance: str | None = None,
               scope_id: str = "11" * 16) -> dict:
    body = {"session": session, "epoch": epoch, "compat_id": COMPAT, "scope_id": scope_id,
            "prompt_blocks": ["aa" * 32], "prompt_tail": [1, 2],
            "generated": list(range(100, 100 + offset)), "output_offset": offset,
            "sampler": {"method": "greedy", "params": {}, "seed": 0, "step": offset,
                        "deterministic": True}}
    if instance is not None:
        body["instance"] = instance
    return body


def new_session() -> str:
    return str(uuid.uuid4())


def ndjson(index: int, epoch: int, token: int) -> bytes:
    return (json.dumps({"index": index, "epoch": epoch, "token": token}) + "\n").encode()
