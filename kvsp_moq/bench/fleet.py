"""`kvsp bench fleet`: fan-out through a relay against HTTP, and MTUs, on a fleet of network
namespaces (`kvsp_moq.fleet.bench`; needs root)."""

from __future__ import annotations

from typing import Any


def run(*, quick: bool = False) -> dict[str, Any]:
    from kvsp_moq.fleet.bench import run as run_fleet

    return run_fleet(quick=quick)
