"""The `openai` client against the gateway, in front of a PC and two tiny-model agents."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from agent.service import Agent
from kvsp_moq.gateway.text import ModelText
from tests.polling import wait_until

from .conftest import B, Stack

MODEL = "llama-tiny"


def words(start: int, n: int) -> str:
    """A prompt of the tiny model: one token per word."""
    return " ".join(f"w{i}" for i in range(start, start + n))


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    with httpx.Client(trust_env=False, timeout=60) as http:
        yield openai.OpenAI(base_url=stack.v1, api_key="unused", max_retries=0, http_client=http)


def session_of(response_id: str) -> str:
    return str(uuid.UUID(response_id.split("-", 1)[1]))


def agent_with(stack: Stack, session: str) -> Agent:
    (agent,) = [a for a in stack.agents if session in a.engine.sessions]
    return agent


def agent_generate(stack: Stack, tokens: list[int], n: int) -> list[int]:
    r = httpx.post(stack.agents[0].url + "generate", timeout=60,
                   json={"tokens": tokens, "max_new_tokens": n}, trust_env=False)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def expected_text(stack: Stack, text: ModelText, tokens: list[int], n: int) -> tuple[str, str]:
    out = agent_generate(stack, tokens, n)
    eos = [i for i, t in enumerate(out) if t in text.eos_ids]
    if eos:
        return text.decode(out[:eos[0]]), "stop"
    return text.decode(out), "length"


def quiet(stack: Stack) -> None:
    """Until no instance runs or queues a request, nor has one routed to it unaccounted."""
    wait_until(lambda: all(a.engine.running == 0 and a.engine.queued == 0
                           for a in stack.agents), timeout=60, what="the agents are idle")

    def idle_at_pc() -> bool:
        listed = httpx.get(stack.pc + "instances", trust_env=False, timeout=10).json()
        mine = [i for i in listed["instances"] if i["instance"] in {a.url for a in stack.agents}]
        return len(mine) == 2 and all(i["running"] == 0 and i["queued"] == 0 and i["routed"] == 0
                                      for i in mine)

    wait_until(idle_at_pc, timeout=60, what="the PC sees the agents idle")


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_greedy_completion_equals_the_agents_own_generate(stack: Stack,
                                                          client: openai.OpenAI) -> None:
    text = ModelText(stack.model_dir)
    prompt = words(100, 3 * B + 5)
    tokens = text.encode(prompt)
    assert len(tokens) == 3 * B + 5
    want, finish = expected_text(stack, text, tokens, 12)
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=12,
                                                      temperature=0)
    assert float(raw.headers["x-kvsp-gateway-ms"]) >= 0
    got = raw.parse()
    assert got.choices[0].text.strip() == want
    assert got.choices[0].finish_reason == finish
    assert got.usage is not None and got.usage.prompt_tokens == len(tokens)
    assert got.usage.completion_tokens == 12 or finish == "stop"
    # The same prompt as token ids, streamed: the same text.
    chunks = list(client.completions.create(model=MODEL, prompt=tokens, max_tokens=12,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices).strip() == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(tokens)


def test_stop_string_cuts_the_output(stack: Stack, client: openai.OpenAI) -> None:
    text = ModelText(stack.model_dir)
    prompt = words(300, 2 * B)
    full, _ = expected_text(stack, text, text.encode(prompt), 10)
    cut_at = full.split()[3]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                    stop=[cut_at])
    assert got.choices[0].finish_reason == "stop"
    assert got.choices[0].text.strip() == full[:full.index(cut_at)].strip()
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10,
                                         temperature=0, stop=cut_at, stream=True)
    assert "".join(c.choices[0].text for c in streamed).strip() == got.choices[0].text.strip()


def test_chat_whole_and_streamed(stack: Stack, client: openai.OpenAI) -> None:
    text = ModelText(stack.model_dir)
    messages = [{"role": "system", "content": words(500, 20)},
                {"role": "user", "content": words(600, 10)}]
    tokens = text.chat_tokens(messages)
    want, finish = expected_text(stack, text, tokens, 6)
    got = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                         max_completion_tokens=6, temperature=0)
    assert got.object == "chat.completion"
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content is not None
    assert got.choices[0].message.content.strip() == want
    assert got.choices[0].finish_reason == finish
    assert got.usage is not None and got.usage.prompt_tokens == len(tokens)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=6,  # type: ignore[arg-type]
        temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks).strip() == want
    assert chunks[-1].choices[0].finish_reason == finish
    # Sampled (temperature > 0, seeded): the same seed, the same answer.
    a, b = (client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                           max_tokens=6, temperature=0.9, top_p=0.9, seed=5)
            for _ in range(2))
    assert a.choices[0].message.content == b.choices[0].message.content


def test_bad_requests_and_unknown_model(client: openai.OpenAI, stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="w5 w6", n=2)
    assert e.value.status_code == 400
    body = e.value.body
    assert isinstance(body, dict) and body["param"] == "n" and body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="w5", max_tokens=0)
    with pytest.raises(openai.NotFoundError) as nf:
        client.completions.create(model="gpt-nothing", prompt="w5 w6")
    assert isinstance(nf.value.body, dict) and nf.value.body["code"] == "model_not_found"
    # Not JSON at all: the OpenAI error shape, not a problem document.
    r = httpx.post(stack.v1 + "/chat/completions", content=b"{nope", trust_env=False,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_second_request_with_the_prefix_goes_where_it_is_cached(stack: Stack,
                                                                client: openai.OpenAI) -> None:
    text = ModelText(stack.model_dir)
    system = words(1000, 4 * B)
    first = client.completions.create(model=MODEL, prompt=system + " w7", max_tokens=2,
                                      temperature=0)
    holder = agent_with(stack, session_of(first.id))
    # Its prompt blocks are published (looked up at the index) before the next request.
    body = stack.app.state.gateway.backend.route_body  # type: ignore[attr-defined]
    from kvsp_moq.gateway.backend import Job
    from kvsp_moq.gateway.scopes import ScopeChooser
    from kvsp_moq.scope_keys import OPEN_SCOPE, OPEN_SCOPE_KEY

    scope = ScopeChooser({OPEN_SCOPE: OPEN_SCOPE_KEY}).scopes[OPEN_SCOPE]
    route = body(Job(tuple(text.encode(system)), 1, {}, scope))
    lookup = {"compat_id": route["compat_id"], "scope_id": route["scope_id"],
              "block_keys": route["block_keys"]}
    wait_until(lambda: httpx.post(stack.index + "lookup", json=lookup, trust_env=False,
                                  timeout=10).json()["matched"] == 4,
               timeout=30, what="the first prompt's blocks are published")
    # Both instances idle, as the PC sees them (an earlier request cut by a stop string may
    # still be generating): the cost is then the prefix's alone.
    quiet(stack)
    second = client.completions.create(model=MODEL, prompt=system + " w9 w10", max_tokens=2,
                                       temperature=0)
    assert agent_with(stack, session_of(second.id)) is holder
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens == 4 * B


def test_metrics_count_the_gateways_overhead(stack: Stack) -> None:
    text = httpx.get(stack.gateway + "metrics", trust_env=False).text
    line = [x for x in text.splitlines() if x.startswith("kvsp_gateway_overhead_requests ")]
    assert line and int(float(line[0].split()[1])) >= 1


def test_an_unreachable_instance_is_excluded_and_the_prompt_routed_again(
        stack: Stack, client: openai.OpenAI) -> None:
    """Last in this module: the PC keeps the dead instance until its status expires."""
    from tests.pc.fakes import status, status_path

    dead = "http://127.0.0.1:9/"
    r = httpx.put(stack.pc + status_path(dead), trust_env=False, timeout=10,
                  json=status(dead, ttl_ms=3000, prefill_tokens_per_s=10**9,
                              decode_tokens_per_s=10**6))
    assert r.status_code == 200, r.text
    prompt = words(3000, 2 * B)
    route = stack.app.state.gateway.backend.route_body
    from kvsp_moq.gateway.backend import Job
    from kvsp_moq.gateway.scopes import ScopeChooser
    from kvsp_moq.scope_keys import OPEN_SCOPE, OPEN_SCOPE_KEY

    scope = ScopeChooser({OPEN_SCOPE: OPEN_SCOPE_KEY}).scopes[OPEN_SCOPE]
    tokens = ModelText(stack.model_dir).encode(prompt)
    decision = httpx.post(stack.pc + "route", json=route(Job(tuple(tokens), 1, {}, scope)),
                          trust_env=False, timeout=10).json()
    assert decision["instance"] == dead  # the PC's first choice cannot be reached
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    assert got.choices[0].text and agent_with(stack, session_of(got.id)) in stack.agents


def test_no_active_instance_is_a_503(model_dir: Path, tmp_path: Path) -> None:
    from kvsp_moq.gateway.app import GatewaySettings, create_app
    from kvsp_moq.web import BackgroundServer
    from pc.app import PCSettings, create_pc_app

    with BackgroundServer(create_pc_app(PCSettings(database=str(tmp_path / "pc.db")))) as pc, \
            BackgroundServer(create_app(GatewaySettings(pc.url, model_dir))) as gw, \
            httpx.Client(trust_env=False, timeout=30) as http:
        c = openai.OpenAI(base_url=gw.url + "v1", api_key="unused", max_retries=0,
                          http_client=http)
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model=MODEL, prompt="w5 w6", max_tokens=2)
        assert e.value.status_code == 503
        assert isinstance(e.value.body, dict) and e.value.body["code"] == "kvsp-no-instance"
