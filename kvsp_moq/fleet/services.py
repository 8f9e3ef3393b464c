"""A fleet running: `kvsp index`, `kvsp relay` and `kvsp holder` in namespaces of their own,
and fetch clients (`kvsp_moq.fleet.client`) in theirs, on the links a `Topology` describes.

Every server runs as across machines (README, "Across several machines"): with a principals
file, each process with a token of its own, the relay's generated certificate given to its
clients, nothing open. Each process's MOQT datagrams are sized to its narrowest path
(KVSP_MOQT_DATAGRAM_SIZE, from the topology), so a jumbo-frame fleet sends jumbo datagrams.
Logs go to the work directory; `Fleet.logs()` shows their ends when something fails.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator

from kvsp_moq.auth import principal_entry, token_digest
from kvsp_moq.errors import Failed
from kvsp_moq.fleet.network import FleetNetwork
from kvsp_moq.fleet.topology import Topology
from kvsp_moq.netns import Host
from kvsp_moq.protocol.keys import scope_id

__all__ = ["ClientProcess", "Fleet", "process_environment", "terminate_as_interrupt"]

ROOT = Path(__file__).resolve().parents[2]
INDEX_PORT, RELAY_PORT, HOLDER_PORT, AGENT_PORT = 8700, 4443, 8801, 8900
#: The scope of the fleet's blocks and sessions, in keys.toml.
SCOPE = "fleet"
#: The Compatibility ID of the fleet's blocks (any 32 octets: the holder checks no geometry).
COMPAT = "f1" * 32
#: How long a server may take to come up (two shared cores import slowly).
START_S = 120.0


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt meanwhile, so the fleet is torn down as on ^C."""
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: nothing to install
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def uninterrupted() -> Iterator[None]:
    """^C and SIGTERM are ignored meanwhile (main thread only: elsewhere nothing is installed).

    A teardown cut short leaves processes and namespaces behind, and the second signal is the
    usual case, not the odd one: timeout(1) signals the command and then its whole process
    group, so the command gets two. Every wait of the teardown is bounded, and SIGKILL still
    stops it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def process_environment(extra: dict[str, str]) -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT),
            "NO_COLOR": "1", **extra}


class ClientProcess:
    """A fleet client's process, driven one JSON line at a time."""

    def __init__(self, name: str, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.name = name
        self.proc = proc
        self.log = log
        self._buffer = b""

    def send(self, op: str, **fields: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"op": op, **fields}) + "\n").encode())
        self.proc.stdin.flush()

    def receive(self, timeout: float) -> dict[str, Any]:
        """The next answer; Failed when none comes in `timeout` seconds."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Failed(f"{self.name} did not answer in {timeout:g} s")
            ready, _, _ = select.select([fd], [], [], remaining)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise Failed(f"{self.name} exited ({self.proc.wait()})")
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def request(self, op: str, timeout: float = 120.0, **fields: Any) -> dict[str, Any]:
        """Send a command and wait for its answer; Failed when it failed."""
        self.send(op, **fields)
        answer = self.receive(timeout)
        if not answer.get("ok"):
            raise Failed(f"{self.name} {op}: {answer.get('error')}")
        return answer


class Fleet:
    """The network of a `Topology` and its processes; a context manager that tears it all
    down (processes, namespaces, the work directory unless `keep`) on exit."""

    def __init__(self, topology: Topology, *, workdir: str | Path | None = None, prefix: str | None = None,
                 subnet: str = "198.18.0.0/24", engine: str | None = None, datagram_size: int | None = None,
                 relay_args: tuple[str, ...] = (), holder_args: tuple[str, ...] = (),
                 agent_args: tuple[str, ...] = (), agent_token_interval_s: float = 0.0,
                 unplaced_agents: tuple[str, ...] = (), client_config: dict[str, Any] | None = None,
                 keep: bool = False) -> None:
        self.topology = topology
        self.net = FleetNetwork(subnet=subnet, prefix=prefix)
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="kvsp-fleet-"))
        self.engine = engine
        self.datagram_override = datagram_size
        self.relay_args = relay_args
        self.holder_args = holder_args
        self.agent_args = agent_args
        self.agent_token_interval_s = agent_token_interval_s
        #: agents that report to no PC: they compute and serve blocks, but nothing is placed there
        self.unplaced_agents = unplaced_agents
        self.client_config = client_config or {}
        self.keep = keep
        self.scope_key = secrets.token_bytes(32)
        self.scope_id = scope_id(self.scope_key).hex()
        self.servers: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
        self.clients: dict[str, ClientProcess] = {}
        self._logs: list[IO[bytes]] = []

    # ------------------------------------------------------------------ addresses

    def address(self, name: str) -> str:
        return self.net.hosts[name].address

    @property
    def index_url(self) -> str:
        return f"http://{self.address(self.topology.of_role('index')[0].name)}:{INDEX_PORT}/"

    @property
    def relay_url(self) -> str:
        return f"moqt://{self.address(self.topology.of_role('relay')[0].name)}:{RELAY_PORT}"

    def holder_url(self, name: str | None = None) -> str:
        name = name or self.topology.of_role("holder")[0].name
        return f"http://{self.address(name)}:{HOLDER_PORT}/"

    def agent_url(self, name: str) -> str:
        return f"http://{self.address(name)}:{AGENT_PORT}/"

    @property
    def relay_ca(self) -> Path:
        return self.workdir / "relay" / "relay-cert.pem"

    def datagram_size(self, name: str) -> int:
        return self.datagram_override or self.topology.datagram_size(name)

    # ------------------------------------------------------------------ life

    def __enter__(self) -> "Fleet":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.net.open()
        for node in self.topology.nodes.values():
            self.net.add_host(node.name, link=node.link)
        self._write_keys()
        index = self.topology.of_role("index")[0].name
        relay = self.topology.of_role("relay")[0].name
        self._start_server(index, ["index", "--listen", f"{self.address(index)}:{INDEX_PORT}",
                                   "--public-url", self.index_url, "--principals", "principals.toml",
                                   "--scope-keys", "keys.toml", "--token-file", "pc.token",
                                   "--db", "pc.sqlite3"])
        self._start_server(relay, ["relay", "--listen", f"{self.address(relay)}:{RELAY_PORT}",
                                   "--principals", "principals.toml", "--cert-dir", "relay",
                                   "--cache-bytes", "1G", *self.relay_args])
        self._wait_for_line(relay, "relay listening on ")
        self._wait_for_tcp(index, INDEX_PORT)
        holders = [n.name for n in self.topology.of_role("holder")]
        for name in holders:
            self._start_server(name, ["holder", "--listen", f"{self.address(name)}:{HOLDER_PORT}",
                                      "--public-url", self.holder_url(name), "--principals", "principals.toml",
                                      "--token-file", f"{name}.token", "--index", self.index_url,
                                      "--relay", self.relay_url, "--relay-ca", str(self.relay_ca),
                                      "--host-bytes", "2G", *self.holder_args])
        agents = [n.name for n in self.topology.of_role("agent")]
        for name in agents:
            placed = ["--pc", self.index_url] if name not in self.unplaced_agents else []
            self._start_server(name, ["--token-interval-s", str(self.agent_token_interval_s),
                                      "--listen", f"{self.address(name)}:{AGENT_PORT}",
                                      "--public-url", self.agent_url(name), "--model", "tiny",
                                      "--data", f"data-{name}", "--principals", "principals.toml",
                                      "--scope-keys", "keys.toml", "--scope", SCOPE,
                                      "--token-file", f"{name}.token", "--index", self.index_url,
                                      *placed, "--relay", self.relay_url,
                                      "--relay-ca", str(self.relay_ca), *self.agent_args],
                               module="kvsp_moq.fleet.agent")
        for node in self.topology.of_role("client"):
            self.clients[node.name] = self._start_client(node.name, node.name)
        for name in holders:
            self._wait_for_tcp(name, HOLDER_PORT)
        for name in agents:
            self._wait_for_tcp(name, AGENT_PORT)

    def close(self) -> None:
        with uninterrupted():
            self._close()

    def _close(self) -> None:
        for client in self.clients.values():
            try:
                client.send("quit")
            except OSError:
                pass
        self.net.close()  # stops every process still running in the namespaces
        for log in self._logs:
            log.close()
        self._logs.clear()
        if self._own_workdir and not self.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # ------------------------------------------------------------------ keys

    def _write_keys(self) -> None:
        """A token per process and the principals file every server reads (as `kvsp keys`
        makes them, README "Keys and tokens")."""
        entries = [self._principal("pc", ["pc"], [], scopes=["*"])]
        for node in self.topology.nodes.values():
            if node.role == "holder":
                entries.append(self._principal(node.name, ["holder"], [self.holder_url(node.name)]))
            elif node.role == "agent":
                entries.append(self._principal(node.name, ["instance"], [self.agent_url(node.name)]))
            elif node.role == "client":
                entries.append(self._principal(node.name, ["instance"], []))
        # who stores the blocks the fleet loads (an agent that computed them, say), and an end
        # user's front end
        entries.append(self._principal("seeder", ["instance"], []))
        entries.append(self._principal("frontend", ["client"], []))
        self._private("principals.toml", "\n".join(entries))
        self._private("keys.toml", f'{SCOPE} = "{self.scope_key.hex()}"\n')

    def _principal(self, name: str, roles: list[str], holders: list[str],
                   scopes: list[str] | None = None) -> str:
        token = secrets.token_urlsafe(32)
        self._private(f"{name}.token", token + "\n")
        return principal_entry(name, token_digest(token), scopes or [self.scope_id], holders, roles)

    def token(self, name: str) -> str:
        """The bearer token of a principal of the fleet (a host's name, "pc", "frontend")."""
        return (self.workdir / f"{name}.token").read_text().strip()

    def _private(self, name: str, text: str) -> None:
        path = self.workdir / name
        path.write_text(text)
        path.chmod(0o600)

    # ------------------------------------------------------------------ processes

    def _env(self, name: str) -> dict[str, str]:
        extra = {"KVSP_MOQT_DATAGRAM_SIZE": str(self.datagram_size(name))}
        if self.engine:
            extra["KVSP_QUIC_ENGINE"] = self.engine
        return process_environment(extra)

    def _open_log(self, label: str) -> tuple[Path, IO[bytes]]:
        path = self.workdir / f"{label}.log"
        log = open(path, "ab")
        self._logs.append(log)
        return path, log

    def _start_server(self, name: str, args: list[str], module: str = "kvsp_moq.cli") -> None:
        path, log = self._open_log(name)
        proc = self.net.hosts[name].start([sys.executable, "-m", module, *args], cwd=self.workdir,
                                          env=self._env(name), stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL)
        self.servers[name] = (proc, path)

    def _start_client(self, name: str, host: str, token: str | None = None, label: str | None = None) -> ClientProcess:
        label = label or name
        config = {"index": self.index_url, "relay": self.relay_url, "relay_ca": str(self.relay_ca),
                  "token_file": str(self.workdir / f"{token or name}.token"), "compat_id": COMPAT,
                  "scope_id": self.scope_id, **self.client_config}
        (self.workdir / f"{label}.json").write_text(json.dumps(config))
        path, log = self._open_log(label)
        proc = self.net.hosts[host].start(
            [sys.executable, "-m", "kvsp_moq.fleet.client", str(self.workdir / f"{label}.json")],
            cwd=self.workdir, env=self._env(host), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        return ClientProcess(label, proc, path)

    def seeder(self, holder: str | None = None) -> ClientProcess:
        """A client in the holder's own namespace that stores blocks there over its loopback,
        so seeding costs no link."""
        holder = holder or self.topology.of_role("holder")[0].name
        return self._start_client("seeder", holder, token="seeder", label=f"seeder-{holder}")

    def _check_running(self, name: str) -> None:
        proc, log = self.servers[name]
        if proc.poll() is not None:
            raise Failed(f"{name} exited with status {proc.returncode}:\n{self.tail(log)}")

    def _wait_for_line(self, name: str, text: str) -> None:
        log = self.servers[name][1]
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            self._check_running(name)
            if text in log.read_text(errors="replace"):
                return
            time.sleep(0.2)
        raise Failed(f"{name} did not say {text!r} in {START_S:g} s:\n{self.tail(log)}")

    def _wait_for_tcp(self, name: str, port: int) -> None:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            self._check_running(name)
            if self.net.tcp_open(name, self.address(name), port):
                return
            time.sleep(0.2)
        raise Failed(f"{name} did not listen on port {port} in {START_S:g} s:\n{self.tail(self.servers[name][1])}")

    @staticmethod
    def tail(path: Path, lines: int = 15) -> str:
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def logs(self, lines: int = 15) -> str:
        """The last lines of every log, for a failure's message."""
        return "\n".join(f"--- {p.name}\n{self.tail(p, lines)}" for p in sorted(self.workdir.glob("*.log")))

    def describe(self) -> dict[str, Any]:
        """What runs where, and how to reach it (the `kvsp fleet` command prints it)."""
        return {"hosts": self.net.describe(), "index": self.index_url, "relay": self.relay_url,
                "relay_ca": str(self.relay_ca),
                "holders": [self.holder_url(n.name) for n in self.topology.of_role("holder")],
                "agents": [self.agent_url(n.name) for n in self.topology.of_role("agent")],
                "scope_id": self.scope_id, "compat_id": COMPAT, "workdir": str(self.workdir),
                "datagram_sizes": {name: self.datagram_size(name) for name in self.topology.nodes
                                   if self.topology.moqt_peers(name)}}

    def host(self, name: str) -> Host:
        return self.net.hosts[name]
