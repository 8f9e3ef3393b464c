"""A producer of live KV killed with SIGKILL in the middle of a prefill it computes for another
instance (DESIGN §9.3): the decode instance stops waiting for its layers within a bounded time
(its live layer timeout), computes the prompt itself, and the front end delivers every token
once, exactly the tokens of one instance alone."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Callable

import httpx

from agent.model import ModelAdapter
from agent.service import Agent, AgentSettings
from index.app import IndexSettings
from index.app import create_app as create_index_app
from kvsp_moq.frontend import FrontEnd
from kvsp_moq.web import BackgroundServer
from relay.service import BackgroundRelay
from tests.agent.conftest import model_dir as model_dir  # a fixture, re-exported for pytest
from tests.agent.conftest import tokens
from tests.pc.test_failover_sigkill import AgentProcess
from tests.pc.test_failover_sigkill import agent_processes as agent_processes  # a fixture, re-exported
from tests.polling import wait_until

B = 16
PROMPT = 6 * B + 5
NEW = 12


async def test_decode_instance_recomputes_when_its_producer_is_killed(
        model_dir: Path, agent_processes: Callable[..., AgentProcess], relay: BackgroundRelay) -> None:
    prompt = tokens(PROMPT, 31)
    reference = ModelAdapter.load(model_dir).generate_greedy(prompt, NEW)
    with BackgroundServer(create_index_app(IndexSettings())) as index:
        common: dict[str, Any] = dict(index_url=index.url, relay=relay.url, relay_timeout_s=5.0)
        a = agent_processes("producer", pace_layers_s=0.5, **common)
        b = Agent(AgentSettings(listen="127.0.0.1:0", model=str(model_dir), block_tokens=B,
                                warmup_tokens=0, choose_by_cost=False, **common)).start()
        try:
            a_url = a.wait_url(120)
            r = httpx.post(a_url + "prefill", json={"tokens": prompt}, timeout=30)
            assert r.status_code == 202, r.text
            blocks = len(r.json()["live"])
            assert blocks == PROMPT // B
            session = str(uuid.uuid4())
            async with httpx.AsyncClient(timeout=30) as client:
                async with client.stream("POST", b.url + "generate", json={
                        "tokens": prompt, "max_new_tokens": NEW, "session": session, "stream": True,
                        "prefill_at": a_url}) as g:
                    assert g.status_code == 200
            # B receives the first layers of every block from A through the relay, then A dies.
            wait_until(lambda: relay.snapshot()["objects_in"] >= blocks, timeout=30,
                       what="the producer's first layers at the relay", step=0.05)
            a.kill()
            async with FrontEnd("http://127.0.0.1:9/", timeout_s=60) as fe:
                got = [t async for t in fe.stream(session, instance=b.url, max_tokens=NEW)]
            assert [t.index for t in got] == list(range(NEW))
            assert [t.token for t in got] == reference
            summary = b.engine.sessions[session]
            assert summary.sources["moqt"] == 0 and summary.sources["recompute"] == blocks
            assert summary.load["failures"], summary.load
        finally:
            b.stop()
