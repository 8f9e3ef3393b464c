"""The errors a user meets at the command line: each is one line on stderr with the exit
status the README gives (2 for usage, authorization and bind errors), never a traceback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from kvsp_moq.errors import KvspError, SettingError, TransportError, reason_of

ROOT = Path(__file__).resolve().parent.parent


def kvsp(*args: str, cwd: Path = ROOT, timeout: float = 60.0) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "kvsp_moq.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def one_line(done: subprocess.CompletedProcess, command: str) -> str:
    """The single line the command wrote on stderr (asserted to be one, and no traceback)."""
    err = done.stderr
    assert "Traceback" not in err, err
    assert err.count("\n") == 1 and err.startswith(f"kvsp {command}: "), err
    return err.strip()


# --------------------------------------------------------------------------- a port in use


@pytest.fixture
def taken_tcp() -> Iterator[int]:
    """A TCP port on 127.0.0.1 another process listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


@pytest.fixture
def taken_udp() -> Iterator[int]:
    """A UDP port on 127.0.0.1 another socket is bound to (a relay listens on UDP)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@pytest.mark.parametrize("command", ["holder", "agent", "index"])
def test_a_port_in_use_is_one_line_and_exit_2(command: str, taken_tcp: int, tmp_path: Path) -> None:
    extra = ["--model", str(tmp_path / "no-such-model")] if command == "agent" else []
    done = kvsp(command, "--listen", f"127.0.0.1:{taken_tcp}", *extra, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line == f"kvsp {command}: cannot listen on 127.0.0.1:{taken_tcp}: address already in use"
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "kvsp-pc.sqlite3").exists()  # refused before the PC opens its db


def test_a_relay_port_in_use_is_one_line_and_exit_2(taken_udp: int) -> None:
    done = kvsp("relay", "--listen", f"127.0.0.1:{taken_udp}")
    assert done.returncode == 2, done.stderr
    assert one_line(done, "relay") == (f"kvsp relay: cannot listen on 127.0.0.1:{taken_udp}: "
                                       "address already in use")


def test_the_listening_helper_names_the_address(taken_tcp: int) -> None:
    from kvsp_moq.serving import listening

    with pytest.raises(SettingError, match=f"^cannot listen on 127.0.0.1:{taken_tcp}: address already in use$"):
        listening("127.0.0.1", taken_tcp)
    sock = listening("127.0.0.1", 0)
    try:
        assert sock.getsockname()[1] > 0
    finally:
        sock.close()


# --------------------------------------------------------------------------- empty reasons


def test_reason_of_never_leaves_a_reason_empty() -> None:
    assert reason_of(TimeoutError()) == "TimeoutError"
    assert reason_of(TimeoutError(), named=True) == "TimeoutError"
    assert reason_of(ConnectionRefusedError(111, "Connection refused")) == "[Errno 111] Connection refused"
    assert reason_of(OSError("boom"), named=True) == "OSError: boom"
    assert reason_of(TransportError("peer gone")) == "peer gone"
    assert reason_of(KvspError()) == "Internal error"


def test_an_unreachable_relay_says_why() -> None:
    """The holder's publisher and a relay's upstream log "unreachable (REASON)": a connection
    attempt that times out has an empty text, which read "unreachable ()"."""
    import asyncio

    from kvsp_moq.fetch.moqt import _failure_of

    failure = _failure_of(ConnectionResetError())
    assert failure.reason == "ConnectionResetError"
    assert reason_of(asyncio.TimeoutError()) == "TimeoutError"
    for path in ("relay/upstream.py", "kvsp_moq/holder/moqt_publisher.py"):
        text = (ROOT / path).read_text()
        assert 'e or "timeout"' not in text and "reason_of(e)" in text, path


# --------------------------------------------------------------------------- the wrong file


def test_a_principals_file_without_a_principal_is_refused(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(f'tenant = "{"00" * 32}"\n')
    for command in ("index", "holder", "relay"):
        done = kvsp(command, "--principals", str(keys), "--listen", "127.0.0.1:0", cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        line = one_line(done, command)
        assert "names no principal" in line and "is this a --scope-keys file?" in line, line
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    done = kvsp("index", "--principals", str(empty), "--listen", "127.0.0.1:0", cwd=tmp_path)
    assert done.returncode == 2 and "names no principal" in one_line(done, "index")
    assert not (tmp_path / "kvsp-pc.sqlite3").exists()


# --------------------------------------------------------------------------- 401 and 403

TOKEN_A, TOKEN_B = "tok-tenant-a", "tok-tenant-b"


def principals_file(path: Path, scope_a: str, scope_b: str) -> Path:
    path.write_text("".join(
        f'[[principal]]\nname = "{name}"\ntoken = "{token}"\nscopes = ["{scope}"]\nholders = ["*"]\n'
        f'roles = ["holder", "client", "instance", "relay"]\n\n'
        for name, token, scope in (("a", TOKEN_A, scope_a), ("b", TOKEN_B, scope_b))))
    return path


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """A holder and a relay that know tenants A and B, and one block of A's stored with
    `kvsp put` (its record and the MOQT replica's)."""
    from kvsp_moq.auth import Authenticator
    from kvsp_moq.holder.service import Holder, HolderSettings
    from kvsp_moq.naming import moqt_record
    from kvsp_moq.protocol.records import ReplicaRecord
    from relay.relay import RelaySettings
    from relay.service import BackgroundRelay
    from tests.security.conftest import COMPAT, SCOPE_A, SCOPE_B, bkey, container

    tmp = tmp_path_factory.mktemp("guarded")
    principals = principals_file(tmp / "principals.toml", SCOPE_A, SCOPE_B)
    relay = BackgroundRelay(RelaySettings(authenticator=Authenticator.from_file(principals))).start()
    holder = Holder(HolderSettings(listen="127.0.0.1:0", principals=principals, relay=relay.url,
                                   index_token=TOKEN_A)).start()
    try:
        block = tmp / "block.kvb"
        block.write_bytes(container(1))
        key = bkey(1, "a")
        done = kvsp("put", holder.url, str(block), "--compat", COMPAT, "--scope", SCOPE_A,
                    "--key", key, "--token", TOKEN_A)
        assert done.returncode == 0, done.stderr
        record = tmp / "record.json"
        record.write_text(done.stdout)
        yield {"holder": holder.url, "relay": relay.url, "record": record, "tmp": tmp,
               "ids": ["--compat", COMPAT, "--scope", SCOPE_A, "--key", key],
               "moqt": moqt_record(ReplicaRecord.from_json(json.loads(done.stdout)),
                                   relay.url).moqt_namespace}
    finally:
        holder.stop()
        relay.stop()


@pytest.mark.parametrize("token", ["not-a-token", TOKEN_B])
def test_get_exits_2_when_the_token_is_refused(guarded: dict, token: str) -> None:
    """401 (an unknown token) and 403 (another tenant's) over HTTP and MOQT: status 2, as
    `kvsp put` and the README say, not 1 as a miss."""
    for source in (guarded["holder"], guarded["relay"]):
        done = kvsp("get", source, "--record", str(guarded["record"]), "-o",
                    str(guarded["tmp"] / "never.kvb"), "--token", token, "--timeout", "5")
        assert done.returncode == 2, done.stderr
        line = one_line(done, "get")
        assert ("401" in line or "403" in line or "UNAUTHORIZED" in line), line
    done = kvsp("get", guarded["holder"], "--record", str(guarded["record"]), "-o",
                str(guarded["tmp"] / "got.kvb"), "--token", TOKEN_A, "--timeout", "5")
    assert done.returncode == 0, done.stderr


def test_put_and_subscribe_exit_2_when_the_token_is_refused(guarded: dict) -> None:
    block = guarded["tmp"] / "other.kvb"
    block.write_bytes((guarded["tmp"] / "block.kvb").read_bytes())
    ids = list(guarded["ids"])
    ids[-1] = "ab" * 32
    done = kvsp("put", guarded["holder"], str(block), *ids, "--token", TOKEN_B)
    assert done.returncode == 2, done.stderr
    assert "403" in one_line(done, "put") or "scope" in done.stderr
    moqt = guarded["moqt"]
    for token in ("not-a-token", TOKEN_B):
        done = kvsp("subscribe", guarded["relay"], "--namespace", moqt, "--token", token,
                    "--timeout", "5")
        assert done.returncode == 2, done.stderr
        assert "refused the subscription" in one_line(done, "subscribe")
    done = kvsp("subscribe", guarded["relay"], "--namespace", moqt, "--token", TOKEN_A,
                "--count", "1", "--timeout", "10")
    assert done.returncode == 0, done.stderr
