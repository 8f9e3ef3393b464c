"""Prefill and decode apart between two vLLM engines behind the gateway: the PC (`--pd
length:64`) names one engine, which publishes live KV through the relay from its embedded holder
(a fixed port, named in its status), to compute a new prompt; the gateway asks it for one token
and sends the request to the other engine with `kv_transfer_params` naming that holder. The
decode engine loads every complete prompt block from the producer's live tracks (vLLM counts
them as cached prompt tokens) and its greedy output is that of one engine alone."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from kvsp_moq.gateway.text import ModelText
from tests_vllm.conftest import NEW_TOKENS, free_port, prompt
from tests_vllm.test_gateway import Fleet, shown

ENGINE = ("python -m vllm.entrypoints.openai.api_server --model models/tiny --host 127.0.0.1 "
          "--port {port} --dtype float32 --block-size 32 --max-model-len 1024 --enforce-eager "
          "--no-enable-prefix-caching --disable-hybrid-kv-cache-manager "
          "--enable-prompt-tokens-details --kv-transfer-config '{config}' &")


def commands(workdir: Path) -> list[str]:
    index, relay, gateway = free_port(), free_port(), free_port()
    out = ["kvsp descriptor tiny --data . --block-tokens 32 --out tiny.json",
           f"kvsp index --listen 127.0.0.1:{index} --block-tokens 32 --pd length:64 &",
           f"kvsp relay --listen 127.0.0.1:{relay} --cert-dir relay &"]
    for _ in range(2):
        port, holder = free_port(), free_port()
        extra = {"index": f"http://127.0.0.1:{index}/", "holder": "embedded",
                 "listen": f"127.0.0.1:{holder}", "relay": f"moqt://127.0.0.1:{relay}",
                 "relay_ca": "relay/relay-cert.pem", "relay_timeout_s": 20.0,
                 "pc": f"http://127.0.0.1:{index}/", "instance_url": f"http://127.0.0.1:{port}/"}
        config = {"kv_connector": "KVSPConnector",
                  "kv_connector_module_path": "kvsp_moq.integrations.vllm", "kv_role": "kv_both",
                  "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
        out.append(ENGINE.format(port=port, config=json.dumps(config)))
    out.append(f"kvsp gateway --listen 127.0.0.1:{gateway} --pc http://127.0.0.1:{index}/ "
               "--model models/tiny --block-tokens 32 &")
    return out


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    workdir = tmp_path_factory.mktemp("vllm-pd")
    f = Fleet(workdir)
    try:
        f.run(commands(workdir))
        yield f
    finally:
        f.stop()


def test_two_engines_prefill_and_decode_apart(fleet: Fleet, reference: Any) -> None:
    pc = fleet.url_of("index")[0]

    def both_live() -> bool:
        listed = httpx.get(pc + "instances", trust_env=False).json()["instances"]
        return sum(1 for i in listed if i.get("live_kv") and i.get("holder")) == 2

    for _ in range(200):  # statuses arrive every second (bounded: 20 s)
        if both_live():
            break
        time.sleep(0.1)
    assert both_live(), httpx.get(pc + "instances", trust_env=False).text
    tokens = prompt(300, seed=23)  # 9 complete blocks before the last token: 288 tokens
    (expected,) = reference(tokens)  # vLLM alone, without the connector (in this process)
    text = ModelText(fleet.workdir / "models" / "tiny")
    with httpx.Client(trust_env=False, timeout=120) as http:
        client = openai.OpenAI(base_url=fleet.url_of("gateway")[0] + "v1", api_key="unused",
                               max_retries=0, http_client=http)
        out = client.completions.create(model="llama-tiny", prompt=tokens, max_tokens=NEW_TOKENS,
                                        temperature=0)
    # The decode engine loaded every complete prompt block from the producer's live tracks
    # (it looked nothing up: only those tracks were offered to it).
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    assert out.usage.prompt_tokens_details.cached_tokens == 288, (out.usage, fleet.logs())
    assert out.choices[0].text.strip() == shown(text, expected)
