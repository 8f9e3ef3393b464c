import hashlib
import json
import subprocess
import sys

import pytest

from kvsp_moq.protocol.container import encode
from kvsp_moq.protocol.keys import block_keys
from tests.fixtures import DESCRIPTOR


def kvsp(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "kvsp_moq.cli", *args], input=stdin,
                          capture_output=True, timeout=60)


@pytest.fixture
def files(tmp_path):
    d = tmp_path / "d.json"
    d.write_text(json.dumps(DESCRIPTOR))
    k = tmp_path / "keys.toml"
    k.write_text(f'tenant = "{"11" * 32}"\n')
    t = tmp_path / "t.json"
    t.write_text(json.dumps(list(range(40))))
    return d, k, t


def refused(result, fragment):
    assert result.returncode == 2, result
    err = result.stderr.decode()
    assert err.count("\n") == 1 and "Traceback" not in err and fragment in err, err


def test_compat_id(files):
    d, _, _ = files
    r = kvsp("compat-id", str(d))
    assert r.returncode == 0
    expected = hashlib.sha256(b"KVSP-COMPAT-1\x00" + json.dumps(DESCRIPTOR, sort_keys=True,
                              separators=(",", ":")).encode()).hexdigest()
    assert r.stdout.decode() == expected + "\n"


def test_block_keys(files):
    d, k, t = files
    r = kvsp("block-keys", "--descriptor", str(d), "--scope-keys", str(k), "--tokens", str(t))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    compat = bytes.fromhex(out["compat_id"])
    assert out["scope_id"] == hashlib.sha256(b"KVSP-SCOPE-1\x00" + bytes([0x11]) * 32).hexdigest()[:32]
    assert out["block_keys"] == [x.hex() for x in block_keys(bytes([0x11]) * 32, compat, list(range(40)), 16)]
    assert len(out["block_keys"]) == 2


def test_inspect(tmp_path):
    f = tmp_path / "b.kvb"
    f.write_bytes(encode(0, 2, [(b"k" * 8, b"v" * 8), (b"K" * 8, b"V" * 8)]))
    r = kvsp("inspect", str(f))
    assert r.returncode == 0
    out = json.loads(r.stdout)
    assert set(out) == {"version", "flags", "codec", "first_layer", "layer_count", "token_count",
                        "layers", "digest"}
    assert out["layers"][1] == {"layer": 1, "k_len": 8, "v_len": 8,
                                "digest": "sha-256:" + hashlib.sha256(b"K" * 8 + b"V" * 8).hexdigest()}


def test_refusals(files, tmp_path):
    d, k, t = files
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**DESCRIPTOR, "kv_dtype": "int4"}))
    refused(kvsp("compat-id", str(bad)), "kv_dtype")
    refused(kvsp("compat-id", str(tmp_path / "missing.json")), "cannot read")
    bad.write_text("{not json")
    refused(kvsp("compat-id", str(bad)), "not valid JSON")
    short = tmp_path / "short.toml"
    short.write_text(f'tenant = "{"11" * 31}"\n')
    refused(kvsp("block-keys", "--descriptor", str(d), "--scope-keys", str(short), "--tokens", str(t)),
            "32 octets")
    t.write_text(json.dumps([1, 2, 2**32]))
    refused(kvsp("block-keys", "--descriptor", str(d), "--scope-keys", str(k), "--tokens", str(t)),
            "tokens[2]")
    c = tmp_path / "c.kvb"
    good = encode(0, 1, [(b"k", b"v")])
    for blob, fragment in [(good[:-1], "past the end"), (good + b"x", "trailing"),
                           (b"XXXX" + good[4:], "magic"), (good[:4] + b"\x09" + good[5:], "version"),
                           (good[:7], "truncated")]:
        c.write_bytes(blob)
        refused(kvsp("inspect", str(c)), fragment)


def test_help_explains_itself():
    r = kvsp("--help")
    assert r.returncode == 0 and b"compat-id" in r.stdout and b"block-keys" in r.stdout
    r = kvsp("block-keys", "--help")
    assert b"--scope-keys" in r.stdout and b"--scope-key-file" not in r.stdout


def test_bench_core_quick_prints_json_with_ratios():
    r = kvsp("bench", "core", "--quick")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert all(x["ratio"] > 0 for x in out["block_keys"] + out["container"])
