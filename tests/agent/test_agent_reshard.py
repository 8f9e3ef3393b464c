"""Resharding of sequence-sharded caches (KVSP §6.9): fetched ranges arrive before the 200,
retained ranges never move, commit installs and releases, abort discards; driven by the PC."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import pytest
import torch

from agent.model import ModelAdapter
from agent.service import Agent, AgentSettings
from kvsp_moq.web import BackgroundServer
from pc.app import PCSettings, create_pc_app
from pc.placement import MemoryIndex
from tests.agent.conftest import tokens

N = 96




@pytest.fixture()
def agents(model_dir: Path) -> Iterator[tuple[Agent, Agent]]:
    def settings() -> AgentSettings:
        return AgentSettings(listen="127.0.0.1:0", model=str(model_dir), warmup_tokens=0)

    with Agent(settings()) as a, Agent(settings()) as b:
        yield a, b


def seed(agent: Agent, toks: list[int], ranges: list[list[int]], version: int = 1) -> None:
    r = httpx.put(agent.url + "shards/m", json={"version": version, "tokens": toks, "ranges": ranges},
                  timeout=60)
    assert r.status_code == 200, r.text


def held_kv(agent: Agent, a: int, b: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shards = agent.context.shards.maps["m"]
    for (x, y), kv in shards.held.items():
        if x <= a and b <= y:
            return [(k[a - x:b - x], v[a - x:b - x]) for k, v in kv]
    raise AssertionError(f"{a}-{b} not held")


def test_plan_fetches_commit_installs_and_retained_never_moves(agents: tuple[Agent, Agent],
                                                               model_dir: Path) -> None:
    a, b = agents
    toks = tokens(N, 31)
    seed(a, toks, [[0, 48], [48, N]])
    seed(b, toks, [])
    plan_a = {"map": "m", "from": 1, "to": 2, "deadline_ms": 5000, "retain": [[0, 48]],
              "fetch": [], "release": [[48, N]]}
    plan_b = {"map": "m", "from": 1, "to": 2, "deadline_ms": 5000, "retain": [],
              "fetch": [{"tokens": [48, N], "from": a.url}], "release": []}
    ra = httpx.post(a.url + "reshard", json=plan_a, timeout=30)
    rb = httpx.post(b.url + "reshard", json=plan_b, timeout=30)
    assert ra.status_code == 200 and rb.status_code == 200, (ra.text, rb.text)
    status_a = httpx.get(a.url + "reshard/m").json()
    status_b = httpx.get(b.url + "reshard/m").json()
    assert status_a["last"]["transferred_bytes"] == 0 and status_a["last"]["retained"] == [[0, 48]]
    per_token = 2 * a.context.adapter.num_layers * a.context.adapter.num_kv_heads * a.context.adapter.head_dim * 4
    fetched = status_b["last"]["fetched"]
    assert [f["tokens"] for f in fetched] == [[48, N]]
    assert fetched[0]["bytes"] >= (N - 48) * per_token
    assert status_b["version"] == 1 and status_b["pending"] == [[48, N]]  # v1 still authoritative

    for agent in (a, b):
        assert httpx.post(agent.url + "reshard", json={"map": "m", "commit": 2}).status_code == 200
    assert httpx.get(a.url + "reshard/m").json()["ranges"] == [[0, 48]]
    status_b = httpx.get(b.url + "reshard/m").json()
    assert status_b["version"] == 2 and status_b["ranges"] == [[48, N]] and status_b["pending"] == []
    reference = ModelAdapter.load(model_dir)
    expected = reference.kv_for_range(reference.prefill(toks, return_kv=False).state, 48, N)
    for (k, v), (ek, ev) in zip(held_kv(b, 48, N), expected):
        assert torch.allclose(k, ek, atol=1e-5) and torch.allclose(v, ev, atol=1e-5)


def test_abort_discards_and_stale_plans_are_refused(agents: tuple[Agent, Agent]) -> None:
    a, b = agents
    toks = tokens(N, 32)
    seed(a, toks, [[0, N]])
    seed(b, toks, [])
    plan = {"map": "m", "from": 1, "to": 2, "deadline_ms": 5000, "retain": [],
            "fetch": [{"tokens": [0, 32], "from": a.url}], "release": []}
    assert httpx.post(b.url + "reshard", json=plan, timeout=30).status_code == 200
    assert httpx.post(b.url + "reshard", json={"map": "m", "abort": 2}).status_code == 200
    status = httpx.get(b.url + "reshard/m").json()
    assert status["version"] == 1 and status["ranges"] == [] and status["pending"] == []
    assert status["last"]["state"] == "aborted"
    stale = dict(plan, **{"from": 0, "to": 1})
    r = httpx.post(b.url + "reshard", json=stale)
    assert r.status_code == 409
    missing = dict(plan, fetch=[{"tokens": [0, 32], "from": b.url}])  # B does not hold it
    assert httpx.post(b.url + "reshard", json=missing, timeout=30).status_code == 502


def test_pc_drives_a_reshard(agents: tuple[Agent, Agent], tmp_path: Path) -> None:
    a, b = agents
    toks = tokens(N, 33)
    seed(a, toks, [[0, N]])
    seed(b, toks, [])
    pc_app = create_pc_app(PCSettings(database=str(tmp_path / "pc.sqlite3")), lookup=MemoryIndex().lookup)
    with BackgroundServer(pc_app) as pc:
        v1 = {"map": "m", "version": 1, "shards": [{"tokens": [0, N], "instance": a.url}]}
        assert httpx.post(pc.url + "reshard/m", json=v1).status_code == 201
        v2 = {"map": "m", "version": 2, "deadline_ms": 5000, "shards": [
            {"tokens": [0, 64], "instance": a.url}, {"tokens": [64, N], "instance": b.url}]}
        r = httpx.post(pc.url + "reshard/m", json=v2, timeout=30)
        assert r.status_code == 200, r.text
        outcome = r.json()
        assert outcome["committed"] is True, outcome
    assert httpx.get(a.url + "reshard/m").json()["ranges"] == [[0, 64]]
    status_b = httpx.get(b.url + "reshard/m").json()
    assert status_b["version"] == 2 and status_b["ranges"] == [[64, N]]
    assert status_b["last"]["fetched"][0]["from"] == a.url
    assert httpx.get(a.url + "reshard/m").json()["last"]["transferred_bytes"] == 0
