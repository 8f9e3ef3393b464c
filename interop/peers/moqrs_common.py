"""What the moq-rs peers (moqrs_pub.py, moqrs_sub.py) and the tests agree on: object payloads.

Object `obj` of group `group` is SIZES[(group * OBJECTS + obj) % len(SIZES)] octets of
SHAKE-256 over "SEED:group:obj", so whoever receives it can recompute every byte. Plain Python:
imported both by the moq-rs peers (interop/.venv-moqrs) and by the tests (our venv).
"""

from __future__ import annotations

import hashlib

#: The default frame sizes, cycled: 16 B, 1 KiB, 64 KiB, 256 KiB.
DEFAULT_SIZES = (16, 1 << 10, 64 << 10, 256 << 10)


def parse_sizes(text: str) -> tuple[int, ...]:
    """"16,1024,65536" -> (16, 1024, 65536); suffixes K and M (binary) are allowed."""
    sizes = []
    for part in text.split(","):
        part = part.strip().upper()
        scale = 1
        if part.endswith("K"):
            scale, part = 1 << 10, part[:-1]
        elif part.endswith("M"):
            scale, part = 1 << 20, part[:-1]
        sizes.append(int(part) * scale)
    if not sizes or min(sizes) < 0:
        raise ValueError(f"not a list of sizes: {text!r}")
    return tuple(sizes)


def object_size(group: int, obj: int, objects: int, sizes: tuple[int, ...]) -> int:
    return sizes[(group * objects + obj) % len(sizes)]


def payload(seed: str, group: int, obj: int, objects: int, sizes: tuple[int, ...]) -> bytes:
    return hashlib.shake_256(f"{seed}:{group}:{obj}".encode()).digest(object_size(group, obj, objects, sizes))
