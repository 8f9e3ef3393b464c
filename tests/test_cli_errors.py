"""The errors a user meets at the command line: each is one line on stderr with the exit
status the README gives (2 for usage, authorization and bind errors), never a traceback."""

from __future__ import annotations

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
