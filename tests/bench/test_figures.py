"""The benchmarks' figures: each, given data shaped as its benchmark reports it, has axes with
units, a legend in words and a title, and writes a PNG that matplotlib reads back; without
matplotlib the figure is skipped with one line naming the extra."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import pytest
from matplotlib.figure import Figure
from matplotlib.image import imread

from kvsp_moq.bench import figures

#: Four layers of `Timeline.to_json()`: layer 0 computed at once, the rest loaded first.
SPANS: list[dict[str, Any]] = [
    {"layer": 0, "load": [0.4, 3.1], "wait": 3.1, "compute": [3.1, 5.0]},
    {"layer": 1, "load": [0.5, 4.2], "wait": 5.0, "compute": [5.0, 6.8]},
    {"layer": 2, "load": [3.2, 6.0], "wait": 6.8, "compute": [6.8, 8.9]},
    {"layer": 3, "load": [None, None], "wait": None, "compute": None},
]


def _run(seconds_each: list[float], holder: int, relay: int) -> dict[str, Any]:
    return {"seconds_all": max(seconds_each), "seconds_each": seconds_each, "holder_egress_bytes": holder,
            "relay_egress_bytes": relay, "layers": {"moqt": 8}, "fallbacks": 0, "cpu_seconds": {}}


PREFIX = 2 * 8 * figures.MiB
#: `fleet.bench.fanout()`'s result for 4 clients, 2 rounds.
FANOUT: dict[str, Any] = {
    "agents": 4, "block_bytes": PREFIX, "blocks": 2, "bytes_per_block": 8 * figures.MiB,
    "moqt": {"seconds_all": 1.2, "holder_egress_bytes": int(1.05 * PREFIX), "relay_egress_bytes": 4 * PREFIX,
             "runs": [_run([1.0, 1.1, 1.1, 1.2], int(1.05 * PREFIX), 4 * PREFIX),
                      _run([0.9, 1.0, 1.2, 1.3], int(1.06 * PREFIX), 4 * PREFIX)]},
    "http": {"seconds_all": 2.9, "holder_egress_bytes": int(4.1 * PREFIX),
             "runs": [_run([2.1, 2.5, 2.8, 2.9], int(4.1 * PREFIX), 0),
                      _run([2.0, 2.6, 2.7, 3.0], int(4.1 * PREFIX), 0)]},
}

TTFL_MS = {"moqt": [2.0, 2.5, 3.1, 4.0, 9.5], "http": [1.5, 1.7, 2.2, 30.0]}


def _texts(fig: Figure) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {"xlabel": [], "ylabel": [], "title": [], "legend": []}
    for ax in fig.axes:
        out["xlabel"].append(ax.get_xlabel())
        out["ylabel"].append(ax.get_ylabel())
        out["title"].append(ax.get_title())
        legend = ax.get_legend()
        out["legend"] += [t.get_text() for t in legend.get_texts()] if legend else []
    for legend in fig.legends:
        out["legend"] += [t.get_text() for t in legend.get_texts()]
    return out


def _read_back(path: str | None, expected: Path) -> None:
    assert path == str(expected)
    pixels = imread(expected)
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100


def test_timeline_names_its_bars_and_its_units(tmp_path: Path) -> None:
    fig = figures.timeline_figure(SPANS)
    texts = _texts(fig)
    assert texts["xlabel"] == ["time since the request arrived (ms)"]
    assert texts["ylabel"] == ["layer"]
    assert any("loading" in t for t in texts["legend"]) and any("computing" in t for t in texts["legend"])
    assert texts["title"][0]
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0", "1", "2", "3"]
    assert len(ax.collections) == 3 + 3  # load and compute bars of the three layers that have them
    _read_back(figures.write(tmp_path / "t.png", figures.timeline_figure, SPANS, "a title"), tmp_path / "t.png")


def test_fanout_shows_clients_done_over_time_and_octets_per_interface(tmp_path: Path) -> None:
    fig = figures.fanout_figure(FANOUT)
    texts = _texts(fig)
    assert texts["xlabel"][0] == "time since the common start (s)"
    assert texts["ylabel"] == ["clients with the whole prefix, verified", "octets sent, in copies of the prefix"]
    assert "MOQT through the relay, round 1" in texts["legend"]
    assert "HTTP from the holder, round 2" in texts["legend"]
    assert "one copy per client (4)" in texts["legend"]
    assert all(texts["title"])
    bars = fig.axes[1]
    assert [round(p.get_height(), 2) for p in bars.patches] == [1.05, 4.0, 4.1]
    assert [t.get_text() for t in bars.texts] == ["1.05x", "4.00x", "4.10x"]
    _read_back(figures.write(tmp_path / "f.png", figures.fanout_figure, FANOUT), tmp_path / "f.png")


def test_ttfl_distribution_per_transport(tmp_path: Path) -> None:
    fig = figures.ttfl_figure(TTFL_MS, {"moqt": 32, "http": 32})
    texts = _texts(fig)
    assert texts["xlabel"] == ["time to the first verified layer (ms, log scale)"]
    assert texts["ylabel"] == ["share of fetches with their first layer"]
    assert "MOQT through the relay, 32 clients (5 fetches)" in texts["legend"]
    assert "HTTP p99: 30.0 ms" in texts["legend"] and "MOQT p50: 3.1 ms" in texts["legend"]
    assert texts["title"][0]
    _read_back(figures.write(tmp_path / "l.png", figures.ttfl_figure, TTFL_MS), tmp_path / "l.png")


def test_ttfl_without_fetches_still_draws() -> None:
    texts = _texts(figures.ttfl_figure({"moqt": [], "http": []}))
    assert texts["xlabel"][0] and texts["title"][0]


def test_without_matplotlib_the_figure_is_skipped_with_the_extra_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # an import of it fails
    with caplog.at_level(logging.WARNING, logger="kvsp.bench.figures"):
        assert figures.write(tmp_path / "t.png", figures.timeline_figure, SPANS) is None
    assert not (tmp_path / "t.png").exists()
    [record] = caplog.records
    assert "pip install 'kvsp-moq[plots]'" in record.getMessage() and "\n" not in record.getMessage()


def test_figures_go_to_kvsp_bench_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSP_BENCH_OUT", str(tmp_path))
    assert figures.out_dir() == tmp_path
