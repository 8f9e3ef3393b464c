"""What a draft's wire makes different for the machinery every draft shares: how it
encodes and decodes datagrams, which writers its subgroup and fetch streams take, where
its request records keep a subscription's track, and the forms of the answers the shared
session gives (SUBSCRIBE_OK, FETCH_OK, PUBLISH_DONE, a request's refusal). A draft's
session hands one `Dialect` object to `core.SessionCore` instead of overriding a hook
for each; what it decodes is in draft-18 form whatever the wire, and what it encodes is
given in draft-18 form. Which stream carries an answer is the draft's `messages.Messages`'
business."""

from __future__ import annotations

from typing import Protocol, TypeVar

from ..d18.data import ObjectDatagram, SubgroupHeader
from ..d18.messages import FetchOk, Redirect, SubscribeOk
from ..wire import TrackNamespace
from .records import FetchObjectWriter, RequestState, SubgroupObjectWriter

__all__ = ["Dialect"]

_RequestC = TypeVar("_RequestC", bound=RequestState, contravariant=True)


class Dialect(Protocol[_RequestC]):
    """The wire forms of one draft's data streams, datagrams and answers, for the
    session's request records (`_RequestC`)."""

    @property
    def fetch_writer_type(self) -> type[FetchObjectWriter]:
        """The class of the writers `fetch_writer` returns, by which a fetch stream is
        told from a subgroup stream."""
        ...

    def decode_datagram(self, data: bytes) -> ObjectDatagram | None:
        """A received datagram in its draft-18 form; None when it carries no object."""
        ...

    def encode_datagram(self, request: _RequestC, datagram: ObjectDatagram) -> bytes:
        """The bytes of an object datagram of a subscription this endpoint publishes."""
        ...

    def subgroup_writer(self, request: _RequestC, header: SubgroupHeader) -> SubgroupObjectWriter:
        """The writer of a new subgroup stream of a subscription this endpoint publishes."""
        ...

    def fetch_writer(self, request: _RequestC) -> FetchObjectWriter:
        """The writer of the fetch stream answering `request`."""
        ...

    def track_of(self, request: _RequestC) -> tuple[TrackNamespace, bytes]:
        """Namespace and track name of a peer SUBSCRIBE, as its record keeps them."""
        ...

    def answer(self, request: _RequestC, message: SubscribeOk | FetchOk) -> bytes | None:
        """The bytes of SUBSCRIBE_OK / FETCH_OK accepting a peer request; None where the
        draft sends none (a draft-20 fill)."""
        ...

    def publish_done(self, request: _RequestC, status_code: int, reason: str) -> bytes:
        """The bytes of PUBLISH_DONE ending a subscription this endpoint publishes (its
        Stream Count is the request's data streams opened)."""
        ...

    def request_error(
        self, request: _RequestC, error_code: int, reason: str, retry_interval: int = 0,
        redirect: Redirect | None = None,
    ) -> bytes:
        """The bytes of the error refusing a peer request (a draft-18 REQUEST_ERROR code)."""
        ...
