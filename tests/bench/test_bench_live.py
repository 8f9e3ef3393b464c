"""`kvsp bench live` end to end on a small model: the report has the issue's shape, its ratios
are those of the figures it holds, the streamed and loading variants did load their prompt
blocks over MOQT, and the bench refuses outputs that differ. Speeds are not checked: they
depend on the machine."""

from __future__ import annotations

from typing import Any

import pytest

from kvsp_moq.bench import live

SMALL = {"layers": 4, "hidden": 128, "heads": 4, "kv_heads": 2, "intermediate": 256,
         "max_positions": 1024}
PROMPT = 128


def ratio(a: float, b: float) -> float:
    return round(a / b, 3)


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    # At a real path's datagram size: every process of the bench (agents, relay) uses it.
    return live.run(quick=True, model=SMALL, prompt_tokens=PROMPT, rounds=1, datagram_size="1452")


def test_pd_figures_and_their_ratios(report: dict[str, Any]) -> None:
    pd = report["pd"]
    assert pd["prompt_tokens"] == PROMPT
    ttft = pd["ttft_ms"]
    assert set(ttft) == {"single", "streamed", "load_after_prefill"}
    assert all(v > 0 for v in ttft.values()), ttft
    assert pd["streamed_vs_single"] == ratio(ttft["streamed"], ttft["single"])
    assert pd["streamed_vs_load_after_prefill"] == ratio(ttft["streamed"], ttft["load_after_prefill"])
    assert set(pd["cpu_s"]) == {"producer", "consumer", "relay"}
    assert pd["cpu_s"]["producer"] > 0 and pd["cpu_s"]["consumer"] > 0
    floor = round(sum(pd["cpu_s"].values()) / report["cores"] * 1000, 1)
    assert pd["streamed_cpu_floor_ms"] == floor
    assert pd["streamed_vs_cpu_floor"] == ratio(ttft["streamed"], floor)
    # Where the CPU went: the producer's model ran, the consumer's event loop took the layers in.
    threads = pd["streamed_cpu_by_thread_s"]
    assert threads["producer"]["model"] > 0 and threads["consumer"]["event_loop"] > 0, threads
    # B took every loadable prompt block from A over MOQT, in both variants; single computed all.
    loadable = (PROMPT - 1) // live.B
    for variant in ("streamed", "load_after_prefill"):
        assert pd["sources"][variant] == {"moqt": loadable, "http": 0,
                                          "recompute": PROMPT // live.B - loadable}, pd["sources"]
    assert pd["sources"]["single"]["recompute"] == PROMPT // live.B


def test_herd_figures_and_their_ratios(report: dict[str, Any]) -> None:
    herd = report["herd"]
    assert herd["instances"] == live.HERD == 4
    assert herd["prefix_tokens"] == PROMPT - live.B
    cpu, whole, ttft = herd["prefill_cpu_s"], herd["request_cpu_s"], herd["ttft_ms"]
    assert set(cpu) == {"herd", "one_prefill"}
    assert set(whole) == {"herd", "one_request", "without_live"}
    # The prefill's CPU comes from runs of one new token, the whole requests' from the others:
    # one instance's prefill costs it less than its whole request.
    assert cpu["one_prefill"] == report["pd"]["single_prefill_cpu_s"]
    assert whole["one_request"] == report["pd"]["single_cpu_s"]
    assert 0 < cpu["one_prefill"] < whole["one_request"]
    assert 0 < cpu["herd"] < whole["herd"]
    assert ttft["single"] == report["pd"]["ttft_ms"]["single"]
    assert herd["prefill_cpu_vs_one"] == ratio(cpu["herd"], cpu["one_prefill"])
    assert herd["request_cpu_vs_one"] == ratio(whole["herd"], whole["one_request"])
    assert herd["without_live_cpu_vs_one"] == ratio(whole["without_live"], whole["one_request"])
    assert herd["max_ttft_vs_single"] == ratio(ttft["max_in_herd"], ttft["single"])
    assert ttft["max_in_herd"] == round(max(ttft["in_herd"]), 1)
    assert len(ttft["in_herd"]) == 4
    # The first instance computes the prefix; those that did not compute it loaded it over
    # MOQT (which ones depends on when the first one's in-production records were found).
    computed = herd["computed_by"][0]
    assert computed[0] == 0, herd
    loaded = [s for i, s in enumerate(herd["sources"]) if i not in computed]
    assert all(s["moqt"] == (PROMPT - 1) // live.B for s in loaded), herd["sources"]
    if loaded:
        assert herd["producer_egress_copies"] > 0
    assert herd["computed_by_prefill"][0][0] == 0, herd
    # Without it every instance that found nothing computed (at least the first).
    assert 0 in herd["computed_by_without_live"][0]
    # Page faults per process: the producer's store keeps the new blocks, on pages it had not
    # touched before.
    assert set(herd["page_faults"]) == {"agent0", "agent1", "agent2", "agent3", "relay"}
    assert herd["page_faults"]["agent0"] > 0, herd["page_faults"]


def test_the_outputs_were_compared(report: dict[str, Any]) -> None:
    assert report["outputs_identical"] is True
    assert report["targets"] == live.TARGETS
    assert report["datagram_size"] == 1452


def test_the_processes_get_the_datagram_size_of_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSP_MOQT_DATAGRAM_SIZE", "9000")
    assert live._datagram_size(None) == 9000  # as for any service
    assert live._datagram_size("loopback") is None
    assert live.child_env(None).get("KVSP_MOQT_DATAGRAM_SIZE") is None
    assert live.child_env(1452)["KVSP_MOQT_DATAGRAM_SIZE"] == "1452"


@pytest.mark.parametrize("argv, message", [
    (["--datagram-size", "600"], "--datagram-size: 600: QUIC needs at least 1,200 bytes"),
    (["--datagram-size", "1452,9000"], "--datagram-size: bench live runs at one size"),
    (["--engine", "qh3"], "--engine: only for bench moqt"),
])
def test_bad_options_of_bench_live_are_refused(argv: list[str], message: str) -> None:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "kvsp_moq.cli", "bench", "live", *argv],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_outputs_that_differ_are_refused() -> None:
    live.same_outputs("pd streamed", [5, 6, 7], [[5, 6, 7], [5, 6, 7]])
    with pytest.raises(live.OutputsDiffer, match="pd streamed"):
        live.same_outputs("pd streamed", [5, 6, 7], [[5, 6, 7], [5, 6, 8]])
