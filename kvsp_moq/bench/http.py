"""`kvsp bench http`: block GETs against raw TCP, and IS lookups against a bare endpoint."""

from __future__ import annotations

from typing import Any


def run(*, quick: bool = False) -> dict[str, Any]:
    from kvsp_moq.bench.http_blocks import run_blocks

    out: dict[str, Any] = {"benchmark": "http", "blocks": run_blocks(quick)}
    try:
        from kvsp_moq.bench.http_lookup import run_lookup
    except ImportError as e:  # the lookup benchmark ships with the Index Service
        out["lookup"] = {"error": str(e)}
    else:
        out["lookup"] = run_lookup(quick)
    return out
