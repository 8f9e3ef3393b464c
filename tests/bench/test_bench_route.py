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
