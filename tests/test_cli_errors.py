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
    assert one_line(done, command) == (f"kvsp {command}: cannot listen on 127.0.0.1:{taken_tcp}: "
                                       "address already in use")
    assert not (tmp_path / "kvsp-pc.sqlite3").exists()  # refused before the PC opens its db


def test_a_relay_port_in_use_is_one_line_and_exit_2(taken_udp: int) -> None:
    done = kvsp("relay", "--listen", f"127.0.0.1:{taken_udp}")
    assert done.returncode == 2, done.stderr
    assert one_line(done, "relay") == (f"kvsp relay: cannot listen on 127.0.0.1:{taken_udp}: "
                                       "address already in use")


def test_a_relay_metrics_port_in_use_is_one_line_and_exit_2(taken_tcp: int) -> None:
    """The relay has started (and logged so) when its metrics server binds; the refusal is
    still the last line, and the relay closes."""
    done = kvsp("relay", "--listen", "127.0.0.1:0", "--metrics", f"127.0.0.1:{taken_tcp}")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1] == (f"kvsp relay: cannot listen on 127.0.0.1:{taken_tcp}: "
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


# --------------------------------------------------------------------------- leases, load choice


def test_a_lease_on_another_scope_is_documented_as_not_held() -> None:
    from kvsp_moq.openapi import _HOLDER_PATHS, LEASE_SCOPE_NOTE

    assert _HOLDER_PATHS["/leases"]["post"]["description"] == LEASE_SCOPE_NOTE
    assert "404" in LEASE_SCOPE_NOTE and "403" in LEASE_SCOPE_NOTE
    readme = (ROOT / "README.md").read_text()
    assert "another tenant's) is answered 404 `kvsp-not-found`" in readme


def test_a_cold_request_says_nothing_matched() -> None:
    from agent.choice import choose

    cold = choose(instance="http://127.0.0.1:1/", prefill_tokens_per_s=1000.0, links=(),
                  matched_blocks=0, resident_blocks=0, remote=(), block_tokens=16, total_tokens=40)
    assert cold.to_json()["chose"] == "recompute" and cold.reason == "nothing matched: recompute"
    warm = choose(instance="http://127.0.0.1:1/", prefill_tokens_per_s=1000.0, links=(),
                  matched_blocks=2, resident_blocks=2, remote=(), block_tokens=16, total_tokens=40)
    assert warm.load and warm.reason == "every matched block is resident here"


# --------------------------------------------------------------------------- the relay's CA


def test_a_relay_ca_that_is_not_pem_says_so(tmp_path: Path) -> None:
    from kvsp_moq.moqt.certs import client_tls

    der = tmp_path / "relay-cert.der"
    der.write_bytes(b"\x30\x82\x01\x0a" + bytes(64))
    with pytest.raises(SettingError, match="is not a PEM certificate"):
        client_tls("moqt://10.0.0.2:4443", cafile=der)
    done = kvsp("subscribe", "moqt://127.0.0.1:9", "--namespace", "a3ZzcA", "--relay-ca", str(der),
                "--timeout", "2")
    assert done.returncode == 2
    assert one_line(done, "subscribe").startswith(f"kvsp subscribe: --relay-ca {der} is not a PEM certificate")


def test_a_wrong_relay_ca_is_named_as_not_the_relays(tmp_path: Path) -> None:
    from kvsp_moq.errors import SessionClosed
    from kvsp_moq.moqt.certs import client_tls, generate_self_signed, untrusted_certificate

    pem = tmp_path / "other.pem"
    pem.write_bytes(generate_self_signed().certificate_pem)
    rejected = SessionClosed("unknown ca")
    rejected.error_code = 0x100 + 48  # the unknown_ca TLS alert
    line = untrusted_certificate(rejected, "moqt://10.0.0.2:4443",
                                 client_tls("moqt://10.0.0.2:4443", cafile=pem))
    assert line is not None and f"--relay-ca {pem} is not its certificate nor its CA" in line
    plain = untrusted_certificate(rejected, "moqt://10.0.0.2:4443", client_tls("moqt://10.0.0.2:4443"))
    assert plain is not None and "is not its certificate" not in plain and "--relay-ca FILE" in plain


# --------------------------------------------------------------------------- help texts


def help_of(command: str) -> str:
    done = kvsp(command, "--help")
    assert done.returncode == 0, done.stderr
    return " ".join(done.stdout.split())  # argparse wraps lines


def test_the_help_texts_read_right() -> None:
    index = help_of("index")
    assert "file holding the bearer token the PC presents to instances" in index
    assert "PC: bearer" not in index
    for command in ("index", "holder", "relay"):
        text = help_of(command)
        insecure = text[text.index("--insecure-open "):][:400]
        assert "open scope" not in insecure, (command, insecure)
    agent = help_of("agent")
    assert "open scope" in agent[agent.index("--insecure-open "):][:500]


# --------------------------------------------------------------------------- the agent extra


def test_bench_fleet_without_the_agent_extra_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    import kvsp_moq.bench
    from kvsp_moq import cli

    def never(*args: object, **kwargs: object) -> dict:
        raise AssertionError("the benchmark must not start")

    monkeypatch.setattr(kvsp_moq.bench, "run_bench", never)
    monkeypatch.setitem(sys.modules, "torch", None)  # as if torch were not installed
    assert cli.main(["bench", "fleet", "--quick"]) == 2
    err = capsys.readouterr().err
    assert err == ("kvsp bench: bench fleet needs the agent extra (torch is not installed): "
                   "pip install 'kvsp-moq[agent]'\n")


def test_a_missing_model_package_met_later_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    import kvsp_moq.bench
    from kvsp_moq import cli

    def missing(*args: object, **kwargs: object) -> dict:
        raise ModuleNotFoundError("No module named 'transformers'", name="transformers")

    monkeypatch.setattr(kvsp_moq.bench, "run_bench", missing)
    assert cli.main(["bench", "core", "--quick"]) == 2
    assert capsys.readouterr().err == ("kvsp bench: needs the agent extra (transformers is not "
                                       "installed): pip install 'kvsp-moq[agent]'\n")


# --------------------------------------------------------------------------- the README


def test_the_readme_says_where_files_go() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "with its folder, as `relay-b/relay-cert.pem`" in readme
    assert "`kvsp-pc.sqlite3` in the directory" in readme


def test_the_index_logs_where_the_pc_keeps_its_database(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "kvsp_moq.cli", "index", "--listen", "127.0.0.1:0"],
                            cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        lines = []
        for _ in range(40):  # the line comes before the server starts
            line = proc.stderr.readline()
            lines.append(line)
            if not line or "PC sessions and shard maps in" in line:
                break
        assert f"PC sessions and shard maps in {tmp_path.resolve() / 'kvsp-pc.sqlite3'}" in lines[-1], lines
    finally:
        proc.terminate()
        proc.wait(timeout=30)
