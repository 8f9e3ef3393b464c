"""A real `redis-server` on 127.0.0.1 for tests: started, restarted and always stopped here.

The Redis store is tested against the server it will meet, never a fake. A machine without
`redis-server` fails these tests with the command that installs it, rather than skipping them.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

#: Where a test run looks for the server first; otherwise `redis-server` on PATH.
SERVER_ENV = "KVSP_REDIS_SERVER"
MISSING = ("redis-server not found (set {env} or put it on PATH): install it with "
           "`apt-get install -y redis-server` (Debian) or use valkey-server")


def server_binary() -> str:
    """The redis-server (or valkey-server) to run; fails the calling test when there is none."""
    given = os.environ.get(SERVER_ENV)
    if given and not (os.path.isfile(given) and os.access(given, os.X_OK)):
        pytest.fail(f"{SERVER_ENV}={given} is not an executable file", pytrace=False)
    path = given or shutil.which("redis-server") or shutil.which("valkey-server")
    if not path:
        pytest.fail(MISSING.format(env=SERVER_ENV), pytrace=False)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process on 127.0.0.1, its files under `directory`.

    `persistent` turns on the append-only file (fsync every second, as in production
    defaults); otherwise nothing survives a restart.
    """

    def __init__(self, directory: Path, *, persistent: bool = False) -> None:
        self.directory = directory
        self.persistent = persistent
        self.port = 0
        self.proc: subprocess.Popen | None = None
        directory.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "RedisServer":
        """Start on the same port as before, or on a free one the first time."""
        binary = server_binary()
        for _ in range(3):  # a port taken between choosing and binding: choose again
            port = self.port or free_port()
            log = open(self.directory / "redis.log", "ab")
            self.proc = subprocess.Popen(
                [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "yes" if self.persistent else "no",
                 "--appendfsync", "everysec", "--dir", str(self.directory),
                 "--daemonize", "no", "--protected-mode", "yes"],
                stdout=log, stderr=subprocess.STDOUT)
            log.close()
            if self._wait_ready(port, timeout):
                self.port = port
                return self
            self.kill()
            if self.port:  # the port was ours and is not free: nothing to retry with
                break
        raise RuntimeError(f"redis-server did not start; see {self.directory / 'redis.log'}")

    def _wait_ready(self, port: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return True
            except OSError:
                pass
            time.sleep(0.02)
        return False

    def stop(self, timeout: float = 10.0) -> None:
        """A clean shutdown (SIGTERM): Redis flushes its append-only file first."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def kill(self) -> None:
        """A crash (SIGKILL)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One server for the session (without persistence); tests flush it before use."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session server's URL, its database emptied for this test."""
    import redis

    with redis.Redis.from_url(redis_server.url) as client:
        client.flushdb()
    return redis_server.url


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """Start servers that a test may stop, kill and restart; all are stopped afterwards."""
    servers: list[RedisServer] = []

    def make(*, persistent: bool = False) -> RedisServer:
        server = RedisServer(tmp_path / f"redis{len(servers)}", persistent=persistent)
        servers.append(server)
        return server.start()

    try:
        yield make
    finally:
        for server in servers:
            server.kill()
