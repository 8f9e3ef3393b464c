"""The instance's own §6.4 choice: load a cached prefix, or recompute it when that is cheaper
with the rates it has measured, and say which and why."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from agent.choice import choose
from agent.model import ModelAdapter
from agent.service import Agent, AgentSettings
from kvsp_moq.protocol.records import Link, ReplicaRecord
from tests.agent.conftest import tokens

B = 16
PROMPT = 128


def record(holder: str, size: int = 1 << 20) -> ReplicaRecord:
    return ReplicaRecord(block_key="ab" * 16, compat_id="cd" * 16, scope_id="ef" * 8,
                         holder=holder, codec=1, size=size, digest="sha-256:" + "0" * 64,
                         ttl_ms=1000)


def test_a_slow_link_recomputes_and_a_fast_one_loads() -> None:
    remote = [record("http://h/")] * 4  # 4 MiB
    common = dict(instance="http://me/", prefill_tokens_per_s=10_000.0, matched_blocks=4,
                  resident_blocks=0, remote=remote, block_tokens=64, total_tokens=300)
    slow = choose(links=[Link("http://h/", 100.0, 500.0)], **common)  # 335 ms vs 30 ms
    assert not slow.load and slow.fetch_ms == pytest.approx(336.0, rel=0.01)
    assert slow.recompute_all_ms == pytest.approx(30.0)
    assert "recomputing" in slow.reason
    fast = choose(links=[Link("http://h/", 100_000.0, 200.0)], **common)  # 0.5 + 4.4 ms
    assert fast.load and fast.recompute_rest_ms == pytest.approx(4.4)
    assert fast.to_json()["chose"] == "load"


def test_without_a_prefill_rate_or_remote_blocks_the_cache_is_used() -> None:
    common = dict(instance="http://me/", links=[Link("http://h/", 1.0, 500.0)], matched_blocks=4,
                  block_tokens=64, total_tokens=300)
    assert choose(prefill_tokens_per_s=None, resident_blocks=0, remote=[record("http://h/")] * 4,
                  **common).load
    resident = choose(prefill_tokens_per_s=10_000.0, resident_blocks=4, remote=[], **common)
    assert resident.load and resident.remote_blocks == 0


def test_resident_blocks_are_free_and_only_the_rest_is_compared() -> None:
    # 2 blocks here, 2 elsewhere over a slow link: recompute from block 2, not from 0
    c = choose(instance="http://me/", prefill_tokens_per_s=1_000.0,
               links=[Link("http://h/", 100.0, 0.0)], matched_blocks=4, resident_blocks=2,
               remote=[record("http://h/")] * 2, block_tokens=64, total_tokens=300)
    assert not c.load
    assert c.recompute_all_ms == pytest.approx(1000 * (300 - 128) / 1000)
    assert c.recompute_rest_ms == pytest.approx(1000 * (300 - 256) / 1000)


def test_a_due_probe_loads_even_when_recomputing_is_cheaper() -> None:
    c = choose(instance="http://me/", prefill_tokens_per_s=10_000.0,
               links=[Link("http://h/", 1.0, 0.0)], matched_blocks=1, resident_blocks=0,
               remote=[record("http://h/")], block_tokens=64, total_tokens=100, probe=True)
    assert c.load and "measured again" in c.reason


@pytest.fixture(scope="module")
def agents(model_dir: Path, index_url: str) -> Iterator[tuple[Agent, Agent]]:
    def settings() -> AgentSettings:
        return AgentSettings(listen="127.0.0.1:0", model=str(model_dir), index_url=index_url,
                             block_tokens=B, warmup_tokens=0)

    with Agent(settings()) as a, Agent(settings()) as b:
        yield a, b


def measured(agent: Agent, holder: str, mbit_per_s: float, prefill_tokens_per_s: float) -> None:
    meters = agent.context.meters
    for _ in range(60):  # the moving average converges on the rate
        meters.transfer(holder, 1 << 20, 8 * (1 << 20) / (mbit_per_s * 1e6))
    meters.prefill.value = prefill_tokens_per_s


def test_an_agent_recomputes_over_a_slow_link_and_loads_over_a_fast_one(
        agents: tuple[Agent, Agent], model_dir: Path) -> None:
    a, b = agents
    gets = ("GET", "/blocks/{compat}/{scope}/{key}", 200)
    reference = ModelAdapter.load(model_dir)
    for seed, rate, loads in ((61, 0.5, False), (62, 100_000.0, True)):
        prompt = tokens(PROMPT, seed)
        r = httpx.post(a.url + "generate", json={"tokens": prompt, "max_new_tokens": 1}, timeout=60)
        assert r.status_code == 200
        measured(b, a.url, rate, 5_000.0)
        before = a.app.state.metrics.requests[gets]
        out = httpx.post(b.url + "generate", json={"tokens": prompt + [5], "max_new_tokens": 2},
                         timeout=60).json()
        choice = out["load_choice"]
        assert choice["chose"] == ("load" if loads else "recompute"), choice
        assert choice["remote_blocks"] == PROMPT // B
        if loads:
            assert out["cached_tokens"] == PROMPT and out["sources"]["http"] == PROMPT // B
            assert a.app.state.metrics.requests[gets] - before == PROMPT // B
        else:
            assert out["cached_tokens"] == 0 and out["sources"]["recompute"] == PROMPT // B
            assert a.app.state.metrics.requests[gets] == before  # nothing was fetched
        assert out["tokens"] == reference.generate_greedy(prompt + [5], 2)


def test_a_due_link_measurement_runs_beside_the_request_which_recomputes(
        agents: tuple[Agent, Agent]) -> None:
    """After `probe_every` recomputes in a row the link is measured again, in the background:
    the request that found it due still recomputes (it does not pay for a slow link), and a
    load of the blocks from their holder refreshes the link's rate."""
    a, b = agents
    prompt = tokens(PROMPT, 63)
    assert httpx.post(a.url + "generate", json={"tokens": prompt, "max_new_tokens": 1},
                      timeout=60).status_code == 200
    measured(b, a.url, 0.5, 5_000.0)
    engine = b.context.engine
    engine._recomputed_in_a_row = engine.options.probe_every - 1
    out = httpx.post(b.url + "generate", json={"tokens": prompt + [5], "max_new_tokens": 1},
                     timeout=60).json()
    assert out["load_choice"]["chose"] == "recompute" and out["cached_tokens"] == 0
    assert engine._recomputed_in_a_row == 0
    measuring = [d for d in b.context.prefetcher.directives.values()
                 if d.directive.request_ref == "link measurement"]
    assert len(measuring) == 1 and len(measuring[0].directive.blocks) == PROMPT // B
    for _ in range(200):  # loopback is far faster than the 0.5 Mbit/s measured before
        rates = {link.holder: link.mbit_per_s for link in b.context.meters.links()}
        if rates.get(a.url, 0.0) > 10:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the link was not measured again: {rates}")
    assert measuring[0].state == "complete"
