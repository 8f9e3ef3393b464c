"""`kvsp keys`: what it writes is what the servers read, with private modes and no duplicates."""

from __future__ import annotations

import json
import stat
import tomllib
from pathlib import Path

import pytest

from kvsp_moq.auth import ROLES, Authenticator, token_digest
from kvsp_moq.cli import main
from kvsp_moq.errors import Unauthorized
from kvsp_moq.protocol.keys import scope_id
from kvsp_moq.scope_keys import read_scope_keys


def kvsp(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def refused(result: tuple[int, str, str], fragment: str) -> None:
    rc, _, err = result
    assert rc == 2, result
    assert err.count("\n") == 1 and "Traceback" not in err and fragment in err, err


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_token_is_random_and_private_in_a_file(capsys, tmp_path: Path) -> None:
    rc, out, _ = kvsp(capsys, "keys", "token")
    rc2, out2, _ = kvsp(capsys, "keys", "token")
    assert rc == rc2 == 0 and out != out2 and len(out.strip()) == 43  # 32 octets, base64url
    path = tmp_path / "agent1.token"
    assert kvsp(capsys, "keys", "token", "--out", str(path)) == (0, "", "")
    assert mode(path) == 0o600 and len(path.read_text().strip()) == 43
    first = path.read_text()
    refused(kvsp(capsys, "keys", "token", "--out", str(path)), "--force")
    assert path.read_text() == first
    assert kvsp(capsys, "keys", "token", "--out", str(path), "--force")[0] == 0
    assert path.read_text() != first and mode(path) == 0o600


def test_principal_authenticates_its_token_with_its_roles_and_scopes(capsys, tmp_path: Path) -> None:
    token_file = tmp_path / "t"
    kvsp(capsys, "keys", "token", "--out", str(token_file))
    token = token_file.read_text().strip()
    sid = "0123456789ABCDEF0123456789abcdef"
    principals = tmp_path / "principals.toml"
    rc, out, err = kvsp(capsys, "keys", "principal", "--name", "agent-1", "--role", "instance",
                        "--role", "holder", "--scope", sid, "--holder", "http://10.0.0.5:8900",
                        "--token-file", str(token_file), "--append", str(principals))
    assert (rc, out, err) == (0, "", "")
    assert mode(principals) == 0o600
    assert token not in principals.read_text()
    who = Authenticator.from_file(principals).authenticate(f"Bearer {token}")
    assert who.name == "agent-1" and who.roles == {"instance", "holder"}
    assert who.scopes == {sid.lower()} and who.may_use_scope(sid) and not who.may_use_scope("0" * 32)
    assert who.may_publish_for("http://10.0.0.5:8900/") and not who.may_publish_for("http://x:1/")

    # A second principal (printed, then appended): the file still reads, both authenticate.
    rc, out, _ = kvsp(capsys, "keys", "principal", "--name", "ops", "--role", "admin,pc",
                      "--scope", "*", "--holder", "*", "--token", "second-token")
    entry = tomllib.loads(out)["principal"][0]
    assert entry == {"name": "ops", "token_sha256": token_digest("second-token"), "scopes": ["*"],
                     "holders": ["*"], "roles": ["admin", "pc"]}
    kvsp(capsys, "keys", "principal", "--name", "ops", "--role", "admin,pc", "--scope", "*",
         "--holder", "*", "--token", "second-token", "--append", str(principals))
    auth = Authenticator.from_file(principals)
    assert auth.authenticate("Bearer second-token").roles == {"admin", "pc"}
    assert auth.authenticate(token).name == "agent-1"
    with pytest.raises(Unauthorized):
        auth.authenticate("Bearer nobody")


def test_principal_refuses_duplicates_and_bad_input_in_one_line(capsys, tmp_path: Path) -> None:
    principals = tmp_path / "p.toml"
    base = ("keys", "principal", "--append", str(principals))
    assert kvsp(capsys, *base, "--name", "a", "--role", "pc", "--token", "tok-a")[0] == 0
    before = principals.read_text()
    refused(kvsp(capsys, *base, "--name", "a", "--role", "pc", "--token", "tok-b"), "named 'a'")
    refused(kvsp(capsys, *base, "--name", "b", "--role", "pc", "--token", "tok-a"), "already in")
    assert principals.read_text() == before
    refused(kvsp(capsys, "keys", "principal", "--name", "x", "--role", "root", "--token", "t"),
            "unknown role 'root'")
    refused(kvsp(capsys, "keys", "principal", "--name", "x", "--scope", "tenant", "--token", "t"),
            "not a Scope ID")
    refused(kvsp(capsys, "keys", "principal", "--name", "x", "--scope", "ab" * 15, "--token", "t"),
            "not a Scope ID")
    refused(kvsp(capsys, "keys", "principal", "--name", "x", "--holder", "10.0.0.1:80",
                 "--token", "t"), "not a holder base URL")
    refused(kvsp(capsys, "keys", "principal", "--name", "x", "--token", " "), "bearer token")
    refused(kvsp(capsys, "keys", "principal", "--name", "x", "--token-file",
                 str(tmp_path / "missing")), "cannot read token file")
    broken = tmp_path / "broken.toml"
    broken.write_text("[[principal]\n")
    refused(kvsp(capsys, "keys", "principal", "--name", "x", "--token", "t", "--append",
                 str(broken)), "not valid TOML")
    assert broken.read_text() == "[[principal]\n"


def test_every_role_the_authenticator_knows_is_accepted(capsys) -> None:
    rc, out, _ = kvsp(capsys, "keys", "principal", "--name", "all", "--token", "t",
                      *(x for role in sorted(ROLES) for x in ("--role", role)))
    assert rc == 0 and set(tomllib.loads(out)["principal"][0]["roles"]) == ROLES


def test_names_need_quoting_and_still_round_trip(capsys, tmp_path: Path) -> None:
    keys = tmp_path / "k.toml"
    for name in ("tenant a", 'quote"d', "ünï"):
        assert kvsp(capsys, "keys", "scope", name, "--append", str(keys))[0] == 0
    assert list(read_scope_keys(keys)) == ["tenant a", 'quote"d', "ünï"]
    rc, out, _ = kvsp(capsys, "keys", "principal", "--name", 'odd "name"\\', "--token", "t")
    assert tomllib.loads(out)["principal"][0]["name"] == 'odd "name"\\'


def test_scope_keys_and_scope_ids_round_trip(capsys, tmp_path: Path) -> None:
    keys = tmp_path / "scope-keys.toml"
    rc, out, err = kvsp(capsys, "keys", "scope", "tenant-a", "--out", str(keys))
    assert rc == 0 and err == "" and mode(keys) == 0o600
    loaded = read_scope_keys(keys)
    assert list(loaded) == ["tenant-a"] and len(loaded["tenant-a"]) == 32
    assert out.strip() == scope_id(loaded["tenant-a"]).hex()
    refused(kvsp(capsys, "keys", "scope", "tenant-a", "--out", str(keys)), "--force")

    rc, out, _ = kvsp(capsys, "keys", "scope", "tenant-b", "--append", str(keys), "--json")
    report = json.loads(out)
    loaded = read_scope_keys(keys)
    assert report == {"name": "tenant-b", "scope_id": scope_id(loaded["tenant-b"]).hex(),
                      "key_file": str(keys)}
    assert mode(keys) == 0o600
    refused(kvsp(capsys, "keys", "scope", "tenant-a", "--append", str(keys)), "already in")
    assert read_scope_keys(keys) == loaded

    ids = {name: scope_id(key).hex() for name, key in loaded.items()}
    assert kvsp(capsys, "keys", "scope-id", "--scope-keys", str(keys), "tenant-b")[1] == \
        ids["tenant-b"] + "\n"
    rc, out, _ = kvsp(capsys, "keys", "scope-id", "--scope-keys", str(keys))
    assert out.splitlines() == [f"{ids['tenant-a']}  tenant-a", f"{ids['tenant-b']}  tenant-b"]
    assert json.loads(kvsp(capsys, "keys", "scope-id", "--scope-keys", str(keys), "--json")[1]) == ids
    refused(kvsp(capsys, "keys", "scope-id", "--scope-keys", str(keys), "tenant-c"), "tenant-c")

    # Without a file: the keys-file line on stdout, its Scope ID on stderr.
    rc, out, err = kvsp(capsys, "keys", "scope", "solo")
    key = tomllib.loads(out)["solo"]
    assert rc == 0 and scope_id(bytes.fromhex(key)).hex() in err

    # A principal may name its scopes through the keys file.
    rc, out, _ = kvsp(capsys, "keys", "principal", "--name", "t", "--token", "t", "--scope-keys",
                      str(keys), "--scope", "tenant-a", "--scope", "tenant-b")
    assert tomllib.loads(out)["principal"][0]["scopes"] == [ids["tenant-a"], ids["tenant-b"]]


def test_append_warns_about_a_file_others_can_read(capsys, tmp_path: Path) -> None:
    keys = tmp_path / "k.toml"
    keys.write_text("")
    keys.chmod(0o644)
    rc, _, err = kvsp(capsys, "keys", "scope", "a", "--append", str(keys))
    assert rc == 0 and "chmod 600" in err


def test_help_lists_the_subcommands(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["keys", "--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in ("token", "principal", "scope", "scope-id"))
