"""The routing benchmark, in its quick form: it runs, its router decides as the reference
router on the same requests, and its ranking agrees with the baseline that costs every block
separately on the same registry state."""

from __future__ import annotations

from kvsp_moq.bench import route


def test_route_benchmark_agrees_with_its_baseline() -> None:
    result = route.run(quick=True)
    assert result["instances"] == 64 and result["keys_per_prompt"] == 2048
    assert result["matched"] == 2048
    assert result["routes_per_s"] > 0 and result["baseline_ungrouped_routes_per_s"] > 0
    assert 0 < result["lookup_share"] < 1
    assert result["same_choice_as_baseline"] is True
    assert result["same_choices_as_reference"] is True and result["checked_routes"] > 0
    assert result["reference_routes_per_s"] > 0 and result["ratio_to_reference"] > 0


def test_route_benchmark_over_a_shared_store() -> None:
    """`--pcs 2`: one and two PC processes on a Redis of the benchmark's own, each routing
    on its copy of the shared registry, the processes choosing alike."""
    from kvsp_moq.bench.route_pcs import run_pcs

    result = run_pcs(2, quick=True)
    assert [row["pcs"] for row in result["by_pcs"]] == [1, 2]
    for row in result["by_pcs"]:
        assert row["same_choice"] is True and row["routes_per_s_total"] > 0
        assert len(row["routes_per_s_each"]) == row["pcs"]
    assert result["total_ratio_to_one_pc"] == round(
        result["by_pcs"][1]["routes_per_s_total"] / result["by_pcs"][0]["routes_per_s_total"], 2)


def test_pcs_is_refused_outside_bench_route() -> None:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "kvsp_moq.cli", "bench", "http", "--pcs", "2"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--pcs: only for bench route" in r.stderr
