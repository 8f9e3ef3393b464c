"""Benchmarks behind `kvsp bench`: each prints JSON with a baseline measured in the same run."""

from __future__ import annotations

import importlib
from typing import Any


def run_bench(target: str, *, quick: bool = False, **options: Any) -> dict[str, Any]:
    """Run benchmark `target`; `options` (e.g. moqt's engines and datagram_sizes) go to its
    run() only when given, so targets without them keep their plain signature."""
    module = importlib.import_module(f"kvsp_moq.bench.{target}")
    return module.run(quick=quick, **{k: v for k, v in options.items() if v is not None})
