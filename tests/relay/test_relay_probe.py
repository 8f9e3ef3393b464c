"""The relay PINGs its sessions: a peer that vanished without closing is let go."""

from __future__ import annotations

import asyncio

import pytest

from kvsp_moq.errors import SettingError
from kvsp_moq.moqt.errors import DoesNotExist, PublishDoneCode, PublishDoneError
from kvsp_moq.moqt.quic import MoqtConnection, connect
from tests.polling import eventually

from .conftest import STEP, TrackPublisher, collect, dial, make_objects, publishing, running_relay

NS = (b"kvsp", b"c" * 32, b"s" * 16)
NAME = b"1"


class _Void:
    """A transport that drops everything: what a relay sees of a killed or unplugged peer."""

    def sendto(self, data: bytes, addr: object = None) -> None:
        pass

    def close(self) -> None:
        pass

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default


def go_silent(connection: MoqtConnection) -> None:
    """From now on the connection sends nothing and hears nothing, without closing."""
    connection._transport = _Void()  # type: ignore[assignment]
    connection.datagram_received = lambda *args: None  # type: ignore[method-assign]


async def test_a_silent_publisher_is_closed_and_its_namespace_withdrawn():
    ns_a, ns_b = NS + (b"a" * 16,), NS + (b"b" * 16,)
    track_a, track_b = ns_a + (b"k" * 32,), ns_b + (b"k" * 32,)
    objects = make_objects(1, 40, 2000)
    pub_a = TrackPublisher(objects, pace=0.01, end=False)
    pub_b = TrackPublisher(objects)
    async with running_relay(probe_interval=0.2, probe_timeout=0.8) as relay:
        conn_a = await dial(relay.url)
        pub_a.attach(conn_a)
        await asyncio.wait_for(conn_a.publish_namespace(ns_a), STEP)
        async with publishing(relay.url, ns_b, pub_b):
            client = await dial(relay.url)
            try:
                sub_a = await asyncio.wait_for(client.subscribe(track_a, NAME), STEP)
                got = [await asyncio.wait_for(sub_a.__anext__(), STEP) for _ in range(3)]
                # Several probe rounds pass with every peer answering: nobody is closed.
                await asyncio.sleep(1.0)
                assert relay.stats.peers_unresponsive == 0
                assert relay.snapshot()["sessions"] == 3
                go_silent(conn_a)
                with pytest.raises(PublishDoneError) as e:
                    got += await collect(sub_a, timeout=STEP)
                assert e.value.error_code == PublishDoneCode.INTERNAL_ERROR
                assert relay.stats.peers_unresponsive == 1
                assert relay.stats.publishers_lost == 1
                await eventually(lambda: relay.snapshot()["sessions"] == 2, timeout=STEP,
                                 what="two sessions at the relay", step=0.05)
                # A's namespace is withdrawn; B, idle all along, still serves.
                with pytest.raises(DoesNotExist):
                    await asyncio.wait_for(client.subscribe(track_a, NAME), STEP)
                late = await asyncio.wait_for(client.subscribe(track_b, NAME), STEP)
                assert [(o.group_id, o.object_id, o.payload) for o in await collect(late)] == objects
                assert relay.stats.peers_unresponsive == 1
            finally:
                await client.aclose()
                await conn_a.aclose(timeout=0.1)


async def test_a_peer_still_sending_is_kept_when_its_pings_go_unanswered():
    """On a lossy path a PING or its ACK can be lost while the peer is plainly alive: what it
    sends (here: a publisher's objects) keeps its session. Once it falls silent it is closed."""
    ns_a = NS + (b"a" * 16,)
    track_a = ns_a + (b"k" * 32,)
    pub_a = TrackPublisher(make_objects(1, 400, 500), pace=0.01, end=False)
    async with running_relay(probe_interval=0.2, probe_timeout=0.6) as relay:
        conn_a = await dial(relay.url)
        pub_a.attach(conn_a)
        await asyncio.wait_for(conn_a.publish_namespace(ns_a), STEP)
        client = await dial(relay.url)
        try:
            sub_a = await asyncio.wait_for(client.subscribe(track_a, NAME), STEP)
            await asyncio.wait_for(sub_a.__anext__(), STEP)
            peer_a = relay.route(track_a, None)
            assert peer_a is not None

            async def unanswered() -> None:  # every PING to A, or its ACK, is lost
                await asyncio.Event().wait()

            peer_a.connection.ping = unanswered  # type: ignore[method-assign]
            await eventually(lambda: relay.stats.pings_unanswered_kept >= 2, timeout=STEP,
                             what="two unanswered PINGs to a sending peer", step=0.05)
            assert relay.stats.peers_unresponsive == 0 and peer_a.alive
            await asyncio.wait_for(sub_a.__anext__(), STEP)  # its objects still flow
            go_silent(conn_a)
            await eventually(lambda: relay.stats.peers_unresponsive == 1, timeout=STEP,
                             what="the silent peer closed", step=0.05)
            assert not peer_a.alive
        finally:
            await client.aclose()
            await conn_a.aclose(timeout=0.1)


async def test_probing_off_keeps_a_silent_peer():
    async with running_relay(probe_interval=0) as relay:
        conn = await dial(relay.url)
        try:
            await asyncio.wait_for(conn.publish_namespace(NS + (b"a" * 16,)), STEP)
            go_silent(conn)
            await asyncio.sleep(1.0)
            assert relay.stats.peers_unresponsive == 0
            assert relay.snapshot()["sessions"] == 1
        finally:
            await conn.aclose(timeout=0.1)


def relay_args(*argv: str):
    import argparse

    from relay.service import configure_parser

    parser = argparse.ArgumentParser()
    configure_parser(parser)
    return parser.parse_args(["--listen", "127.0.0.1:0", *argv])


async def test_cli_sets_probing_and_can_refuse_draft14_clients(tmp_path):
    from kvsp_moq.moqt.errors import SessionClosed
    from relay.relay import Relay
    from relay.service import settings_from_args

    settings, _ = settings_from_args(relay_args("--cert-dir", str(tmp_path), "--probe-interval", "0.5",
                                                "--probe-timeout", "1.5", "--no-draft14"))
    assert (settings.probe_interval, settings.probe_timeout) == (0.5, 1.5)
    relay = await Relay(settings).start()
    try:
        cadata = settings.certificate.certificate_pem
        with pytest.raises(SessionClosed):
            await asyncio.wait_for(connect(relay.url, cadata=cadata, drafts=(14,)), STEP)
        client = await asyncio.wait_for(connect(relay.url, cadata=cadata, drafts=(18, 14)), STEP)
        assert client.draft == 18
        await client.aclose()
    finally:
        await relay.aclose()
    default, _ = settings_from_args(relay_args("--cert-dir", str(tmp_path)))
    assert default.quic.draft14_fallback and default.probe_interval == 2.0
    for bad in (["--probe-interval", "-1"], ["--probe-timeout", "0"]):
        with pytest.raises(SettingError):
            settings_from_args(relay_args("--cert-dir", str(tmp_path), *bad))


async def test_liveness_as_every_prober_sees_it():
    """`liveness`, the one rule of the relay's, the holder publisher's and the fetcher's probes:
    a PING answered; unanswered while the peer keeps sending; unanswered and nothing heard."""
    ns_a = NS + (b"a" * 16,)
    track_a = ns_a + (b"k" * 32,)
    pub_a = TrackPublisher(make_objects(1, 400, 500), pace=0.01, end=False)
    async with running_relay(probe_interval=0) as relay:
        conn_a = await dial(relay.url)
        pub_a.attach(conn_a)
        await asyncio.wait_for(conn_a.publish_namespace(ns_a), STEP)
        client = await dial(relay.url)
        try:
            assert await client.liveness(STEP) == "answered"
            sub_a = await asyncio.wait_for(client.subscribe(track_a, NAME), STEP)
            await asyncio.wait_for(sub_a.__anext__(), STEP)

            async def unanswered() -> None:
                await asyncio.Event().wait()

            client.ping = unanswered  # type: ignore[method-assign]
            assert await client.liveness(0.3) == "sending"  # the relay forwards A's objects
            client.datagram_received = lambda *args: None  # type: ignore[method-assign]
            client.datagrams_received = lambda *args: None  # type: ignore[method-assign]
            assert await client.liveness(0.3) == "silent"
        finally:
            await client.aclose(timeout=0.1)
            await conn_a.aclose(timeout=0.1)
