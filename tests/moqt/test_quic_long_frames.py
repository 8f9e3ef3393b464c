"""Datagrams above 16 KiB: aioquic 1.7 writes a STREAM frame's Length as a fixed 2-byte
varint, so frames of more than 16,383 data bytes are corrupt. quic.py carries a narrow fix
for aioquic 1.7.x (quic/aioquic_engine.py), applied only when the datagram size needs it."""

import asyncio
import hashlib
import os

import aioquic
import pytest
from aioquic.quic.packet import QuicErrorCode

from kvsp_moq.errors import SettingError
from kvsp_moq.moqt.certs import generate_self_signed
from kvsp_moq.moqt.errors import SessionClosed
from kvsp_moq.moqt.quic import LOOPBACK_DATAGRAM_SIZE, QuicSettings, connect, serve
from kvsp_moq.moqt.quic import aioquic_engine as moqt_quic
from kvsp_moq.moqt.quic.aioquic_engine import LONG_FRAME_DATAGRAM_SIZE

CERT = generate_self_signed()
NS = ("kvsp", "long-frames")
MIB = 1024 * 1024
STEP = 10.0
LARGE = 60_000

pinned = pytest.mark.skipif(not aioquic.__version__.startswith("1.7."),
                            reason=f"shows a bug of aioquic 1.7.x; installed: {aioquic.__version__}")


async def transfer(settings: QuicSettings, objects: list[bytes], *, sizes: list[int] | None = None) -> list[bytes]:
    """A FETCH of `objects` (group 0) over 127.0.0.1, both ends with `settings`; returns
    the payloads received. `sizes` collects the lengths of the datagrams the server sent."""

    async def on_fetch(request):
        sender = request.accept()
        for i, payload in enumerate(objects):
            await sender.send(0, i, payload)
        sender.close()

    def watch(connection):
        if sizes is None:
            return
        quic = connection._quic
        original = quic.datagrams_to_send

        def datagrams_to_send(now):
            out = original(now=now)
            sizes.extend(len(data) for data, _ in out)
            return out

        quic.datagrams_to_send = datagrams_to_send

    server = await serve(certificate=CERT, settings=settings, handlers={"fetch": on_fetch}, on_connection=watch)
    try:
        client = await asyncio.wait_for(
            connect(server.url, cadata=CERT.certificate_pem, settings=settings), STEP)
        try:
            result = await asyncio.wait_for(client.fetch(NS, "1", (0, 0), (0, len(objects) - 1)), STEP)
            got = []

            async def read():
                async for obj in result:
                    got.append(obj.payload)

            await asyncio.wait_for(read(), STEP)
            return got
        finally:
            await client.aclose()
    finally:
        await server.aclose()


@pinned
async def test_unpatched_aioquic_corrupts_stream_frames_above_16383_bytes(monkeypatch):
    # The connections use aioquic's own _write_stream_frame with 32,000-byte datagrams.
    monkeypatch.setattr(moqt_quic, "_LongFrameConnection", moqt_quic._ConsumptionWindowConnection)
    settings = QuicSettings(engine="aioquic", max_datagram_size=LARGE)
    payload = hashlib.shake_256(b"long frames").digest(1 * MIB)
    with pytest.raises((SessionClosed, asyncio.TimeoutError)) as failure:
        await transfer(settings, [payload])
    # The receiver reads a wrong frame length and closes the connection.
    if isinstance(failure.value, SessionClosed):
        assert failure.value.error_code == QuicErrorCode.FRAME_ENCODING_ERROR, failure.value


@pinned
async def test_patched_connection_sends_32000_byte_datagrams_byte_identical():
    settings = QuicSettings(engine="aioquic", max_datagram_size=LARGE)
    objects = [hashlib.shake_256(b"%d" % i).digest(MIB // 2) for i in range(8)] + [b"", b"x" * 16_384, b"y" * 16_383]
    sizes: list[int] = []
    got = await transfer(settings, objects, sizes=sizes)
    assert got == objects
    assert max(sizes) > LONG_FRAME_DATAGRAM_SIZE + 10_000  # frames far above 16,383 bytes went out
    assert max(sizes) <= LARGE


async def test_16384_byte_datagrams_need_no_patch():
    settings = QuicSettings(engine="aioquic", max_datagram_size=LONG_FRAME_DATAGRAM_SIZE)
    assert moqt_quic._connection_class(settings.max_datagram_size) is moqt_quic._ConsumptionWindowConnection
    objects = [os.urandom(300_000), os.urandom(5)]
    assert await transfer(settings, objects) == objects


def test_the_patch_is_chosen_only_when_the_datagram_size_needs_it():
    assert not moqt_quic._check_datagram_size(1200)
    assert not moqt_quic._check_datagram_size(LONG_FRAME_DATAGRAM_SIZE, "9.9.9")
    assert moqt_quic._check_datagram_size(LONG_FRAME_DATAGRAM_SIZE + 1, "1.7.2")
    assert moqt_quic._check_datagram_size(LARGE, "1.7.0")
    if aioquic.__version__.startswith("1.7."):
        assert moqt_quic._connection_class(LARGE) is moqt_quic._LongFrameConnection


@pytest.mark.parametrize("version", ["1.6.0", "1.8.0", "2.0.0"])
def test_large_datagrams_are_refused_on_an_unverified_aioquic(monkeypatch, version):
    with pytest.raises(ValueError, match="not verified"):
        moqt_quic._check_datagram_size(LARGE, version)
    monkeypatch.setattr(moqt_quic.aioquic, "__version__", version)
    with pytest.raises(SettingError, match=r"max_datagram_size <= 16384"):
        QuicSettings(engine="aioquic", max_datagram_size=LARGE).quic_configuration(is_client=True)
    QuicSettings(engine="aioquic", max_datagram_size=LONG_FRAME_DATAGRAM_SIZE).quic_configuration(is_client=True)
    monkeypatch.setattr(moqt_quic, "_VERIFIED_AIOQUIC_VERSIONS", frozenset({version}))
    assert not moqt_quic._check_datagram_size(LARGE)  # verified: aioquic's own writer is used


def test_the_default_datagram_size_follows_the_installed_aioquic(monkeypatch):
    monkeypatch.delenv("KVSP_MOQT_DATAGRAM_SIZE", raising=False)
    settings = QuicSettings(engine="aioquic")
    assert settings.max_datagram_size is None  # chosen by destination
    if aioquic.__version__.startswith("1.7."):
        assert settings.datagram_size_for("127.0.0.1") == LOOPBACK_DATAGRAM_SIZE == LARGE
    assert settings.datagram_size_for("198.18.0.1") == 1452
    monkeypatch.setattr(moqt_quic, "LARGEST_DATAGRAM_SIZE", LONG_FRAME_DATAGRAM_SIZE)
    assert settings.datagram_size_for("::1") == LONG_FRAME_DATAGRAM_SIZE
    settings.quic_configuration(is_client=False)  # usable as it is
