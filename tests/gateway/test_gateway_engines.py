"""OpenAI engines behind the gateway (`kvsp_moq.gateway.openai_backend`), without vLLM: two
small engines that speak vLLM's streamed completions (token ids in, `token_ids` out) and report
status to the PC. The gateway finds out what they speak, forwards token ids, relays their
refusals, and continues a stream whose engine is lost on the other one, each token once.
(`tests_vllm/test_gateway.py` runs the same against vLLM.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from index.app import IndexSettings
from index.app import create_app as create_index_app
from kvsp_moq.gateway.app import GatewaySettings, create_app
from kvsp_moq.gateway.text import ModelText
from kvsp_moq.protocol.instances import instance_id
from kvsp_moq.web import BackgroundServer
from pc.app import PCSettings, create_pc_app

B = 16
MAX_PROMPT = 400


def next_token(seq: list[int]) -> int:
    """The engines' "greedy" model: a function of the whole sequence, never end of sequence."""
    return 3 + (sum(seq) * 7919 + len(seq)) % 4000


def expected(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


#: The next stream of either engine fails after `after` tokens, `left` times, and how ("break":
#: the connection breaks; "error": an error event of the engine's own; "truncated": the stream
#: ends cleanly without a finish reason; "refuse": a 500 before the stream).
FAILURES: dict[str, Any] = {"left": 0, "after": 5, "how": "break", "by": None}


class Engine:
    """An OpenAI engine: the requests it got, and the streams its client closed early."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.aborted = 0
        self.url = ""

    def app(self) -> Starlette:
        async def models(request: Request) -> Response:
            return JSONResponse({"object": "list", "data": [{"id": "engine-model",
                                                             "object": "model"}]})

        async def completions(request: Request) -> Response:
            body = await request.json()
            self.requests.append(body)
            prompt = body["prompt"]
            if FAILURES["left"] > 0 and FAILURES["how"] == "refuse":
                FAILURES["left"] -= 1
                FAILURES["by"] = self
                return JSONResponse({"error": {"message": "EngineCore died", "code": 500}},
                                    status_code=500)
            if len(prompt) > MAX_PROMPT:
                return JSONResponse({"error": {"message": "the prompt is too long",
                                               "type": "BadRequestError", "param": "prompt",
                                               "code": 400}}, status_code=400)
            return StreamingResponse(self.stream(prompt, body["max_tokens"]),
                                     media_type="text/event-stream")

        return Starlette(routes=[Route("/v1/models", models),
                                 Route("/v1/completions", completions, methods=["POST"])])

    async def stream(self, prompt: list[int], n: int) -> AsyncIterator[bytes]:
        def event(obj: Any) -> bytes:
            return f"data: {json.dumps(obj)}\n\n".encode()

        sent, failed = 0, False
        try:
            for i, t in enumerate(expected(prompt, n)):
                if FAILURES["left"] > 0 and i >= FAILURES["after"]:
                    FAILURES["left"] -= 1
                    FAILURES["by"] = self
                    failed = True
                    if FAILURES["how"] == "error":
                        yield event({"error": {"message": "EngineCore died", "code": 500}})
                        yield b"data: [DONE]\n\n"
                    if FAILURES["how"] == "break":
                        raise RuntimeError("the engine is lost")  # the body breaks off
                    return
                finish = "length" if i == n - 1 else None
                yield event({"choices": [{"index": 0, "text": "?", "token_ids": [t],
                                          "finish_reason": finish}]})
                sent += 1
                await asyncio.sleep(0.01)
        finally:
            if sent < n and not failed:
                self.aborted += 1
        yield event({"choices": [], "usage": {"prompt_tokens": len(prompt),
                                              "prompt_tokens_details": {"cached_tokens": 32}}})
        yield b"data: [DONE]\n\n"


def report(pc: str, url: str, running: int = 0) -> None:
    record = {"instance": url, "epoch": 1, "state": "active", "ttl_ms": 600_000,
              "running": running, "prefill_tokens_per_s": 1000.0}
    r = httpx.put(f"{pc}instances/{instance_id(url)}/status", json=record, trust_env=False)
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def fleet(model_dir: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[str, list[Engine], Any]]:
    db = tmp_path_factory.mktemp("gateway-engines") / "pc.sqlite3"
    with contextlib.ExitStack() as stack:
        index = stack.enter_context(BackgroundServer(create_index_app(IndexSettings())))
        pc = stack.enter_context(BackgroundServer(
            create_pc_app(PCSettings(database=str(db), index_url=index.url))))
        engines = [Engine(), Engine()]
        for e in engines:
            e.url = stack.enter_context(BackgroundServer(e.app())).url
            report(pc.url, e.url)
        app = create_app(GatewaySettings(pc_url=pc.url, model_dir=model_dir, block_tokens=B))
        gateway = stack.enter_context(BackgroundServer(app))
        yield gateway.url + "v1", engines, pc.url


def client(v1: str, http: httpx.Client) -> openai.OpenAI:
    return openai.OpenAI(base_url=v1, api_key="unused", max_retries=0, http_client=http)


def test_token_ids_go_to_the_engine_and_its_token_ids_come_back(model_dir: Path, fleet: Any) -> None:
    v1, engines, _ = fleet
    text = ModelText(model_dir)
    prompt = "w1 w2 w3 w4 w5"
    with httpx.Client(trust_env=False, timeout=30) as http:
        out = client(v1, http).completions.create(model="llama-tiny", prompt=prompt,
                                                  max_tokens=6, temperature=0)
    tokens = text.encode(prompt)
    assert out.choices[0].text.strip() == text.decode(expected(tokens, 6)).strip()
    assert out.usage is not None and out.usage.completion_tokens == 6
    assert out.usage.prompt_tokens_details is not None
    assert out.usage.prompt_tokens_details.cached_tokens == 32  # the engine's count
    (sent,) = [r for e in engines for r in e.requests][-1:]
    assert sent["prompt"] == tokens and sent["model"] == "engine-model"
    assert sent["stream"] and sent["return_token_ids"] and sent["temperature"] == 0.0
    assert sent["max_tokens"] == 6


def test_an_engine_refusal_is_relayed(fleet: Any) -> None:
    v1, _, _ = fleet
    with httpx.Client(trust_env=False, timeout=30) as http, \
            pytest.raises(openai.BadRequestError) as caught:
        client(v1, http).completions.create(model="llama-tiny", prompt=list(range(3, 500)),
                                            max_tokens=4, temperature=0)
    assert "too long" in str(caught.value)


@pytest.mark.parametrize("how", ["break", "error", "truncated", "refuse"])
def test_a_stream_continues_on_another_engine(model_dir: Path, fleet: Any, how: str) -> None:
    v1, engines, _ = fleet
    text = ModelText(model_dir)
    tokens = [3 + i for i in range(40)]
    for e in engines:
        e.requests.clear()
    FAILURES.update(left=1, after=5, how=how, by=None)  # the engine the PC picks fails after 5 tokens
    try:
        with httpx.Client(trust_env=False, timeout=30) as http:
            stream = client(v1, http).completions.create(
                model="llama-tiny", prompt=tokens, max_tokens=12, temperature=0, stream=True)
            pieces = [c.choices[0].text for c in stream if c.choices]
    finally:
        FAILURES["left"] = 0
    assert "".join(pieces).strip() == text.decode(expected(tokens, 12)).strip()
    lost = FAILURES["by"]
    (other,) = [e for e in engines if e is not lost]
    assert len(lost.requests) == 1 and len(other.requests) == 1  # the lost one is not retried
    continued = other.requests[0]
    done = 0 if how == "refuse" else 5
    assert continued["prompt"] == tokens + expected(tokens, done)
    assert continued["max_tokens"] == 12 - done


def test_an_output_stopped_early_closes_the_engine_stream(model_dir: Path, fleet: Any) -> None:
    v1, engines, _ = fleet
    text = ModelText(model_dir)
    tokens = [5 + i for i in range(30)]
    ids = expected(tokens, 200)
    stop = text.decode(ids[3:4]).strip()
    before = sum(e.aborted for e in engines)
    with httpx.Client(trust_env=False, timeout=30) as http:
        out = client(v1, http).completions.create(model="llama-tiny", prompt=tokens,
                                                  max_tokens=200, temperature=0, stop=stop)
    assert out.choices[0].finish_reason == "stop"
    assert stop not in out.choices[0].text
    for _ in range(200):  # the engine sees its client go (bounded: 2 s)
        if sum(e.aborted for e in engines) > before:
            break
        time.sleep(0.01)
    assert sum(e.aborted for e in engines) == before + 1
