"""`kvsp agent --loader-cpus`: the loader's threads on cores of their own, the model's on the
others, torch computing with one thread per model core; undone when the agent closes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import torch

from agent.cores import loader_cpus
from agent.service import Agent, AgentSettings
from kvsp_moq.errors import SettingError


def affinity(thread_id: int | None) -> set[int]:
    assert thread_id is not None
    return os.sched_getaffinity(thread_id)


def test_the_loader_and_the_model_on_cores_of_their_own(model_dir: Path) -> None:
    allowed = os.sched_getaffinity(0)
    assert len(allowed) >= 2, "this test needs two CPUs"
    loader = frozenset({max(allowed)})
    model = allowed - loader
    with Agent(AgentSettings(listen="127.0.0.1:0", model=str(model_dir), block_tokens=16,
                             warmup_tokens=8, loader_cpus=loader)) as agent:
        loop_thread = agent.call(_current_thread())
        model_thread = agent.engine.model_thread.submit(threading.get_native_id).result(10)
        assert affinity(loop_thread) == loader and affinity(model_thread) == model
        assert affinity(threading.get_native_id()) == model  # every other thread too
        assert agent.engine.model_thread.submit(torch.get_num_threads).result(10) == len(model)
        r = httpx.post(agent.url + "generate", json={"tokens": list(range(3, 40)),
                                                     "max_new_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
    assert affinity(threading.get_native_id()) == allowed


async def _current_thread() -> int:
    return threading.get_native_id()


def test_choices_and_refusals() -> None:
    allowed = os.sched_getaffinity(0)
    assert loader_cpus(None) is None and loader_cpus("none") is None
    auto = loader_cpus("auto")
    assert auto and auto < allowed
    for spec, says in (("x", "'x' is not a CPU number"), ("100000", "CPU 100000 is not one"),
                       (f"0-{max(allowed)}", "leaves the model no core")):
        with pytest.raises(SettingError, match=says):
            loader_cpus(spec)


def test_the_command_line_refuses_in_one_line() -> None:
    allowed = os.sched_getaffinity(0)
    r = subprocess.run([sys.executable, "-m", "kvsp_moq.cli", "agent", "--loader-cpus",
                        ",".join(map(str, sorted(allowed)))], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "leaves the model no core" in r.stderr
