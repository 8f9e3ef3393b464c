"""QUIC transport parameters (RFC 9000 section 18) that the engines advertise differently
from their defaults: rewritten in the encoded form, since neither engine has a setting."""

from __future__ import annotations

from ..varint import decode_quic_varint, encode_quic_varint

__all__ = ["MAX_ACK_DELAY", "MAX_UDP_PAYLOAD_SIZE", "INITIAL_MAX_STREAMS_BIDI", "INITIAL_MAX_STREAMS_UNI",
           "with_transport_parameters", "with_max_udp_payload_size"]

MAX_UDP_PAYLOAD_SIZE = 0x03
INITIAL_MAX_STREAMS_BIDI = 0x08
INITIAL_MAX_STREAMS_UNI = 0x09
#: milliseconds (RFC 9000 section 18.2); both engines send 25
MAX_ACK_DELAY = 0x0B


def with_transport_parameters(parameters: bytes, values: dict[int, int]) -> bytes:
    """Encoded transport parameters with the integer parameters of `values` set (added
    when absent); every other parameter is kept octet for octet."""
    out = bytearray()
    offset = 0
    while offset < len(parameters):
        start = offset
        identifier, offset = decode_quic_varint(parameters, offset)
        length, offset = decode_quic_varint(parameters, offset)
        offset += length
        if identifier not in values:
            out += parameters[start:offset]
    for identifier, number in values.items():
        value = encode_quic_varint(number)
        out += encode_quic_varint(identifier) + encode_quic_varint(len(value)) + value
    return bytes(out)


def with_max_udp_payload_size(parameters: bytes, size: int) -> bytes:
    """Encoded transport parameters with max_udp_payload_size set to `size`."""
    return with_transport_parameters(parameters, {MAX_UDP_PAYLOAD_SIZE: size})
