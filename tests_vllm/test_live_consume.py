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


def test_other_requests_decode_while_a_request_waits_for_its_layers(
        model_dir: Path, index_url: str, keys_file: Path, reference: Any, relay: Any) -> None:
    """The asynchronous load ("load_async": "live"): the request whose prompt another instance
    computes waits in WAITING_FOR_REMOTE_KVS while the engine goes on decoding another request.
    The producer here starts only once that other request has finished, which a load held
    inside the engine's step would never allow: its step would wait for layers that come only
    after the step ends (until the load timed out and the prompt was recomputed)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tokens = prompt(140, seed=12)
    other = prompt(40, seed=13)
    expected, expected_other = reference(tokens), reference(other)
    agent = Agent(AgentSettings(listen="127.0.0.1:0", model=str(model_dir), index_url=index_url,
                                scope_keys=read_scope_keys(keys_file), scope="team",
                                block_tokens=BLOCK, warmup_tokens=0, choose_by_cost=False,
                                relay=relay.url)).start()
    answered: dict[str, Any] = {}

    def prefill() -> None:
        r = httpx.post(agent.url + "prefill", json={"tokens": tokens, "scope": "team"},
                       timeout=60, trust_env=False)
        answered["status"] = r.status_code

    try:
        config = {"index": index_url, "scope_keys": str(keys_file), "scope": "team",
                  "holder": None, "relay": relay.url, "relay_timeout_s": 10.0,
                  "load_timeout_s": 60.0}
        with Engine(model_dir, config) as engine:
            llm = engine.llm.llm_engine
            greedy = {"temperature": 0.0, "max_tokens": NEW_TOKENS, "ignore_eos": True}
            llm.add_request("decoding", TokensPrompt(prompt_token_ids=other),
                            SamplingParams(**greedy))
            llm.add_request("waiting", TokensPrompt(prompt_token_ids=tokens), SamplingParams(
                **greedy, extra_args={"kv_transfer_params": {"kvsp_prefill_at": agent.url}}))
            outputs: dict[str, Any] = {}
            starter: threading.Thread | None = None
            deadline = time.monotonic() + 120
            for _ in range(20_000):  # bounded in count and in time
                if not llm.has_unfinished_requests() or time.monotonic() > deadline:
                    break
                for out in llm.step():
                    if out.finished:
                        outputs[out.request_id] = out
                if starter is None and "decoding" in outputs:
                    assert "waiting" not in outputs
                    starter = threading.Thread(target=prefill, daemon=True)
                    starter.start()
                time.sleep(0.001)
            assert starter is not None, "the other request never finished"
            starter.join(60)
            worker, scheduler = engine.worker_stats(), engine.scheduler_stats()
    finally:
        agent.stop()
    assert answered.get("status") == 202, answered
    assert list(outputs["decoding"].outputs[0].token_ids) == expected_other[0]
    got = outputs["waiting"]
    assert list(got.outputs[0].token_ids) == expected[0]
    assert int(got.num_cached_tokens or 0) == 4 * BLOCK
    assert scheduler["async_loads"] == 1 and scheduler["load_errors"] == 0, scheduler
    assert worker["async_loads"] == 1 and worker["async_finished"] == 1, worker
    assert worker["loaded_blocks"] == 4 and worker["load_errors"] == 0, worker


def test_a_request_ended_while_it_waits_for_its_layers_frees_its_blocks(
        model_dir: Path, index_url: str, keys_file: Path, reference: Any, relay: Any) -> None:
    """vLLM keeps the blocks of a request it ends during an asynchronous load until the
    connector reports the load finished: the load is stopped and reported at once, so the
    blocks come back and the engine goes on serving."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.request import RequestStatus

    tokens, other = prompt(140, seed=14), prompt(40, seed=15)
    expected_other = reference(other)
    config = {"index": index_url, "scope_keys": str(keys_file), "scope": "team",
              "holder": None, "relay": relay.url, "relay_timeout_s": 30.0, "load_timeout_s": 60.0}
    with Engine(model_dir, config) as engine:
        llm, scheduler = engine.llm.llm_engine, engine.core.scheduler
        pool = scheduler.kv_cache_manager.block_pool
        free = pool.get_num_free_blocks()
        greedy = {"temperature": 0.0, "max_tokens": NEW_TOKENS, "ignore_eos": True}
        nobody = "http://127.0.0.1:9/"  # no instance ever computes these blocks
        llm.add_request("waiting", TokensPrompt(prompt_token_ids=tokens), SamplingParams(
            **greedy, extra_args={"kv_transfer_params": {"kvsp_prefill_at": nobody}}))
        def held() -> list[Any]:  # vLLM's own request ids carry a suffix
            return [r for rid, r in scheduler.requests.items() if rid.startswith("waiting")]

        for _ in range(200):
            llm.step()
            if held() and held()[0].status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                break
            time.sleep(0.01)
        [waiting] = held()
        assert waiting.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert pool.get_num_free_blocks() < free  # its blocks are held
        llm.abort_request(["waiting"])
        for _ in range(200):
            llm.step()
            if not held():
                break
            time.sleep(0.01)
        assert not held()
        assert pool.get_num_free_blocks() == free
        assert engine.generate([other]) == [(expected_other[0], 0)]
        worker = engine.worker_stats()
    assert worker["async_loads"] == 1 and worker["async_finished"] == 1, worker
