"""Any sequence of control messages, well-formed or with one octet changed, on any kind of
stream, from either peer: the session handles each one or closes with a MOQT close code. No other exception may leave
`handle_event` (it would take down the connection's task, and with it every request on it)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsp_moq.moqt import events as ev
from kvsp_moq.moqt.d18.data import FetchHeader, SubgroupHeader
from kvsp_moq.moqt.errors import SessionCloseCode

from .pair import ENGINES, SessionPair
from .strategies import messages

WHERE = st.sampled_from(["new request stream", "same request stream", "new unidirectional"])


@st.composite
def encoded(draw, strategy: st.SearchStrategy) -> bytes:
    """A message's encoding, as is or with one octet changed."""
    data = bytearray(draw(strategy).encode())
    if draw(st.booleans()):
        i = draw(st.integers(0, len(data) - 1))
        data[i] ^= draw(st.integers(1, 255))
    return bytes(data)


@st.composite
def data_stream(draw) -> bytes:
    """A data stream's header (aliases and request IDs small, so that some refer to requests
    of the same session) and arbitrary octets after it."""
    if draw(st.booleans()):
        header = SubgroupHeader(draw(st.integers(0, 4)), draw(st.integers(0, 3)),
                                draw(st.sampled_from([0, 1])),
                                draw(st.sampled_from([None, 0, 128])),
                                has_properties=draw(st.booleans()),
                                end_of_group=draw(st.booleans()),
                                first_object=draw(st.booleans())).encode()
    else:
        header = FetchHeader(draw(st.integers(0, 9))).encode()
    return header + draw(st.binary(max_size=64))


STEPS = st.lists(st.one_of(st.tuples(encoded(messages()), WHERE, st.booleans()),
                           st.tuples(data_stream(), st.just("new unidirectional"), st.booleans())),
                 min_size=1, max_size=6)


def _inject(pair: SessionPair, from_client: bool, steps) -> list:
    quic = pair.client_quic if from_client else pair.server_quic
    receiver = (lambda: pair.server) if from_client else (lambda: pair.client)
    events: list = []
    open_bidi: int | None = None
    for data, where, fin in steps:
        if where == "new unidirectional":
            stream_id = quic.get_next_available_stream_id(is_unidirectional=True)
        elif where == "same request stream" and open_bidi is not None:
            stream_id = open_bidi
        else:
            stream_id = open_bidi = quic.get_next_available_stream_id(is_unidirectional=False)
        try:
            quic.send_stream_data(stream_id, data, end_stream=fin)
        except (ValueError, AssertionError, RuntimeError):
            continue  # that stream was already ended by us or reset by the peer
        pair.exchange()  # an exception out of either session's handle_event fails the test
        events += pair.take("server" if from_client else "client")
        if receiver().closed:
            break
    return events


@pytest.mark.parametrize("engine", ENGINES)
@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(steps=STEPS, from_client=st.booleans())
def test_any_messages_on_any_stream_are_handled_or_close_the_session(engine, steps, from_client) -> None:
    pair = SessionPair(engine=engine)
    events = _inject(pair, from_client, steps)
    codes = {int(code) for code in SessionCloseCode}
    for event in events:
        if isinstance(event, ev.SessionTerminated) and event.local:
            assert event.error_code in codes, event
