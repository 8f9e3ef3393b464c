"""Command-line value types the services share: sizes, counts and HOST:PORT.

Each `kvsp` command declares its own options, but a size or an address means the same thing in
all of them, so they are parsed in one place.
"""

from __future__ import annotations

import argparse
import re
from typing import Callable

from kvsp_moq.errors import SettingError

__all__ = ["parse_size", "positive_int", "parse_listen", "listen_type"]

_SIZE = re.compile(r"^(\d+)\s*([kmgt]i?b?|b)?$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """An argparse type: octets from "1073741824", "512M", "4GiB" and the like (binary units)."""
    m = _SIZE.match(text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 512M, 4G)")
    return int(m.group(1)) * _UNITS[(m.group(2) or "").lower()[:1]]


def positive_int(text: str) -> int:
    """An argparse type: a whole number above zero."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {value}")
    return value


def parse_listen(text: str, default_port: int | None = None) -> tuple[str, int]:
    """(host, port) from "HOST:PORT", "[v6]:PORT", ":PORT" (loopback) or, with a default port,
    a bare "HOST"; a SettingError naming --listen otherwise."""
    host, sep, port = text.strip().rpartition(":")
    if not sep and default_port is not None:
        host, port = text.strip(), str(default_port)
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise SettingError(f"--listen must be HOST:PORT, got {text!r}", member="listen")
    return host.strip("[]") or "127.0.0.1", int(port)


def listen_type(default_port: int | None = None) -> Callable[[str], tuple[str, int]]:
    """An argparse type for HOST:PORT options (a bare HOST takes `default_port`)."""

    def parse(text: str) -> tuple[str, int]:
        try:
            return parse_listen(text, default_port)
        except SettingError as e:
            raise argparse.ArgumentTypeError(f"not HOST:PORT: {text!r}") from e

    return parse
