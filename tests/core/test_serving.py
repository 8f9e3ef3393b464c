"""Where servers may listen (kvsp_moq.serving): open only on loopback unless --insecure-open,
never advertising 0.0.0.0, and the same decision in `kvsp index`, `holder`, `relay`, `agent`."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvsp_moq import cli
from kvsp_moq.errors import SettingError
from kvsp_moq.serving import check_advertised, check_exposure, is_loopback, is_unspecified, normalize_public_url

ROOT = Path(__file__).resolve().parents[2]
#: An address the checks see as off loopback; never bound by these tests (refusals come first).
REMOTE = "198.18.0.1"


def test_what_counts_as_loopback():
    for host in ("127.0.0.1", "127.9.9.9", "::1", "[::1]", "localhost", "LOCALHOST."):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "", "10.77.0.1", "relay.example", "localhost.example"):
        assert not is_loopback(host), host
    assert is_unspecified("0.0.0.0") and is_unspecified("[::]") and is_unspecified("")
    assert not is_unspecified("127.0.0.1") and not is_unspecified("relay.example")


def test_open_servers_stay_on_loopback_unless_insecure_open():
    assert check_exposure("the relay", "127.0.0.1", authenticated=False) == []
    assert check_exposure("the agent", "::1", authenticated=False, open_scope=True) == []
    assert check_exposure("the relay", REMOTE, authenticated=True) == []
    for host in (REMOTE, "0.0.0.0", "::", "relay.example"):
        with pytest.raises(SettingError, match="refusing to run open .*--insecure-open"):
            check_exposure("the relay", host, authenticated=False)
    with pytest.raises(SettingError, match="open scope.*--scope-keys FILE"):
        check_exposure("the agent", REMOTE, authenticated=True, open_scope=True)
    warnings = check_exposure("the agent", "0.0.0.0", authenticated=False, open_scope=True,
                              insecure_open=True)
    assert len(warnings) == 2 and all(w.startswith("INSECURE") for w in warnings)
    assert "WITHOUT AUTHENTICATION" in warnings[0] and "anyone" in warnings[0]


def test_an_unspecified_address_is_never_advertised():
    check_advertised("127.0.0.1", None)
    check_advertised("0.0.0.0", "http://10.77.0.1:8801/")
    with pytest.raises(SettingError, match=r"^listening on 0.0.0.0 needs --public-url: others "
                                           r"cannot reach 0.0.0.0$"):
        check_advertised("0.0.0.0", None)
    with pytest.raises(SettingError, match=r"\[::\] needs --public-url"):
        check_advertised("::", None)
    assert normalize_public_url("http://10.77.0.1:8801") == "http://10.77.0.1:8801/"
    assert normalize_public_url("moqt://relay.example:4443", ("moqt",)) == "moqt://relay.example:4443"
    for bad in ("http://0.0.0.0:8801/", "http://[::]:8801/", "10.77.0.1:8801", "ftp://x/"):
        with pytest.raises(SettingError):
            normalize_public_url(bad)


# --------------------------------------------------------------------------- the four services


def _parse(module, *argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    module.configure_parser(p)
    return p.parse_args(list(argv))


def test_every_server_decides_the_same(tmp_path):
    from agent import service as agent
    from index import service as index
    from kvsp_moq.holder import service as holder
    from relay import service as relay

    principals = tmp_path / "principals.toml"
    principals.write_text('[[principal]]\nname = "a"\ntoken = "tok"\nscopes = ["*"]\nroles = ["holder"]\n')
    keys = tmp_path / "keys.toml"
    keys.write_text(f'a = "{"11" * 32}"\n')

    def relay_check(*argv: str) -> list[str]:
        _, notes = relay.settings_from_args(_parse(relay, "--cert-dir", str(tmp_path), *argv))
        return [n for n in notes if n.startswith("INSECURE")]

    checks = {
        "index": lambda *a: index.check_serving(_parse(index, *a)),
        "holder": lambda *a: holder.check_serving(_parse(holder, *a)),
        "relay": relay_check,
        "agent": lambda *a: agent.check_serving(_parse(agent, "--scope-keys", str(keys), *a)),
    }
    for name, check in checks.items():
        assert check("--listen", "127.0.0.1:0") == [], name
        assert check("--listen", f"{REMOTE}:0", "--principals", str(principals)) == [], name
        with pytest.raises(SettingError, match="refusing to run open"):
            check("--listen", f"{REMOTE}:0")
        warnings = check("--listen", f"{REMOTE}:0", "--insecure-open")
        assert len(warnings) == 1 and "WITHOUT AUTHENTICATION" in warnings[0], name
        if name != "index":  # it advertises nothing (its URL goes only to --start-command)
            with pytest.raises(SettingError, match="needs --public-url"):
                check("--listen", "0.0.0.0:0", "--principals", str(principals))
            with pytest.raises(SettingError, match="others cannot reach"):
                public = "moqt://0.0.0.0:4443" if name == "relay" else "http://0.0.0.0:1/"
                check("--listen", "127.0.0.1:0", "--public-url", public)
    with pytest.raises(SettingError, match="needs --public-url"):
        checks["index"]("--listen", "0.0.0.0:0", "--principals", str(principals),
                        "--start-command", "true")
    with pytest.raises(SettingError, match="open scope"):  # an agent without --scope-keys
        agent.check_serving(_parse(agent, "--listen", f"{REMOTE}:0", "--principals", str(principals)))


@pytest.mark.parametrize("command", ["index", "holder", "relay", "agent"])
def test_the_command_refuses_with_one_line_and_exit_2(command, capsys):
    assert cli.main([command, "--listen", f"{REMOTE}:0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"kvsp {command}: refusing to run open"), err
    if command == "index":  # it advertises nothing: with --insecure-open it would serve
        return
    assert cli.main([command, "--listen", "0.0.0.0:0", "--insecure-open"]) == 2
    err = capsys.readouterr().err
    assert err == f"kvsp {command}: listening on 0.0.0.0 needs --public-url: others cannot reach 0.0.0.0\n"


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT))


def test_a_relay_process_refuses_before_binding():
    done = subprocess.run([sys.executable, "-m", "kvsp_moq.cli", "relay", "--listen", f"{REMOTE}:4443"],
                          capture_output=True, env=_env(), timeout=60, cwd=ROOT)
    assert done.returncode == 2
    assert done.stderr.decode().count("\n") == 1 and b"refusing to run open" in done.stderr
    assert done.stdout == b""


def _netns_available() -> bool:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    return subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _netns_available(), reason="needs unshare -n (a private network namespace)")
def test_a_relay_process_runs_off_loopback_with_insecure_open(tmp_path):
    """In a private network namespace, where 198.18.0.1 is an address of lo only."""
    script = (f"ip link set lo up && ip addr add {REMOTE}/32 dev lo && exec {sys.executable} -m "
              f"kvsp_moq.cli relay --listen {REMOTE}:4443 --insecure-open --cert-dir {tmp_path}")
    proc = subprocess.Popen(["unshare", "-n", "sh", "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=_env(), cwd=ROOT)
    try:
        lines = _lines_until(proc, "INSECURE: the relay serves", 60)
        assert lines[0] == f"relay listening on moqt://{REMOTE}:4443\n", lines
    finally:
        proc.terminate()
        proc.wait(10)


def _lines_until(proc: subprocess.Popen, prefix: str, timeout: float) -> list[str]:
    """Lines of the process's stdout up to one starting with `prefix` (fails after `timeout`)."""
    import queue
    import threading

    assert proc.stdout is not None
    stdout = proc.stdout
    arrived: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [arrived.put(line.decode()) for line in stdout], daemon=True).start()
    lines: list[str] = []
    while not lines or not lines[-1].startswith(prefix):
        try:
            lines.append(arrived.get(timeout=timeout))
        except queue.Empty:
            raise AssertionError(f"no line starting {prefix!r} within {timeout} s: {lines}") from None
    return lines
