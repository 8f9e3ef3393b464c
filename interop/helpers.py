"""Pieces shared by the suite's system tests: `kvsp` services as child processes on 127.0.0.1,
blocks, records read back from the Index Service, and bounded waits.

Every service is started as its own process (the `kvsp` command beside this interpreter), with
stdout and stderr in a log file under the test's temporary folder; a failed wait names the
service and shows the end of its log, so a failure says which process misbehaved.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import socket
import sys
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

import httpx
import numpy as np

from kvsp_moq.holder.store import BlockId
from kvsp_moq.protocol.container import encode
from kvsp_moq.protocol.records import ReplicaRecord

ROOT = Path(__file__).resolve().parent.parent
#: Longest time any single step (a service starting, a record appearing) may take.
STEP = 30.0
COMPAT = "5e" * 32
SCOPE = "a7" * 16
PUT = {"If-None-Match": "*"}


def kvsp_command() -> list[str]:
    """The `kvsp` entry point installed beside this interpreter, as CI's venv has it."""
    script = Path(sys.executable).parent / "kvsp"
    if not os.access(script, os.X_OK):
        raise AssertionError(f"the kvsp command is not installed beside {sys.executable}")
    return [str(script)]


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- processes


@dataclass
class Service:
    """A service running as a child process of the test."""

    name: str
    url: str
    process: asyncio.subprocess.Process
    log: Path

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def failed(self, what: str) -> AssertionError:
        state = "running" if self.process.returncode is None else f"exited with {self.process.returncode}"
        return AssertionError(f"{self.name} ({state}): {what}; the end of {self.log}:\n{self.tail()}")

    async def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process.returncode is None:
            self.process.send_signal(sig)
            try:
                await asyncio.wait_for(self.process.wait(), 10)
            except asyncio.TimeoutError:
                self.process.kill()
                await self.process.wait()


class Services:
    """Child processes of one test, all stopped (newest first) when it ends."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.started: list[Service] = []

    async def spawn(self, name: str, url: str, argv: Sequence[str]) -> Service:
        log = self.directory / f"{name}.log"
        with open(log, "ab") as out:
            process = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=asyncio.subprocess.STDOUT,
                cwd=str(ROOT), env=dict(os.environ, PYTHONUNBUFFERED="1"))
        service = Service(name, url, process, log)
        self.started.append(service)
        return service

    async def stop_all(self) -> None:
        for service in reversed(self.started):
            await service.stop()

    # ---------------------------------------------------------------- the services

    async def index(self, name: str = "index") -> Service:
        """`kvsp index`, open on loopback."""
        port = free_port()
        return await self.spawn(name, f"http://127.0.0.1:{port}/", [
            *kvsp_command(), "index", "--listen", f"127.0.0.1:{port}",
            "--db", str(self.directory / f"{name}.sqlite3")])

    async def relay(self, name: str = "relay", *extra: str) -> Service:
        """`kvsp relay`, open, with a self-signed certificate written under the test's folder."""
        port = free_port(socket.SOCK_DGRAM)
        return await self.spawn(name, f"moqt://127.0.0.1:{port}", [
            *kvsp_command(), "relay", "--listen", f"127.0.0.1:{port}",
            "--cert-dir", str(self.directory / f"{name}-cert"), *extra])

    async def holder(self, name: str = "holder", *extra: str) -> Service:
        """`kvsp holder`, memory only, open."""
        port = free_port()
        return await self.spawn(name, f"http://127.0.0.1:{port}/", [
            *kvsp_command(), "holder", "--listen", f"127.0.0.1:{port}", "--host-bytes", "256M", *extra])

    async def static_server(self, directory: Path, name: str = "static") -> Service:
        """Python's own `http.server`: a plain static web server, nothing of KVSP in it."""
        port = free_port()
        return await self.spawn(name, f"http://127.0.0.1:{port}/", [
            sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port), "--directory", str(directory)])


@asynccontextmanager
async def services(directory: Path) -> AsyncIterator[Services]:
    group = Services(directory)
    try:
        yield group
    finally:
        await group.stop_all()


# --------------------------------------------------------------------------- waits


async def eventually(predicate: Callable[[], Awaitable[Any] | Any], what: str, timeout: float = STEP,
                     service: Service | None = None, interval: float = 0.05) -> Any:
    """The first truthy value of `predicate` (plain or async), polled for at most `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if service is not None and service.process.returncode is not None:
            raise service.failed(f"exited while waiting for {what}")
        if time.monotonic() > deadline:
            if service is not None:
                raise service.failed(f"timed out after {timeout:.0f} s waiting for {what}")
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(interval)


async def healthy(client: httpx.AsyncClient, service: Service, timeout: float = STEP) -> Service:
    """Until the service answers GET /healthz with 200."""
    async def probe() -> bool:
        try:
            return (await client.get(service.url + "healthz", timeout=1.0)).status_code == 200
        except httpx.HTTPError:
            return False

    await eventually(probe, "GET /healthz to answer 200", timeout, service, interval=0.1)
    return service


async def logged(service: Service, text: str, timeout: float = STEP) -> str:
    """Until the service's log holds `text`; the first log line containing it."""
    def find() -> str | None:
        for line in service.tail(1 << 20).splitlines():
            if text in line:
                return line
        return None

    return await eventually(find, f"{text!r} in its log", timeout, service, interval=0.1)


async def relay_up(service: Service, timeout: float = STEP) -> str:
    """Until the relay process printed its URL; that URL."""
    line = await logged(service, "relay listening on ", timeout)
    url = line.split()[-1]
    assert url == service.url, (url, service.url)
    return url


def relay_cert(service: Service) -> Path:
    """The self-signed certificate a relay wrote under its --cert-dir."""
    return service.log.parent / f"{service.name}-cert" / "relay-cert.pem"


# --------------------------------------------------------------------------- blocks


@dataclass
class Block:
    bid: BlockId
    data: bytes

    @property
    def path(self) -> str:
        return "blocks/" + self.bid.path


def make_block(n: int, *, layers: int = 12, section: int = 16_384, tokens: int = 16,
               compat: str = COMPAT, scope: str = SCOPE) -> Block:
    """A raw container of random K and V sections, keyed by `n`."""
    rng = np.random.default_rng(n)
    parts = [(rng.bytes(section), rng.bytes(section)) for _ in range(layers)]
    key = hashlib.sha256(f"interop block {n}".encode()).hexdigest()
    return Block(BlockId(compat, scope, key), encode(0, tokens, parts))


async def put_block(client: httpx.AsyncClient, holder: Service, block: Block) -> ReplicaRecord:
    """PUT a block to a holder; the HTTP Replica Record it answers with."""
    r = await client.put(holder.url + block.path, content=block.data, headers=PUT)
    if r.status_code != 201:
        raise holder.failed(f"PUT {block.path} answered {r.status_code}: {r.text}")
    return ReplicaRecord.from_json(r.json())


async def lookup(client: httpx.AsyncClient, index: Service, compat: str, scope: str,
                 keys: Sequence[str]) -> dict[str, list[ReplicaRecord]]:
    """POST {is}lookup: the replicas of each matched leading key."""
    r = await client.post(index.url + "lookup", json={"compat_id": compat, "scope_id": scope,
                                                      "block_keys": list(keys)})
    if r.status_code != 200:
        raise index.failed(f"lookup answered {r.status_code}: {r.text}")
    return {b["block_key"]: [ReplicaRecord.from_json(x) for x in b["replicas"]] for b in r.json()["blocks"]}


def by_kind(records: Sequence[ReplicaRecord]) -> dict[str, list[ReplicaRecord]]:
    """Records split into "http" and "moqt" replicas."""
    out: dict[str, list[ReplicaRecord]] = {"http": [], "moqt": []}
    for record in records:
        out["moqt" if record.is_moqt else "http"].append(record)
    return out
