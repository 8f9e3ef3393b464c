"""One scope keys file for every command: block-keys and lookup read the TOML keys file the PC
and the agents read, and give the keys the bare hex file gave."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest

from index.app import IndexSettings
from index.app import create_app as create_index_app
from kvsp_moq.cli import main
from kvsp_moq.protocol.compat import CompatDescriptor
from kvsp_moq.protocol.keys import block_keys, scope_id
from kvsp_moq.web import BackgroundServer
from tests.fixtures import DESCRIPTOR

KEY_A = bytes([0x11]) * 32
KEY_B = bytes(range(40))
TOKENS = list(range(40))


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    paths = {name: tmp_path / name for name in ("d.json", "t.json", "one.toml", "two.toml", "hex")}
    paths["d.json"].write_text(json.dumps(DESCRIPTOR))
    paths["t.json"].write_text(json.dumps(TOKENS))
    paths["one.toml"].write_text(f'tenant-a = "{KEY_A.hex()}"\n')
    paths["two.toml"].write_text(f'tenant-a = "{KEY_A.hex()}"\n"tenant b" = "{KEY_B.hex()}"\n')
    paths["hex"].write_text(KEY_A.hex() + "\n")
    return paths


def kvsp(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def expected(key: bytes) -> dict:
    compat = CompatDescriptor.from_dict(DESCRIPTOR)
    return {"compat_id": compat.compat_hex, "scope_id": scope_id(key).hex(),
            "block_keys": [k.hex() for k in block_keys(key, compat.compat_id, TOKENS,
                                                         compat.block_tokens)]}


def test_block_keys_from_the_keys_file(capsys, files) -> None:
    common = ("block-keys", "--descriptor", str(files["d.json"]), "--tokens", str(files["t.json"]))
    rc, out, err = kvsp(capsys, *common, "--scope-keys", str(files["one.toml"]))
    assert rc == 0 and err == "" and json.loads(out) == expected(KEY_A)
    rc, out, _ = kvsp(capsys, *common, "--scope-keys", str(files["two.toml"]), "--scope", "tenant b")
    assert json.loads(out) == expected(KEY_B)

    # The bare hex file still works for one release, saying so, and gives the same keys.
    rc, out, err = kvsp(capsys, *common, "--scope-key-file", str(files["hex"]))
    assert rc == 0 and json.loads(out) == expected(KEY_A)
    assert err.count("\n") == 1 and "deprecated" in err and "--scope-keys" in err


@pytest.mark.parametrize("extra, fragment", [
    ((), "--scope-keys FILE is required"),
    (("--scope-keys", "{two.toml}"), "--scope NAME is needed"),
    (("--scope-keys", "{two.toml}", "--scope", "nobody"), "no scope named 'nobody'"),
    (("--scope-keys", "{hex}"), "not valid TOML"),
    (("--scope-keys", "{missing}"), "cannot read"),
    (("--scope-keys", "{one.toml}", "--scope-key-file", "{hex}"), "not both"),
])
def test_block_keys_refusals(capsys, files, tmp_path: Path, extra, fragment) -> None:
    names = {**{k: str(v) for k, v in files.items()}, "missing": str(tmp_path / "missing")}
    argv = ["block-keys", "--descriptor", str(files["d.json"]), "--tokens", str(files["t.json"]),
            *(names[x[1:-1]] if x.startswith("{") else x for x in extra)]
    rc, _, err = kvsp(capsys, *argv)
    assert rc == 2 and err.count("\n") == 1 and fragment in err, err


@pytest.fixture(scope="module")
def index_url() -> Iterator[str]:
    with BackgroundServer(create_index_app(IndexSettings())) as server:
        yield server.url


def test_lookup_asks_for_the_keys_of_the_keys_file(capsys, files, index_url: str) -> None:
    common = ("lookup", "--index", index_url, "--descriptor", str(files["d.json"]),
              "--tokens", str(files["t.json"]))
    rc, out, err = kvsp(capsys, *common, "--scope-keys", str(files["two.toml"]), "--scope", "tenant-a")
    assert rc == 0 and err == "", err
    answer = json.loads(out)
    assert answer["scope_id"] == expected(KEY_A)["scope_id"]
    assert answer["matched"] == 0 and answer["unmatched"] == expected(KEY_A)["block_keys"]
    rc, out, err = kvsp(capsys, *common, "--scope-key-file", str(files["hex"]))
    assert rc == 0 and "deprecated" in err and json.loads(out) == answer
    rc, _, err = kvsp(capsys, *common, "--scope-keys", str(files["two.toml"]))
    assert rc == 2 and err.count("\n") == 1 and "--scope NAME is needed" in err
