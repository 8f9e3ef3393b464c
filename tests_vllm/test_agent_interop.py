"""Check 3: blocks cross between vLLM and `kvsp agent` in both directions.

Both compute the Compatibility Descriptor of the same model directory with the same function
(`kvsp_moq.model_descriptor`), so the Compatibility IDs and Block Keys are equal. A prompt the
agent computed is loaded by vLLM, one vLLM computed is loaded by the agent, and each output is
identical to its own engine's recompute.

vLLM's K/V differ from transformers' (the agent's) in the last float32 bits, so the two engines'
replicas of one Block Key differ in bytes, and so in their digests. KVSP names a block by its
token prefix, not its octets (§6.7: "the key identifies the token prefix, not the stored
octets"): each replica is verified against its own record, which its own holder published, and
a client that falls back from one replica to another mid-block verifies each layer against the
record of the replica it came from. The last test shows both replicas published under one key,
each verifying against its own record and not against the other's, and a vLLM engine loading
whichever it is given with output identical to recompute.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from agent.model import ModelAdapter
from agent.service import Agent, AgentSettings
from kvsp_moq.errors import DigestMismatch
from kvsp_moq.fetch.http import HttpFetcher
from kvsp_moq.protocol.container import Container
from kvsp_moq.protocol.keys import scope_id
from kvsp_moq.protocol.records import ReplicaRecord
from kvsp_moq.scope_keys import read_scope_keys
from tests_vllm.conftest import BLOCK, NEW_TOKENS, Engine, block_keys, compat_of, eventually, prompt, records_of


def _agent(model_dir: Path, index_url: str, keys_file: Path) -> Agent:
    settings = AgentSettings(listen="127.0.0.1:0", model=str(model_dir), index_url=index_url,
                             scope_keys=read_scope_keys(keys_file), scope="team",
                             block_tokens=BLOCK, warmup_tokens=0, choose_by_cost=False)
    return Agent(settings).start()


def _generate(agent: Agent, tokens: list[int]) -> dict[str, Any]:
    r = httpx.post(agent.url + "generate", json={"tokens": tokens, "max_new_tokens": NEW_TOKENS},
                   timeout=120, trust_env=False)
    assert r.status_code == 200, r.text
    return r.json()


def _config(index_url: str, keys_file: Path) -> dict[str, Any]:
    return {"index": index_url, "scope_keys": str(keys_file), "scope": "team"}


@pytest.fixture(scope="module")
def adapter(model_dir: Path) -> ModelAdapter:
    return ModelAdapter.load(model_dir)


def test_the_agent_and_vllm_name_blocks_alike(model_dir: Path, index_url: str,
                                              keys_file: Path) -> None:
    agent = _agent(model_dir, index_url, keys_file)
    try:
        assert agent.context.compat_id == compat_of(model_dir)
    finally:
        agent.stop()
    with Engine(model_dir, _config(index_url, keys_file)) as engine:
        assert engine.scheduler_connector._scheduler.compat_id == compat_of(model_dir)


def test_vllm_loads_what_the_agent_computed(model_dir: Path, index_url: str, keys_file: Path,
                                            reference: Any) -> None:
    tokens = prompt(140, seed=3)  # 4 blocks before the last token
    (expected,) = reference(tokens)
    agent = _agent(model_dir, index_url, keys_file)
    try:
        computed = _generate(agent, tokens)
        assert computed["cached_tokens"] == 0
        with Engine(model_dir, {**_config(index_url, keys_file), "holder": None}) as engine:
            [(out, cached)] = engine.generate([tokens])
            worker = engine.worker_stats()
    finally:
        agent.stop()
    assert out == expected, "vLLM's output with the agent's blocks differs from its recompute"
    assert cached == 4 * BLOCK
    assert worker["loaded_blocks"] == 4 and worker["load_errors"] == 0, worker


def test_the_agent_loads_what_vllm_computed(model_dir: Path, index_url: str, keys_file: Path,
                                            adapter: ModelAdapter) -> None:
    tokens = prompt(140, seed=4)
    key = read_scope_keys(keys_file)["team"]
    keys = block_keys(key, compat_of(model_dir), tokens)
    recomputed = adapter.generate_greedy(tokens, NEW_TOKENS)
    with Engine(model_dir, _config(index_url, keys_file)) as engine:
        engine.generate([tokens])
        eventually(lambda: all(records_of(index_url, scope_id(key).hex(), compat_of(model_dir), keys)),
                   "vLLM's records")
        vllm_holder = engine.worker_stats()["holder"]
        agent = _agent(model_dir, index_url, keys_file)
        try:
            loaded = _generate(agent, tokens)
        finally:
            agent.stop()
    assert loaded["cached_tokens"] == 4 * BLOCK, loaded
    assert loaded["sources"]["http"] == 4, loaded
    assert all(f["source"] != vllm_holder for f in loaded.get("load", {}).get("failures", []))
    assert loaded["tokens"] == recomputed, "the agent's output with vLLM's blocks differs"


def test_replicas_of_one_key_from_both_engines(model_dir: Path, index_url: str, keys_file: Path,
                                               reference: Any) -> None:
    """Both engines compute the same prompt (vLLM as a producer, so it does not load the
    agent's blocks): two replicas per key, each verified against its own record."""
    tokens = prompt(110, seed=5)
    (expected,) = reference(tokens)
    key = read_scope_keys(keys_file)["team"]
    compat = compat_of(model_dir)
    keys = block_keys(key, compat, tokens)[:3]
    agent = _agent(model_dir, index_url, keys_file)
    try:
        _generate(agent, tokens)
        with Engine(model_dir, _config(index_url, keys_file), kv_role="kv_producer") as producer:
            [(out, cached)] = producer.generate([tokens])
            assert out == expected and cached == 0
            vllm_holder = producer.worker_stats()["holder"]
            found = eventually(
                lambda: (lambda rs: rs if all(len(r) == 2 for r in rs) else None)(
                    records_of(index_url, scope_id(key).hex(), compat, keys)),
                "a replica from each engine for every key")
            for records in found:
                by_holder = {r.holder: r for r in records}
                mine, theirs = by_holder.pop(vllm_holder), by_holder.popitem()[1]
                assert theirs.holder == agent.url
                _each_verifies_against_its_own_record(mine, theirs)
        # Either replica serves: vLLM loads the prefix (from the agent's holder, the only one
        # left) and its output is its recompute's.
        with Engine(model_dir, {**_config(index_url, keys_file), "holder": None},
                    kv_role="kv_consumer") as consumer:
            [(out, cached)] = consumer.generate([tokens])
            assert consumer.worker_stats()["loaded_blocks"] == 3
        assert out == expected and cached == 3 * BLOCK
    finally:
        agent.stop()


def _each_verifies_against_its_own_record(a: ReplicaRecord, b: ReplicaRecord) -> None:
    async def run() -> None:
        async with HttpFetcher() as fetcher:
            got_a = await fetcher.fetch_block([a.holder], a)
            got_b = await fetcher.fetch_block([b.holder], b)
            values_a = _values(got_a.container)
            values_b = _values(got_b.container)
            assert max((x - y).abs().max().item() for x, y in zip(values_a, values_b)) <= 1e-4, (
                "vLLM's and the agent's K/V of one block must agree to float32 rounding")
            print(f"block {a.block_key[:12]}: replica digests {'differ' if a.digest != b.digest else 'agree'}")
            if a.digest != b.digest:
                # Not interchangeable byte for byte: B's octets fail A's record.
                crossed = ReplicaRecord.from_json({**a.to_json(), "holder": b.holder})
                with pytest.raises(DigestMismatch):
                    await fetcher.fetch_block([b.holder], crossed)

    asyncio.run(run())


def _values(container: Container) -> list[torch.Tensor]:
    return [torch.frombuffer(bytearray(bytes(layer.k) + bytes(layer.v)), dtype=torch.float32)
            for layer in container.layers()]
