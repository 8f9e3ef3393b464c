"""`kvsp bench gateway --quick` runs to the end and its JSON is whole and consistent: every arm
answered every request, the token counts add up, the ratio is the one of its figures. Speed is
not asserted (two shared cores)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvsp_moq.bench.gateway import _workload, requests_of

ROOT = Path(__file__).resolve().parent.parent
ARM_KEYS = {"requests", "ttft_ms_p50", "ttft_ms_p99", "requests_per_s", "prompt_tokens",
            "prompt_tokens_computed", "prompt_tokens_loaded"}


def test_the_quick_benchmark_prints_consistent_json(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import sys; from kvsp_moq.cli import main; sys.exit(main())",
         "bench", "gateway", "--quick"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout)
    w = _workload(True)
    prompts = requests_of(w)
    assert out["workload"]["requests"] == len(prompts) == w["prefixes"] * w["questions_per_prefix"]
    # the prefixes do not fit one engine's own cache
    assert out["workload"]["prefix_blocks_all"] > w["engine_cache_blocks"]
    total = sum(len(p) for p in prompts)
    for name in ("kvsp", "round_robin", "single"):
        arm = out[name]
        assert ARM_KEYS <= set(arm), (name, arm)
        assert arm["requests"] == len(prompts)
        assert arm["prompt_tokens"] == total
        assert arm["prompt_tokens_computed"] + arm["prompt_tokens_loaded"] == total
        assert 0 <= arm["prompt_tokens_loaded"] < total
        assert 0 < arm["ttft_ms_p50"] <= arm["ttft_ms_p99"]
        assert arm["requests_per_s"] > 0
    # behind the gateway, engines loaded prefixes from KVSP (the holder), counted by vLLM itself
    assert 0 < out["kvsp"]["prompt_tokens_loaded_from_kvsp"] <= out["kvsp"]["prompt_tokens_loaded"]
    assert 0 < out["gateway_ms_per_request"] <= out["gateway_ms_p99"]
    # the header's mean is the gateway's own two parts, as its /metrics count them
    parts = out["gateway_tokenize_ms_mean"] + out["gateway_route_ms_mean"]
    assert abs(parts - out["gateway_ms_mean"]) < 0.05, out
    ratio = out["kvsp"]["ttft_ms_p50"] / out["round_robin"]["ttft_ms_p50"]
    assert abs(out["ttft_p50_kvsp_vs_round_robin"] - ratio) < 1e-3
