"""Finished sessions stay readable for a while, but their number and what each keeps are
bounded: memory must not follow the request rate."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from agent.service import Agent, AgentSettings
from tests.agent.conftest import tokens


def test_finished_sessions_are_forgotten_by_count_and_by_age(model_dir: Path, index_url: str) -> None:
    settings = AgentSettings(listen="127.0.0.1:0", model=str(model_dir), index_url=index_url,
                             block_tokens=16, warmup_tokens=0)
    with Agent(settings) as agent:
        engine = agent.context.engine
        engine.options.keep_finished, engine.options.keep_finished_s = 3, 5.0
        ids = []
        start = time.monotonic()
        for i in range(5):
            r = httpx.post(agent.url + "generate", json={"tokens": tokens(20, i), "max_new_tokens": 1},
                           timeout=60)
            assert r.status_code == 200, r.text
            ids.append(r.json()["session"])
        deadline = time.monotonic() + 5
        while len(engine.sessions) > 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert time.monotonic() - start < 5.0  # so what went, went for the count
        assert sorted(engine.sessions) == sorted(ids[2:])
        # Nor does a kept session hold its first logits (a vocabulary-sized tensor) unless
        # asked to (keep_first_logits, for checks against a recompute).
        assert all(s.first_logits is None for s in engine.sessions.values())
        assert httpx.get(f"{agent.url}sessions/{ids[0]}/stream", timeout=10).status_code == 404
        with httpx.stream("GET", f"{agent.url}sessions/{ids[-1]}/stream", params={"from": 0},
                          timeout=10) as s:
            assert s.status_code == 200
        deadline = time.monotonic() + 20
        while engine.sessions and time.monotonic() < deadline:
            time.sleep(0.1)
        assert engine.sessions == {}
        assert not engine._finished
