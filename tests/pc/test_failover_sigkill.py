"""An agent killed with SIGKILL in the middle of a session (§6.8), greedy and top-p with a seed.
The killed agent is a process of its own; the IS, the PC, a holder and the agent the session
moves to run in the test process; all of them talk HTTP on 127.0.0.1.

What must hold, and is asserted, for both samplers:

- the front end delivers every output index exactly once, epoch 1 (the killed instance) and
  then epoch 2 (the instance the PC resumed the session on, from the last checkpoint the PC
  acknowledged, with the sampler's method, parameters and seed at step output_offset);
- no delivered token is ever changed: the resumed instance has, at every index, the token
  the front end delivered.

Greedy (deterministic): the killed instance released tokens once the PC had acknowledged the
first checkpoint (the prompt alone, sent at admission), without waiting for later ones; the
resumed one regenerates those after the checkpoint exactly, and the whole output equals an
uninterrupted run.

Top-p (the non-deterministic rule): the killed instance released no token before the PC
acknowledged a checkpoint covering it, so every token delivered under epoch 1 lies below the
checkpoint's output_offset and equals the token the checkpoint holds there. Up to
output_offset the output is the killed instance's sample, i.e. the uninterrupted run with the
same seed. After it the rule lets the tokens differ from that run: the resumed instance
computed its KV cache another way (loaded blocks, recomputed tail), and a top-p draw may fall
on the other side of a probability boundary. That part is not compared.
"""

from __future__ import annotations

import asyncio
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

from agent.model import ModelAdapter, TokenSampler
from agent.service import Agent, AgentSettings
from index.app import IndexSettings
from index.app import create_app as create_index_app
from kvsp_moq.frontend import FrontEnd, Restart, Token
from kvsp_moq.holder.service import Holder, HolderSettings
from kvsp_moq.scope_keys import OPEN_SCOPE, OPEN_SCOPE_KEY
from kvsp_moq.web import BackgroundServer
from pc.app import PCSettings, create_pc_app
from pc.lifecycle import LifecycleSettings
from pc.placement import ScopeKeys
from tests.agent.conftest import model_dir as model_dir  # a fixture, re-exported for pytest
from tests.agent.conftest import tokens
from tests.polling import wait_until

B = 16
PROMPT = 72  # 4 complete blocks and a tail of 8
NEW = 40
KILL_AT = 12  # tokens delivered when the serving agent is killed
SAMPLERS = {
    "greedy": ({"method": "greedy"}, TokenSampler()),
    "top-p": ({"method": "top-p", "params": {"p": 0.9, "temperature": 1.0}, "seed": 7},
              TokenSampler(temperature=1.0, top_p=0.9, seed=7)),
}
ROOT = Path(__file__).resolve().parents[2]


class AgentProcess:
    """`tests.pc.agent_process` in a process of its own; `kill()` sends SIGKILL."""

    def __init__(self, log: Path, **options: Any) -> None:
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.pc.agent_process", json.dumps(options)],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=open(log, "wb"), env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.url = ""

    def wait_url(self, timeout: float) -> str:
        """The agent's base URL, once it serves (bounded)."""
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while not self.url:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                raise AssertionError(f"agent did not start: {self.log.read_text()[-2000:]}")
            if sel.select(min(left, 0.5)):
                line = self.proc.stdout.readline()
                if line:
                    self.url = json.loads(line)["url"]
        sel.close()
        return self.url

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # the agent stops when its input closes
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None and not stream.closed:
                stream.close()


@pytest.fixture
def agent_processes(model_dir: Path, tmp_path: Path) -> Iterator[Callable[..., AgentProcess]]:
    """Starts agent processes for a test and stops whatever is left of them after it."""
    started: list[AgentProcess] = []

    def start(name: str, **options: Any) -> AgentProcess:
        p = AgentProcess(tmp_path / f"{name}.log", model=str(model_dir), block_tokens=B,
                         warmup_tokens=8, **options)
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()


@pytest.mark.parametrize("method", list(SAMPLERS))
async def test_session_survives_sigkill_without_changing_a_delivered_token(
        method: str, model_dir: Path, agent_processes: Callable[..., AgentProcess],
        tmp_path: Path) -> None:
    sampler, model_sampler = SAMPLERS[method]
    prompt = tokens(PROMPT, 21)
    with BackgroundServer(create_index_app(IndexSettings())) as index, \
            Holder(HolderSettings(listen="127.0.0.1:0", index_url=index.url)) as holder:
        settings = PCSettings(database=str(tmp_path / "pc.sqlite3"), index_url=index.url,
                              sweep_interval_s=0.05, lifecycle=LifecycleSettings())
        pc_app = create_pc_app(settings, keys=ScopeKeys({OPEN_SCOPE: OPEN_SCOPE_KEY}))
        with BackgroundServer(pc_app) as pc:
            controller = pc_app.state.pc
            resumes: list[tuple[str, str, dict]] = []
            send_resume = controller.failover.send_resume

            async def recording_resume(instance: str, session: str, body: dict) -> None:
                resumes.append((instance, session, body))
                await send_resume(instance, session, body)

            controller.failover.send_resume = recording_resume
            common: dict[str, Any] = dict(index_url=index.url, pc_url=pc.url, status_ttl_ms=600,
                                          replicate_to=[holder.url])
            # A, the one killed, runs in its own process; B, where the session goes, runs
            # here (it only has to survive). A starts while the reference is computed.
            a = agent_processes("a", token_interval_s=0.03, **common)
            reference = ModelAdapter.load(model_dir).generate(prompt, NEW,
                                                              sampler=model_sampler).tokens
            b = Agent(AgentSettings(listen="127.0.0.1:0", model=str(model_dir), block_tokens=B,
                                    warmup_tokens=8, **common)).start()
            try:
                await _run(pc.url, a, b.url, prompt, sampler, reference, resumes,
                           lambda: holder.publisher.published >= PROMPT // B)
            finally:
                b.stop()


async def _run(pc_url: str, a: AgentProcess, b_url: str, prompt: list[int], sampler: dict,
               reference: list[int], resumes: list[tuple[str, str, dict]],
               replicated: Callable[[], bool]) -> None:
    """Start the session on A, kill A after KILL_AT tokens (once its prompt blocks have a
    replica that outlives it: without one no instance can resume the session, which knows
    the prompt only by its Block Keys), check what the front end got."""
    a_url = a.wait_url(120)

    def both_active() -> bool:
        listed = httpx.get(pc_url + "instances", timeout=5).json()["instances"]
        return {i["instance"] for i in listed if i["state"] == "active"} >= {a_url, b_url}

    wait_until(both_active, timeout=30, what="both agents active at the PC", step=0.05)

    session = str(uuid.uuid4())
    async with httpx.AsyncClient(timeout=30) as client:
        async with client.stream("POST", a_url + "generate", json={
                "tokens": prompt, "max_new_tokens": NEW, "session": session,
                "sampler": sampler, "stream": True}) as r:
            assert r.status_code == 200  # the front end reads the session from here
    got: list[Token] = []
    killed_after: int | None = None
    async with FrontEnd(pc_url, timeout_s=30, backoff_s=0.1) as fe:
        async for tok in fe.stream(session, instance=a_url):
            got.append(tok)
            if len(got) == KILL_AT and killed_after is None:
                wait_until(replicated, timeout=30, what="A's prompt blocks at the holder",
                           step=0.02)
                a.kill()
                killed_after = len(got)
    assert killed_after == KILL_AT

    # Every index exactly once; the killed instance's epoch, then the new one.
    assert [t.index for t in got] == list(range(NEW))
    epochs = [t.epoch for t in got]
    assert epochs == sorted(epochs) and epochs[0] == 1 and epochs[-1] == 2
    before = [t.token for t in got if t.epoch == 1]
    assert len(before) >= KILL_AT

    # The PC resumed the session once, on B, from A's last acknowledged checkpoint.
    assert [(inst, s, body["epoch"]) for inst, s, body in resumes] == [(b_url, session, 2)]
    cp = resumes[0][2]["checkpoint"]
    offset = cp["output_offset"]
    assert cp["epoch"] == 1 and len(cp["generated"]) == offset
    assert offset < NEW  # A was killed before it had produced the whole output
    deterministic = sampler["method"] == "greedy"
    assert cp["sampler"] == {"method": sampler["method"], "seed": sampler.get("seed", 0),
                             "step": offset, "deterministic": deterministic,
                             "params": {**sampler.get("params", {}), "max_new_tokens": NEW}}
    if not deterministic:
        # Nothing left A before a checkpoint covering it was acknowledged.
        assert len(before) <= offset
        assert cp["generated"][:len(before)] == before

    # No delivered token is ever changed: B holds the same token at every index.
    with httpx.stream("GET", f"{b_url}sessions/{session}/stream", params={"from": 0},
                      timeout=30) as s:
        lines = [json.loads(x) for x in s.iter_lines() if x.strip()]
    assert lines[-1] == {"done": True}
    assert [x["index"] for x in lines[:-1]] == list(range(NEW))
    assert {x["epoch"] for x in lines[:-1]} == {2}
    assert [x["token"] for x in lines[:-1]] == [t.token for t in got]
    assert [x["token"] for x in lines[:offset]] == cp["generated"]

    if deterministic:
        # A greedy output is the same wherever it is computed.
        assert [t.token for t in got] == reference
    else:
        # Up to the checkpoint it is A's sample: the uninterrupted run with seed 7.
        assert [t.token for t in got[:offset]] == reference[:offset]

    # The session ended at the PC when B finished it.
    assert httpx.get(f"{pc_url}sessions/{session}", timeout=5).json()["ended"] is True


class HeldCheckpoints:
    """The PC behind a door that holds every checkpoint PUT until `release`, then refuses the
    held ones (503) without the PC seeing them: a checkpoint still in flight when its
    instance dies."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.waiting = 0
        self._released = threading.Event()

    def release(self) -> None:
        self._released.set()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if (scope["type"] == "http" and scope["method"] == "PUT"
                and scope["path"].endswith("/checkpoint") and not self._released.is_set()):
            self.waiting += 1
            for _ in range(600):  # bounded: a minute
                if self._released.is_set():
                    break
                await asyncio.sleep(0.1)
            await send({"type": "http.response.start", "status": 503, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        await self.app(scope, receive, send)


@pytest.mark.parametrize("method", list(SAMPLERS))
async def test_a_session_lost_before_its_first_checkpoint_starts_again_from_its_prompt(
        method: str, model_dir: Path, agent_processes: Callable[..., AgentProcess],
        tmp_path: Path) -> None:
    """The PC resumes only what it holds a checkpoint of; an agent killed before the PC
    acknowledged its first checkpoint leaves none (and released no token). The front end,
    which knows how it started the session, starts it again from its prompt on another
    instance at epoch 2: every index once, and (greedy) the uninterrupted run's output."""
    sampler, model_sampler = SAMPLERS[method]
    prompt = tokens(PROMPT, 22)
    with BackgroundServer(create_index_app(IndexSettings())) as index:
        settings = PCSettings(database=str(tmp_path / "pc.sqlite3"), index_url=index.url,
                              sweep_interval_s=0.05, lifecycle=LifecycleSettings())
        pc_app = create_pc_app(settings, keys=ScopeKeys({OPEN_SCOPE: OPEN_SCOPE_KEY}))
        held = HeldCheckpoints(pc_app)
        with BackgroundServer(held) as pc:
            resumes: list[str] = []
            send_resume = pc_app.state.pc.failover.send_resume

            async def recording_resume(instance: str, session: str, body: dict) -> None:
                resumes.append(instance)
                await send_resume(instance, session, body)

            pc_app.state.pc.failover.send_resume = recording_resume
            common: dict[str, Any] = dict(index_url=index.url, pc_url=pc.url, status_ttl_ms=600)
            a = agent_processes("a", token_interval_s=0.03, **common)
            reference = ModelAdapter.load(model_dir).generate(prompt, NEW,
                                                              sampler=model_sampler).tokens
            b = Agent(AgentSettings(listen="127.0.0.1:0", model=str(model_dir), block_tokens=B,
                                    warmup_tokens=8, **common)).start()
            try:
                a_url = a.wait_url(120)

                def both_active() -> bool:
                    listed = httpx.get(pc.url + "instances", timeout=5).json()["instances"]
                    return {i["instance"] for i in listed if i["state"] == "active"} >= {a_url, b.url}

                wait_until(both_active, timeout=30, what="both agents active at the PC", step=0.05)
                session = str(uuid.uuid4())
                generate = {"tokens": prompt, "max_new_tokens": NEW, "sampler": sampler}
                async with httpx.AsyncClient(timeout=30) as client:
                    async with client.stream("POST", a_url + "generate", json={
                            **generate, "session": session, "stream": True}) as r:
                        assert r.status_code == 200
                wait_until(lambda: held.waiting > 0, timeout=30, what="A's first checkpoint")
                a.kill()  # its first checkpoint not acknowledged: the PC knows nothing of it
                held.release()
                assert httpx.get(f"{pc.url}sessions/{session}", timeout=5).status_code == 404
                restart = Restart(route={"tokens": prompt, "scope": OPEN_SCOPE,
                                         "compat_id": b.context.compat_id}, generate=generate)
                async with FrontEnd(pc.url, timeout_s=60, backoff_s=0.1) as fe:
                    got = [tok async for tok in fe.stream(session, instance=a_url, restart=restart)]
                # B holds the same tokens, at epoch 2.
                with httpx.stream("GET", f"{b.url}sessions/{session}/stream", params={"from": 0},
                                  timeout=30) as s:
                    lines = [json.loads(x) for x in s.iter_lines() if x.strip()]
            finally:
                b.stop()
    assert [t.index for t in got] == list(range(NEW))
    assert {t.epoch for t in got} == {2} and resumes == []
    assert lines[-1] == {"done": True}
    assert [(x["index"], x["epoch"], x["token"]) for x in lines[:-1]] == \
        [(t.index, t.epoch, t.token) for t in got]
    if sampler["method"] == "greedy":
        assert [t.token for t in got] == reference
