"""Base URLs as KVSP writes them: with a trailing slash, so that a resource is the base URL
followed by its path (`{pc}route`, `{holder}blocks/...`), and two spellings of one base URL
compare equal."""

from __future__ import annotations


def base_url(url: str) -> str:
    """`url` with a trailing slash (added when missing)."""
    return url if url.endswith("/") else url + "/"
