"""Prefill and decode apart, with vLLM decoding: a request whose `kv_transfer_params` name the
instance computing its prompt ("kvsp_prefill_at") is not looked up; the connector derives the
producer's block tracks from its URL and subscribes through the relay at once (the relay holds
the SUBSCRIBE until the producer publishes), and vLLM's forward pass takes each layer as it
arrives. Here the producer is a `kvsp agent` asked to prefill (`POST {ii}prefill`) after vLLM
has the request; vLLM's greedy output is that of its own recompute."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx

from agent.service import Agent, AgentSettings
from kvsp_moq.scope_keys import read_scope_keys
from tests_vllm.conftest import BLOCK, NEW_TOKENS, Engine, prompt


def test_vllm_decodes_on_layers_another_instance_computes(model_dir: Path, index_url: str,
                                                         keys_file: Path, reference: Any,
                                                         relay: Any) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tokens = prompt(140, seed=11)  # 4 complete blocks before the last token
    (expected,) = reference(tokens)
    agent = Agent(AgentSettings(listen="127.0.0.1:0", model=str(model_dir), index_url=index_url,
                                scope_keys=read_scope_keys(keys_file), scope="team",
                                block_tokens=BLOCK, warmup_tokens=0, choose_by_cost=False,
                                relay=relay.url)).start()
    answered: dict[str, Any] = {}

    def prefill_soon() -> None:  # the producer starts after vLLM subscribed
        time.sleep(1.0)
        r = httpx.post(agent.url + "prefill", json={"tokens": tokens, "scope": "team"},
                       timeout=60, trust_env=False)
        answered["status"], answered["body"] = r.status_code, r.json()

    try:
        config = {"index": index_url, "scope_keys": str(keys_file), "scope": "team",
                  "holder": None, "relay": relay.url, "relay_timeout_s": 10.0}
        with Engine(model_dir, config) as engine:
            starter = threading.Thread(target=prefill_soon, daemon=True)
            starter.start()
            params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                    extra_args={"kv_transfer_params": {
                                        "kvsp_prefill_at": agent.url}})
            [o] = engine.llm.generate([TokensPrompt(prompt_token_ids=tokens)], params,
                                      use_tqdm=False)
            starter.join(60)
            worker, scheduler = engine.worker_stats(), engine.scheduler_stats()
    finally:
        agent.stop()
    assert answered.get("status") == 202, answered
    assert list(o.outputs[0].token_ids) == expected
    assert int(o.num_cached_tokens or 0) == 4 * BLOCK
    assert scheduler["live_requests"] == 1 and scheduler["lookups"] == 0, scheduler
    assert worker["loaded_blocks"] == 4 and worker["loaded_by"] == {"moqt": 4}, worker
    assert worker["load_errors"] == 0, worker
