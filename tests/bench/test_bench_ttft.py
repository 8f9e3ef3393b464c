"""`kvsp bench ttft` end to end on a small model: every fraction is measured, the HTTP variant
reads over HTTP and the MOQT variant through the relay, and the timeline figure is written. Only
the shape of the report is checked; its speeds depend on the machine."""

from __future__ import annotations

from pathlib import Path

import pytest
from matplotlib.image import imread

from kvsp_moq.bench import ttft

SMALL = {"layers": 4, "hidden": 128, "heads": 4, "kv_heads": 2, "intermediate": 256}
PROMPT = 128


def test_the_bench_reports_http_and_moqt_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSP_BENCH_OUT", str(tmp_path))
    out = ttft.run(quick=True, model=SMALL, prompt_tokens=PROMPT, repeats=1)

    rows = {r["cached_fraction"]: r for r in out["fractions"]}
    assert set(rows) == set(ttft.FRACTIONS)
    assert rows[0.0]["recompute_ms"] > 0
    assert rows[0.0]["sources"]["recompute"] == PROMPT // ttft.B
    for f in ttft.FRACTIONS:
        if f == 0:
            continue
        row = rows[f]
        blocks = int(f * PROMPT) // ttft.B
        assert row["cached_tokens"] == blocks * ttft.B
        for k in ("recompute_ms", "load_then_compute_ms", "pipelined_ms", "pipelined_moqt_ms",
                  "load_ms", "compute_ms", "pipelined_over_max_load_compute",
                  "pipelined_moqt_over_max_load_compute", "pipelined_over_fixed_plus_max",
                  "pipelined_moqt_over_fixed_plus_max"):
            assert row[k] > 0, (k, row)
        assert 0 <= row["fixed_ms"] < row["load_then_compute_ms"]
        assert row["pipelined_over_fixed_plus_max"] < row["pipelined_over_max_load_compute"] or \
            row["fixed_ms"] == 0
        assert row["sources"]["http"] == blocks and row["sources"]["moqt"] == 0, row["sources"]
        moqt = row["pipelined_moqt_sources"]
        assert moqt["moqt"] == blocks and moqt["http"] == 0, moqt

    png = Path(out["timeline_png"])
    assert png.parent == tmp_path and png.is_file()
    assert imread(png).ndim == 3  # a PNG matplotlib reads back (tests/bench/test_figures.py: its texts)
