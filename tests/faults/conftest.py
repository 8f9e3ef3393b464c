"""Real `kvsp` processes on 127.0.0.1 for fault tests: start, kill with SIGKILL, restart.

Every fault here is one a deployment meets (a process dies, a disk fills, bytes flip), so the
components run as separate processes that can vanish mid-transfer, as they would on a machine.
Each wait is bounded; a process that does not come up fails the test with the tail of its log.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import httpx
import pytest

from kvsp_moq.protocol.container import MEDIA_TYPE, encode
from kvsp_moq.protocol.records import ReplicaRecord

COMPAT = "ab" * 32
SCOPE = "cd" * 16
#: Any single wait for a process or a recovery.
STEP = 20.0


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def block_key(n: int, tag: str = "faults") -> str:
    return hashlib.sha256(f"{tag} {n}".encode()).hexdigest()


def make_container(n: int, *, layers: int = 4, layer_bytes: int = 64 << 10, tokens: int = 16) -> bytes:
    """A valid KVB1 container whose content depends on `n` (each layer K then V, equal halves)."""
    half = layer_bytes // 2
    seed = hashlib.sha256(f"content {n}".encode()).digest()
    unit = (seed * (half // 32 + 1))[:half]
    parts = [(bytes([i & 0xFF]) + unit[1:], bytes([(i + 1) & 0xFF]) + unit[1:]) for i in range(layers)]
    return encode(0, tokens, parts)


@dataclass
class Proc:
    """One `kvsp` subcommand as a child process, restartable on the same port."""

    name: str
    argv: list[str]
    log: Path
    url: str
    ready: Callable[["Proc"], bool]
    preexec: Callable[[], None] | None = None
    process: subprocess.Popen | None = None
    #: where this run's output starts in the log (a restart appends to it)
    log_offset: int = 0

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self, timeout: float = STEP) -> "Proc":
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(self.log, "ab") as out:
            self.log_offset = out.tell()
            out.write(f"--- start {' '.join(self.argv)}\n".encode())
            out.flush()
            self.process = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=env,
                                            preexec_fn=self.preexec)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive:
                raise RuntimeError(f"{self.name} exited:\n{self.tail()}")
            if self.ready(self):
                return self
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} did not come up in {timeout:.0f} s:\n{self.tail()}")

    def kill(self) -> None:
        """SIGKILL: no goodbye, no flush, as a crash."""
        if self.alive:
            assert self.process is not None
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.alive:
            assert self.process is not None
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)

    def tail(self, n: int = 3000) -> str:
        return self.output()[-n:]

    def output(self) -> str:
        """What the current run has logged (not the runs before a restart)."""
        try:
            with open(self.log, "rb") as f:
                f.seek(self.log_offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def rss_bytes(self) -> int:
        """VmRSS of the process, from /proc."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0


def _http_ready(proc: Proc) -> bool:
    try:
        return httpx.get(proc.url + "healthz", timeout=1.0, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def _relay_ready(proc: Proc) -> bool:
    return "relay listening" in proc.output()


@dataclass
class Processes:
    """Factory and owner of the processes of one test; all are stopped at teardown."""

    root: Path
    procs: list[Proc] = field(default_factory=list)

    def _kvsp(self) -> list[str]:
        return [sys.executable, "-m", "kvsp_moq.cli"]

    def index(self, *, port: int | None = None) -> Proc:
        port = port or free_port()
        proc = Proc("index", self._kvsp() + ["index", "--listen", f"127.0.0.1:{port}", "--role", "is"],
                    self.root / f"index-{port}.log", f"http://127.0.0.1:{port}/", _http_ready)
        self.procs.append(proc)
        return proc.start()

    def relay(self, *, port: int | None = None, cache_bytes: str = "64M",
              extra: Sequence[str] = ()) -> Proc:
        port = port or free_port(socket.SOCK_DGRAM)
        proc = Proc("relay", self._kvsp() + ["relay", "--listen", f"127.0.0.1:{port}",
                                             "--cache-bytes", cache_bytes, *extra],
                    self.root / f"relay-{port}.log", f"moqt://127.0.0.1:{port}", _relay_ready)
        self.procs.append(proc)
        return proc.start()

    def holder(self, *, index: str | None = None, relay: str | None = None, data: Path | None = None,
               host_bytes: str = "256M", disk_bytes: str = "1G", ttl_ms: int = 60_000,
               port: int | None = None, preexec: Callable[[], None] | None = None,
               extra: Sequence[str] = ()) -> Proc:
        port = port or free_port()
        argv = self._kvsp() + ["holder", "--listen", f"127.0.0.1:{port}", "--host-bytes", host_bytes,
                               "--record-ttl-ms", str(ttl_ms), *extra]
        if data is not None:
            argv += ["--data", str(data), "--disk-bytes", disk_bytes]
        if index:
            argv += ["--index", index]
        if relay:
            argv += ["--relay", relay]
        proc = Proc("holder", argv, self.root / f"holder-{port}.log", f"http://127.0.0.1:{port}/",
                    _http_ready, preexec=preexec)
        self.procs.append(proc)
        return proc.start()

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    p = Processes(tmp_path)
    try:
        yield p
    finally:
        p.stop_all()


def put_block(holder_url: str, bkey: str, body: bytes, *, timeout: float = STEP) -> httpx.Response:
    """PUT a container at a holder (If-None-Match: *), as a client storing a block does."""
    return httpx.put(f"{holder_url}blocks/{COMPAT}/{SCOPE}/{bkey}", content=body,
                     headers={"If-None-Match": "*", "Content-Type": MEDIA_TYPE},
                     timeout=timeout, trust_env=False)


def stored_record(holder_url: str, bkey: str, body: bytes) -> ReplicaRecord:
    """PUT a block and return the HTTP Replica Record the holder answers with."""
    r = put_block(holder_url, bkey, body)
    assert r.status_code == 201, r.text
    return ReplicaRecord.from_json(r.json())


def lookup(index_url: str, bkeys: Sequence[str]) -> dict[str, list[ReplicaRecord]]:
    """The replicas the Index Service lists for each key (empty lists for misses).

    One lookup per key: a lookup answers the longest matched prefix of its keys (§6.2), and
    these tests ask about keys that are not a prefix chain.
    """
    out: dict[str, list[ReplicaRecord]] = {k: [] for k in bkeys}
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        for key in bkeys:
            r = client.post(index_url + "lookup", json={"scope_id": SCOPE, "compat_id": COMPAT,
                                                        "block_keys": [key]})
            assert r.status_code == 200, r.text
            for b in r.json().get("blocks", []):
                out[b["block_key"]] = [ReplicaRecord.from_json(x) for x in b["replicas"]]
    return out


def small_window_client(rcvbuf: int = 256 << 10, timeout: float = 10.0) -> httpx.AsyncClient:
    """An HTTP client whose sockets take at most `rcvbuf` octets ahead of the reader.

    Loopback TCP autotunes a receive buffer up to net.ipv4.tcp_rmem's maximum (often 32 MiB),
    enough to swallow a whole test block while the consumer sleeps; a fixed SO_RCVBUF keeps
    the holder still sending (and its read still open) while the consumer is slow.
    """
    transport = httpx.AsyncHTTPTransport(
        socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)])
    return httpx.AsyncClient(transport=transport, trust_env=False,
                             timeout=httpx.Timeout(timeout, connect=5.0))
