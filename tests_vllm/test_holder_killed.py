"""Check 4: a holder killed (SIGKILL) in the middle of a load still gives vLLM's exact output.

Each holder is a `kvsp holder` process behind a small TCP proxy that is its public URL. Once
armed, the proxies let only a few tens of kB of block responses through in all (less than one
block of the tiny model), then the holder that was serving is killed and its proxy closes every
connection and refuses new ones: the load is cut mid-block, whatever the machine's speed.

With one replica the blocks cannot be loaded: they become load errors, vLLM recomputes them,
and the output is its recompute's. With a second replica on another holder, the loader goes on
from there at each block's first missing layer, and every block is loaded.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from kvsp_moq.integrations.vllm.loop import LoopThread
from kvsp_moq.protocol.keys import scope_id
from kvsp_moq.scope_keys import read_scope_keys
from tests_vllm.conftest import BLOCK, Engine, block_keys, compat_of, eventually, free_port, prompt, records_of

ROOT = Path(__file__).resolve().parent.parent
#: Octets of block responses let through after arming: under one tiny-model block (128 KiB).
BUDGET = 40_000


class Trigger:
    """Shared by the proxies: after `arm`, the first to use up the budget kills its holder."""

    def __init__(self) -> None:
        self.armed = False
        self.left = BUDGET
        self.fired: "Proxy | None" = None
        self.lock = threading.Lock()


class Proxy:
    """127.0.0.1:port -> a holder process; cuts and kills when the trigger fires here."""

    def __init__(self, loop: LoopThread, upstream: int, trigger: Trigger) -> None:
        self.loop = loop
        self.upstream = upstream
        self.trigger = trigger
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.process: subprocess.Popen[bytes] | None = None
        self.dead = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._server = loop.call(asyncio.start_server(self._serve, "127.0.0.1", self.port))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.dead:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._pump(reader, up_writer, down=False),
                             self._pump(up_reader, writer, down=True), return_exceptions=True)
        for w in (writer, up_writer):
            w.close()
            self._writers.discard(w)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, *, down: bool) -> None:
        while not self.dead:
            data = await src.read(16384)
            if not data:
                break
            if down and self.trigger.armed and self.trigger.fired is None:
                with self.trigger.lock:
                    allowed = min(len(data), self.trigger.left)
                    self.trigger.left -= allowed
                    fire = self.trigger.left == 0 and self.trigger.fired is None
                    if fire:
                        self.trigger.fired = self
                if allowed:
                    dst.write(data[:allowed])
                    await dst.drain()
                if fire:
                    await self._die()
                if allowed < len(data):
                    return
                continue
            dst.write(data)
            await dst.drain()
        dst.close()

    async def _die(self) -> None:
        """The holder process is killed; its address stops answering."""
        self.dead = True
        assert self.process is not None
        self.process.kill()
        self._server.close()
        for w in list(self._writers):
            w.transport.abort()

    def close(self) -> None:
        self.loop.call(self._close())

    async def _close(self) -> None:
        self.dead = True
        self._server.close()
        for w in list(self._writers):
            w.transport.abort()


@pytest.fixture
def holders(index_url: str, tmp_path: Path) -> Iterator[Any]:
    loop = LoopThread("test-proxies")
    trigger = Trigger()
    made: list[Proxy] = []

    def start() -> Proxy:
        port = free_port()
        proxy = Proxy(loop, port, trigger)
        log = open(tmp_path / f"holder-{port}.log", "wb")
        proxy.process = subprocess.Popen(
            [sys.executable, "-m", "kvsp_moq.cli", "holder", "--listen", f"127.0.0.1:{port}",
             "--public-url", proxy.url, "--index", index_url],
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1"))
        made.append(proxy)
        eventually(lambda: _healthy(proxy.url), f"holder {proxy.url}")
        return proxy

    start.trigger = trigger  # type: ignore[attr-defined]
    yield start
    for proxy in made:
        proxy.close()
        if proxy.process is not None and proxy.process.poll() is None:
            proxy.process.kill()
            proxy.process.wait(10)
    loop.stop()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "healthz", timeout=1.0, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def _config(index_url: str, keys_file: Path, holder: str | None) -> dict[str, Any]:
    return {"index": index_url, "scope_keys": str(keys_file), "scope": "team", "holder": holder,
            "lease_ms": 5000, "load_timeout_s": 10}


def _computed(model_dir: Path, index_url: str, keys_file: Path, holder: str,
              tokens: list[int], expected: list[int]) -> list[str]:
    """A first engine computes the prompt and PUTs its blocks to `holder`."""
    key = read_scope_keys(keys_file)["team"]
    keys = block_keys(key, compat_of(model_dir), tokens)[:3]
    with Engine(model_dir, _config(index_url, keys_file, holder)) as cold:
        assert cold.generate([tokens]) == [(expected, 0)]
        eventually(lambda: all(records_of(index_url, scope_id(key).hex(), compat_of(model_dir), keys)),
                   "the blocks' records")
        assert cold.worker_stats()["saved_blocks"] == 3
    return keys


def _copy(source: str, target: str, compat: str, scope: str, keys: list[str]) -> None:
    for key in keys:
        path = f"blocks/{compat}/{scope}/{key}"
        body = httpx.get(source + path, timeout=10, trust_env=False).content
        r = httpx.put(target + path, content=body, timeout=10, trust_env=False,
                      headers={"If-None-Match": "*", "Content-Type": "application/kvsp-block"})
        assert r.status_code == 201, r.text


def test_holder_killed_mid_load_recomputes(model_dir: Path, index_url: str, keys_file: Path,
                                           reference: Any, holders: Any, tmp_path: Path) -> None:
    """The warm request extends the cached prefix by three blocks of its own, computed in the
    step whose load fails: they attended to a prefix with holes, so they are not saved; the
    recompute that follows saves all six."""
    tokens = prompt(110, seed=7)
    longer = tokens[:96] + prompt(110, seed=9)  # 6 complete blocks, the first 3 cached
    expected, expected_longer = reference(tokens, longer)
    holder = holders()
    _computed(model_dir, index_url, keys_file, holder.url, tokens, expected)
    holders.trigger.armed = True
    config = {**_config(index_url, keys_file, "embedded"), "data": str(tmp_path / "own")}
    with Engine(model_dir, config) as warm:
        started = time.monotonic()
        [(out, _)] = warm.generate([longer])
        elapsed = time.monotonic() - started
        worker = warm.worker_stats()
        scheduler = warm.scheduler_stats()
        eventually(lambda: warm.worker_stats()["saved_blocks"] == 6, "the recomputed blocks saved")
    assert holders.trigger.fired is holder and holder.process.poll() is not None, "not killed"
    assert out == expected_longer, "output after a holder died mid-load differs from recompute"
    assert worker["loaded_blocks"] == 0 and worker["load_errors"] == 3, worker
    assert worker["saves_dropped"] == 3, worker
    assert scheduler["load_errors"] == 3, scheduler
    assert worker["load_failures"], worker
    assert elapsed < 15, f"recovering took {elapsed:.1f} s"


def test_holder_killed_mid_load_falls_back_to_another_replica(
        model_dir: Path, index_url: str, keys_file: Path, reference: Any, holders: Any) -> None:
    tokens = prompt(110, seed=8)
    (expected,) = reference(tokens)
    first, second = holders(), holders()
    keys = _computed(model_dir, index_url, keys_file, first.url, tokens, expected)
    key = read_scope_keys(keys_file)["team"]
    _copy(first.url, second.url, compat_of(model_dir), scope_id(key).hex(), keys)
    eventually(lambda: all(len(r) == 2 for r in records_of(
        index_url, scope_id(key).hex(), compat_of(model_dir), keys)), "both replicas' records")
    holders.trigger.armed = True
    with Engine(model_dir, _config(index_url, keys_file, None)) as warm:
        [(out, cached)] = warm.generate([tokens])
        worker = warm.worker_stats()
    killed = holders.trigger.fired
    assert killed in (first, second) and killed.process.poll() is not None, "no holder was killed"
    assert out == expected and cached == 3 * BLOCK
    assert worker["loaded_blocks"] == 3 and worker["load_errors"] == 0, worker
    assert any(f["source"] == killed.url for f in worker["load_failures"]), worker
