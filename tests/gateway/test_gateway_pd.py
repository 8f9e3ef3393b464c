"""Prefill and decode apart behind the gateway (DESIGN §9.4): with `kvsp index --pd length:N`
the PC names a prefill instance; the gateway asks it to compute the prompt and has the decode
instance subscribe to its layers through the relay; the client gets the text one instance
alone gives."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from kvsp_moq.gateway.text import ModelText
from pc.disaggregation import SplitPolicy
from relay.relay import RelaySettings
from relay.service import BackgroundRelay
from tests.polling import wait_until

from .conftest import B, Stack, make_stack

NEW = 8


@pytest.fixture(scope="module")
def pd_stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    relay = BackgroundRelay(RelaySettings()).start()
    try:
        db = tmp_path_factory.mktemp("gateway-pd") / "pc.sqlite3"
        with make_stack(model_dir, db, pc={"pd": SplitPolicy.parse(f"length:{4 * B}")},
                        relay=relay.url, relay_timeout_s=5.0) as stack:
            yield stack
    finally:
        relay.stop()


def test_a_completion_is_prefilled_on_one_instance_and_decoded_on_another(pd_stack: Stack) -> None:
    stack = pd_stack
    wait_until(lambda: sum(i["state"] == "active" for i in httpx.get(
        stack.pc + "instances", timeout=5, trust_env=False).json()["instances"]) == 2,
        timeout=20, what="both agents active at the PC")
    text = ModelText(stack.model_dir)
    prompt = " ".join(f"w{i}" for i in range(3000, 3000 + 8 * B))
    tokens = text.encode(prompt)
    expected = httpx.post(stack.agents[0].url + "generate", trust_env=False, timeout=60,
                          json={"tokens": tokens, "max_new_tokens": NEW}).json()["tokens"]
    assert len(set(tokens)) > B  # words the tokenizer knows (unknown ones are all one token)
    # The reference request stored the prompt's blocks at agent 0: a new prompt is needed.
    prompt = " ".join(f"w{i}" for i in range(3200, 3200 + 8 * B))
    tokens = text.encode(prompt)
    with httpx.Client(trust_env=False, timeout=60) as http:
        client = openai.OpenAI(base_url=stack.v1, api_key="unused", max_retries=0, http_client=http)
        done = client.completions.create(model="llama-tiny", prompt=prompt, max_tokens=NEW,
                                         temperature=0)
    session = str(uuid.UUID(done.id.split("-", 1)[1]))
    (decoder,) = [a for a in stack.agents if session in a.engine.sessions]
    state = decoder.engine.sessions[session]
    (producer,) = [a for a in stack.agents if a is not decoder]
    assert state.prefill_at == producer.url, state.prefill_at
    # The producer's pass layout came with the generate: its blocks were one subscription.
    assert state.prefill_passes == ((0, len(tokens) // B),), state.prefill_passes
    assert state.sources["moqt"] == (len(tokens) - 1) // B and state.sources["recompute"] <= 1
    alone = httpx.post(producer.url + "generate", trust_env=False, timeout=60,
                       json={"tokens": tokens, "max_new_tokens": NEW}).json()["tokens"]
    assert done.choices[0].text.strip() == text.decode(alone).strip()
    assert expected != alone  # the two prompts differ, and so do their answers
