"""The QUIC engine seam: both engines behind one session, mixed peers, and how an engine is chosen."""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import sys

import pytest

from kvsp_moq.errors import SettingError
from kvsp_moq.moqt.certs import generate_self_signed
from kvsp_moq.moqt.quic import ENGINE_ENV, QuicSettings, check_engine, connect, serve
from kvsp_moq.moqt.quic import settings as quic_settings
from kvsp_moq.moqt.quic.transport_parameters import with_max_udp_payload_size

CERT = generate_self_signed()
NS = ("kvsp", "engines")
STEP = 10.0


@pytest.mark.parametrize("server_engine, client_engine", [("qh3", "aioquic"), ("aioquic", "qh3"), ("qh3", "qh3")])
@pytest.mark.parametrize("datagram_size", [1452, 9000])
async def test_mixed_engines_carry_a_fetch_byte_for_byte(server_engine: str, client_engine: str,
                                                         datagram_size: int) -> None:
    objects = [hashlib.shake_256(b"%d" % i).digest(300_000) for i in range(4)] + [b"", b"x"]

    async def on_fetch(request):  # type: ignore[no-untyped-def]
        sender = request.accept()
        for i, payload in enumerate(objects):
            await sender.send(0, i, payload)
        sender.close()

    server = await serve(certificate=CERT, handlers={"fetch": on_fetch},
                         settings=QuicSettings(engine=server_engine, max_datagram_size=datagram_size))
    try:
        client = await connect(server.url, cadata=CERT.certificate_pem,
                               settings=QuicSettings(engine=client_engine, max_datagram_size=datagram_size))
        try:
            assert client.engine == client_engine
            result = await asyncio.wait_for(client.fetch(NS, "1", (0, 0), (0, len(objects) - 1)), STEP)
            got = [obj.payload async for obj in result]
            assert got == objects
        finally:
            await client.aclose()
    finally:
        await server.aclose()


def test_a_qh3_client_advertises_its_datagram_size() -> None:
    # max_udp_payload_size (0x03) = 1472 between two other parameters (0x01 and 0x04).
    encoded = bytes([0x01, 0x02, 0x40, 0x19, 0x03, 0x02, 0x45, 0xC0, 0x04, 0x01, 0x07])
    out = with_max_udp_payload_size(encoded, 60000)
    assert out.startswith(bytes([0x01, 0x02, 0x40, 0x19, 0x04, 0x01, 0x07]))  # the others, unchanged
    assert out.endswith(bytes([0x03, 0x04, 0x80, 0x00, 0xEA, 0x60]))  # 60000 as a 4-byte varint
    assert with_max_udp_payload_size(b"", 9000) == bytes([0x03, 0x02, 0x63, 0x28])  # added when absent


def test_an_engine_is_checked_by_name_and_by_package(monkeypatch: pytest.MonkeyPatch) -> None:
    assert check_engine("qh3") == "qh3"
    with pytest.raises(SettingError, match="unknown QUIC engine 'quiche'"):
        check_engine("quiche")
    monkeypatch.setitem(quic_settings.ENGINES, "ghost", ("kvsp_moq_no_such_adapter", "kvsp_moq_no_such_adapter"))
    with pytest.raises(SettingError, match="needs the 'kvsp_moq_no_such_adapter' package"):
        check_engine("ghost")
    monkeypatch.setenv(ENGINE_ENV, "qh3")
    assert QuicSettings().engine == "qh3"
    monkeypatch.setenv(ENGINE_ENV, "nope")
    with pytest.raises(SettingError, match=ENGINE_ENV):
        QuicSettings()


@pytest.mark.parametrize("argv, env", [
    (["relay", "--listen", "127.0.0.1:0", "--quic-engine", "nope"], {}),
    (["get", "moqt://127.0.0.1:9/x"], {ENGINE_ENV: "nope"}),
])
def test_the_command_line_refuses_an_unknown_engine_on_one_line(argv: list[str], env: dict[str, str]) -> None:
    import os

    done = subprocess.run([sys.executable, "-m", "kvsp_moq.cli", *argv], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown QUIC engine 'nope'" in lines[0], done.stderr


def test_qh3_datagrams_built_before_a_capacity_refusal_are_still_sent() -> None:
    from qh3.quic.connection import QuicConnectionError

    from kvsp_moq.moqt.quic.qh3_engine import Qh3Engine

    class Core:  # qh3's native core, refusing its third packet as it does without allowance
        def __init__(self, outcomes: list) -> None:
            self.outcomes = outcomes

        def poll_transmit(self, now: float):  # type: ignore[no-untyped-def]
            outcome = self.outcomes.pop(0)
            if isinstance(outcome, Exception):
                raise outcome
            return outcome

    engine = Qh3Engine.__new__(Qh3Engine)
    engine.quic = type("Quic", (), {"_quic_logger": None})()
    engine._blocked = {}
    addr = ("127.0.0.1", 4433)
    engine.quic._core = Core([(b"a", addr), (b"b", addr), RuntimeError("packet builder capacity exhausted")])
    assert engine.datagrams_to_send(0.0) == [(b"a", addr), (b"b", addr)]
    engine.quic._core = Core([RuntimeError("something else")])
    with pytest.raises(QuicConnectionError, match="something else"):
        engine.datagrams_to_send(0.0)


async def test_a_qh3_server_validates_addresses_with_a_retry() -> None:
    server = await serve(certificate=CERT, settings=QuicSettings(engine="qh3"))
    try:
        assert server._quic_server._retry is not None
        client = await connect(server.url, cadata=CERT.certificate_pem, settings=QuicSettings(engine="aioquic"))
        await client.aclose()
    finally:
        await server.aclose()


async def test_a_normal_close_logs_no_warning_and_an_error_close_still_does(
        caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from qh3.quic.connection import logger as qh3_logger

    server = await serve(certificate=CERT, settings=QuicSettings(engine="qh3"))
    try:
        with caplog.at_level(logging.WARNING):
            client = await connect(server.url, cadata=CERT.certificate_pem, settings=QuicSettings(engine="qh3"))
            await client.aclose()
            await asyncio.sleep(0.2)  # the server takes the close
            qh3_logger.warning("Native peer close: %r", ("peer_closed", True, 0x10, None, b"bad"))
        closes = [r for r in caplog.records if r.getMessage().startswith("Native peer close")]
        assert len(closes) == 1 and "16" in closes[0].getMessage()
    finally:
        await server.aclose()


@pytest.mark.parametrize("server_engine, client_engine",
                         [("qh3", "qh3"), ("qh3", "aioquic"), ("aioquic", "qh3"), ("aioquic", "aioquic")])
async def test_hundreds_of_requests_at_once_on_one_connection(server_engine: str, client_engine: str) -> None:
    """Each draft-18 request is a bidirectional stream: 300 FETCHes held open together
    exceed qh3's own limit of 100 streams and what an aioquic server advertises (128),
    which QuicSettings.max_streams raises."""
    count = 300
    arrived = 0
    all_arrived = asyncio.Event()

    async def on_fetch(request):  # type: ignore[no-untyped-def]
        nonlocal arrived
        arrived += 1
        if arrived == count:
            all_arrived.set()
        await asyncio.wait_for(all_arrived.wait(), STEP)  # every request is open at once
        sender = request.accept()
        await sender.send(0, 0, request.track_name)
        sender.close()

    server = await serve(certificate=CERT, handlers={"fetch": on_fetch}, settings=QuicSettings(engine=server_engine))
    try:
        client = await connect(server.url, cadata=CERT.certificate_pem, settings=QuicSettings(engine=client_engine))
        try:
            async def one(i: int) -> bytes:
                result = await client.fetch(NS, f"t{i}", (0, 0), (0, 0), timeout=STEP)
                return b"".join([obj.payload async for obj in result])

            got = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(count))), 3 * STEP)
            assert got == [b"t%d" % i for i in range(count)]
        finally:
            await client.aclose()
    finally:
        await server.aclose()


def test_the_binding_is_reachable_from_the_moqt_package_and_each_module_imports_alone() -> None:
    import kvsp_moq.moqt as moqt
    from kvsp_moq.moqt import quic

    assert moqt.connect is quic.connect and moqt.QuicSettings is quic.QuicSettings
    modules = ["settings", "protocol", "core", "subscriber", "publisher", "incoming", "connection", "endpoints",
               "aioquic_engine", "qh3_engine"]
    code = "import importlib, sys; [importlib.import_module(f'kvsp_moq.moqt.quic.{m}') for m in sys.argv[1:]]"
    for module in modules:  # each one first, in a fresh interpreter: no import cycle bites
        done = subprocess.run([sys.executable, "-c", code, module], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, (module, done.stderr)
