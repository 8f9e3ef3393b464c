"""Checks 1 and 2 of the vLLM connector: a cold request publishes its prompt's blocks (the Index
Service has records of them), and a restarted engine serves the same prompt with the prefix
loaded from KVSP and greedy output identical to vLLM without the connector; over HTTP, and over
MOQT through a relay.

The embedded holder keeps its blocks under "data", so the restarted engine's holder has them
again and republishes them; the load goes through the index like any other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvsp_moq.protocol.keys import scope_id
from kvsp_moq.scope_keys import read_scope_keys
from tests_vllm.conftest import BLOCK, Engine, block_keys, compat_of, eventually, free_port, prompt, records_of

PROMPT = prompt(110, seed=1)  # 3 complete blocks before the last token


def _config(index_url: str, keys_file: Path, data: Path, port: int, **more: Any) -> dict[str, Any]:
    return {"index": index_url, "scope_keys": str(keys_file), "scope": "team",
            "holder": "embedded", "listen": f"127.0.0.1:{port}", "data": str(data), **more}


def _published(index_url: str, keys_file: Path, model_dir: Path, *, moqt: bool) -> list[str]:
    key = read_scope_keys(keys_file)["team"]
    compat = compat_of(model_dir)
    keys = block_keys(key, compat, PROMPT)
    assert len(keys) == len(PROMPT) // BLOCK == 3

    def complete() -> bool:
        found = records_of(index_url, scope_id(key).hex(), compat, keys)
        return all(any(r.is_moqt for r in rs) == moqt and any(not r.is_moqt for r in rs)
                   for rs in found)

    eventually(complete, "records of every complete prompt block")
    return keys


def _cold_then_restart(model_dir: Path, index_url: str, keys_file: Path, tmp_path: Path,
                       reference: Any, **more: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    (expected,) = reference(PROMPT)
    port = free_port()
    config = _config(index_url, keys_file, tmp_path / "holder", port, **more)
    with Engine(model_dir, config) as cold:
        [(tokens, cached)] = cold.generate([PROMPT])
        assert tokens == expected and cached == 0
        _published(index_url, keys_file, model_dir, moqt="relay" in more)
        stats = cold.worker_stats()
        assert stats["saved_blocks"] == 3 and stats["loaded_blocks"] == 0, stats
    with Engine(model_dir, config) as warm:  # a restart: a new engine, the same holder data
        [(tokens, cached)] = warm.generate([PROMPT])
        worker, scheduler = warm.worker_stats(), warm.scheduler_stats()
    assert tokens == expected, "output with the prefix loaded from KVSP differs from recompute"
    assert cached == 3 * BLOCK
    assert scheduler["hit_tokens"] == 3 * BLOCK and scheduler["load_errors"] == 0, scheduler
    assert worker["loaded_blocks"] == 3 and worker["load_errors"] == 0, worker
    return worker, scheduler


def test_cold_publishes_and_restart_loads_over_http(model_dir: Path, index_url: str,
                                                    keys_file: Path, tmp_path: Path,
                                                    reference: Any) -> None:
    worker, _ = _cold_then_restart(model_dir, index_url, keys_file, tmp_path, reference)
    assert worker["loaded_by"] == {"http": 3}, worker


def test_cold_publishes_and_restart_loads_over_moqt(model_dir: Path, index_url: str,
                                                    keys_file: Path, tmp_path: Path,
                                                    reference: Any, relay: Any) -> None:
    worker, _ = _cold_then_restart(model_dir, index_url, keys_file, tmp_path, reference,
                                   relay=relay.url, relay_timeout_s=5.0)
    assert worker["loaded_by"] == {"moqt": 3}, worker
