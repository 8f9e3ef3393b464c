"""What a relay does with input too large to be honest (issue 35, What 3): control messages
whose fields pass their bounds, of an unknown type announcing a long payload, and objects over
its `max_object_size` close the sender's session with PROTOCOL_VIOLATION as soon as they are
seen, rather than being buffered; the relay goes on serving everyone else. A control message is
never held beyond its 16-bit length, and a namespace without a publisher_id may be announced
only by who may publish for any holder.
"""

from __future__ import annotations

import asyncio

import pytest

from kvsp_moq.auth import Authenticator
from kvsp_moq.errors import SessionCloseCode
from kvsp_moq.moqt.d18.messages import ControlStreamParser
from kvsp_moq.moqt.errors import Unauthorized
from kvsp_moq.moqt.quic import MoqtConnection, QuicSettings
from kvsp_moq.moqt.varint import VI64
from kvsp_moq.moqt.wire import MAX_MESSAGE_LENGTH, Writer
from tests.polling import eventually

from .conftest import STEP, TrackPublisher, collect, dial, publishing, running_relay

NS = (b"kvsp", b"c" * 32, b"s" * 16, b"p" * 16)
SUBSCRIBE = 0x3


def framed(mtype: int, payload: bytes, length: int | None = None) -> bytes:
    return VI64.encode(mtype) + (len(payload) if length is None else length).to_bytes(2, "big") + payload


def subscribe(fields: list[bytes], name: bytes) -> bytes:
    """A SUBSCRIBE written field by field, past the checks an honest sender makes."""
    w = Writer(VI64)
    w.varint(0)  # request ID
    w.varint(len(fields))
    for f in fields:
        w.length_prefixed(f)
    w.length_prefixed(name)
    w.varint(0)  # no parameters
    return framed(SUBSCRIBE, bytes(w.data))


async def closed_with(connection: MoqtConnection) -> int | None:
    error = await eventually(lambda: connection.error, timeout=STEP, what="the relay closes the session")
    return getattr(error, "error_code", None)


@pytest.mark.parametrize("data, reason", [
    (subscribe([b"x"] * 33, b"t"), "33 fields"),
    (subscribe([b"kvsp"], b"n" * 5000), "full track name over 4096"),
    (framed(0x3FF, b"a" * 1000, length=MAX_MESSAGE_LENGTH), "unknown message type"),
])
async def test_an_oversized_or_unknown_request_closes_its_session_with_protocol_violation(data, reason):
    async with running_relay() as relay:
        attacker = await dial(relay.url)
        bystander = await dial(relay.url)
        try:
            stream = attacker._quic.get_next_available_stream_id(is_unidirectional=False)
            attacker._quic.send_stream_data(stream, data)
            attacker.transmit()
            assert await closed_with(attacker) == SessionCloseCode.PROTOCOL_VIOLATION
            assert reason in str(attacker.error)
            # Everyone else is still served.
            async with publishing(relay.url, NS, TrackPublisher([(0, 0, b"a" * 100)])):
                got = await collect(await bystander.fetch(NS, b"t", (0, 0), (0, 1), timeout=STEP))
            assert [len(o.payload) for o in got] == [100]
        finally:
            await asyncio.gather(attacker.aclose(), bystander.aclose())


async def test_an_object_over_the_relays_limit_closes_its_publishers_session():
    async with running_relay(quic=QuicSettings(max_object_size=1000)) as relay:
        publisher = TrackPublisher([(0, 0, b"a" * 500), (0, 1, b"b" * 5000)])
        async with publishing(relay.url, NS, publisher) as connection:
            client = await dial(relay.url)
            try:
                with pytest.raises(Exception):  # the publisher is gone, whatever it says
                    await collect(await client.fetch(NS, b"t", (0, 0), (0, 2), timeout=STEP))
                assert await closed_with(connection) == SessionCloseCode.PROTOCOL_VIOLATION
                assert "object of 5000 bytes (max 1000)" in str(connection.error)
            finally:
                await client.aclose()


def test_a_control_message_is_held_no_longer_than_its_16_bit_length():
    """However a peer splits its bytes, what waits for the rest of a message is at most one
    message: the largest a 16-bit length can announce, and its header."""
    parser = ControlStreamParser()
    header = framed(SUBSCRIBE, b"", length=MAX_MESSAGE_LENGTH)
    parser.feed(header)
    for _ in range(MAX_MESSAGE_LENGTH // 4096):
        assert parser.feed(b"\x00" * 4096) == []
        assert parser.buffered <= len(header) + MAX_MESSAGE_LENGTH


async def test_a_namespace_without_publisher_id_needs_a_principal_that_may_publish_for_any_holder():
    scope = "5c" * 16
    auth = Authenticator.from_mapping({"principal": [
        {"name": "relay", "token": "t-relay", "scopes": [scope], "roles": ["relay"]},
        {"name": "holder", "token": "t-holder", "scopes": [scope], "holders": ["http://h.test/"],
         "roles": ["holder"]},
        {"name": "any", "token": "t-any", "scopes": [scope], "holders": ["*"], "roles": ["holder"]},
    ]})
    short = (b"kvsp", b"c" * 32, scope.encode())
    async with running_relay(authenticator=auth) as relay:
        clients = {n: await dial(relay.url, authorization=f"t-{n}") for n in ("relay", "holder", "any")}
        try:
            for name in ("relay", "holder"):
                with pytest.raises(Unauthorized, match="no publisher_id"):
                    await clients[name].publish_namespace(short, timeout=STEP)
            await clients["any"].publish_namespace(short, timeout=STEP)
        finally:
            await asyncio.gather(*(c.aclose() for c in clients.values()))
