"""What every "verified layers in ascending order" stream shares, whatever its transport.

The HTTP and the MOQT fetcher differ only in how one source is asked for layers; the requested
range, the account of which source served which layers and why others were skipped, the one
exception that ends a source (`SourceFailed`), and the error raised once every source has
failed are the same, so that callers and the cross-transport fallback (`fetch.fallback`) read
either stream the same way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import AsyncGenerator, Sequence

from kvsp_moq.errors import DigestMismatch, KvspError, LayersUnavailable, NotFound, TransportError
from kvsp_moq.protocol.container import Container, Layer, replica_digest
from kvsp_moq.protocol.records import ReplicaRecord


class FailureKind(str, Enum):
    """Why one source failed; the kinds together decide the error once no source is left."""

    #: the source does not hold the layers (HTTP 404/410, DOES_NOT_EXIST, a track that ends early)
    MISS = "miss"
    #: the source served octets that do not match the record's digests
    DIGEST = "digest"
    #: the source answered but refused (another status, a request error, not its scheme)
    REFUSED = "refused"
    #: the answer could not be read as the requested layers
    MALFORMED = "malformed"
    #: the connection failed or timed out
    TRANSPORT = "transport"


class SourceFailed(Exception):
    """One source cannot deliver the rest of the layers; the stream moves on to the next.

    `kind` decides the error raised once no source is left: any DIGEST failure makes it a
    DigestMismatch (someone served wrong octets), only MISS failures a NotFound (nobody
    holds the layers), anything else a TransportError.
    """

    def __init__(self, kind: FailureKind, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


def record_layer_digests(record: ReplicaRecord) -> list[bytes] | None:
    """The record's layer digests, refused when they do not give its replica digest."""
    if record.layer_digests is None:
        return None
    digests = record.layer_digest_bytes()
    if replica_digest(digests).hex() != record.digest[8:]:
        raise DigestMismatch("the record's layer digests do not give its replica digest")
    return digests


def requested_range(record: ReplicaRecord, layers: tuple[int, int] | None) -> tuple[int, int] | None:
    """Layers a..b checked against the record (default all; None when the record does not
    say how many layers there are)."""
    n = record.layer_count
    if layers is None:
        return (0, n - 1) if n is not None else None
    a, b = layers
    if a > b or a < 0 or (n is not None and b >= n):
        raise LayersUnavailable(f"layers {a}-{b} are not in this replica "
                                f"({n if n is not None else '?'} layers)")
    return a, b


@dataclass
class FetchedBlock:
    """A verified container of the requested layers, and how it was obtained."""

    container: Container
    layers: tuple[int, int]
    #: (source, first, last) for each source that delivered layers
    served_by: list[tuple[str, int, int]]
    failures: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    bytes_received: int = 0
    seconds: float = 0.0
    first_layer_seconds: float | None = None

    @property
    def source(self) -> str:
        return self.served_by[-1][0]

    @classmethod
    def of(cls, stream: "VerifiedLayerStream", container: Container) -> "FetchedBlock":
        """The result of a stream that has delivered every layer of `container`."""
        return cls(container, (container.first_layer, container.last_layer), stream.served_by,
                   stream.failures, stream.notes, stream.bytes_received,
                   time.perf_counter() - stream.started, stream.first_layer_seconds)


class VerifiedLayerStream:
    """An async iterator (and context manager) over the layers `_run()` yields, with the
    account of the sources it tried."""

    def __init__(self, sources: Sequence[str], record: ReplicaRecord,
                 layers: tuple[int, int] | None) -> None:
        self.sources = list(sources)
        self.record = record
        #: (source, reason) for each source given up, in the order tried
        self.failures: list[tuple[str, str]] = []
        #: what a caller may want to know that was not a failure (e.g. no Repr-Digest sent)
        self.notes: list[str] = []
        #: (source, first, last) for each source that delivered layers
        self.served_by: list[tuple[str, int, int]] = []
        self.bytes_received = 0
        self.started = time.perf_counter()
        self.first_layer_seconds: float | None = None
        self.token_count: int | None = None
        self.range = requested_range(record, layers)
        self._kinds: list[FailureKind] = []

    def _start(self) -> None:
        self._gen = self._run()

    async def _run(self) -> AsyncGenerator[Layer, None]:  # pragma: no cover - overridden
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

    def _fail(self, source: str, kind: FailureKind, reason: str) -> None:
        self.failures.append((source, reason))
        self._kinds.append(kind)

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def _exhausted(self) -> KvspError:
        """The error once every source has failed; it carries `failures`."""
        summary = "; ".join(f"{s}: {r}" for s, r in self.failures) or "no sources"
        err: KvspError
        if FailureKind.DIGEST in self._kinds:
            err = DigestMismatch(f"no source delivered verified layers ({summary})")
        elif not self._kinds or all(k is FailureKind.MISS for k in self._kinds):
            err = NotFound(f"no source holds the layers ({summary})")
        else:
            err = TransportError(f"no source delivered the layers ({summary})")
        err.failures = list(self.failures)  # type: ignore[union-attr]  # an attribute of this error only
        return err
