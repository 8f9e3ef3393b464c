"""The session machinery every draft shares, sans I/O: lifecycle, request state, data
streams and datagrams, object writing, flow control of the engine beneath. A draft's
`session` module supplies its control messages and stream formats; requests and answers
reach this code in their draft-18 form (`kvsp_moq.moqt.d18.messages`) whatever the wire.

`SessionBase` puts together pieces that each have a module: the records of requests
and data streams (`records`), the state a session keeps and the hooks a draft fills in
(`core`, which owns the parts: the peer's tokens, `tokens`; the draft's wire forms,
`dialect`; reading data, `receiving`; the peer's FETCHes, `fetches`; writing data,
`sending`). It keeps the lifecycle, the checks of
the peer's setup and the answers both drafts give alike."""

from __future__ import annotations

from .. import events as ev
from ..d18.data import ObjectDatagram, SubgroupHeader
from ..d18.messages import Fetch, FetchOk, Parameters, Redirect, Subscribe, SubscribeOk
from ..engine import (
    ConnectionTerminated,
    DatagramFrameReceived,
    QuicEvent,
    StopSendingReceived,
    StreamDataReceived,
    StreamReset,
)
from ..errors import (
    SESSION_ENDING,
    InvalidAuthority,
    InvalidPath,
    ProtocolViolation,
    PublishDoneCode,
    SessionCloseCode,
    StreamClosed,
    StreamResetCode,
)
from ..wire import (
    DEFAULT_PUBLISHER_PRIORITY,
    Location,
    ObjectStatus,
    Properties,
    TrackNamespace,
    TrackPropertyType,
    property_value,
)
from .core import SessionCore
from .records import RequestT

__all__ = ["SessionBase"]


class SessionBase(SessionCore[RequestT]):
    """What the draft-18 and draft-14 sessions share: the session's lifecycle, track
    aliases, joining FETCHes, reading data streams and datagrams, and writing objects.
    A draft supplies its control messages and wire encodings through the hooks of
    `core.SessionCore`; data stream items and answers reach this code in their
    draft-18 form whatever the wire."""

    # ------------------------------------------------------------------
    # QUIC events
    # ------------------------------------------------------------------

    def take_events(self) -> list[ev.MoqtEvent]:
        """Events produced by calls of the application rather than by QUIC events
        (a joining FETCH held until its SUBSCRIBE was accepted is released by
        subscribe_ok() as a FetchReceived). handle_event() also returns any of these
        not yet taken, ahead of its own."""
        out, self._released = self._released, []
        return out

    def handle_event(self, event: QuicEvent) -> list[ev.MoqtEvent]:
        """Process one QUIC event; returns the MOQT events it produced."""
        if self._closed:
            return []
        out: list[ev.MoqtEvent] = self.take_events()
        try:
            if isinstance(event, ConnectionTerminated):
                self._closed = True
                out.append(ev.SessionTerminated(event.error_code, event.reason_phrase, False))
                return out
            if self.peer_setup is None and not self._is_control_event(event):
                self._hold_before_setup(event)
            else:
                self._dispatch(event, out)
        except SESSION_ENDING as exc:
            self.close(int(exc.session_code), exc.reason)
            out.append(ev.SessionTerminated(int(exc.session_code), exc.reason, True))
        return out

    def close(self, error_code: int = SessionCloseCode.NO_ERROR, reason: str = "") -> None:
        """Close the session and its QUIC connection."""
        if self._closed:
            return
        self._closed = True
        self._quic.close(error_code=error_code, reason_phrase=reason)

    # -- reading data ----------------------------------------------------------

    def stop_data_stream(self, stream_id: int, error_code: int = StreamResetCode.CANCELLED) -> None:
        """STOP_SENDING an incoming data stream, e.g. a group no longer of interest;
        its remaining bytes are discarded and the subscription goes on."""
        self._receiving.stop_data_stream(stream_id, error_code)

    def incoming_stream_open(self, stream_id: int) -> bool:
        """Whether an incoming data stream is still being read."""
        return self._receiving.incoming_stream_open(stream_id)

    def release(self, request_id: int) -> None:
        """Forget a subscription that ended with PUBLISH_DONE, even if some of its
        streams never arrived (after a grace period chosen by the caller)."""
        request = self._requests.get(request_id)
        if request is not None:
            self._receiving.release(request)

    def _dispatch(self, event: QuicEvent, out: list[ev.MoqtEvent]) -> None:
        if isinstance(event, StreamDataReceived):
            self._on_stream_data(event, out)
        elif isinstance(event, StreamReset):
            self._on_stream_reset(event, out)
        elif isinstance(event, StopSendingReceived):
            self._on_stop_sending(event, out)
        elif isinstance(event, DatagramFrameReceived):
            self._receiving.on_datagram(event.data, out)

    def _hold_before_setup(self, event: QuicEvent) -> None:
        self._before_setup_bytes += len(getattr(event, "data", b""))
        if self._before_setup_bytes > self._max_buffered_before_setup:
            raise ProtocolViolation("too much data before SETUP")
        self._before_setup.append(event)

    def _replay_held(self, out: list[ev.MoqtEvent]) -> None:
        held = self._before_setup
        self._before_setup = []
        self._before_setup_bytes = 0
        for event in held:
            self._dispatch(event, out)

    # -- setup ---------------------------------------------------------------

    def _check_peer_target(self, path: str | None, authority: str | None, noun: str) -> None:
        """PATH and AUTHORITY of the peer's setup: none from a server, and on a
        server only those it serves."""
        if self._is_client:
            if path is not None:
                raise InvalidPath(f"PATH {noun} from the server")
            if authority is not None:
                raise InvalidAuthority(f"AUTHORITY {noun} from the server")
        else:
            if self._accept_path is not None and (path or "") not in self._accept_path:
                raise InvalidPath(f"path {path!r} is not served here")
            if self._accept_authority is not None and authority not in self._accept_authority:
                raise InvalidAuthority(f"authority {authority!r} is not served here")

    # ------------------------------------------------------------------
    # Control messages (the draft's `Messages` part sends them)
    # ------------------------------------------------------------------

    def subscribe(self, namespace: TrackNamespace, track_name: bytes, parameters: Parameters = Parameters()) -> int:
        """Send SUBSCRIBE; returns its Request ID."""
        return self._messages.subscribe(namespace, track_name, parameters)

    def fetch(
        self,
        namespace: TrackNamespace,
        track_name: bytes,
        start: Location,
        end: Location,
        parameters: Parameters = Parameters(),
    ) -> int:
        """Send a standalone FETCH. `end` is the wire End Location (last Object + 1,
        or Object 0 for the whole group)."""
        return self._messages.fetch(namespace, track_name, start, end, parameters)

    def joining_fetch(
        self,
        subscribe_request_id: int,
        joining_start: int,
        *,
        relative: bool = True,
        parameters: Parameters = Parameters(),
    ) -> int:
        """Send a joining FETCH for one of our subscriptions (not from draft-20 on, where
        FILL_PARAMETERS in the SUBSCRIBE asks for the same objects)."""
        return self._messages.joining_fetch(
            subscribe_request_id, joining_start, relative=relative, parameters=parameters
        )

    def track_status(self, namespace: TrackNamespace, track_name: bytes, parameters: Parameters = Parameters()) -> int:
        """Send TRACK_STATUS; returns its Request ID."""
        return self._messages.track_status(namespace, track_name, parameters)

    def publish_namespace(self, namespace: TrackNamespace, parameters: Parameters = Parameters()) -> int:
        """Send PUBLISH_NAMESPACE; withdrawn by cancel_request()."""
        return self._messages.publish_namespace(namespace, parameters)

    def subscribe_namespace(self, namespace_prefix: TrackNamespace, parameters: Parameters = Parameters()) -> int:
        """Send SUBSCRIBE_NAMESPACE; the namespaces come as NamespaceReceived events."""
        return self._messages.subscribe_namespace(namespace_prefix, parameters)

    def subscribe_tracks(self, namespace_prefix: TrackNamespace, parameters: Parameters = Parameters()) -> int:
        """Send SUBSCRIBE_TRACKS (NotSupported in draft-14)."""
        return self._messages.subscribe_tracks(namespace_prefix, parameters)

    def publish(
        self,
        namespace: TrackNamespace,
        track_name: bytes,
        *,
        track_alias: int | None = None,
        parameters: Parameters = Parameters(),
        track_properties: Properties = (),
    ) -> int:
        """Send PUBLISH; objects may follow at once unless FORWARD is 0."""
        return self._messages.publish(
            namespace, track_name, track_alias=track_alias, parameters=parameters, track_properties=track_properties
        )

    def request_update(self, request_id: int, parameters: Parameters) -> int:
        """Update a request of ours (or a PUBLISH we receive); returns the update's own
        Request ID, which its answer will carry."""
        return self._messages.request_update(request_id, parameters)

    def cancel_request(self, request_id: int, error_code: int = StreamResetCode.CANCELLED) -> None:
        """Abandon a request: this unsubscribes, withdraws a published namespace, stops a
        fetch, ... (by stream reset in draft-18, by message in draft-14)."""
        self._messages.cancel_request(request_id, error_code)

    def goaway(self, new_session_uri: str = "", timeout_ms: int = 0) -> None:
        """Send GOAWAY on the control stream; later peer requests are refused."""
        self._messages.goaway(new_session_uri, timeout_ms)

    def request_goaway(self, request_id: int, new_session_uri: str = "", timeout_ms: int = 0) -> None:
        """Send GOAWAY on one request stream: re-issue this request elsewhere (draft-18)."""
        self._messages.request_goaway(request_id, new_session_uri, timeout_ms)

    def request_ok(
        self, request_id: int, parameters: Parameters = Parameters(), track_properties: Properties = ()
    ) -> None:
        """Accept a peer request other than SUBSCRIBE and FETCH (PUBLISH, TRACK_STATUS, the
        namespace requests), or a peer's REQUEST_UPDATE (pass the update's Request ID)."""
        self._messages.request_ok(request_id, parameters, track_properties)

    def request_error(
        self,
        request_id: int,
        error_code: int,
        reason: str = "",
        *,
        retry_interval: int = 0,
        redirect: Redirect | None = None,
    ) -> None:
        """Reject a peer's request or one of its REQUEST_UPDATEs; a failed update of a
        subscription this endpoint publishes also ends it with PUBLISH_DONE UPDATE_FAILED."""
        self._messages.request_error(request_id, error_code, reason, retry_interval=retry_interval, redirect=redirect)

    def namespace(self, request_id: int, namespace_suffix: TrackNamespace) -> None:
        """Announce a namespace under a peer's SUBSCRIBE_NAMESPACE (after accepting it)."""
        self._messages.namespace(request_id, namespace_suffix)

    def namespace_done(self, request_id: int, namespace_suffix: TrackNamespace) -> None:
        """Withdraw a namespace announced by namespace()."""
        self._messages.namespace_done(request_id, namespace_suffix)

    def publish_blocked(self, request_id: int, namespace_suffix: TrackNamespace, track_name: bytes) -> None:
        """Send PUBLISH_BLOCKED on a peer's SUBSCRIBE_TRACKS (draft-18)."""
        self._messages.publish_blocked(request_id, namespace_suffix, track_name)

    # ------------------------------------------------------------------
    # Sending: answers
    # ------------------------------------------------------------------

    def _send_answer(self, request: RequestT, message: SubscribeOk | FetchOk) -> None:
        data = self._dialect.answer(request, message)
        if data is not None:
            self._messages.send_about(request, data)

    def _allocate_alias(self, alias: int | None) -> int:
        if alias is None:
            while self._next_alias in self._aliases_out:
                self._next_alias += 1
            alias = self._next_alias
            self._next_alias += 1
        elif alias in self._aliases_out and not self._aliases_out[alias].closed:
            raise ValueError(f"track alias {alias} in use")
        return alias

    def subscribe_ok(
        self,
        request_id: int,
        *,
        track_alias: int | None = None,
        largest: Location | None = None,
        expires: int | None = None,
        track_properties: Properties = (),
    ) -> int:
        """Accept a peer's SUBSCRIBE; returns the Track Alias its objects carry.

        `largest` is the Largest Object (must be given when objects exist); it is
        also the Joining Location for joining fetches.
        """
        request = self._peer_request(request_id, (Subscribe,))
        alias = self._allocate_alias(track_alias)
        parameters = Parameters(expires=expires, largest_object=None if largest is None else Location(*largest))
        self._send_answer(request, SubscribeOk(alias, parameters, track_properties))
        request.answered = request.accepted = True
        request.track_alias = alias
        request.largest_at_ok = parameters.largest_object
        request.default_priority = property_value(
            track_properties, TrackPropertyType.DEFAULT_PUBLISHER_PRIORITY, DEFAULT_PUBLISHER_PRIORITY
        )
        self._aliases_out[alias] = request
        if request.held_fetches:
            self._fetches.release_held(request, self._released)
        return alias

    def fetch_ok(
        self,
        request_id: int,
        end_location: Location,
        *,
        end_of_track: bool = False,
        track_properties: Properties = (),
    ) -> None:
        """Accept a peer's FETCH. `end_location` uses the wire encoding (last + 1)."""
        request = self._peer_request(request_id, (Fetch,))
        answer = FetchOk(end_of_track, Location(*end_location), Parameters(), track_properties)
        self._send_answer(request, answer)
        request.answered = request.accepted = True
        self._maybe_finish_fetch(request)

    def publish_done(self, request_id: int, status_code: int = PublishDoneCode.TRACK_ENDED, reason: str = "") -> None:
        """End a subscription this endpoint publishes: FIN its open data streams and
        send PUBLISH_DONE with the stream count."""
        self._check_open()
        request = self._request(request_id)
        if not request.is_subscription or not request.publisher_is_local:
            raise ValueError(f"request {request_id} is not a subscription this endpoint publishes")
        if request.closed:
            raise StreamClosed(f"subscription {request_id} is closed")
        for sid in list(request.open_data_streams):
            stream = self._sending.streams.get(sid)
            if stream is not None and stream.payload_remaining:
                self.reset_data_stream(sid, StreamResetCode.CANCELLED)
            else:
                self.close_data_stream(sid)
        self._messages.send_about(request, self._dialect.publish_done(request, status_code, reason), final=True)

    # ------------------------------------------------------------------
    # Writing data (the `sending` part, for requests checked here)
    # ------------------------------------------------------------------

    def _publishing_request(self, request_id: int) -> RequestT:
        self._check_open()
        request = self._request(request_id)
        if not request.is_subscription or not request.publisher_is_local:
            raise ValueError(f"request {request_id} is not a subscription this endpoint publishes")
        if request.closed:
            raise StreamClosed(f"subscription {request_id} is closed")
        if request.kind is Subscribe and not request.accepted:
            raise ValueError("objects are sent only after SUBSCRIBE_OK")
        return request

    def open_subgroup(
        self,
        request_id: int,
        group_id: int,
        subgroup_id: int = 0,
        *,
        publisher_priority: int | None = DEFAULT_PUBLISHER_PRIORITY,
        end_of_group: bool = False,
        has_properties: bool = False,
        first_object: bool = True,
    ) -> int:
        """Open a subgroup stream for a subscription this endpoint publishes; returns
        the stream ID. `publisher_priority` None inherits the track's default."""
        request = self._publishing_request(request_id)
        alias = request.track_alias
        assert alias is not None  # set by subscribe_ok() or publish(), before any object
        header = SubgroupHeader(
            alias, group_id, subgroup_id, publisher_priority, has_properties, end_of_group, first_object
        )
        return self._sending.open_subgroup(request, header)

    def begin_object(
        self, stream_id: int, object_id: int, payload_length: int, *, properties: Properties = ()
    ) -> None:
        """Write the header of a Normal object on a subgroup stream; its payload
        follows with write_payload(), in as many pieces as the caller likes."""
        self._sending.begin_object(stream_id, object_id, payload_length, properties=properties)

    def write_payload(self, stream_id: int, data: bytes | bytearray | memoryview, *, end_stream: bool = False) -> None:
        """Write payload bytes of the object begun on this stream."""
        self._sending.write_payload(stream_id, data, end_stream=end_stream)

    def write_object(
        self,
        stream_id: int,
        object_id: int,
        payload: bytes | bytearray | memoryview,
        *,
        properties: Properties = (),
        end_stream: bool = False,
    ) -> None:
        """Write a whole Normal object on a subgroup stream (the payload is not copied here)."""
        self._sending.write_object(stream_id, object_id, payload, properties=properties, end_stream=end_stream)

    def write_object_status(
        self, stream_id: int, object_id: int, status: ObjectStatus, *, end_stream: bool = False
    ) -> None:
        """Write an object status (End of Group / End of Track, or an empty Normal object)."""
        self._sending.write_object_status(stream_id, object_id, status, end_stream=end_stream)

    def open_fetch_stream(self, request_id: int) -> int:
        """Open the data stream answering a peer's FETCH; returns the stream ID."""
        self._check_open()
        request = self._request(request_id)
        if request.local or request.kind is not Fetch:
            raise ValueError(f"request {request_id} is not a peer FETCH")
        if request.closed:
            raise StreamClosed(f"fetch {request_id} was cancelled")
        if request.data_streams_opened:
            raise ValueError("a FETCH is answered on one stream")
        return self._sending.open_fetch_stream(request)

    def begin_fetch_object(
        self,
        stream_id: int,
        group_id: int,
        object_id: int,
        payload_length: int,
        *,
        subgroup_id: int | None = 0,
        publisher_priority: int = DEFAULT_PUBLISHER_PRIORITY,
        properties: Properties = (),
    ) -> None:
        """Write the header of the next object of a FETCH response; the payload
        follows with write_payload(). `subgroup_id` None marks a Datagram object."""
        self._sending.begin_fetch_object(
            stream_id, group_id, object_id, payload_length,
            subgroup_id=subgroup_id, publisher_priority=publisher_priority, properties=properties,
        )

    def write_fetch_object(
        self,
        stream_id: int,
        group_id: int,
        object_id: int,
        payload: bytes | bytearray | memoryview,
        *,
        subgroup_id: int | None = 0,
        publisher_priority: int = DEFAULT_PUBLISHER_PRIORITY,
        properties: Properties = (),
        end_stream: bool = False,
    ) -> None:
        """Write a whole object of a FETCH response."""
        self._sending.write_fetch_object(
            stream_id, group_id, object_id, payload,
            subgroup_id=subgroup_id, publisher_priority=publisher_priority, properties=properties,
            end_stream=end_stream,
        )

    def close_data_stream(self, stream_id: int) -> None:
        """FIN a data stream: every object of it was written."""
        self._sending.close_data_stream(stream_id)

    def reset_data_stream(self, stream_id: int, error_code: int = StreamResetCode.CANCELLED) -> None:
        """Reset a data stream this endpoint writes."""
        self._sending.reset_data_stream(stream_id, error_code)

    def data_stream_request(self, stream_id: int) -> int | None:
        """Request ID an outgoing data stream serves, while it can still be written."""
        return self._sending.data_stream_request(stream_id)

    def send_datagram(
        self,
        request_id: int,
        group_id: int,
        object_id: int,
        payload: bytes = b"",
        *,
        publisher_priority: int | None = DEFAULT_PUBLISHER_PRIORITY,
        status: ObjectStatus | None = None,
        properties: Properties = (),
        end_of_group: bool = False,
    ) -> None:
        """Send one object as an OBJECT_DATAGRAM (dropped by QUIC if it does not fit)."""
        request = self._publishing_request(request_id)
        alias = request.track_alias
        assert alias is not None  # set by subscribe_ok() or publish(), before any object
        datagram = ObjectDatagram(
            alias, group_id, object_id, payload, publisher_priority, status, properties, end_of_group
        )
        self._sending.send_datagram(request, datagram)
