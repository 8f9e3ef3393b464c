"""Sessions across instances (KVSP §6.8): checkpoints to the PC, failover to another agent with
identical greedy output, sampler state restored on resume, stale epochs refused, and tokens of
a non-deterministic sampler held back until a checkpoint covering them is acknowledged."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agent.model import ModelAdapter
from agent.service import Agent, AgentSettings
from kvsp_moq.frontend import FrontEnd
from kvsp_moq.holder.service import Holder, HolderSettings
from kvsp_moq.scope_keys import OPEN_SCOPE, OPEN_SCOPE_KEY
from kvsp_moq.web import BackgroundServer
from pc.app import PCSettings, create_pc_app
from pc.lifecycle import LifecycleSettings
from pc.placement import ScopeKeys
from tests.agent.conftest import tokens

B = 16
PROMPT = 72  # 4 complete blocks and a tail of 8
NEW = 40




@pytest.fixture(scope="module")
def reference(model_dir: Path) -> ModelAdapter:
    return ModelAdapter.load(model_dir)



def settings(model_dir: Path, **kw: object) -> AgentSettings:
    return AgentSettings(listen="127.0.0.1:0", model=str(model_dir), block_tokens=B,
                         warmup_tokens=8, **kw)  # type: ignore[arg-type]


def stream_lines(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + "generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        return [json.loads(line) for line in r.iter_lines() if line.strip()]


# ------------------------------------------------------------------ failover through the PC


async def test_session_resumed_on_another_agent_after_failure(
        model_dir: Path, index_url: str, reference: ModelAdapter, tmp_path: Path) -> None:
    prompt = tokens(PROMPT, 11)
    expected = reference.generate_greedy(prompt, NEW)
    pc_settings = PCSettings(database=str(tmp_path / "pc.sqlite3"), index_url=index_url,
                             sweep_interval_s=0.05, lifecycle=LifecycleSettings())
    pc_app = create_pc_app(pc_settings, keys=ScopeKeys({OPEN_SCOPE: OPEN_SCOPE_KEY}))
    with BackgroundServer(pc_app) as pc, \
            Holder(HolderSettings(listen="127.0.0.1:0", index_url=index_url)) as holder:
        common = dict(index_url=index_url, pc_url=pc.url, status_ttl_ms=1500, replicate_to=[holder.url])
        a = Agent(settings(model_dir, token_interval_s=0.03, **common)).start()
        b = Agent(settings(model_dir, **common)).start()
        try:
            session = str(uuid.uuid4())
            async with httpx.AsyncClient(timeout=30) as client:
                async with client.stream("POST", a.url + "generate", json={
                        "tokens": prompt, "max_new_tokens": NEW, "session": session,
                        "stream": True}) as r:
                    assert r.status_code == 200  # the session runs on whoever reads it
            got: list[int] = []
            stopped = False
            # Retries bounded by the 30 s deadline, not by their count: on a loaded machine
            # the PC may take a while to fail A (status TTL 1.5 s) and resume on B.
            async with FrontEnd(pc.url, timeout_s=30, backoff_s=0.1, retries=200) as fe:
                async for tok in fe.stream(session, instance=a.url):
                    got.append(tok.token)
                    if len(got) == 12 and not stopped:
                        stopped = True
                        await asyncio.to_thread(a.stop)  # dies mid-session
            assert stopped
            assert got == expected
            moved = b.engine.sessions[session]
            assert moved.epoch == 2 and moved.state == "finished"
            assert moved.cached_tokens >= (PROMPT // B) * B  # prompt blocks loaded from the holder
            assert moved.load is not None and moved.load["failures"]  # A's own replicas were dead
            r = httpx.get(f"{pc.url}sessions/{session}")
            assert r.json()["ended"] and r.json()["instance"] == b.url  # ended by the instance
            # that finished it
        finally:
            a.stop()
            b.stop()


# ------------------------------------------------------------------ resume by hand


def test_resume_restores_sampler_and_refuses_stale_epochs(model_dir: Path, index_url: str) -> None:
    prompt = tokens(PROMPT, 12)
    sampler = {"method": "top-p", "params": {"p": 0.9, "temperature": 1.0}, "seed": 7}
    with Agent(settings(model_dir, index_url=index_url)) as a, \
            Agent(settings(model_dir, index_url=index_url)) as b:
        full = httpx.post(a.url + "generate", json={"tokens": prompt, "max_new_tokens": 24,
                                                    "sampler": sampler}, timeout=60).json()
        sid = full["session"]
        checkpoint = a.engine.sessions[sid].checkpoint(10).to_json()
        assert checkpoint["sampler"]["step"] == 10 and checkpoint["output_offset"] == 10
        assert checkpoint["prompt_tail"] == prompt[PROMPT // B * B:]
        r = httpx.post(f"{b.url}sessions/{sid}/resume", json={"checkpoint": checkpoint, "epoch": 2})
        assert r.status_code == 202, r.text
        with httpx.stream("GET", f"{b.url}sessions/{sid}/stream", params={"from": 0}, timeout=30) as s:
            lines = [json.loads(x) for x in s.iter_lines() if x.strip()]
        assert lines[-1] == {"done": True}
        assert [x["index"] for x in lines[:-1]] == list(range(24))
        assert {x["epoch"] for x in lines[:-1]} == {2}
        assert [x["token"] for x in lines[:-1]] == full["tokens"]  # same sample, same (seed, step)
        resumed = b.engine.sessions[sid]
        # A's prompt blocks and its first generated block, loaded over HTTP
        assert resumed.cached_tokens == (PROMPT + 10) // B * B
        for epoch in (2, 1):  # not newer than what B holds: refused
            r = httpx.post(f"{b.url}sessions/{sid}/resume", json={"checkpoint": checkpoint, "epoch": epoch})
            assert r.status_code == 409
            assert r.json()["type"] == "urn:kvsp:problem:kvsp-stale-epoch"


def test_resume_without_prompt_blocks_is_refused(model_dir: Path, index_url: str) -> None:
    with Agent(settings(model_dir, index_url=index_url)) as b:
        sid = str(uuid.uuid4())
        checkpoint = {"session": sid, "epoch": 1, "compat_id": b.context.compat_id,
                      "scope_id": _scope_id(), "prompt_blocks": ["ab" * 32],
                      "prompt_tail": [5, 6], "generated": [7], "output_offset": 1,
                      "sampler": {"method": "greedy", "seed": 0, "step": 1}}
        r = httpx.post(f"{b.url}sessions/{sid}/resume", json={"checkpoint": checkpoint, "epoch": 2})
        assert r.status_code == 409
        assert r.json()["type"] == "urn:kvsp:problem:kvsp-prefix-unavailable"


def _scope_id() -> str:
    from kvsp_moq.protocol.keys import scope_id

    return scope_id(OPEN_SCOPE_KEY).hex()


# ------------------------------------------------------------------ release after acknowledgement


class SlowPC:
    """Acknowledges checkpoints after a delay and records when; agrees with every status."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.acks: list[tuple[float, int, int]] = []  # (time acknowledged, epoch, output_offset)
        self.deleted: list[str] = []
        self.statuses: list[dict] = []
        self.lock = threading.Lock()

    def app(self) -> Starlette:
        async def checkpoint(request: Request) -> Response:
            body = await request.json()
            await asyncio.sleep(self.delay)
            with self.lock:
                self.acks.append((time.monotonic(), body["epoch"], body["output_offset"]))
            return JSONResponse({"session": body["session"], "epoch": body["epoch"],
                                 "instance": body.get("instance"), "output_offset": body["output_offset"]})

        async def delete(request: Request) -> Response:
            self.deleted.append(request.path_params["session"])
            return Response(status_code=204)

        async def status(request: Request) -> Response:
            body = await request.json()
            with self.lock:
                self.statuses.append(body)
            return JSONResponse({"state": body["state"]})  # agrees with whatever it is told

        return Starlette(routes=[
            Route("/sessions/{session}/checkpoint", checkpoint, methods=["PUT"]),
            Route("/sessions/{session}", delete, methods=["DELETE"]),
            Route("/instances/{id}/status", status, methods=["PUT"]),
        ])


def test_top_p_tokens_wait_for_an_acknowledged_checkpoint(model_dir: Path) -> None:
    pc = SlowPC(delay=0.05)
    with BackgroundServer(pc.app()) as server, Agent(settings(model_dir, pc_url=server.url)) as a:
        sid = str(uuid.uuid4())
        received: list[tuple[float, dict]] = []
        with httpx.stream("POST", a.url + "generate", timeout=60, json={
                "tokens": tokens(40, 13), "max_new_tokens": 20, "session": sid, "stream": True,
                "sampler": {"method": "top-p", "params": {"p": 0.8}, "seed": 3}}) as r:
            for line in r.iter_lines():
                if line.strip():
                    received.append((time.monotonic(), json.loads(line)))
        assert received[-1][1] == {"done": True}
        toks = [x for _, x in received[:-1]]
        assert [x["index"] for x in toks] == list(range(20))
        for at, x in received[:-1]:
            covering = [t for t, _, offset in pc.acks if offset > x["index"]]
            assert covering and min(covering) <= at, x
        # Small batches: the first tokens went out long before the last checkpoint.
        assert len(pc.acks) >= 2 and pc.acks[0][2] < 20
        assert received[0][0] < pc.acks[-1][0]
        assert pc.deleted == [sid]


def test_greedy_checkpoints_every_block(model_dir: Path) -> None:
    pc = SlowPC(delay=0.0)
    with BackgroundServer(pc.app()) as server, Agent(settings(model_dir, pc_url=server.url)) as a:
        sid = str(uuid.uuid4())
        lines = stream_lines(a.url, {"tokens": tokens(PROMPT, 14), "max_new_tokens": 40, "session": sid,
                                     "stream": True})
        assert lines[-1] == {"done": True} and len(lines) == 41
        offsets = [offset for _, _, offset in pc.acks]
        assert offsets == sorted(offsets) and offsets[0] == 0  # the prompt alone, at admission
        # Generated blocks complete when the sequence reaches 80, 96 and 112 tokens.
        for boundary in (80 - PROMPT, 96 - PROMPT, 112 - PROMPT):
            assert any(o >= boundary for o in offsets)
        assert max(b - a for a, b in zip([0] + offsets, offsets)) <= 64


def test_state_changes_and_draining(model_dir: Path) -> None:
    pc = SlowPC(delay=0.0)
    with BackgroundServer(pc.app()) as server, \
            Agent(settings(model_dir, pc_url=server.url, status_ttl_ms=300)) as a:
        epoch = a.context.epoch
        r = httpx.put(a.url + "state", json={"state": "draining", "epoch": epoch - 1})
        assert r.status_code == 409 and r.json()["type"] == "urn:kvsp:problem:kvsp-stale-epoch"
        r = httpx.put(a.url + "state", json={"state": "draining", "epoch": epoch})
        assert r.status_code == 200 and r.json()["state"] == "draining"
        r = httpx.post(a.url + "generate", json={"tokens": [5, 6, 7], "max_new_tokens": 2})
        assert r.status_code == 503
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # nothing running: it reports sleeping
            if any(s["state"] == "sleeping" for s in pc.statuses):
                break
            time.sleep(0.05)
        assert any(s["state"] == "sleeping" for s in pc.statuses)
        r = httpx.put(a.url + "state", json={"state": "active", "epoch": epoch})
        assert r.status_code == 200
        assert httpx.post(a.url + "generate", json={"tokens": [5, 6, 7], "max_new_tokens": 2},
                          timeout=30).status_code == 200
