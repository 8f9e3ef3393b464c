"""`kvsp bench moqt` reports a matrix of QUIC engines x datagram sizes in one run (issue #17):
every cell moves verified blocks and has positive figures; bad options are one line, exit 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvsp_moq.bench import moqt
from kvsp_moq.errors import SettingError
from kvsp_moq.moqt.quic.settings import default_engine

BLOCK = 1 << 20  # one small block size keeps the run short; no timing is asserted


def test_the_quick_matrix_measures_every_cell_with_verified_bytes() -> None:
    report = moqt.run(quick=True, engines="qh3,aioquic", datagram_sizes="1452", sizes=(BLOCK,))
    block = moqt.block_label(BLOCK)
    # The top-level keys of before stay, for the reference cell (the default engine's).
    assert report["reference"] == {"engine": default_engine(), "datagram_size": "1452"}
    for key in ("ours", "aiomoqt_relay", "ratios", "targets", "cpu_parallelism"):
        assert key in report
    assert report["ours"][block]["http"]["mb_per_s"] > 0
    assert list(report["matrix"]) == ["qh3", "aioquic"]
    summary = {row["cell"]: row for row in report["matrix_summary"]}
    assert set(summary) == {"qh3/1452", "aioquic/1452"}
    for engine in ("qh3", "aioquic"):
        cell = report["matrix"][engine]["1452"]
        assert cell["engine"] == engine and cell["datagram_size"] == 1452
        figures = cell["blocks"][block]
        # A run is counted only after every layer matched its digest (else the bench raises).
        for variant in ("moqt_fetch_cold", "moqt_fetch_cached", "moqt_subscribe"):
            assert figures[variant]["runs"] == report["repeats"]
            assert figures[variant]["mb_per_s"] > 0
        assert "http" not in figures  # HTTP is measured once, in the reference cell's run
        # The bare engine moved (and CRC-checked) every octet at the same datagram size.
        assert cell["bare"]["bytes"] > 0 and cell["bare"]["mb_per_s"] > 0
        assert cell["bare"]["largest_datagram_received"] <= 1452
        cpu = cell["cpu"][block]
        assert cpu["moqt_cpu_s_per_gb_per_hop"] > 0 and cpu["bare_cpu_s_per_gb_per_hop"] > 0
        assert cpu["cpu_vs_bare"] > 0
        ratios = cell["ratios"][block]
        assert ratios["vs_http"] > 0 and ratios["vs_bare"] > 0
        assert summary[f"{engine}/1452"]["fetch_cold_mb_s"] == figures["moqt_fetch_cold"]["mb_per_s"]
    assert report["matrix"]["aioquic"]["1452"]["ratios"][block]["vs_aioquic"] == 1.0
    assert report["matrix"]["qh3"]["1452"]["ratios"][block]["vs_aioquic"] > 0
    assert report["matrix"][default_engine()]["1452"].get("reference") is True


def test_options_parse_and_the_environment_keeps_choosing_the_default_size(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSP_MOQT_DATAGRAM_SIZE", raising=False)
    assert moqt.parse_engines(None) == ("aioquic", "qh3")
    assert moqt.parse_engines("qh3, qh3,aioquic") == ("qh3", "aioquic")
    assert moqt.parse_datagram_sizes(None) == (1452, 9000, None)
    assert moqt.parse_datagram_sizes("loopback,9000") == (None, 9000)
    monkeypatch.setenv("KVSP_MOQT_DATAGRAM_SIZE", "9000")
    assert moqt.parse_datagram_sizes(None) == (9000,)
    assert moqt.parse_datagram_sizes("1452") == (1452,)
    for bad in ("100", "70000", "big", ""):
        with pytest.raises(SettingError):
            moqt.parse_datagram_sizes(bad)
    with pytest.raises(SettingError):
        moqt.parse_engines("nope")
    env = moqt.cell_environment("qh3", None)
    assert env["KVSP_QUIC_ENGINE"] == "qh3" and "KVSP_MOQT_DATAGRAM_SIZE" not in env


@pytest.mark.parametrize("args", [
    ["--engine", "nope"],
    ["--datagram-size", "1000"],
    ["--datagram-size", "jumbo"],
])
def test_an_invalid_option_is_one_line_and_exit_status_2(args: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "kvsp_moq.cli", "bench", "moqt", "--quick", *args],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvsp bench: "), done.stderr


def test_matrix_options_are_refused_by_other_benchmarks() -> None:
    done = subprocess.run([sys.executable, "-m", "kvsp_moq.cli", "bench", "core", "--engine", "qh3"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1


def test_a_cell_the_engine_cannot_carry_is_reported_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(moqt, "_unsupported", lambda engine, size: f"{engine} cannot here")
    monkeypatch.setattr(moqt, "cpu_parallelism", lambda: 1.0)
    with pytest.raises(SettingError, match="qh3/1452: qh3 cannot here"):
        moqt.run(quick=True, engines="qh3", datagram_sizes="1452")
