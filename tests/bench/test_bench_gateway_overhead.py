"""`kvsp bench gateway --overhead-only --quick`: the gateway's own time per request without
vLLM, through the CLI as a user runs it; its figures are present and consistent (never timed)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_overhead_only_runs_without_vllm() -> None:
    r = subprocess.run([sys.executable, "-m", "kvsp_moq.cli", "bench", "gateway", "--overhead-only",
                        "--quick"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    w = out["workload"]
    assert w["prompts"] == 24 and w["prompt_tokens"] == 552 and w["engines"] == 2
    assert out["gateway_ms_p99"] >= out["gateway_ms_per_request"] > 0
    assert out["gateway_tokenize_ms_mean"] > 0 and out["gateway_route_ms_mean"] > 0
    # the header's mean is the sum of the two parts' means, from the gateway's /metrics
    assert abs(out["gateway_ms_mean"] - out["gateway_tokenize_ms_mean"]
               - out["gateway_route_ms_mean"]) < 0.01
    for path in ("client", "httpx", "bare_round_trip"):
        figures = out["route_call"][path]
        assert figures["ms_p99"] >= figures["ms_p50"] > 0 and figures["ms_mean"] > 0
    assert out["route_vs_httpx"] == round(out["route_call"]["client"]["ms_p50"]
                                          / out["route_call"]["httpx"]["ms_p50"], 3)
    assert out["targets"] == {"gateway_ms_per_request": 5.0}


def test_overhead_only_is_refused_elsewhere() -> None:
    r = subprocess.run([sys.executable, "-m", "kvsp_moq.cli", "bench", "http", "--overhead-only"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--overhead-only: only for bench gateway" in r.stderr
