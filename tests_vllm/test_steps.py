"""The scheduler's per-step plans beyond one request in one step: prefills chunked over several
steps save every block in the step that completes it, and several requests loading in one step
each get their own blocks, with outputs identical to vLLM without the connector."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests_vllm.conftest import BLOCK, Engine, free_port, prompt

SHARED = prompt(100, seed=21)


def _config(index_url: str, keys_file: Path, tmp_path: Path, port: int) -> dict[str, Any]:
    return {"index": index_url, "scope_keys": str(keys_file), "scope": "team",
            "listen": f"127.0.0.1:{port}", "data": str(tmp_path / "holder")}


def test_chunked_prefill_saves_and_loads_every_block(model_dir: Path, index_url: str,
                                                     keys_file: Path, tmp_path: Path,
                                                     reference: Any) -> None:
    tokens = prompt(230, seed=22)  # 7 complete blocks before the last token
    (expected,) = reference(tokens)
    config = _config(index_url, keys_file, tmp_path, free_port())
    with Engine(model_dir, config, max_batched=48) as cold:  # 48 tokens per step
        assert cold.generate([tokens]) == [(expected, 0)]
        assert cold.worker_stats()["saved_blocks"] == 7
    with Engine(model_dir, config, max_batched=48) as warm:
        [(out, cached)] = warm.generate([tokens])
        stats = warm.worker_stats()
    assert out == expected and cached == 7 * BLOCK
    assert stats["loaded_blocks"] == 7 and stats["load_errors"] == 0, stats


def test_requests_loading_in_the_same_step(model_dir: Path, index_url: str, keys_file: Path,
                                           tmp_path: Path, reference: Any) -> None:
    first = SHARED + prompt(20, seed=23)
    second = SHARED + prompt(50, seed=24)   # shares 3 blocks with the first, has 4 of its own
    third = prompt(120, seed=25)            # nothing cached
    expected = reference(first, second, third)
    config = _config(index_url, keys_file, tmp_path, free_port())
    with Engine(model_dir, config) as engine:
        assert engine.generate([first]) == [(expected[0], 0)]
        got = engine.generate_together([first, second, third])
        stats = engine.worker_stats()
    assert [tokens for tokens, _ in got] == expected
    assert [cached for _, cached in got] == [3 * BLOCK, 3 * BLOCK, 0]
    assert stats["loaded_blocks"] == 6 and stats["load_errors"] == 0, stats
