"""What every "verified layers in ascending order" stream shares, whatever its transport."""

from __future__ import annotations

from typing import AsyncIterator

from kvsp_moq.errors import DigestMismatch
from kvsp_moq.protocol.container import Layer, replica_digest
from kvsp_moq.protocol.records import ReplicaRecord


def record_layer_digests(record: ReplicaRecord) -> list[bytes] | None:
    """The record's layer digests, refused when they do not give its replica digest."""
    if record.layer_digests is None:
        return None
    digests = record.layer_digest_bytes()
    if replica_digest(digests).hex() != record.digest[8:]:
        raise DigestMismatch("the record's layer digests do not give its replica digest")
    return digests


class VerifiedLayerStream:
    """An async iterator (and context manager) over the layers `_run()` yields."""

    def _start(self) -> None:
        self._gen = self._run()

    async def _run(self) -> AsyncIterator[Layer]:  # pragma: no cover - overridden
        raise NotImplementedError
        yield

    def __aiter__(self) -> "VerifiedLayerStream":
        return self

    async def __anext__(self) -> Layer:
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        await self._gen.aclose()

    async def __aenter__(self) -> "VerifiedLayerStream":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
