"""Prefill and decode apart between OpenAI engines (vLLM with the connector) behind the gateway:
the PC names an engine that publishes live KV (`"live_kv": true` and its embedded holder in its
status) to compute the prompt; the gateway asks it for one token (an answer nobody reads) and
sends the request to the decode engine with `kv_transfer_params` naming that holder, whose
tracks the decode engine's connector subscribes to. (`tests_vllm/test_live_consume.py` runs the
decode side inside vLLM.)"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from index.app import IndexSettings
from index.app import create_app as create_index_app
from kvsp_moq.gateway.app import GatewaySettings, create_app
from kvsp_moq.gateway.text import ModelText
from kvsp_moq.protocol.instances import instance_id
from kvsp_moq.web import BackgroundServer
from pc.app import PCSettings, create_pc_app
from pc.disaggregation import SplitPolicy
from tests.gateway.test_gateway_engines import B, Engine, client, expected

HOLDERS = ("http://127.0.0.1:9701/", "http://127.0.0.1:9702/")


@pytest.fixture(scope="module")
def split_fleet(model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[tuple[str, list[Engine], str]]:
    db = tmp_path_factory.mktemp("gateway-pd") / "pc.sqlite3"
    with contextlib.ExitStack() as stack:
        index = stack.enter_context(BackgroundServer(create_index_app(IndexSettings())))
        pc = stack.enter_context(BackgroundServer(create_pc_app(PCSettings(
            database=str(db), index_url=index.url, pd=SplitPolicy.parse("length:16")))))
        engines = [Engine(), Engine()]
        for e, holder in zip(engines, HOLDERS):
            e.url = stack.enter_context(BackgroundServer(e.app())).url
            record = {"instance": e.url, "epoch": 1, "state": "active", "ttl_ms": 600_000,
                      "prefill_tokens_per_s": 1000.0, "live_kv": True, "holder": holder}
            r = httpx.put(f"{pc.url}instances/{instance_id(e.url)}/status", json=record,
                          trust_env=False)
            assert r.status_code == 200, r.text
        app = create_app(GatewaySettings(pc_url=pc.url, model_dir=model_dir, block_tokens=B))
        gateway = stack.enter_context(BackgroundServer(app))
        yield gateway.url + "v1", engines, pc.url


def test_the_route_names_the_prefill_engine_and_its_holder(split_fleet: Any) -> None:
    _, engines, pc = split_fleet
    r = httpx.post(f"{pc}route", json={"block_keys": ["ab" * 32] * 3, "scope_id": "cd" * 16,
                                       "compat_id": "ef" * 32, "token_count": 48,
                                       "block_tokens": B}, trust_env=False)
    assert r.status_code == 200, r.text
    decision = r.json()
    split = decision["prefill"]
    assert split["instance"] != decision["instance"]
    assert split["holder"] == dict(zip((e.url for e in engines), HOLDERS))[split["instance"]]


def test_a_prompt_is_computed_by_one_engine_and_decoded_by_the_other(model_dir: Path,
                                                                    split_fleet: Any) -> None:
    v1, engines, _ = split_fleet
    for e in engines:
        e.requests.clear()
    text = ModelText(model_dir)
    tokens = [7 + i for i in range(48)]
    with httpx.Client(trust_env=False, timeout=30) as http:
        out = client(v1, http).completions.create(model="llama-tiny", prompt=tokens,
                                                  max_tokens=6, temperature=0)
    assert out.choices[0].text.strip() == text.decode(expected(tokens, 6)).strip()
    for _ in range(200):  # the prefill request is sent beside the decode one (bounded: 2 s)
        if sum(len(e.requests) for e in engines) == 2:
            break
        time.sleep(0.01)
    (prefill,) = [e for e in engines if e.requests and e.requests[0]["max_tokens"] == 1]
    (decode,) = [e for e in engines if e is not prefill]
    assert prefill.requests[0]["prompt"] == tokens and prefill.requests[0]["stream"] is False
    (sent,) = decode.requests
    holder = HOLDERS[engines.index(prefill)]
    assert sent["kv_transfer_params"] == {"kvsp_prefill_at": holder}
    assert sent["prompt"] == tokens and sent["max_tokens"] == 6
