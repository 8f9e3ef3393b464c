"""Several PC URLs (`--pc A,B`: PC processes on one store): a PC that cannot be reached is left
for the next, for `kvsp agent`s and OpenAI engines alike, and the next call starts there."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from index.app import IndexSettings
from index.app import create_app as create_index_app
from kvsp_moq.gateway.app import GatewaySettings, create_app
from kvsp_moq.gateway.text import ModelText
from kvsp_moq.web import BackgroundServer
from pc.app import PCSettings, create_pc_app

from .conftest import B, Stack, make_stack
from .test_gateway_engines import Engine, expected, report


@pytest.fixture(scope="module")
def stack_after_a_dead_pc(model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                          ) -> Iterator[Stack]:
    with make_stack(model_dir, tmp_path_factory.mktemp("gateway-pcs") / "pc.sqlite3",
                    dead_pc=True) as s:
        yield s


def test_agents_are_routed_by_the_pc_after_a_stopped_one(stack_after_a_dead_pc: Stack) -> None:
    stack = stack_after_a_dead_pc
    backend = stack.app.state.gateway.backend
    dead, live = backend.pcs.urls
    assert live == stack.pc and backend.pc_url == dead  # the stopped PC comes first
    text = ModelText(stack.model_dir)
    with httpx.Client(trust_env=False, timeout=60) as http:
        client = openai.OpenAI(base_url=stack.v1, api_key="unused", max_retries=0,
                               http_client=http)
        for i in range(2):  # whole, then streamed
            prompt = " ".join(f"w{n}" for n in range(500 + 100 * i, 500 + 100 * i + 2 * B))
            if i == 0:
                got = client.completions.create(model="llama-tiny", prompt=prompt, max_tokens=4,
                                                temperature=0)
                out = got.choices[0].text
            else:
                out = "".join(c.choices[0].text for c in client.completions.create(
                    model="llama-tiny", prompt=prompt, max_tokens=4, temperature=0, stream=True))
            assert out.strip()
            assert len(text.encode(out.strip(), special=False)) <= 4
            assert backend.pc_url == live  # the next call starts at the PC that answered
    routed = httpx.get(stack.gateway + "metrics", trust_env=False).text
    assert "kvsp_gateway_overhead_requests 2" in routed


@pytest.fixture(scope="module")
def engines_after_a_dead_pc(model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                            ) -> Iterator[tuple[str, list[Engine], Any]]:
    db = tmp_path_factory.mktemp("gateway-pcs-engines") / "pc.sqlite3"
    with contextlib.ExitStack() as stack:
        index = stack.enter_context(BackgroundServer(create_index_app(IndexSettings())))
        pc = stack.enter_context(BackgroundServer(
            create_pc_app(PCSettings(database=str(db), index_url=index.url))))
        with BackgroundServer(create_pc_app(PCSettings(database=str(db) + ".dead"))) as dead:
            pass
        engines = [Engine(), Engine()]
        for e in engines:
            e.url = stack.enter_context(BackgroundServer(e.app())).url
            report(pc.url, e.url)
        app = create_app(GatewaySettings(pc_url=f"{dead.url},{pc.url}", model_dir=model_dir,
                                         block_tokens=B, instance_api="openai"))
        gateway = stack.enter_context(BackgroundServer(app))
        yield gateway.url, engines, app.state.gateway.backend


def test_engines_are_routed_by_the_pc_after_a_stopped_one(
        model_dir: Path, engines_after_a_dead_pc: tuple[str, list[Engine], Any]) -> None:
    gateway, engines, backend = engines_after_a_dead_pc
    dead, live = backend.pcs.urls
    assert backend.pc_url == dead
    text = ModelText(model_dir)
    prompt = " ".join(f"w{n}" for n in range(40, 40 + 3 * B))
    tokens = text.encode(prompt)
    with httpx.Client(trust_env=False, timeout=30) as http:
        client = openai.OpenAI(base_url=gateway + "v1", api_key="unused", max_retries=0,
                               http_client=http)
        out = client.completions.create(model="llama-tiny", prompt=prompt, max_tokens=5,
                                        temperature=0)
        assert out.choices[0].text.strip() == text.decode(expected(tokens, 5)).strip()
        assert backend.pc_url == live
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="llama-tiny", prompt=prompt, max_tokens=5, temperature=0, stream=True))
        assert streamed.strip() == out.choices[0].text.strip()
    assert [r["prompt"] for e in engines for r in e.requests] == [tokens, tokens]
