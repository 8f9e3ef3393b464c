"""The MOQT interop suite against aiomoqt, an independent draft-18 implementation.

Run it inside a private network namespace, after installing the peer with network access:

    bash interop/install-peer.sh
    unshare -n sh -c 'ip link set lo up && .venv/bin/python -m pytest -q interop'

aiomoqt's tools bind wildcard addresses; in a namespace that has only `lo` nothing can reach
them. Every test fails (never skips) when the peer is missing or when the suite is not in
such a namespace.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PEER_VENV = HERE / ".venv-aiomoqt"
PEER_BIN = PEER_VENV / "bin"
PEER_PYTHON = PEER_BIN / "python"
PEERS = HERE / "peers"
RUN_HINT = ("bash interop/install-peer.sh && "
            "unshare -n sh -c 'ip link set lo up && .venv/bin/python -m pytest -q interop'")


def _environment_problems() -> list[str]:
    problems = []
    for tool in ("moq-interop-client", "moq-interop-relay", "python"):
        if not os.access(PEER_BIN / tool, os.X_OK):
            problems.append(f"the aiomoqt peer is not installed ({PEER_BIN / tool} is missing); "
                            f"install it with network access: bash interop/install-peer.sh")
            break
    interfaces = sorted(name for _, name in socket.if_nameindex())
    if interfaces != ["lo"]:
        problems.append(f"not inside a private network namespace (interfaces: {', '.join(interfaces)}); "
                        f"aiomoqt binds wildcard addresses, so run: {RUN_HINT}")
    else:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.bind(("127.0.0.1", 0))
                s.sendto(b"x", s.getsockname())
        except OSError as e:
            problems.append(f"loopback is down in this namespace ({e}); run: {RUN_HINT}")
    return problems


@pytest.fixture(scope="session", autouse=True)
def interop_environment() -> None:
    """Fail every test, loudly, when the suite cannot be run as intended."""
    problems = _environment_problems()
    if problems:
        pytest.fail("interop suite cannot run:\n  " + "\n  ".join(problems), pytrace=False)


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A child process whose stdout lines can be awaited."""

    def __init__(self, proc: asyncio.subprocess.Process, name: str) -> None:
        self.proc = proc
        self.name = name
        self.lines: list[str] = []

    async def line(self, timeout: float = 20.0) -> str:
        assert self.proc.stdout is not None
        raw = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not raw:
            raise AssertionError(f"{self.name} exited ({await self.proc.wait()}) before printing the expected "
                                 f"line; it printed: {self.lines}")
        text = raw.decode(errors="replace").rstrip("\n")
        self.lines.append(text)
        return text

    async def wait_for_line(self, prefix: str, timeout: float = 20.0) -> str:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            text = await self.line(max(0.1, deadline - loop.time()))
            if text.startswith(prefix):
                return text

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()


@asynccontextmanager
async def spawn(*argv: str, name: str, stderr: Path | None = None) -> AsyncIterator[Process]:
    err = open(stderr, "wb") if stderr is not None else asyncio.subprocess.DEVNULL
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=err, cwd=str(ROOT))
        process = Process(proc, name)
        try:
            yield process
        finally:
            await process.stop()
    finally:
        if stderr is not None:
            err.close()  # type: ignore[union-attr]


@asynccontextmanager
async def our_relay(tmp_path: Path, drafts: str | None = None) -> AsyncIterator[str]:
    """Our relay as its own process (`python -m relay.service`); yields its moqt:// URL.
    `drafts` pins the drafts it serves ("18,14"), else it serves its default list."""
    extra = ["--drafts", drafts] if drafts else []
    async with spawn(sys.executable, "-m", "relay.service", "--listen", "127.0.0.1:0", *extra,
                     "--cert-dir", str(tmp_path / "relay-cert"), name="our relay",
                     stderr=tmp_path / "our-relay.log") as relay:
        line = await relay.wait_for_line("relay listening on ")
        yield line.split()[-1]


@asynccontextmanager
async def aiomoqt_relay(tmp_path: Path, draft: int = 18) -> AsyncIterator[str]:
    """aiomoqt's relay over raw QUIC on 127.0.0.1, speaking `draft`; yields its moqt:// URL."""
    from kvsp_moq.moqt.certs import generate_self_signed

    cert, key = tmp_path / "aiomoqt-cert.pem", tmp_path / "aiomoqt-key.pem"
    generate_self_signed().write(cert, key)
    port = free_udp_port()
    async with spawn(str(PEER_BIN / "moq-interop-relay"), "--quic", "--bind", "127.0.0.1", "--port", str(port),
                     "--cert", str(cert), "--key", str(key), "--draft", str(draft),
                     name="aiomoqt relay", stderr=tmp_path / "aiomoqt-relay.log"):
        url = f"moqt://127.0.0.1:{port}"
        await _wait_for_moqt(url, draft)
        yield url


async def _wait_for_moqt(url: str, draft: int = 18, timeout: float = 20.0) -> None:
    """Until a MOQT session to `url` can be set up."""
    from kvsp_moq.moqt.quic import connect

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            connection = await connect(url, verify=False, timeout=1.0, drafts=(draft,))
        except (OSError, asyncio.TimeoutError, ConnectionError, Exception):
            if loop.time() > deadline:
                raise AssertionError(f"nothing answers MOQT at {url}") from None
            await asyncio.sleep(0.2)
            continue
        await connection.aclose()
        return


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small test model, made once per run and shared by every agent of the suite."""
    from agent.tiny import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.getbasetemp() / "kvsp-tiny")


# --------------------------------------------------------------------------- the matrix

#: Cells of the interop matrix printed at the end of a run: (pairing, path, draft) -> results.
_MATRIX: dict[tuple[str, str, str], list[str]] = {}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "matrix(pairing, path, draft=None): a cell of the interop matrix; the draft comes from "
        "the test's `draft` parameter when not given",
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    mark = item.get_closest_marker("matrix")
    if mark is None or not (report.when == "call" or report.failed):
        return
    params = getattr(item, "callspec", None)
    draft = mark.kwargs.get("draft") or (params.params.get("draft") if params else None) or "18"
    pairing, path = mark.args
    _MATRIX.setdefault((pairing, path, str(draft)), []).append("ok" if report.passed else "FAILED")


def pytest_terminal_summary(terminalreporter: object) -> None:
    if not _MATRIX:
        return
    rows = [("peers", "through", "draft", "result")]
    for (pairing, path, draft), results in sorted(_MATRIX.items()):
        failed = results.count("FAILED")
        rows.append((pairing, path, draft,
                     f"{len(results) - failed}/{len(results)} ok" + (" FAILED" if failed else "")))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    write = terminalreporter.write_line  # type: ignore[attr-defined]
    terminalreporter.section("MOQT interop matrix")  # type: ignore[attr-defined]
    for n, row in enumerate(rows):
        write("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        if n == 0:
            write("  ".join("-" * width for width in widths))


async def read_track(url: str, namespace: str, track: str, *, draft: int = 18,
                     timeout: float = 20.0) -> list[tuple[int, int, bytes]]:
    """Our client at `url`, speaking `draft`, subscribes to `track` of the namespace whose
    fields `namespace` joins with "/", and reads (group, object, payload) until the
    subscription ends (bounded by `timeout`)."""
    from kvsp_moq.moqt.quic import connect

    client = await connect(url, verify=False, timeout=timeout, drafts=(draft,))
    got: list[tuple[int, int, bytes]] = []
    try:
        assert client.draft == draft
        subscription = await client.subscribe(namespace.split("/"), track, timeout=timeout)

        async def read() -> None:
            async for obj in subscription:
                got.append((obj.group_id, obj.object_id, obj.payload))

        await asyncio.wait_for(read(), timeout)
    finally:
        await client.aclose()
    return got
