"""The chunked stream sender (quic/aioquic_engine.py): aioquic's QuicStreamSender with
the written bytes kept as the writer's chunks. Frames, retransmissions and acknowledgements
must behave exactly as aioquic's own sender does."""

import random

import aioquic
import pytest
from aioquic.quic.packet_builder import QuicDeliveryState
from aioquic.quic.stream import QuicStream, QuicStreamSender

from kvsp_moq.moqt.quic.aioquic_engine import _chunked, _ChunkedStreamSender

pytestmark = pytest.mark.skipif(not aioquic.__version__.startswith("1.7."),
                                reason=f"replaces aioquic 1.7's sender; installed: {aioquic.__version__}")


def chunked_sender() -> QuicStreamSender:
    stream = _chunked(QuicStream(stream_id=3, readable=False))
    assert type(stream.sender) is _ChunkedStreamSender
    return stream.sender


def test_frames_carry_the_bytes_written_across_chunks_and_views():
    sender = chunked_sender()
    payload = bytes(range(256)) * 64
    view = memoryview(payload)
    sender.write(b"header")
    sender.write(view[:5000])  # a view of bytes: kept as it is
    sender.write(bytearray(view[5000:9000]))  # a mutable buffer: copied
    sender.write(view[9000:], end_stream=True)
    expected = b"header" + payload
    out = bytearray()
    while True:
        frame = sender.get_frame(1234)
        if frame is None:
            break
        assert type(frame.data) is bytes and frame.offset == len(out)
        out += frame.data
        if frame.fin:
            break
    assert bytes(out) == expected and frame.fin


def test_lost_frames_are_sent_again_and_acknowledged_chunks_are_dropped():
    rng = random.Random(7)
    sender = chunked_sender()
    pieces = [rng.randbytes(rng.randrange(1, 3000)) for _ in range(200)]
    data = b"".join(pieces)
    for i, piece in enumerate(pieces):
        sender.write(piece, end_stream=i == len(pieces) - 1)
    received = bytearray(len(data))
    outstanding = []
    while not sender.is_finished:
        frame = sender.get_frame(rng.randrange(1, 5000))
        if frame is not None:
            outstanding.append(frame)
        if outstanding and (frame is None or rng.random() < 0.5):
            lost = outstanding.pop(rng.randrange(len(outstanding)))
            stop = lost.offset + len(lost.data)
            if rng.random() < 0.2:
                sender.on_data_delivery(QuicDeliveryState.LOST, lost.offset, stop, lost.fin)
            else:
                received[lost.offset:stop] = lost.data
                sender.on_data_delivery(QuicDeliveryState.ACKED, lost.offset, stop, lost.fin)
    assert bytes(received) == data
    assert sender._buffer_start == len(data)
    assert [chunk for chunk in sender._chunks if chunk is not None] == []  # nothing kept
