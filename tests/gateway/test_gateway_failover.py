"""A streamed completion survives the loss of its instance: the gateway reads it through
`FrontEnd`, which follows the session to the instance the PC resumed it on; the client gets
every token once, the same text as an uninterrupted greedy run."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from kvsp_moq.gateway.text import ModelText
from pc.lifecycle import LifecycleSettings

from .conftest import B, Stack, make_stack

NEW = 40


@pytest.fixture(scope="module")
def slow_stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    db = tmp_path_factory.mktemp("gateway-failover") / "pc.sqlite3"
    with make_stack(model_dir, db, pc={"sweep_interval_s": 0.05,
                                       "lifecycle": LifecycleSettings()},
                    holder=True, token_interval_s=0.03, status_ttl_ms=1500) as stack:
        yield stack


def test_a_stream_survives_its_instance(slow_stack: Stack) -> None:
    stack = slow_stack
    text = ModelText(stack.model_dir)
    prompt = " ".join(f"w{i}" for i in range(2000, 2000 + 4 * B + 8))
    tokens = text.encode(prompt)
    r = httpx.post(stack.agents[1].url + "generate", trust_env=False, timeout=60,
                   json={"tokens": tokens, "max_new_tokens": NEW})
    expected = r.json()["tokens"]
    assert not set(expected) & text.eos_ids  # the text runs to max_tokens
    with httpx.Client(trust_env=False, timeout=60) as http:
        client = openai.OpenAI(base_url=stack.v1, api_key="unused", max_retries=0,
                               http_client=http)
        pieces: list[str] = []
        stopped = None
        for chunk in client.completions.create(model="llama-tiny", prompt=prompt,
                                               max_tokens=NEW, temperature=0, stream=True):
            pieces.append(chunk.choices[0].text)
            if len(pieces) == 10 and stopped is None:
                session = str(uuid.UUID(chunk.id.split("-", 1)[1]))
                (stopped,) = [a for a in stack.agents if session in a.engine.sessions]
                stopped.stop()  # its instance goes away mid-stream
        assert stopped is not None
        assert chunks_finish(pieces) == text.decode(expected)
        (survivor,) = [a for a in stack.agents if a is not stopped]
        assert survivor.engine.sessions[session].epoch >= 2


def chunks_finish(pieces: list[str]) -> str:
    return "".join(pieces).strip()


def test_an_output_cut_by_a_stop_string_stops_its_instance(slow_stack: Stack) -> None:
    """The client has what it asked for at the stop string: the instance stops generating (and
    the PC forgets the session) instead of running on to max_tokens."""
    from tests.polling import wait_until

    stack = slow_stack
    text = ModelText(stack.model_dir)
    prompt = " ".join(f"w{i}" for i in range(2400, 2400 + 2 * B))
    tokens = text.encode(prompt)
    expected = httpx.post(stack.agents[0].url + "generate", trust_env=False, timeout=60,
                          json={"tokens": tokens, "max_new_tokens": 6}).json()["tokens"]
    stop = text.decode(expected).split()[3]
    with httpx.Client(trust_env=False, timeout=60) as http:
        client = openai.OpenAI(base_url=stack.v1, api_key="unused", max_retries=0, http_client=http)
        done = client.completions.create(model="llama-tiny", prompt=prompt, max_tokens=400,
                                         temperature=0, stop=[stop])
    assert done.choices[0].finish_reason == "stop"
    session = str(uuid.UUID(done.id.split("-", 1)[1]))
    (agent,) = [a for a in stack.agents if session in a.engine.sessions]
    state = agent.engine.sessions[session]
    wait_until(lambda: state.finished, timeout=20, what="the session ending")
    assert state.state == "cancelled" and state.error == "stopped by the client"
    assert len(state.generated) < 400
    wait_until(lambda: httpx.get(f"{stack.pc}sessions/{session}", trust_env=False,
                                 timeout=5).json().get("ended") is True,
               timeout=20, what="the session ended at the PC (never resumed elsewhere)")
