"""What a draft's control messages make different for the machinery every draft shares:
the requests, updates, cancellations and answers it sends, each in the draft's wire form
and on the draft's streams. A draft's session sets one `Messages` object (its sending
part) on `core.SessionCore`, to which `base.SessionBase`'s public request methods hand
their calls, and which carries the answers it gives (SUBSCRIBE_OK, FETCH_OK,
PUBLISH_DONE, a refusal) in the forms of the draft's `dialect.Dialect`; requests and
answers reach it in their draft-18 form whatever the wire."""

from __future__ import annotations

from typing import Protocol, TypeVar

from ..d18.messages import Parameters, Redirect
from ..wire import Location, Properties, TrackNamespace
from .records import RequestState

__all__ = ["Messages"]

_RequestC = TypeVar("_RequestC", bound=RequestState, contravariant=True)


class Messages(Protocol[_RequestC]):
    """The control messages of one draft, for the session's request records (`_RequestC`);
    `base.SessionBase` documents the public methods."""

    # -- requests, updates, cancellation, GOAWAY ---------------------------------

    def subscribe(self, namespace: TrackNamespace, track_name: bytes, parameters: Parameters) -> int: ...

    def fetch(
        self, namespace: TrackNamespace, track_name: bytes, start: Location, end: Location, parameters: Parameters
    ) -> int: ...

    def joining_fetch(
        self, subscribe_request_id: int, joining_start: int, *, relative: bool, parameters: Parameters
    ) -> int: ...

    def track_status(self, namespace: TrackNamespace, track_name: bytes, parameters: Parameters) -> int: ...

    def publish_namespace(self, namespace: TrackNamespace, parameters: Parameters) -> int: ...

    def subscribe_namespace(self, namespace_prefix: TrackNamespace, parameters: Parameters) -> int: ...

    def subscribe_tracks(self, namespace_prefix: TrackNamespace, parameters: Parameters) -> int: ...

    def publish(
        self,
        namespace: TrackNamespace,
        track_name: bytes,
        *,
        track_alias: int | None,
        parameters: Parameters,
        track_properties: Properties,
    ) -> int: ...

    def request_update(self, request_id: int, parameters: Parameters) -> int: ...

    def cancel_request(self, request_id: int, error_code: int) -> None: ...

    def goaway(self, new_session_uri: str, timeout_ms: int) -> None: ...

    def request_goaway(self, request_id: int, new_session_uri: str, timeout_ms: int) -> None: ...

    # -- answers to the peer's requests ------------------------------------------

    def request_ok(self, request_id: int, parameters: Parameters, track_properties: Properties) -> None: ...

    def request_error(
        self, request_id: int, error_code: int, reason: str, *, retry_interval: int, redirect: Redirect | None
    ) -> None: ...

    def namespace(self, request_id: int, namespace_suffix: TrackNamespace) -> None: ...

    def namespace_done(self, request_id: int, namespace_suffix: TrackNamespace) -> None: ...

    def publish_blocked(self, request_id: int, namespace_suffix: TrackNamespace, track_name: bytes) -> None: ...

    # -- the answers `base.SessionBase` gives, in the forms of the draft's `Dialect` --

    def send_about(self, request: _RequestC, data: bytes, *, final: bool = False) -> None:
        """Send the bytes of a message about a request (an answer, PUBLISH_DONE) where
        the draft carries it; `final`: the message ends the request."""
        ...

    def reject(self, request: _RequestC, error_code: int, reason: str) -> None:
        """Refuse a peer request with a request error."""
        ...
