"""Client of the Index Service (KVSP §6.1, §6.2; resources of DESIGN §3)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import httpx

from kvsp_moq.errors import KvspError, TransportError, reason_of
from kvsp_moq.protocol.problems import Problem
from kvsp_moq.protocol.records import LookupRequest, ReplicaRecord, replica_id
from kvsp_moq.protocol.urls import base_url

#: The most records one POST replicas:batch may carry.
BATCH_LIMIT = 1000


@dataclass(frozen=True)
class LookupBlock:
    block_key: str
    replicas: tuple[ReplicaRecord, ...]


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


def raise_for_problem(response: httpx.Response) -> None:
    """Turn an error response into the project's exception for its problem type."""
    if response.status_code < 400:
        return
    doc = None
    if "json" in response.headers.get("content-type", ""):
        try:
            doc = response.json()
        except ValueError:
            pass
    if not isinstance(doc, dict):
        # Not a problem document (a plain web server, a proxy): its status line says enough.
        doc = {"detail": f"HTTP {response.status_code} {response.reason_phrase}".rstrip()}
    raise Problem.from_json(doc, status=response.status_code).to_error()


class IndexClient:
    """Async client of one Index Service base URL."""

    def __init__(self, base: str, *, token: str | None = None,
                 client: httpx.AsyncClient | None = None, timeout: float = 10.0) -> None:
        self.base = base_url(base)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._own = client is None
        self.client = client or httpx.AsyncClient(timeout=timeout)
        self.headers = headers

    async def aclose(self) -> None:
        if self._own:
            await self.client.aclose()

    async def __aenter__(self) -> "IndexClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _request(self, method: str, path: str, json: Any = None) -> httpx.Response:
        try:
            r = await self.client.request(method, self.base + path, json=json, headers=self.headers)
        except httpx.HTTPError as e:
            raise TransportError(f"index {self.base} unreachable: {reason_of(e, named=True)}") from None
        raise_for_problem(r)
        return r

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
            await self._request("POST", "replicas:batch", {"records": [r.to_json() for r in chunk]})

    async def lookup(self, scope_id: str, compat_id: str, block_keys: Sequence[str],
                     targets: Sequence[str] | None = None) -> LookupResult:
        req = LookupRequest(scope_id, compat_id, tuple(block_keys),
                            tuple(targets) if targets is not None else None)
        r = await self._request("POST", "lookup", req.to_json())
        return LookupResult.from_json(r.json())
