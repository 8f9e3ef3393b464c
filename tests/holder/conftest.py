"""Shared pieces of the holder tests: blocks, a recording Index Service, a fake clock."""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvsp_moq.holder.service import Holder, HolderSettings
from kvsp_moq.holder.store import BlockId
from kvsp_moq.protocol.container import encode
from kvsp_moq.protocol.records import ReplicaRecord, replica_id
from kvsp_moq.web import BackgroundServer

COMPAT = "ab" * 32
SCOPE = "cd" * 16
OTHER_SCOPE = "ef" * 16


def block_key(n: int) -> str:
    return hashlib.sha256(f"block {n}".encode()).hexdigest()


@dataclass
class Block:
    bid: BlockId
    data: bytes
    layer_digests: list[str]

    @property
    def path(self) -> str:
        return "blocks/" + self.bid.path


def make_block(n: int, *, layers: int = 4, section: int = 1024, scope: str = SCOPE,
               tokens: int = 16) -> Block:
    rng = np.random.default_rng(n)
    raw = rng.integers(0, 256, size=2 * layers * section, dtype=np.uint8).tobytes()
    mv = memoryview(raw)
    parts = [(mv[(2 * i) * section:(2 * i + 1) * section],
              mv[(2 * i + 1) * section:(2 * i + 2) * section]) for i in range(layers)]
    digests = [hashlib.sha256(bytes(k) + bytes(v)).hexdigest() for k, v in parts]
    return Block(BlockId(COMPAT, scope, block_key(n)), encode(0, tokens, parts), digests)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class FakeIndex:
    """An Index Service that records what holders send it."""

    records: dict[str, dict] = field(default_factory=dict)
    events: list[tuple[str, str]] = field(default_factory=list)  # (method, block_key)
    batches: list[int] = field(default_factory=list)
    failing: bool = False
    on_delete: Callable[[str], None] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def app(self) -> Starlette:
        async def replica(request: Request) -> Response:
            if self.failing:
                return JSONResponse({"type": "about:blank", "status": 503}, 503)
            p = request.path_params
            path = f"{p['compat']}/{p['scope']}/{p['key']}/{p['rid']}"
            if request.method == "PUT":
                record = ReplicaRecord.from_json(await request.json())
                assert replica_id(record.holder, record.moqt_namespace) == p["rid"]
                with self.lock:
                    self.records[path] = record.to_json()
                    self.events.append(("PUT", p["key"]))
                return Response(status_code=204)
            if self.on_delete is not None:
                self.on_delete(p["key"])
            with self.lock:
                self.events.append(("DELETE", p["key"]))
                found = self.records.pop(path, None)
            return Response(status_code=204 if found else 404)

        async def batch(request: Request) -> Response:
            if self.failing:
                return JSONResponse({"type": "about:blank", "status": 503}, 503)
            records = [ReplicaRecord.from_json(r) for r in (await request.json())["records"]]
            with self.lock:
                for r in records:
                    path = f"{r.compat_id}/{r.scope_id}/{r.block_key}/{replica_id(r.holder)}"
                    self.records[path] = r.to_json()
                    self.events.append(("BATCH", r.block_key))
                self.batches.append(len(records))
            return JSONResponse({"stored": len(records)})

        return Starlette(routes=[
            Route("/replicas/{compat}/{scope}/{key}/{rid}", replica, methods=["PUT", "DELETE"]),
            Route("/replicas:batch", batch, methods=["POST"]),
        ])

    def keys(self) -> set[str]:
        with self.lock:
            return {r["block_key"] for r in self.records.values()}

    def record(self, key: str) -> dict | None:
        with self.lock:
            for r in self.records.values():
                if r["block_key"] == key:
                    return r
        return None

    def deleted(self) -> list[str]:
        with self.lock:
            return [k for m, k in self.events if m == "DELETE"]


@pytest.fixture
def fake_index() -> Iterator[tuple[FakeIndex, str]]:
    index = FakeIndex()
    with BackgroundServer(index.app()) as server:
        yield index, server.url


@pytest.fixture
def start_holder() -> Iterator[Callable[..., Holder]]:
    """Start holders on free ports; all are stopped at the end of the test."""
    started: list[Holder] = []

    def start(clock: Callable[[], float] | None = None, **settings: Any) -> Holder:
        settings.setdefault("listen", "127.0.0.1:0")
        holder = Holder(HolderSettings(**settings), clock=clock).start()
        started.append(holder)
        return holder

    yield start
    for holder in started:
        holder.stop()
