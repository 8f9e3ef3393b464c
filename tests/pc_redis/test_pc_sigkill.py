"""Three PC processes on one Redis; the one holding the duties, which the instances and the
front end also talk to first, is SIGKILLed together with the instance serving a streamed
session. The surviving instance and the front end move to the next PC of their lists, another
PC takes the duties within the lease, fails the instance and resumes the session once, on the
other instance: the front end gets every token once, the greedy output of an uninterrupted
run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest

from agent.model import ModelAdapter
from agent.service import Agent, AgentSettings
from index.app import IndexSettings
from index.app import create_app as create_index_app
from kvsp_moq.frontend import FrontEnd
from kvsp_moq.holder.service import Holder, HolderSettings
from kvsp_moq.web import BackgroundServer
from tests.agent.conftest import model_dir as model_dir  # a fixture, re-exported for pytest
from tests.agent.conftest import tokens
from tests.index_redis.redis_server import RedisServer, free_port
from tests.pc.test_failover_sigkill import KILL_AT, NEW, PROMPT, AgentProcess, B
from tests.pc.test_failover_sigkill import agent_processes as agent_processes  # a fixture
from tests.polling import wait_until

ROOT = Path(__file__).resolve().parents[2]
DUTIES_TTL_MS = 1000


class PCProcess:
    """`kvsp index --role pc --store redis://...` in a process of its own."""

    def __init__(self, log: Path, store: str, index_url: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvsp_moq.cli", "index", "--role", "pc", "--store", store,
             "--index", index_url, "--listen", f"127.0.0.1:{self.port}",
             "--duties-ttl-ms", str(DUTIES_TTL_MS)],
            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=open(log, "wb"), env=dict(os.environ, PYTHONUNBUFFERED="1"))

    def wait_ready(self, timeout: float = 60) -> None:
        def up() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"PC exited: {self.log.read_text()[-2000:]}")
            try:
                return httpx.get(self.url + "instances", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, timeout=timeout, what=f"PC {self.url} serving", step=0.1)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def pc_processes(tmp_path: Path) -> Iterator[Callable[[str, str], PCProcess]]:
    started: list[PCProcess] = []

    def start(store: str, index_url: str) -> PCProcess:
        p = PCProcess(tmp_path / f"pc{len(started)}.log", store, index_url)
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()


def duties_holder(store: str) -> str | None:
    import redis

    with redis.Redis.from_url(store, decode_responses=True) as r:
        return r.get("kvsp:pc:duties")


async def test_the_duties_pc_and_the_instance_killed_mid_stream(
        model_dir: Path, agent_processes: Callable[..., AgentProcess],
        pc_processes: Callable[[str, str], PCProcess], tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis").start()
    prompt = tokens(PROMPT, 31)
    reference = ModelAdapter.load(model_dir).generate_greedy(prompt, NEW)
    try:
        with BackgroundServer(create_index_app(IndexSettings())) as index, \
                Holder(HolderSettings(listen="127.0.0.1:0", index_url=index.url)) as holder:
            first = pc_processes(server.url, index.url)
            first.wait_ready()
            wait_until(lambda: duties_holder(server.url) is not None, timeout=30,
                       what="the first PC holding the duties", step=0.05)
            duties = duties_holder(server.url)
            second, third = pc_processes(server.url, index.url), pc_processes(server.url, index.url)
            second.wait_ready()
            third.wait_ready()
            assert duties_holder(server.url) == duties  # still the first one's
            common = dict(index_url=index.url, pc_url=f"{first.url},{second.url}", status_ttl_ms=600,
                          replicate_to=[holder.url])
            a = agent_processes("a", token_interval_s=0.03, **common)
            b = Agent(AgentSettings(listen="127.0.0.1:0", model=str(model_dir), block_tokens=B,
                                    warmup_tokens=8, **common)).start()
            try:
                a_url = a.wait_url(120)

                def both_active() -> bool:
                    listed = httpx.get(third.url + "instances", timeout=5).json()["instances"]
                    return {i["instance"] for i in listed if i["state"] == "active"} >= {a_url, b.url}

                wait_until(both_active, timeout=30, what="both agents active at the third PC",
                           step=0.05)
                session = str(uuid.uuid4())
                async with httpx.AsyncClient(timeout=30) as client:
                    async with client.stream("POST", a_url + "generate", json={
                            "tokens": prompt, "max_new_tokens": NEW, "session": session,
                            "stream": True}) as r:
                        assert r.status_code == 200
                got = []
                killed_at = 0.0
                async with FrontEnd(f"{first.url},{third.url}", timeout_s=60, backoff_s=0.1,
                                    retries=400) as fe:
                    async for tok in fe.stream(session, instance=a_url):
                        got.append(tok)
                        if len(got) == KILL_AT:
                            wait_until(lambda: holder.publisher.published >= PROMPT // B,
                                       timeout=30, what="A's prompt blocks at the holder")
                            first.kill()  # the PC with the duties...
                            a.kill()      # ...and the instance serving the session
                            killed_at = time.monotonic()
                assert killed_at
                assert [t.index for t in got] == list(range(NEW))  # every token once
                assert [t.token for t in got] == reference
                assert {t.epoch for t in got[:KILL_AT]} == {1} and got[-1].epoch == 2
                moved = b.engine.sessions[session]
                assert (moved.epoch, moved.state) == (2, "finished")  # resumed once
                new_holder = duties_holder(server.url)
                assert new_holder is not None and new_holder != duties
                assert b.context.reporter is not None and b.context.reporter.pc.url == second.url
                assert fe.pc_url == third.url
            finally:
                b.stop()
    finally:
        server.stop()
