"""The demo's process tree: every service as its own `kvsp` process on 127.0.0.1.

Separate processes make the demo honest: blocks cross real sockets, an agent can be killed with
SIGKILL, and what the demo shows is what a deployment on several machines does.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import httpx

from kvsp_moq.auth import principal_entry, token_digest
from kvsp_moq.protocol.keys import scope_id
from kvsp_moq.scope_keys import scope_key_entry


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Tenant:
    name: str
    scope_key: bytes
    token: str

    @property
    def scope_id(self) -> str:
        return scope_id(self.scope_key).hex()


@dataclass
class Service:
    name: str
    url: str
    argv: list[str]
    log: Path
    process: subprocess.Popen | None = None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass
class Cluster:
    """IS + PC, a relay, a holder with a disk tier and N agents, configured for two tenants."""

    root: Path
    agents: int = 2
    #: Tokens per block. Larger than an agent's default (16): every block read from another
    #: instance is one request through the relay, whose fixed cost (a few ms of CPU across
    #: relay, publisher and fetcher) made loading 32 blocks of the demo's small model slower
    #: than recomputing them; at 64 the 512-token prompt is 8 blocks and loading it wins.
    block_tokens: int = 64
    tenants: list[Tenant] = field(default_factory=list)
    services: dict[str, Service] = field(default_factory=dict)
    tokens: dict[str, str] = field(default_factory=dict)
    model_dir: Path | None = None

    def configure(self) -> None:
        """Write the principals and scope keys files; pick free ports."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.tenants = [Tenant(n, secrets.token_bytes(32), secrets.token_urlsafe(24))
                        for n in ("tenant-a", "tenant-b")]
        scopes = [t.scope_id for t in self.tenants]
        ports = {"index": free_port(), "holder": free_port(), "relay": free_port(socket.SOCK_DGRAM)}
        for i in range(self.agents):
            ports[f"agent{i + 1}"] = free_port()
        urls = {n: f"http://127.0.0.1:{p}/" for n, p in ports.items() if n != "relay"}
        urls["relay"] = f"moqt://127.0.0.1:{ports['relay']}"
        self.tokens = {n: secrets.token_urlsafe(24) for n in ["pc", "holder", "admin",
                                                             *(f"agent{i + 1}" for i in range(self.agents))]}
        lines = []

        def principal(name: str, token: str, scopes_: Sequence[str], holders: Sequence[str],
                      roles: Sequence[str]) -> None:
            lines.append(principal_entry(name, token_digest(token), scopes_, holders, roles))

        principal("admin", self.tokens["admin"], ["*"], ["*"], ["admin"])
        principal("pc", self.tokens["pc"], ["*"], [], ["pc"])
        principal("holder", self.tokens["holder"], scopes, [urls["holder"]], ["holder"])
        for i in range(self.agents):
            name = f"agent{i + 1}"
            principal(name, self.tokens[name], scopes, [urls[name]], ["instance", "holder"])
        for t in self.tenants:
            principal(t.name, t.token, [t.scope_id], [], ["client"])
        (self.root / "principals.toml").write_text("\n".join(lines))
        (self.root / "pc.token").write_text(self.tokens["pc"])
        (self.root / "scope-keys.toml").write_text(
            "".join(scope_key_entry(t.name, t.scope_key) for t in self.tenants))
        self.urls = urls
        self.ports = ports

    def _argv(self, name: str) -> list[str]:
        kvsp = [sys.executable, "-m", "kvsp_moq.cli"]
        principals = str(self.root / "principals.toml")
        keys = str(self.root / "scope-keys.toml")
        listen = f"127.0.0.1:{self.ports[name]}"
        if name == "index":
            return kvsp + ["index", "--listen", listen, "--principals", principals,
                           "--scope-keys", keys, "--db", str(self.root / "pc.sqlite3"),
                           "--token-file", str(self.root / "pc.token"),
                           "--block-tokens", str(self.block_tokens)]
        if name == "relay":
            return kvsp + ["relay", "--listen", listen, "--principals", principals,
                           "--cert-dir", str(self.root / "certs")]
        if name == "holder":
            return kvsp + ["holder", "--listen", listen, "--data", str(self.root / "holder"),
                           "--index", self.urls["index"], "--principals", principals,
                           f"--token={self.tokens['holder']}", "--relay", self.urls["relay"],
                           "--disk-bytes", "1G", "--host-bytes", "64M"]
        return kvsp + ["agent", "--listen", listen, "--model", str(self.model_dir),
                       "--index", self.urls["index"], "--pc", self.urls["index"],
                       "--relay", self.urls["relay"], "--data", str(self.root / name),
                       "--scope-keys", keys, "--scope", self.tenants[0].name,
                       "--principals", principals, f"--token={self.tokens[name]}",
                       "--replicate-to", self.urls["holder"],
                       "--block-tokens", str(self.block_tokens)]

    def start(self, names: Sequence[str] | None = None, *, timeout: float = 180.0) -> None:
        order = names or ["index", "relay", "holder", *(f"agent{i + 1}" for i in range(self.agents))]
        for name in order:
            self.start_one(name)
        for name in order:
            self.wait_healthy(name, timeout=timeout)

    def start_one(self, name: str) -> Service:
        log = self.root / f"{name}.log"
        argv = self._argv(name)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(argv, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=False)
        svc = Service(name, self.urls[name], argv, log, proc)
        self.services[name] = svc
        return svc

    def wait_healthy(self, name: str, *, timeout: float = 180.0) -> None:
        svc = self.services[name]
        if name == "relay":
            self._wait_udp_log(svc, timeout)
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not svc.alive:
                raise RuntimeError(f"{name} exited; see {svc.log}:\n{svc.log.read_text()[-2000:]}")
            try:
                if httpx.get(svc.url + "healthz", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{name} did not become healthy in {timeout:.0f} s; see {svc.log}")

    def _wait_udp_log(self, svc: Service, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not svc.alive:
                raise RuntimeError(f"{svc.name} exited; see {svc.log}:\n{svc.log.read_text()[-2000:]}")
            if "listening" in svc.log.read_text(errors="replace").lower():
                return
            time.sleep(0.1)
        raise RuntimeError(f"{svc.name} did not start in {timeout:.0f} s; see {svc.log}")

    def kill(self, name: str) -> None:
        """SIGKILL: the instance vanishes without a goodbye, as a crash would."""
        svc = self.services[name]
        if svc.process is not None and svc.alive:
            svc.process.send_signal(signal.SIGKILL)
            svc.process.wait(10)

    def stop(self) -> None:
        for svc in reversed(list(self.services.values())):
            if svc.process is not None and svc.alive:
                svc.process.terminate()
        deadline = time.monotonic() + 10
        for svc in self.services.values():
            if svc.process is None:
                continue
            try:
                svc.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                svc.process.kill()
                svc.process.wait(5)
