"""A draft-14 MOQT session over one QUIC connection, without I/O.

`MoqtSession14` has the constructor shape, the `handle_event()` contract and the
public methods of the draft-18 `MoqtSession`, and returns the same `events.py`
events, so the layer above needs no second code path for the fallback version.
Both derive from `session.base.SessionBase`, which keeps what the drafts share (token
cache, track aliases, joining FETCHes, data streams and datagrams, writing
objects); data stream items and answers are converted to and from their
draft-18 forms at the edges (`adapters`, `dialect`). `MoqtSession14` owns its parts
as objects: Request ID credit (`credit.RequestCredit`), its requests' sending and
teardown (`requests.Requests14`), namespaces (`namespaces.NamespaceMapping`), what it
sends (`sending.MessageSender14`, the session's `Messages`) and the control messages
received (`control.ControlReceiver14`); this module builds them, routes the session's
streams and hands the hooks of `SessionBase` to the parts. The wire is draft-14's
(codec in `messages` and `data`):

* the client opens one bidirectional control stream and sends CLIENT_SETUP with
  the versions it offers; the server answers SERVER_SETUP with the one it chose,
  or closes with VERSION_NEGOTIATION_FAILED when it supports none of them. Every
  control message of the session travels on that stream; another bidirectional
  stream from the peer is a PROTOCOL_VIOLATION;
* requests carry Request IDs (client even, server odd), each exactly the next
  one expected (else INVALID_REQUEST_ID) and below the Maximum Request ID this
  endpoint granted (else TOO_MANY_REQUESTS). The grant starts in SETUP at
  `max_requests` concurrent requests and is raised with MAX_REQUEST_ID as peer
  requests end. A request of ours beyond the peer's grant is queued (its ID is
  returned at once) and sent when MAX_REQUEST_ID arrives; REQUESTS_BLOCKED is sent
  once per grant;
* answers are *_OK / *_ERROR messages: each *_ERROR becomes a RequestRejected with
  its code renumbered to the draft-18 REQUEST_ERROR code (see `messages`), and a
  draft-18 code this side rejects with is renumbered back (a code without a
  draft-14 counterpart is sent as INTERNAL_ERROR);
* cancellation is by message, not by stream reset: `cancel_request()` sends
  UNSUBSCRIBE, FETCH_CANCEL, PUBLISH_NAMESPACE_DONE or UNSUBSCRIBE_NAMESPACE for a
  request of ours, and SUBSCRIBE_ERROR / FETCH_ERROR (unanswered) or PUBLISH_DONE,
  a fetch stream reset, PUBLISH_NAMESPACE_CANCEL for a peer's. The receiver sees
  RequestCancelled, as with a draft-18 stream reset. Draft-14 has no way to end
  an answered peer SUBSCRIBE_NAMESPACE or TRACK_STATUS, nor an answered peer FETCH
  whose data stream was never opened: cancelling those only drops local state.

What has no draft-14 form, and what happens instead:

* NAMESPACE / NAMESPACE_DONE on a SUBSCRIBE_NAMESPACE: draft-14 announces the
  matching namespaces with PUBLISH_NAMESPACE / PUBLISH_NAMESPACE_DONE. So
  `namespace()` sends a PUBLISH_NAMESPACE (a request with its own Request ID) and
  `namespace_done()` its PUBLISH_NAMESPACE_DONE; on receipt, a PUBLISH_NAMESPACE
  inside the prefix of one of our SUBSCRIBE_NAMESPACEs is answered
  PUBLISH_NAMESPACE_OK here and reported as NamespaceReceived (the longest
  matching prefix wins); any other is a PublishNamespaceReceived for the
  application to answer. When the peer sends UNSUBSCRIBE_NAMESPACE (or this side
  cancels its SUBSCRIBE_NAMESPACE), the namespaces announced under it are
  withdrawn with PUBLISH_NAMESPACE_DONE, so neither side keeps their state.
* SUBSCRIBE_TRACKS: a draft-14 SUBSCRIBE_NAMESPACE also asks for a PUBLISH of
  every matching track (section "Subscribing to Namespaces"), which draft-18 asks
  with SUBSCRIBE_TRACKS. So a peer's SUBSCRIBE_NAMESPACE is reported twice:
  SubscribeNamespaceReceived with its Request ID, then SubscribeTracksReceived
  with that ID plus 2**62 (above every varint, so never on the wire). Answering
  or cancelling that second request sends nothing; it ends (RequestCancelled)
  with its SUBSCRIBE_NAMESPACE. The PUBLISHes made for it are ordinary requests.
  Sending SUBSCRIBE_TRACKS raises NotSupported.
* REQUEST_UPDATE: only a subscription (SUBSCRIBE of ours) can be updated, by
  SUBSCRIBE_UPDATE carrying FORWARD, SUBSCRIBER_PRIORITY, OBJECT_DELIVERY_TIMEOUT,
  tokens and the start / end group of an AbsoluteStart or AbsoluteRange
  SUBSCRIPTION_FILTER (other filters keep the start at the Largest Location of
  SUBSCRIBE_OK); any other parameter or request raises NotSupported.
  SUBSCRIBE_UPDATE has no answer, so the update is reported accepted at once
  (RequestAccepted via `take_events()`), and on the publisher side `request_ok()`
  / `request_error()` for it send nothing (a refused update of a subscription
  this side publishes ends it with PUBLISH_DONE, as in draft-18). The publisher
  sees the update as RequestUpdateReceived with an absolute SUBSCRIPTION_FILTER.
* Delivery timeouts: OBJECT_DELIVERY_TIMEOUT travels as DELIVERY_TIMEOUT in
  SUBSCRIBE / PUBLISH; SUBGROUP_DELIVERY_TIMEOUT, RENDEZVOUS_TIMEOUT and the
  delivery-timeout Track Properties have no draft-14 field and are not sent.
  MAX_CACHE_DURATION and DEFAULT_PUBLISHER_GROUP_ORDER map both ways;
  DEFAULT_PUBLISHER_PRIORITY is applied to the headers and datagrams this side
  sends; other Track Properties are dropped.
* GOAWAY carries only the URI: `timeout_ms` is not sent and arrives as 0, with no
  Request ID. Requests the peer makes after our GOAWAY are refused with
  GOING_AWAY, which has no draft-14 code and so goes out as INTERNAL_ERROR.
  Per-request GOAWAY, PUBLISH_BLOCKED and padding streams raise NotSupported.
  EXPIRES of REQUEST_OK has no place in draft-14 OK messages.
* FETCH end-of-range markers do not exist: `write_fetch_end_of_range()` writes
  nothing (it still honours `end_stream`). Fetch objects with a status other than
  Normal, and objects that "Do Not Exist", produce no event (draft14 conversions).
* Subgroup headers have no FIRST_OBJECT bit nor an inherited priority: a header
  opened with `publisher_priority=None` carries the track's default priority.
"""

from __future__ import annotations

from typing import Iterable

from .. import events as ev
from ..d18 import data as data18
from ..d18.messages import Setup
from ..engine import (
    QuicEngine,
    QuicEvent,
    StopSendingReceived,
    StreamDataReceived,
    StreamReset,
    stream_is_unidirectional,
)
from ..errors import NotSupported, ProtocolViolation, StreamResetCode
from ..session.base import SessionBase
from ..session.records import UNKNOWN_STREAM_COUNT, IncomingDataStream
from ..wire import DEFAULT_MAX_OBJECT_SIZE
from . import messages as d14
from .adapters import DataStreamParser14
from .control import ControlReceiver14
from .credit import RequestCredit
from .dialect import Dialect14
from .namespaces import NamespaceMapping
from .request_state import FETCH, Request14
from .requests import Requests14
from .sending import MessageSender14

__all__ = ["MoqtSession14", "ALPN", "DEFAULT_MAX_REQUESTS", "UNKNOWN_STREAM_COUNT"]

ALPN = d14.ALPN
DEFAULT_MAX_REQUESTS = 100


class MoqtSession14(SessionBase[Request14]):
    """The draft-14 MOQT state of one QUIC connection (ALPN "moq-00").

    `versions` are the SETUP versions offered (client, most preferred first) or
    accepted (server). `max_requests` bounds the peer's concurrent requests through
    MAX_REQUEST_ID. The client writes CLIENT_SETUP when the session is created.
    """

    def __init__(
        self,
        quic: QuicEngine,
        *,
        is_client: bool,
        draft: int = 14,
        setup: Setup | None = None,
        max_object_size: int = DEFAULT_MAX_OBJECT_SIZE,
        max_auth_token_cache_size: int = 0,
        max_buffered_before_setup: int = 4 * 1024 * 1024,
        max_unmatched_stream_bytes: int = 16 * 1024 * 1024,
        accept_path: Iterable[str] | None = None,
        accept_authority: Iterable[str] | None = None,
        versions: Iterable[int] = (d14.VERSION,),
        max_requests: int = DEFAULT_MAX_REQUESTS,
    ) -> None:
        if draft != 14:
            raise NotImplementedError(f"draft-{draft} is not this session's version")
        super().__init__(
            quic,
            is_client=is_client,
            draft=draft,
            setup=setup,
            dialect=Dialect14(),
            max_object_size=max_object_size,
            max_auth_token_cache_size=max_auth_token_cache_size,
            max_buffered_before_setup=max_buffered_before_setup,
            max_unmatched_stream_bytes=max_unmatched_stream_bytes,
            accept_path=accept_path,
            accept_authority=accept_authority,
        )
        self.versions: tuple[int, ...] = tuple(versions)  # offered (client) or accepted (server)
        if not self.versions:
            raise ValueError("no version to offer")
        self.version: int | None = None  # negotiated; None before SETUP
        self._control_stream_id: int | None = None  # the one control stream, bidirectional

        # Request IDs and their credit (section 9.1 / MAX_REQUEST_ID).
        self._credit = RequestCredit(self, quic, self._requests, is_client=is_client, max_requests=max_requests)
        self._requests14 = self._ends = Requests14(self)
        self._namespaces = NamespaceMapping(self, self._requests14)
        self._messages = MessageSender14(self, self._requests14, self._namespaces)
        self._control = ControlReceiver14(self, self._requests14, self._namespaces)
        if is_client:
            self._control_stream_id = quic.get_next_available_stream_id(is_unidirectional=False)
            hello = d14.ClientSetup(self.versions, self._control.setup_parameters())
            quic.send_stream_data(self._control_stream_id, hello.encode())

    #: a subscriber may join a subscription by FETCH
    joins_by_fetch = True

    def request_stream_id(self, request_id: int) -> int | None:
        """Draft-14 requests share the control stream."""
        return self._control_stream_id if request_id in self._requests else None

    # ------------------------------------------------------------------
    # QUIC events
    # ------------------------------------------------------------------

    def _is_control_event(self, event: QuicEvent) -> bool:
        """Before SETUP only the bidirectional control stream is read."""
        sid = getattr(event, "stream_id", None)
        return sid is not None and not stream_is_unidirectional(sid)

    def _on_stream_data(self, event: StreamDataReceived, out: list[ev.MoqtEvent]) -> None:
        sid = event.stream_id
        if not stream_is_unidirectional(sid):
            if self._control_stream_id is None and not self._is_client and not self._is_local_stream(sid):
                self._control_stream_id = sid
            if sid != self._control_stream_id:
                raise ProtocolViolation("bidirectional stream other than the control stream")
            self._on_control_data(event.data, out)
            if event.end_stream:
                raise ProtocolViolation("control stream closed")
            return
        if self._is_local_stream(sid):
            return
        stream = self._receiving.streams.get(sid)
        if stream is None:
            stream = IncomingDataStream(DataStreamParser14(self.max_object_size))
            self._receiving.streams[sid] = stream
        self._receiving.on_data(sid, stream, event.data, event.end_stream, out)

    def _on_stream_reset(self, event: StreamReset, out: list[ev.MoqtEvent]) -> None:
        sid = event.stream_id
        if sid == self._control_stream_id:
            raise ProtocolViolation("control stream reset")
        stream = self._receiving.streams.pop(sid, None)
        if stream is not None:
            self._receiving.on_reset(sid, stream, event.error_code, out)

    def _on_stop_sending(self, event: StopSendingReceived, out: list[ev.MoqtEvent]) -> None:
        if event.stream_id == self._control_stream_id:
            raise ProtocolViolation("STOP_SENDING on the control stream")
        self._sending.on_stop_sending(event.stream_id, event.error_code, out)

    # ------------------------------------------------------------------
    # Data streams and datagrams
    # ------------------------------------------------------------------

    def _on_data_header(
        self, sid: int, stream: IncomingDataStream[Request14], item: object, out: list[ev.MoqtEvent]
    ) -> bool:
        if isinstance(item, data18.FetchHeader):
            stream.fetch = True
            request = self._requests.get(item.request_id)
            if request is None or request.closed:
                if self._requests14.was_ours(item.request_id):
                    self._receiving.stop(sid, stream, StreamResetCode.CANCELLED)
                    return False
                raise ProtocolViolation(f"FETCH_HEADER for unknown fetch {item.request_id}")
            if request.kind is not FETCH or not request.local:
                raise ProtocolViolation(f"FETCH_HEADER for request {item.request_id}, not a FETCH of ours")
            stream.request = request
            request.open_data_streams.add(sid)
            return True
        assert isinstance(item, data18.SubgroupHeader)
        return self._receiving.on_subgroup_header(sid, stream, item, out)

    # ------------------------------------------------------------------
    # Sending: objects
    # ------------------------------------------------------------------

    def write_fetch_end_of_range(
        self, stream_id: int, group_id: int, object_id: int, *, unknown: bool = False, end_stream: bool = False
    ) -> None:
        """Draft-14 has no end-of-range marker: nothing is written; `end_stream` FINs."""
        self._sending.new_object(stream_id, fetch=True)
        if end_stream:
            self.close_data_stream(stream_id)

    def send_padding_stream(self, size: int) -> None:
        raise NotSupported("draft-14 has no padding streams")

    # ------------------------------------------------------------------
    # The control stream
    # ------------------------------------------------------------------

    def _send(self, message: d14.Message) -> None:
        """Write a message on the control stream."""
        assert self._control_stream_id is not None
        self._quic.send_stream_data(self._control_stream_id, message.encode())

    def _on_control_data(self, data: bytes, out: list[ev.MoqtEvent]) -> None:
        self._control.on_control_data(data, out)


