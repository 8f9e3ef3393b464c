"""Benchmarks behind `kvsp bench`: each prints JSON with a baseline measured in the same run."""

from __future__ import annotations

import importlib
from typing import Any


def run_bench(target: str, *, quick: bool = False) -> dict[str, Any]:
    module = importlib.import_module(f"kvsp_moq.bench.{target}")
    return module.run(quick=quick)
