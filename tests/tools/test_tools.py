"""`kvsp get|put|subscribe|lookup` run as subprocesses against real servers on 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import pytest

from index.app import IndexSettings, create_app
from kvsp_moq.holder.service import Holder, HolderSettings
from kvsp_moq.protocol.compat import CompatDescriptor
from kvsp_moq.protocol.container import Container, encode
from kvsp_moq.protocol.keys import block_keys, scope_id
from kvsp_moq.web import BackgroundServer
from relay.relay import RelaySettings
from relay.service import BackgroundRelay
from tests.fixtures import DESCRIPTOR

ROOT = Path(__file__).resolve().parents[2]
SCOPE_KEY = bytes(range(32))
COMPAT = CompatDescriptor.from_dict(DESCRIPTOR).compat_hex
SCOPE = scope_id(SCOPE_KEY).hex()
BLOCK_TOKENS = DESCRIPTOR["block_tokens"]
TOKENS = list(range(1000, 1000 + 3 * BLOCK_TOKENS + 5))  # three complete blocks
KEYS = [k.hex() for k in block_keys(SCOPE_KEY, bytes.fromhex(COMPAT), TOKENS, BLOCK_TOKENS)]
LAYERS = DESCRIPTOR["layers"]


def container(n: int, section: int = 2 * 8 * 4 * BLOCK_TOKENS) -> bytes:
    rng = np.random.default_rng(n)
    return encode(0, BLOCK_TOKENS, [(rng.bytes(section), rng.bytes(section)) for _ in range(LAYERS)])


def kvsp(*args: str, timeout: float = 30.0, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "kvsp_moq.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, timeout=timeout, input=stdin)


def ids(key: str) -> list[str]:
    return ["--compat", COMPAT, "--scope", SCOPE, "--key", key]


class System:
    def __init__(self, index: BackgroundServer, relay: BackgroundRelay, holder: Holder) -> None:
        self.index, self.relay, self.holder = index, relay, holder
        self.data: dict[str, bytes] = {}
        self.records: dict[str, dict] = {}

    def indexed(self, key: str, kinds: int = 2, timeout: float = 10.0) -> list[dict]:
        """Wait until the index lists the block's HTTP and MOQT records."""
        deadline = time.monotonic() + timeout
        while True:
            r = httpx.post(self.index.url + "lookup", json={"scope_id": SCOPE, "compat_id": COMPAT,
                                                             "block_keys": [key]}, trust_env=False)
            blocks = r.json().get("blocks", [])
            if blocks and len(blocks[0]["replicas"]) >= kinds:
                return blocks[0]["replicas"]
            if time.monotonic() > deadline:
                raise AssertionError(f"the index never listed {key}")
            time.sleep(0.05)


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    index = BackgroundServer(create_app(IndexSettings(sweep_interval_s=None))).start()
    relay = BackgroundRelay(RelaySettings()).start()
    holder = Holder(HolderSettings(listen="127.0.0.1:0", index_url=index.url, relay=relay.url)).start()
    sys_ = System(index, relay, holder)
    tmp = tmp_path_factory.mktemp("blocks")
    try:
        for n, key in enumerate(KEYS):  # every block is stored with `kvsp put`
            path = tmp / f"block{n}.kvb"
            path.write_bytes(container(n))
            done = kvsp("put", holder.url, str(path), *ids(key))
            assert done.returncode == 0, done.stderr.decode()
            sys_.data[key] = path.read_bytes()
            sys_.records[key] = json.loads(done.stdout)
        for key in KEYS:
            sys_.indexed(key)
        yield sys_
    finally:
        holder.stop()
        relay.stop()
        index.stop()


def test_put_then_get_over_http_is_byte_identical(system: System, tmp_path: Path) -> None:
    key = KEYS[0]
    record = tmp_path / "record.json"
    record.write_text(json.dumps(system.records[key]))
    out = tmp_path / "got.kvb"
    done = kvsp("get", system.holder.url, *ids(key), "--record", str(record), "-o", str(out), "--json")
    assert done.returncode == 0, done.stderr.decode()
    assert out.read_bytes() == system.data[key]
    summary = json.loads(done.stdout)
    assert summary["layers"] == [0, LAYERS - 1] and summary["failures"] == []
    assert summary["first_layer_ms"] is not None and summary["mb_per_s"] > 0
    # the transfer apart from the closing and from the command's total (imports included)
    assert 0 < summary["seconds"] < summary["total_seconds"]
    assert summary["close_seconds"] >= 0
    assert summary["seconds"] + summary["close_seconds"] <= summary["total_seconds"]
    # to stdout as well
    done = kvsp("get", system.holder.url, "--record", str(record), "-o", "-")
    assert done.returncode == 0 and done.stdout == system.data[key]


def test_a_failed_get_still_reports_in_json(system: System, tmp_path: Path) -> None:
    key = KEYS[0]
    record = dict(system.records[key], block_key="0" * 64)  # a block nobody holds
    path = tmp_path / "record.json"
    path.write_text(json.dumps(record))
    done = kvsp("get", system.holder.url, "--record", str(path), "-o", str(tmp_path / "x"), "--json")
    assert done.returncode == 1
    report = json.loads(done.stdout)
    assert report["source"] == system.holder.url and report["error"]
    assert report["failures"] and report["failures"][0]["source"] == system.holder.url
    assert report["error"] in done.stderr.decode()  # and the one line on stderr
    assert not (tmp_path / "x").exists()


def test_put_of_a_held_block_says_it_exists(system: System, tmp_path: Path) -> None:
    path = tmp_path / "b.kvb"
    path.write_bytes(system.data[KEYS[0]])
    done = kvsp("put", system.holder.url, str(path), *ids(KEYS[0]))
    assert done.returncode == 1 and "already holds" in done.stderr.decode()
    path.write_bytes(b"not a container")
    done = kvsp("put", system.holder.url, str(path), *ids(KEYS[0]))
    assert done.returncode == 2 and "KVB1" in done.stderr.decode()


def test_get_a_layer_range_via_index(system: System, tmp_path: Path) -> None:
    key = KEYS[1]
    out = tmp_path / "part.kvb"
    done = kvsp("get", system.holder.url, *ids(key), "--index", system.index.url, "--layers", "1-2",
                "-o", str(out))
    assert done.returncode == 0, done.stderr.decode()
    part, whole = Container(out.read_bytes()), Container(system.data[key])
    assert (part.first_layer, part.last_layer, part.token_count) == (1, 2, BLOCK_TOKENS)
    for i in (1, 2):
        assert bytes(part.layer(i).k) == bytes(whole.layer(i).k)
        assert bytes(part.layer(i).v) == bytes(whole.layer(i).v)


def test_get_via_index_lookup_whole_block(system: System, tmp_path: Path) -> None:
    out = tmp_path / "whole.kvb"
    done = kvsp("get", system.holder.url, *ids(KEYS[2]), "--index", system.index.url, "-o", str(out))
    assert done.returncode == 0, done.stderr.decode()
    assert out.read_bytes() == system.data[KEYS[2]]


def test_get_with_a_wrong_digest_fails(system: System, tmp_path: Path) -> None:
    record = dict(system.records[KEYS[0]])
    digests = list(record["layer_digests"])
    digests[2] = "00" * 32
    record["layer_digests"] = digests
    from kvsp_moq.protocol.container import format_digest, replica_digest

    record["digest"] = format_digest(replica_digest([bytes.fromhex(d) for d in digests]))
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(record))
    out = tmp_path / "never.kvb"
    done = kvsp("get", system.holder.url, "--record", str(path), "-o", str(out))
    err = done.stderr.decode()
    assert done.returncode == 1 and "digest" in err and "Traceback" not in err
    assert not out.exists()


def test_get_from_an_unreachable_source_is_one_clear_line(system: System, tmp_path: Path) -> None:
    record = tmp_path / "record.json"
    record.write_text(json.dumps(system.records[KEYS[0]]))
    done = kvsp("get", "http://127.0.0.1:9/", "--record", str(record), "-o", str(tmp_path / "x"),
                "--timeout", "2")
    err = done.stderr.decode()
    assert done.returncode == 1 and "Traceback" not in err
    assert err.startswith("kvsp get:") and "127.0.0.1:9" in err and err.count("\n") == 1
    done = kvsp("get", "gopher://x", "--record", str(record))
    assert done.returncode == 2 and "SOURCE" in done.stderr.decode()
    done = kvsp("get", system.holder.url, *ids(KEYS[0]))
    assert done.returncode == 2 and "--record" in done.stderr.decode()


def test_get_over_moqt_matches_http(system: System, tmp_path: Path) -> None:
    key = KEYS[0]
    out = tmp_path / "moqt.kvb"
    # A loopback relay's certificate goes unchecked without --relay-insecure, as for servers.
    done = kvsp("get", system.relay.url, *ids(key), "--index", system.index.url,
                "-o", str(out), "--json")
    assert done.returncode == 0, done.stderr.decode()
    assert out.read_bytes() == system.data[key]
    summary = json.loads(done.stdout)
    assert summary["source"] == system.relay.url and summary["layer_count"] == LAYERS


def test_an_untrusted_relay_certificate_is_one_line_and_exit_2(system: System, tmp_path: Path) -> None:
    from kvsp_moq.moqt.certs import generate_self_signed

    other = tmp_path / "other-relay.pem"  # a certificate, but not the relay's
    other.write_bytes(generate_self_signed().certificate_pem)
    key = KEYS[0]
    moqt = [r for r in system.indexed(key) if r["holder"].startswith("moqt://")][0]
    for argv in (("get", system.relay.url, *ids(key), "--index", system.index.url, "-o",
                  str(tmp_path / "x"), "--relay-ca", str(other)),
                 ("subscribe", system.relay.url, "--namespace", moqt["moqt_namespace"], "--ca", str(other),
                  "--timeout", "5")):
        done = kvsp(*argv)
        err = done.stderr.decode()
        assert done.returncode == 2, err
        assert err.count("\n") == 1 and "is not trusted" in err and system.relay.url in err, err
        assert "--relay-ca FILE" in err and "--relay-insecure" in err


def test_subscribe_prints_one_line_per_layer(system: System, tmp_path: Path) -> None:
    moqt = [r for r in system.indexed(KEYS[1]) if r["holder"].startswith("moqt://")][0]
    path = tmp_path / "moqt.json"
    path.write_text(json.dumps(moqt))
    done = kvsp("subscribe", system.relay.url, "--record", str(path), "--timeout", "10")
    assert done.returncode == 0, done.stderr.decode()
    lines = done.stdout.decode().splitlines()
    assert len(lines) == LAYERS
    for i, line in enumerate(lines):
        assert line.startswith(f"group 0 object {i} size ") and "digest-ok" in line
    done = kvsp("subscribe", system.relay.url, "--namespace", moqt["moqt_namespace"], "--insecure",
                "--count", "2", "--json")  # the older spelling of --relay-insecure
    assert done.returncode == 0, done.stderr.decode()
    assert [json.loads(x)["object"] for x in done.stdout.decode().splitlines()] == [0, 1]


def test_lookup_prints_matched(system: System, tmp_path: Path) -> None:
    (tmp_path / "d.json").write_text(json.dumps(DESCRIPTOR))
    (tmp_path / "keys.toml").write_text(f'tenant = "{SCOPE_KEY.hex()}"\n')
    (tmp_path / "t.json").write_text(json.dumps(TOKENS + [1, 2, 3] * 10))
    done = kvsp("lookup", "--index", system.index.url, "--descriptor", str(tmp_path / "d.json"),
                "--scope-keys", str(tmp_path / "keys.toml"), "--tokens", str(tmp_path / "t.json"))
    assert done.returncode == 0, done.stderr.decode()
    answer = json.loads(done.stdout)
    assert answer["matched"] == 3 and answer["requested"] == 5 and len(answer["unmatched"]) == 2
    assert [b["block_key"] for b in answer["blocks"]] == KEYS
    kinds = {r["kind"] for r in answer["blocks"][0]["replicas"]}
    assert kinds == {"http", "moqt"}
    assert answer["blocks"][0]["replicas"][0]["tiers"]
