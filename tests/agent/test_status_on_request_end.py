"""The agent reports to the PC when a request ends, before answering it, with the count of
requests it admitted: a client that sends its next request at once has it placed knowing the
instance is free again, not counted in its queue until the next round of status records."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx

from agent.service import Agent, AgentSettings
from kvsp_moq.scope_keys import OPEN_SCOPE, OPEN_SCOPE_KEY
from kvsp_moq.web import BackgroundServer
from pc.app import PCSettings, create_pc_app
from pc.lifecycle import LifecycleSettings
from pc.placement import ScopeKeys
from tests.agent.conftest import tokens

B = 16


def test_the_next_route_after_a_response_sees_the_instance_free(
        model_dir: Path, index_url: str, tmp_path: Path) -> None:
    # Status rounds every 20 s: only the reports sent when a request ends can inform the PC.
    # A route is counted in the queue until a record accounts for it, however long it takes.
    lifecycle = LifecycleSettings(routed_settle_ms=100, routed_hold_ms=60_000)
    pc_app = create_pc_app(PCSettings(database=str(tmp_path / "pc.sqlite3"), index_url=index_url,
                                      sweep_interval_s=0.05, lifecycle=lifecycle),
                           keys=ScopeKeys({OPEN_SCOPE: OPEN_SCOPE_KEY}))
    registry = pc_app.state.pc.registry
    common = dict(listen="127.0.0.1:0", model=str(model_dir), block_tokens=B, warmup_tokens=8,
                  index_url=index_url, status_ttl_ms=60_000)
    with BackgroundServer(pc_app) as pc, Agent(AgentSettings(pc_url=pc.url, **common)) as a, \
            Agent(AgentSettings(pc_url=pc.url, **common)) as b, httpx.Client(timeout=60) as http:
        deadline = time.monotonic() + 10
        while len(registry.active()) < 2:
            assert time.monotonic() < deadline, "the agents never reported"
            time.sleep(0.05)
        first = registry.get(a.url).admitted
        assert first == 0 and registry.get(b.url).admitted == 0
        system = tokens(8 * B, 5)
        chosen = []
        for i, stream in enumerate((False, True, False, True)):
            prompt = system + tokens(5, 100 + i)
            body = {"tokens": prompt, "scope": OPEN_SCOPE, "compat_id": a.context.compat_id}
            decision = http.post(pc.url + "route", json=body).json()
            assert "instance" in decision, decision
            instance = decision["instance"]
            chosen.append(instance)
            req = {"tokens": prompt, "max_new_tokens": 2, "scope": OPEN_SCOPE, "stream": stream}
            if stream:
                with http.stream("POST", instance + "generate", json=req) as r:
                    lines = [json.loads(x) for x in r.iter_lines() if x.strip()]
                assert lines[-1] == {"done": True}
            else:
                assert http.post(instance + "generate", json=req).status_code == 200
            # Right after the answer (the records before it came 20 s apart, or not at all):
            # the PC has this request's record, and counts nothing routed there.
            assert registry.pending(instance) == 0, i
            assert registry.get(instance).admitted == chosen.count(instance)
            assert registry.get(instance).running == 0
        # The first request computed the system prompt; every later one went where it is.
        assert chosen[1:] == [chosen[0]] * 3
