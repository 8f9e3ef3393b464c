"""Small, strict readers for JSON members; every refusal names the member at fault."""

from __future__ import annotations

import math
import re
import uuid
from typing import Any, Callable, TypeVar

from kvsp_moq.errors import BadRecord

T = TypeVar("T")
_HEX_RE = re.compile(r"[0-9a-fA-F]*")
_SPACE_RE = re.compile(r"\s")
_DIGEST_RE = re.compile(r"^sha-256:([0-9a-f]{64})$")
MAX_UINT = 2**53 - 1  # the largest integer every JSON implementation keeps exact


def obj(data: Any, where: str = "record") -> dict:
    if not isinstance(data, dict):
        raise BadRecord("must be a JSON object", member=where)
    return data


def required(data: dict, name: str, where: str = "") -> Any:
    if name not in data:
        raise BadRecord("required member is missing", member=where + name)
    return data[name]


def string(value: Any, member: str, *, allow_empty: bool = False, max_len: int = 8192) -> str:
    if not isinstance(value, str) or (not value and not allow_empty):
        raise BadRecord("must be a non-empty string", member=member)
    if len(value) > max_len:
        raise BadRecord(f"longer than {max_len} characters", member=member)
    return value


def integer(value: Any, member: str, *, low: int = 0, high: int = MAX_UINT) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRecord("must be an integer", member=member)
    if not low <= value <= high:
        raise BadRecord(f"must be in [{low}, {high}]", member=member)
    return value


def number(value: Any, member: str, *, low: float = 0.0, high: float = math.inf,
           low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRecord("must be a finite number", member=member)
    if value < low or value > high or (low_open and value == low):
        raise BadRecord(f"must be in {'(' if low_open else '['}{low}, {high}]", member=member)
    return value


def boolean(value: Any, member: str) -> bool:
    if not isinstance(value, bool):
        raise BadRecord("must be true or false", member=member)
    return value


def hexn(value: Any, octets: int, member: str) -> str:
    """Hex text of exactly `octets` octets, normalised to lowercase."""
    if not isinstance(value, str) or len(value) != 2 * octets or not _HEX_RE.fullmatch(value):
        raise BadRecord(f"must be {2 * octets} hex digits", member=member)
    return value.lower()


def hex_array(value: Any, octets: int, member: str, *, min_len: int = 0,
              max_len: int = 1_000_000) -> tuple[str, ...]:
    """An array of hex texts of `octets` octets each, normalised to lowercase. Checked in
    bulk, since records list a digest per layer and requests thousands of block keys: C-level
    passes first, the loop (`hexn` per item) only to name the bad element."""
    if not isinstance(value, list):
        raise BadRecord("must be an array", member=member)
    if not min_len <= len(value) <= max_len:
        raise BadRecord(f"must have between {min_len} and {max_len} items", member=member)
    width = 2 * octets
    if set(map(type, value)) <= {str} and set(map(len, value)) <= {width}:
        joined = "".join(value)
        if _HEX_RE.fullmatch(joined):
            if joined.islower() or joined.isdigit() or not joined:
                return tuple(value)
            lower = joined.lower()
            return tuple(lower[i:i + width] for i in range(0, len(lower), width))
    for i, item in enumerate(value):
        hexn(item, octets, f"{member}[{i}]")
    raise AssertionError("unreachable: a bad item was not named")  # pragma: no cover


def digest(value: Any, member: str) -> str:
    if not isinstance(value, str) or not _DIGEST_RE.match(value):
        raise BadRecord('must be "sha-256:" and 64 lowercase hex digits', member=member)
    return value


def uuid_text(value: Any, member: str) -> str:
    if not isinstance(value, str):
        raise BadRecord("must be a UUID string", member=member)
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise BadRecord("must be a UUID", member=member) from None


def url(value: Any, member: str, *, schemes: tuple[str, ...] = ("http", "https", "moqt")) -> str:
    text = string(value, member, max_len=2048)
    scheme, sep, rest = text.partition("://")
    if not sep or scheme.lower() not in schemes or not rest or _SPACE_RE.search(text):
        raise BadRecord(f"must be a URI with scheme {' or '.join(schemes)}", member=member)
    return text


def array(value: Any, member: str, item: Callable[[Any, str], T], *,
          min_len: int = 0, max_len: int = 1_000_000) -> list[T]:
    if not isinstance(value, list):
        raise BadRecord("must be an array", member=member)
    if not min_len <= len(value) <= max_len:
        raise BadRecord(f"must have between {min_len} and {max_len} items", member=member)
    return [item(v, f"{member}[{i}]") for i, v in enumerate(value)]


def token(value: Any, member: str) -> int:
    return integer(value, member, high=0xFFFFFFFF)


def tokens(value: Any, member: str) -> list[int]:
    """A token array; checked in bulk since prompts hold many thousands of tokens."""
    if not isinstance(value, list):
        raise BadRecord("must be an array of integers", member=member)
    # C-level passes first (types, then the range); the loop only to name the bad element.
    if value and (set(map(type, value)) != {int} or min(value) < 0 or max(value) > 0xFFFFFFFF):
        for i, t in enumerate(value):
            if type(t) is not int or not 0 <= t <= 0xFFFFFFFF:
                raise BadRecord("must be an integer in [0, 2^32)", member=f"{member}[{i}]")
    return value


def pair(value: Any, member: str) -> tuple[int, int]:
    if not isinstance(value, list) or len(value) != 2:
        raise BadRecord("must be an array of two integers", member=member)
    return integer(value[0], member + "[0]"), integer(value[1], member + "[1]")
