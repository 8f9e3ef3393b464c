"""A fleet running on one machine: authenticated servers in namespaces of their own, clients
that load one prefix over MOQT through the relay and over HTTP from the holder, verified, the
relay fetching once for all; `kvsp fleet` up and torn down; a refusal where namespaces cannot be
made. These need root (they fail, not skip, without it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from kvsp_moq.fleet.bench import connect, load_all, prepare
from kvsp_moq.fleet.services import Fleet
from kvsp_moq.fleet.topology import fleet_topology

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
BLOCK = 4 * MiB
BLOCKS = 2
PREFIX = BLOCK * BLOCKS


def namespaces() -> list[str]:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    with Fleet(fleet_topology(clients=2), prefix=f"kvspff{os.getpid()}") as f:
        yield f
    assert not any(n.startswith(f"kvspff{os.getpid()}-") for n in namespaces())


@pytest.fixture(scope="module")
def prefixes(fleet: Fleet) -> dict[str, tuple[list[str], list[str]]]:
    keys, digests = prepare(fleet, os.urandom(4).hex(), 3 * BLOCKS, BLOCK)
    connect(fleet)
    return {t: (keys[i * BLOCKS:(i + 1) * BLOCKS], digests[i * BLOCKS:(i + 1) * BLOCKS])
            for i, t in enumerate(("moqt", "http", "any"))}


def test_clients_load_one_prefix_through_the_relay_which_asks_the_holder_once(
        fleet: Fleet, prefixes: dict[str, Any]) -> None:
    keys, digests = prefixes["moqt"]
    run = load_all(fleet, keys, "moqt", digests)  # raises unless every client got these bytes
    assert run["layers"] == {"moqt": 2 * BLOCKS * 32} and run["fallbacks"] == 0, run
    assert run["holder_egress_bytes"] < 1.3 * PREFIX, run  # one copy (and headers)
    assert run["relay_egress_bytes"] > 2 * PREFIX, run  # one to each client


def test_over_http_the_holder_sends_each_client_its_copy(fleet: Fleet, prefixes: dict[str, Any]) -> None:
    keys, digests = prefixes["http"]
    run = load_all(fleet, keys, "http", digests)
    assert run["layers"] == {"http": 2 * BLOCKS * 32}, run
    assert run["holder_egress_bytes"] > 2 * PREFIX, run
    assert run["relay_egress_bytes"] < 64 * 1024, run  # the relay is not on the path


def test_an_agent_s_order_tries_moqt_first(fleet: Fleet, prefixes: dict[str, Any]) -> None:
    keys, digests = prefixes["any"]
    run = load_all(fleet, keys, "any", digests)
    assert run["layers"] == {"moqt": 2 * BLOCKS * 32}, run


def test_every_process_sends_the_datagrams_its_path_carries(fleet: Fleet) -> None:
    assert fleet.describe()["datagram_sizes"] == {
        name: 1472 for name in ("relay", "holder", "client1", "client2")}
    for name in ("relay", "holder"):
        proc = fleet.servers[name][0]
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
        assert b"KVSP_MOQT_DATAGRAM_SIZE=1472" in environ


def test_the_servers_run_authenticated(fleet: Fleet) -> None:
    """No server runs open: without a token, the index and the holder refuse (401)."""
    import httpx

    def status(url: str) -> int:
        with httpx.Client(trust_env=False) as client:
            return client.post(url, json={}, timeout=5).status_code

    client = next(iter(fleet.topology.of_role("client"))).name
    assert fleet.net.in_host(client, lambda: status(fleet.index_url + "lookup")) == 401
    assert fleet.net.in_host(client, lambda: status(fleet.holder_url() + "leases")) == 401


def _read_document(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    """The JSON document `kvsp fleet` prints (indented, ending with a '}' line)."""
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.rstrip() == "}":
            return json.loads("".join(lines))
    raise AssertionError(f"no document from kvsp fleet: {''.join(lines)}")


def test_the_command_builds_a_fleet_and_sigterm_tears_it_down(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.Popen([sys.executable, "-m", "kvsp_moq.cli", "fleet", "--clients", "1", "--blocks", "1",
                             "--block-bytes", str(MiB), "--workdir", str(tmp_path / "fleet")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        report = _read_document(proc, 180)
        mine = {h["namespace"] for h in report["hosts"].values()}
        assert mine <= set(namespaces()) and len(mine) == 4
        assert report["hosts"]["holder"]["rate_mbit"] == 200
        key = report["blocks"][0]
        got = subprocess.run(["bash", "-c", report["example"].replace("KEY", key)], env=env,
                             capture_output=True, text=True, timeout=120)
        assert got.returncode == 0, got.stderr
        summary = json.loads(got.stdout)
        assert summary["source"] == report["relay"], summary
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert "torn down" in stderr
    assert not mine & set(namespaces())


def test_without_the_right_to_make_namespaces_it_refuses_in_one_line() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(["setpriv", "--bounding-set", "-sys_admin,-net_admin",
                           "--inh-caps=-sys_admin,-net_admin",
                           sys.executable, "-m", "kvsp_moq.cli", "fleet", "--duration", "0"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvsp fleet: cannot build a fleet here: "), done.stderr
    assert done.stdout == ""
