"""Agents choosing between MOQT and HTTP (DESIGN §4, §5), against holders, a relay and two
Index Services that each run as their own `kvsp` process.

A producer agent computes a prompt cold (its tokens are the recomputation reference) and
replicates the prompt's blocks to two holders, each publishing to its own Index Service:

- holder H1 serves HTTP only (no relay). Agent B has a relay, so it prefers MOQT, but all it
  finds are HTTP replicas: it loads every block over HTTP.
- holder H2 publishes through the relay, and its HTTP base is down: its records name a base
  URL nothing listens on, so neither a block nor a lease (§6.6) can be had there. Agent C
  loads every block over MOQT through the relay, without a lease.

Both must produce, greedily and in float32 on the CPU, exactly the producer's tokens. The
agents run in this process (one model import instead of three); everything they talk to is a
separate process.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from agent.service import Agent, AgentSettings
from kvsp_moq.protocol.keys import block_keys, scope_id
from kvsp_moq.scope_keys import OPEN_SCOPE_KEY

from .helpers import Service, by_kind, eventually, free_port, healthy, lookup, relay_up, services

B = 16
PROMPT = 96
BLOCKS = PROMPT // B
NEW = 4


def prompt_tokens(n: int, seed: int) -> list[int]:
    """Deterministic token ids in the tiny model's vocabulary."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 4096, (n,), generator=g).tolist()


async def start_agent(tmp_path: Path, name: str, model: Path, **settings: Any) -> Agent:
    """An agent on a background server; started on a worker thread, as it loads a model."""
    def start() -> Agent:
        return Agent(AgentSettings(listen="127.0.0.1:0", model=str(model), data_dir=tmp_path / name,
                                   block_tokens=B, device="cpu", dtype="float32", warmup_tokens=0,
                                   **settings)).start()

    return await asyncio.to_thread(start)


async def generate(client: httpx.AsyncClient, agent: Agent, tokens: list[int]) -> dict:
    r = await client.post(agent.url + "generate", json={
        "tokens": tokens, "max_new_tokens": NEW, "sampler": {"method": "greedy"}}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


async def test_an_agent_loads_over_http_or_moqt_as_the_replicas_allow(tmp_path: Path, tiny_model: Path) -> None:
    tokens = prompt_tokens(PROMPT, 91) + prompt_tokens(8, 92)
    dead_base = f"http://127.0.0.1:{free_port()}/"  # nothing listens there
    agents: list[Agent] = []
    async with services(tmp_path) as run, httpx.AsyncClient(timeout=10, trust_env=False) as client:
        relay = await run.relay()
        index1, index2 = await run.index("index1"), await run.index("index2")
        h1 = await run.holder("h1", "--index", index1.url)
        h2 = await run.holder("h2", "--index", index2.url, "--relay", relay.url,
                              "--public-url", dead_base)
        try:
            producer, b, c = await asyncio.gather(
                start_agent(tmp_path, "producer", tiny_model, replicate_to=[h1.url, h2.url]),
                start_agent(tmp_path, "agent-b", tiny_model, index_url=index1.url, relay=relay.url),
                start_agent(tmp_path, "agent-c", tiny_model, index_url=index2.url, relay=relay.url))
            agents += [producer, b, c]
            await relay_up(relay)
            for service in (index1, index2, h1, h2):
                await healthy(client, service)

            cold = await generate(client, producer, tokens)
            assert cold["cached_tokens"] == 0, cold
            assert cold["sources"] == {"moqt": 0, "http": 0, "recompute": BLOCKS}, cold
            reference = cold["tokens"]
            assert len(reference) == NEW

            compat = producer.context.compat_id
            scope = scope_id(OPEN_SCOPE_KEY).hex()
            keys = [k.hex() for k in block_keys(OPEN_SCOPE_KEY, bytes.fromhex(compat), tokens, B)][:BLOCKS]

            async def published(index: Service, http: int, moqt: int) -> bool:
                found = await lookup(client, index, compat, scope, keys)
                return len(found) == BLOCKS and all(
                    [len(x) for x in by_kind(found[key]).values()] == [http, moqt] for key in keys)

            await eventually(lambda: published(index1, 1, 0), "H1's HTTP records in index 1", service=h1)
            await eventually(lambda: published(index2, 1, 1), "H2's HTTP and MOQT records in index 2",
                             service=h2)

            # B prefers MOQT; with HTTP replicas only, it loads over HTTP.
            out_b = await generate(client, b, tokens)
            assert out_b["cached_tokens"] == PROMPT, out_b
            assert out_b["sources"] == {"moqt": 0, "http": BLOCKS, "recompute": 0}, out_b
            assert out_b["load"]["failures"] == [], out_b["load"]
            assert out_b["tokens"] == reference

            # C: H2's HTTP base is down; every block comes over MOQT, read without a lease.
            out_c = await generate(client, c, tokens)
            assert out_c["cached_tokens"] == PROMPT, out_c
            assert out_c["sources"] == {"moqt": BLOCKS, "http": 0, "recompute": 0}, out_c
            assert out_c["load"]["failures"] == [], out_c["load"]
            assert out_c["tokens"] == reference
            try:
                await client.get(dead_base + f"blocks/{compat}/{scope}/{keys[0]}", timeout=2)
            except httpx.TransportError:
                pass
            else:
                raise AssertionError(f"{dead_base} answered; the HTTP base was to be down")
        finally:
            for agent in agents:
                await asyncio.to_thread(agent.stop)
