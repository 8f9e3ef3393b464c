"""Client of the Index Service (KVSP §6.1, §6.2; resources of DESIGN §3).

A holder publishes and refreshes its records, and an agent looks up every prompt, many times a
second: each call is a small JSON request. Through httpx one cost ~1 ms of the caller's event
loop more than the lean HTTP/1.1 client of block GETs (`kvsp_moq.fetch.http1`), which a plain
http:// index is called with unless the caller hands over its own httpx client; https goes
through httpx.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Sequence
from urllib.parse import urlsplit

import httpx

from kvsp_moq.errors import KvspError, TransportError, reason_of
from kvsp_moq.fetch.http1 import Http1Pool
from kvsp_moq.protocol.problems import Problem
from kvsp_moq.protocol.records import LookupRequest, ReplicaRecord, Residency, replica_id
from kvsp_moq.protocol.urls import base_url

#: The most records one POST replicas:batch may carry.
BATCH_LIMIT = 1000
#: The longest answer read from the index (a lookup of a long prompt's blocks is a few MiB).
MAX_ANSWER = 64 << 20


#: A replica set as placement costs it: per replica (holder, http_holder, size, layer count,
#: residency), the block key and digests aside.
ReplicaShape = tuple[tuple[str, str | None, int, int | None, tuple[Residency, ...]], ...]

_SHAPES: dict[ReplicaShape, ReplicaShape] = {}
_SHAPES_LIMIT = 1 << 16
_shape_tables = [1]  # how many intern tables there have been


def replica_shape(replicas: Sequence[ReplicaRecord]) -> ReplicaShape:
    """The shape of a replica set, interned: equal shapes are one object while the table holds
    them (it is emptied when full, see `shapes_interned_once`), so blocks can be grouped by
    identity."""
    shape = tuple([(r.holder, r.http_holder, r.size, r.layer_count, r.residency)
                   for r in replicas])
    if len(_SHAPES) >= _SHAPES_LIMIT:
        _SHAPES.clear()
        _shape_tables[0] += 1
    return _SHAPES.setdefault(shape, shape)


def shapes_interned_once() -> bool:
    """True while the intern table was never emptied: two shape objects are then equal only
    when they are the same object. Afterwards equal shapes may be distinct objects."""
    return _shape_tables[0] == 1


@dataclass(frozen=True, slots=True)
class LookupBlock:
    block_key: str
    replicas: tuple[ReplicaRecord, ...]
    shape_id: int = field(default=0, init=False, repr=False, compare=False)
    """id() of `shape` once computed, else 0 (the block holds the shape: no other live shape
    has this id). Kept in a slot, so that grouping a prompt's blocks reads one word each."""
    _shape: ReplicaShape | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def shape(self) -> ReplicaShape:
        """`replica_shape` of the replicas, computed once per block: an index that hands out
        the same block objects again (the PC's in-process lookups) spares routing a walk over
        every replica of every block."""
        shape = self._shape
        if shape is None:
            shape = replica_shape(self.replicas)
            object.__setattr__(self, "_shape", shape)
            object.__setattr__(self, "shape_id", id(shape))
        return shape


@dataclass(frozen=True)
class LookupResult:
    matched: int
    blocks: tuple[LookupBlock, ...]
    targets: tuple[dict[str, Any], ...] = ()

    @classmethod
    def from_json(cls, data: Any) -> "LookupResult":
        blocks = tuple(
            LookupBlock(b["block_key"], tuple(ReplicaRecord.from_json(r) for r in b["replicas"]))
            for b in data.get("blocks", [])
        )
        return cls(int(data["matched"]), blocks, tuple(data.get("targets", [])))


def replica_path(record: ReplicaRecord) -> str:
    rid = replica_id(record.holder, record.moqt_namespace)
    return f"replicas/{record.compat_id}/{record.scope_id}/{record.block_key}/{rid}"


def raise_for_answer(status: int, content_type: str, body: bytes) -> None:
    """Turn an error answer (>= 400) into the project's exception for its problem type."""
    if status < 400:
        return
    doc = None
    if "json" in content_type:
        try:
            doc = json.loads(body)
        except ValueError:
            pass
    if not isinstance(doc, dict):
        # Not a problem document (a plain web server, a proxy): its status line says enough.
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = ""
        doc = {"detail": f"HTTP {status} {phrase}".rstrip()}
    raise Problem.from_json(doc, status=status).to_error()


def raise_for_problem(response: httpx.Response) -> None:
    """`raise_for_answer` of an httpx response (read)."""
    if response.status_code >= 400:
        raise_for_answer(response.status_code, response.headers.get("content-type", ""),
                         response.content)


class IndexClient:
    """Async client of one Index Service base URL."""

    def __init__(self, base: str, *, token: str | None = None,
                 client: httpx.AsyncClient | None = None, timeout: float = 10.0,
                 lean: bool | None = None) -> None:
        """`lean`: plain http:// calls through the lean client (default: unless `client`)."""
        self.base = base_url(base)
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout = timeout
        self._own = client is None
        self.client = client
        if lean is None:
            lean = client is None
        self._pool = (Http1Pool(timeout=timeout, connect_timeout=min(timeout, 5.0), max_connections=32)
                      if lean and urlsplit(self.base).scheme == "http" else None)
        if self._pool is not None and token and not token.isprintable():
            raise ValueError("the index token must be printable (no line breaks)")

    async def aclose(self) -> None:
        if self._pool is not None:
            await self._pool.aclose()
        if self._own and self.client is not None:
            await self.client.aclose()
            self.client = None

    async def __aenter__(self) -> "IndexClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _request(self, method: str, path: str, body: Any = None, *,
                       payload: bytes | None = None) -> bytes:
        """The answer's body (`body` sent as JSON, or `payload` as it is); the project's error
        for a problem or an unreachable index."""
        if body is not None:
            payload = json.dumps(body, separators=(",", ":")).encode()
        headers = self.headers if payload is None else {**self.headers, "Content-Type": "application/json"}
        if self._pool is not None:
            try:
                answer = await self._pool.call(method, self.base + path, headers, payload,
                                               max_answer=MAX_ANSWER)
            except TransportError as e:
                raise TransportError(f"index {self.base} unreachable: {e.detail}") from None
            raise_for_answer(answer.status, answer.content_type, answer.body)
            return answer.body
        if self.client is None:
            self.client = httpx.AsyncClient(timeout=self.timeout, trust_env=False)
        try:
            r = await self.client.request(method, self.base + path, content=payload, headers=headers)
        except httpx.HTTPError as e:
            raise TransportError(f"index {self.base} unreachable: {reason_of(e, named=True)}") from None
        raise_for_problem(r)
        return r.content

    async def put(self, record: ReplicaRecord) -> None:
        await self._request("PUT", replica_path(record), record.to_json())

    async def delete(self, record: ReplicaRecord) -> None:
        try:
            await self._request("DELETE", replica_path(record))
        except KvspError as e:
            if e.status != 404:
                raise

    async def put_many(self, records: Sequence[ReplicaRecord]) -> None:
        """Publish or refresh records with POST replicas:batch, BATCH_LIMIT at a time."""
        for i in range(0, len(records), BATCH_LIMIT):
            chunk = records[i:i + BATCH_LIMIT]
            payload = b'{"records":[' + b",".join(r.encoded for r in chunk) + b"]}"
            await self._request("POST", "replicas:batch", payload=payload)

    async def lookup(self, scope_id: str, compat_id: str, block_keys: Sequence[str],
                     targets: Sequence[str] | None = None) -> LookupResult:
        req = LookupRequest(scope_id, compat_id, tuple(block_keys),
                            tuple(targets) if targets is not None else None)
        body = await self._request("POST", "lookup", req.to_json())
        try:
            data = json.loads(body)
        except ValueError:
            raise TransportError(f"index {self.base}: a lookup answer that is not JSON") from None
        return LookupResult.from_json(data)
