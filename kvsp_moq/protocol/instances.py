"""Identifiers of inference instances."""

from __future__ import annotations

import hashlib

from kvsp_moq.protocol.urls import base_url


def instance_id(url: str) -> str:
    """The path identifier of an instance at the PC (`{pc}instances/{id}/...`, DESIGN §3): the
    first 16 octets, in hex, of SHA-256 over its base URL with its trailing slash, like replica
    ids."""
    return hashlib.sha256(base_url(url).encode()).digest()[:16].hex()
