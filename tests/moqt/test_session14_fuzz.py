"""Draft-14 sessions: any sequence of control messages (valid, or with one octet changed) on
the control stream, and data streams with arbitrary bodies, from either peer, are handled or
close the session with a MOQT close code; no other exception leaves `handle_event`."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsp_moq.moqt import events as ev
from kvsp_moq.moqt.d14.messages import SessionCloseCode

from .pair import ENGINES, SessionPair
from .test_draft14 import any_message
from .test_session_fuzz import encoded


@st.composite
def data_stream(draw) -> bytes:
    """A draft-14 data stream: a subgroup (0x08-0x0D) or fetch (0x05) header's type and a
    few small IDs, then arbitrary octets."""
    stream_type = draw(st.sampled_from([0x05, 0x08, 0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x3F]))
    ids = bytes(draw(st.lists(st.integers(0, 4), min_size=1, max_size=4)))
    return bytes([stream_type]) + ids + draw(st.binary(max_size=64))


STEPS = st.lists(st.one_of(st.tuples(st.just("control"), encoded(any_message)),
                           st.tuples(st.just("data"), data_stream())), min_size=1, max_size=6)


@pytest.mark.parametrize("engine", ENGINES)
@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(steps=STEPS, from_client=st.booleans())
def test_any_messages_and_data_streams_are_handled_or_close_the_session(engine, steps, from_client) -> None:
    pair = SessionPair(draft=14, engine=engine)
    sender = pair.client if from_client else pair.server
    receiver_side = "server" if from_client else "client"
    quic = pair.client_quic if from_client else pair.server_quic
    events: list = []
    for kind, data in steps:
        if kind == "control":
            stream_id = sender._control_stream_id
        else:
            stream_id = quic.get_next_available_stream_id(is_unidirectional=True)
        try:
            quic.send_stream_data(stream_id, data)
        except (ValueError, AssertionError, RuntimeError):
            continue  # the stream was ended or reset meanwhile
        pair.exchange()  # an exception out of either session's handle_event fails the test
        events += pair.take(receiver_side)
        receiver = pair.server if from_client else pair.client
        if receiver.closed:
            break
    codes = {int(code) for code in SessionCloseCode}
    for event in events:
        if isinstance(event, ev.SessionTerminated) and event.local:
            assert event.error_code in codes, event
