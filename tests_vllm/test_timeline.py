"""Check 5: loads overlap compute. Each attention layer waits (`wait_for_layer_load`) for its own
layer of every loaded block, not for the whole prefix: the timeline of one load shows, per layer,
when its last block's bytes arrived and when the forward pass stopped waiting for it.

Loads go strictly layer-major here ("layers_per_request": 1: layer l of every block is
requested before layer l+1 of any), so the early layers are in long before the last.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvsp_moq.cpus import reserved_cpus
from tests_vllm.conftest import BLOCK, Engine, free_port, prompt

TOKENS = prompt(990, seed=11)  # 30 blocks before the last token


def test_layers_are_computed_while_later_layers_load(model_dir: Path, index_url: str,
                                                      keys_file: Path, tmp_path: Path,
                                                      reference: Any) -> None:
    (expected,) = reference(TOKENS)
    config = {"index": index_url, "scope_keys": str(keys_file), "scope": "team",
              "listen": f"127.0.0.1:{free_port()}", "data": str(tmp_path / "holder"),
              "timeline": True, "layers_per_request": 1}
    with Engine(model_dir, config) as cold:
        assert cold.generate([TOKENS]) == [(expected, 0)]
    with Engine(model_dir, config) as warm:
        [(out, cached)] = warm.generate([TOKENS])
        stats = warm.worker_stats()
        loop_thread = warm.worker_connector._worker.loop.thread
        # On the CPU backend the loader runs on the core vLLM keeps for a KV connector.
        assert stats["cpus"] == sorted(reserved_cpus())
        assert os.sched_getaffinity(loop_thread.native_id) == set(stats["cpus"])
    assert out == expected and cached == 30 * BLOCK
    assert stats["loaded_blocks"] == 30 and stats["load_errors"] == 0, stats
    [timeline] = stats["timelines"]
    t0 = min(t["load_start"] for t in timeline)
    print("\nlayer  arrived  wait(start-end)  ms from the first request")
    for t in timeline:
        print(f"{t['layer']:5d}  {(t['arrived'] - t0) * 1e3:7.1f}  "
              f"{(t['wait_start'] - t0) * 1e3:7.1f}-{(t['wait_end'] - t0) * 1e3:7.1f}")
    last = len(timeline) - 1
    for t in timeline:
        assert t["wait_end"] >= t["arrived"], f"layer {t['layer']} computed before it arrived"
    assert timeline[0]["wait_end"] < timeline[last]["arrived"], (
        "layer 0 waited for the whole prefix: no overlap of loading and computing")
    # The forward pass had computed several layers before the last layer was in.
    computed_early = [t["layer"] for t in timeline[1:] if t["wait_start"] < timeline[last]["arrived"]]
    assert computed_early, "no layer was reached before the last one arrived"
