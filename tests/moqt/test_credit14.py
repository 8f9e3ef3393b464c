"""Draft-14 Request ID credit as a part of its own: driven here without a session, through
the few things it asks of one (`CreditHooks`)."""

from __future__ import annotations

import pytest

from kvsp_moq.moqt.d14 import messages as d14
from kvsp_moq.moqt.d14.credit import RequestCredit
from kvsp_moq.moqt.d14.request_state import Request14
from kvsp_moq.moqt.d18 import messages as m
from kvsp_moq.moqt.errors import InvalidRequestId, SessionError


class FakeSession:
    """A session whose control stream (0) is open and whose peer's SETUP has arrived."""

    def __init__(self) -> None:
        self.closed = False
        self.peer_setup: m.Setup | None = m.Setup()
        self._control_stream_id: int | None = 0
        self.sent: list[d14.Message] = []

    def _send(self, message: d14.Message) -> None:
        self.sent.append(message)


class FakeQuic:
    def __init__(self) -> None:
        self.written: list[bytes] = []

    def send_stream_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None:
        self.written.append(bytes(data))


def credit(max_requests: int = 2) -> tuple[RequestCredit, FakeSession, FakeQuic, dict[int, Request14]]:
    session, quic, requests = FakeSession(), FakeQuic(), {}
    part = RequestCredit(session, quic, requests, is_client=False, max_requests=max_requests)  # type: ignore[arg-type]
    return part, session, quic, requests


def test_peer_requests_take_the_next_id_below_the_grant() -> None:
    part, _, _, requests = credit(max_requests=2)
    with pytest.raises(InvalidRequestId):
        part.new_peer_request(2, m.Subscribe)  # the client's first is 0
    part.new_peer_request(0, m.Subscribe)
    part.new_peer_request(2, m.Subscribe)
    assert sorted(requests) == [0, 2]
    with pytest.raises(SessionError) as raised:
        part.new_peer_request(4, m.Subscribe)  # the grant was 4: IDs 0 and 2
    assert raised.value.error_code == d14.SessionCloseCode.TOO_MANY_REQUESTS


def test_an_ended_peer_request_gives_its_credit_back_with_max_request_id() -> None:
    part, session, _, _ = credit(max_requests=2)
    part.new_peer_request(0, m.Subscribe)
    part.new_peer_request(2, m.Subscribe)
    part.peer_request_ended()
    assert session.sent == [d14.MaxRequestId(6)]
    assert part.granted == 6


def test_our_requests_beyond_the_grant_wait_and_report_blocked_once() -> None:
    part, session, quic, requests = credit()
    first, second = Request14(0, m.Subscribe, True), Request14(2, m.Subscribe, True)
    requests.update({0: first, 2: second})
    part.send_request(first, b"first")
    part.send_request(second, b"second")
    part.send_about(first, d14.Unsubscribe(0))  # rides behind its queued request
    assert quic.written == [] and not first.sent
    assert session.sent == [d14.RequestsBlocked(0)]  # once for this grant
    part.on_max_request_id(d14.MaxRequestId(2))
    assert quic.written == [b"first" + d14.Unsubscribe(0).encode()]
    assert first.sent and not second.sent
    assert session.sent == [d14.RequestsBlocked(0), d14.RequestsBlocked(2)]
