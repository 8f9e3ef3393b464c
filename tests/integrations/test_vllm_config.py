"""The vLLM connector's settings (`kv_connector_extra_config`), without vLLM: every refusal is
one line that names the key, and nothing of vLLM is imported to parse them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvsp_moq.cpus import reserved_cpus, usable_cpus
from kvsp_moq.errors import SettingError
from kvsp_moq.integrations.vllm.config import parse_extra_config
from kvsp_moq.protocol.keys import scope_id
from kvsp_moq.scope_keys import OPEN_SCOPE, OPEN_SCOPE_KEY

INDEX = "http://127.0.0.1:8700/"


def refusal(data: dict) -> str:
    with pytest.raises(SettingError) as caught:
        parse_extra_config(data)
    text = str(caught.value)
    assert "\n" not in text
    return text


def test_defaults_and_the_open_scope() -> None:
    c = parse_extra_config({"index": "http://127.0.0.1:8700"})
    assert c.index == INDEX and c.embedded and c.listen == "127.0.0.1:0"
    assert (c.scope, c.scope_key) == (OPEN_SCOPE, OPEN_SCOPE_KEY)
    assert c.relay is None and c.token is None and c.layers_per_request is None


def test_a_full_configuration(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(f'team = "{"ab" * 32}"\nother = "{"cd" * 32}"\n')
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    c = parse_extra_config({"index": INDEX, "scope_keys": str(keys), "scope": "team",
                            "relay": "moqt://127.0.0.1:4443", "holder": "embedded",
                            "listen": "127.0.0.1:8801", "data": str(tmp_path / "d"),
                            "token_file": str(token), "layers_per_request": 1})
    assert scope_id(c.scope_key) == scope_id(bytes.fromhex("ab" * 32))
    assert c.relay == "moqt://127.0.0.1:4443" and c.token == "s3cret"
    assert c.data == tmp_path / "d" and c.layers_per_request == 1
    assert parse_extra_config({"index": INDEX, "holder": "http://h:1"}).holder == "http://h:1/"
    quic = parse_extra_config({"index": INDEX, "quic_engine": "aioquic",
                               "datagram_size": 9000}).quic
    assert (quic.engine, quic.max_datagram_size) == ("aioquic", 9000)
    assert parse_extra_config({"index": INDEX, "holder": None}).holder is None
    assert parse_extra_config({"index": INDEX}).load_async == "live"
    assert parse_extra_config({"index": INDEX, "load_async": "all"}).load_async == "all"


@pytest.mark.parametrize(("data", "key"), [
    ({}, "index"),
    ({"index": "ftp://x/"}, "index"),
    ({"index": INDEX, "relay": "http://x:1"}, "relay"),
    ({"index": INDEX, "relay": "moqt://x"}, "relay"),
    ({"index": INDEX, "holdr": "embedded"}, "holdr"),
    ({"index": INDEX, "holder": "elsewhere"}, "holder"),
    ({"index": INDEX, "listen": "nowhere"}, "listen"),
    ({"index": INDEX, "lease_ms": 0}, "lease_ms"),
    ({"index": INDEX, "lease_ms": "10"}, "lease_ms"),
    ({"index": INDEX, "timeline": "yes"}, "timeline"),
    ({"index": INDEX, "scope": "team"}, "scope"),
    ({"index": INDEX, "scope_keys": "/nonexistent/keys.toml"}, "scope_keys"),
    ({"index": INDEX, "token_file": "/nonexistent/token"}, "token_file"),
    ({"index": INDEX, "relay_insecure": 1}, "relay_insecure"),
    ({"index": INDEX, "quic_engine": "quiche"}, "quic_engine"),
    ({"index": INDEX, "datagram_size": 900}, "datagram_size"),
    ({"index": INDEX, "datagram_size": "big"}, "datagram_size"),
    ({"index": INDEX, "load_async": "sometimes"}, "load_async"),
    ({"index": INDEX, "load_async": True}, "load_async"),
])
def test_refusals_name_the_key(data: dict, key: str) -> None:
    assert f"kv_connector_extra_config: {key}:" in refusal(data)


def test_a_scope_missing_from_the_keys_file(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(f'team = "{"ab" * 32}"\n')
    assert "no scope named 'nope'" in refusal({"index": INDEX, "scope_keys": str(keys),
                                               "scope": "nope"})


def test_parsing_does_not_import_vllm() -> None:
    code = ("import sys, kvsp_moq.integrations.vllm as v, kvsp_moq.integrations.vllm.config;"
            "assert 'vllm' not in sys.modules, 'vllm imported'")
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def test_where_the_loader_threads_go() -> None:
    def cpus(setting: str, device: str) -> frozenset[int] | None:
        return parse_extra_config({"index": INDEX, "cpus": setting}).loader_cpus(device)

    assert cpus("none", "cpu") is None
    assert cpus("auto", "cuda") is None  # the model is not on the host's cores
    assert cpus("auto", "cpu") == reserved_cpus()
    first = min(usable_cpus())
    assert cpus(str(first), "cuda") == {first}
    with pytest.raises(SettingError, match="cpus: CPU 100000 is not usable here"):
        parse_extra_config({"index": "http://127.0.0.1:1/", "cpus": "0,100000"})
    assert parse_extra_config({"index": "http://127.0.0.1:1/"}).cpus == "auto"
    assert parse_extra_config({"index": "http://127.0.0.1:1/", "cpus": "0-1"}).cpus == "0-1"
    for bad in ("some", "1-0", 3):
        with pytest.raises(SettingError, match="kv_connector_extra_config: cpus:"):
            parse_extra_config({"index": "http://127.0.0.1:1/", "cpus": bad})


def test_an_engine_names_its_live_holder_only_when_others_can_subscribe_to_it() -> None:
    from kvsp_moq.integrations.vllm.status import live_holder

    base = {"index": "http://127.0.0.1:8700/", "relay": "moqt://127.0.0.1:4443"}
    assert live_holder(parse_extra_config({**base, "listen": "127.0.0.1:8801"})) == "http://127.0.0.1:8801/"
    assert live_holder(parse_extra_config({**base, "listen": "0.0.0.0:8801",
                                           "public_url": "http://10.0.0.5:8801"})) == "http://10.0.0.5:8801/"
    assert live_holder(parse_extra_config({**base})) is None  # a free port the scheduler cannot know
    assert live_holder(parse_extra_config({**base, "listen": "127.0.0.1:8801", "live_kv": False})) is None
    assert live_holder(parse_extra_config({"index": base["index"], "listen": "127.0.0.1:8801"})) is None
    assert live_holder(parse_extra_config({**base, "listen": "127.0.0.1:8801",
                                           "holder": "http://127.0.0.1:8802/"})) is None
