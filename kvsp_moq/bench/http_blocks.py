"""`kvsp bench http_blocks`: blocks from a real holder through the HTTP fetcher, against raw
asyncio TCP streaming the same octets, measured in the same run.

The holder (uvicorn) and the raw TCP server run in a separate process, so the server and the
client do not share one interpreter lock. The variants run in turns and every figure is the
median of the repeats.

    fetch        HttpFetcher.layers: GET, Repr-Digest and layer digests verified (plain
                 http:// goes through the lean HTTP/1.1 client, kvsp_moq.fetch.http1)
    range        HttpFetcher.fetch_block for layers 8-15 of 32
    first_layer  time from the request to the first verified layer of a whole-block fetch
    httpx_fetch  the verified whole-block fetch through httpx instead (HttpFetcher(lean=False))
    get          the HTTP transfer alone: the same GET through the fetcher's HTTP/1.1 client
                 into a buffer, with no parsing and no hashing (what the holder and the HTTP
                 path cost, apart from the verification §6.7 requires); get_range for 8-15
    unverified   the same GET read with httpx alone (no parsing, no hashing)
    raw_tcp      asyncio streams: one request line, the same container octets back

Beside the rates: `cpu_ms_per_request`, the CPU the client and the server process spent per
request of each kind, and `two_sha256_passes_ms`, what the two SHA-256 passes over the block
that a verifying client must make (§6.7) cost alone on one core of this machine.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import queue
import select
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Awaitable, Callable

import httpx
import numpy as np

from kvsp_moq.allocator import receive_buffer, tune_allocator
from kvsp_moq.bench.usage import ProcessUsage
from kvsp_moq.fetch import http1
from kvsp_moq.fetch.http import HttpFetcher, tune_httpcore_reads
from kvsp_moq.protocol.container import Container, encode
from kvsp_moq.protocol.records import ReplicaRecord

LAYERS = 32
RANGE = (8, 15)
COMPAT = "c0" * 32
SCOPE = "5c" * 16
CHUNK = 1 << 20


def _block(size: int, seed: int) -> bytes:
    """A container of LAYERS layers whose payload is `size` octets, the same in both processes."""
    section = size // LAYERS // 2
    raw = np.random.default_rng(seed).bytes(section * 2 * LAYERS)
    mv = memoryview(raw)
    return encode(0, 256, [(mv[2 * i * section:(2 * i + 1) * section],
                            mv[(2 * i + 1) * section:(2 * i + 2) * section])
                           for i in range(LAYERS)])


def _key(seed: int) -> str:
    return hashlib.sha256(f"bench block {seed}".encode()).hexdigest()


def _loop_factory(name: str = "asyncio") -> tuple[str, Callable[[], asyncio.AbstractEventLoop]]:
    """The event loop of the client and of the raw TCP server.

    "asyncio" by default, so that the baseline is raw asyncio TCP as DESIGN §7 defines it;
    "uvloop" measures both sides on uvloop instead (when it is installed).
    """
    if name == "uvloop":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return "uvloop", uvloop.new_event_loop
    return "asyncio", asyncio.new_event_loop


# --------------------------------------------------------------------------- the server side


def _raw_server(blocks: dict[int, bytes], ready: "queue.Queue[int]", loop: str) -> None:
    """Answers `seed first last\\n` with that container slice, written in 1 MiB views."""
    slices: dict[tuple[int, int, int], bytes] = {}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                seed, first, last = (int(x) for x in line.split())
                key = (seed, first, last)
                if key not in slices:
                    c = Container(blocks[seed])
                    whole = (first, last) == (0, c.last_layer)
                    slices[key] = blocks[seed] if whole else c.slice(first, last)
                view = memoryview(slices[key])
                for i in range(0, len(view), CHUNK):
                    writer.write(view[i:i + CHUNK])
                    await writer.drain()
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        ready.put(server.sockets[0].getsockname()[1])
        await asyncio.Event().wait()

    factory = _loop_factory(loop)[1]
    factory().run_until_complete(main())


def serve(sizes: list[int], loop: str = "asyncio") -> None:
    """The server process: a holder on uvicorn and the raw TCP server beside it.

    Prints one JSON line with their addresses, then serves until terminated.
    """
    import logging

    import uvicorn

    from kvsp_moq.holder.app import create_app
    from kvsp_moq.holder.settings import HolderSettings
    from kvsp_moq.web import bind_tcp, uvicorn_config

    logging.getLogger("kvsp").setLevel(logging.WARNING)
    blocks = {seed: _block(size, seed) for seed, size in enumerate(sizes)}
    app = create_app(HolderSettings(host_bytes=4 * sum(sizes) + (64 << 20)))
    sock = bind_tcp("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/"
    app.state.publisher.holder_url = url
    ready: "queue.Queue[int]" = queue.Queue()
    threading.Thread(target=_raw_server, args=(blocks, ready, loop), daemon=True).start()
    print(json.dumps({"url": url, "raw_port": ready.get(timeout=30),
                      "raw_loop": _loop_factory(loop)[0]}), flush=True)
    uvicorn.Server(uvicorn_config(app)).run(sockets=[sock])


# --------------------------------------------------------------------------- the client side


async def _interleaved(fns: dict[str, Callable[[], Awaitable[Any]]],
                       repeat: int, usage: ProcessUsage | None = None) -> dict[str, float]:
    """Median seconds of each function, run in turns so that a noisy neighbour on the machine
    slows every variant alike instead of whichever happened to run at the time. With `usage`,
    what each process spent in the counted runs is added up per function."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_ in range(repeat + 2):
        for name, fn in fns.items():
            start = time.perf_counter()
            if round_ >= 2 and usage is not None:
                await usage.measure(name, fn())
            else:
                await fn()
            if round_ >= 2:  # two warm-up rounds
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


async def _measure(url: str, raw_port: int, sizes: list[int], repeat: int, sha_mb_per_s: float,
                   server_pid: int | None = None) -> list[dict]:
    out = []
    tune_httpcore_reads()
    fetcher = HttpFetcher(timeout=30.0)
    via_httpx = HttpFetcher(timeout=30.0, lean=False)
    plain = httpx.AsyncClient(trust_env=False, timeout=30.0)
    transfer = http1.Http1Pool(timeout=30.0, connect_timeout=5.0)
    reader, writer = await asyncio.open_connection("127.0.0.1", raw_port)
    try:
        for seed, size in enumerate(sizes):
            data = _block(size, seed)
            path = f"blocks/{COMPAT}/{SCOPE}/{_key(seed)}"
            r = await plain.put(url + path, content=data, headers={"If-None-Match": "*"})
            r.raise_for_status()
            record = ReplicaRecord.from_json(r.json())
            ranged = Container(data).slice(*RANGE)
            first_layer: list[float] = []

            async def fetch_whole() -> None:
                stream = fetcher.layers([url], record)
                n = 0
                async for _ in stream:
                    n += 1
                assert n == LAYERS and not stream.failures
                first_layer.append(stream.first_layer_seconds or 0.0)

            async def fetch_httpx() -> None:
                stream = via_httpx.layers([url], record)
                n = 0
                async for _ in stream:
                    n += 1
                assert n == LAYERS and not stream.failures

            async def fetch_range() -> None:
                result = await fetcher.fetch_block([url], record, RANGE)
                assert len(result.container) == len(ranged)

            async def unverified() -> None:
                async with plain.stream("GET", url + path) as resp:
                    buf = bytearray(len(data))
                    pos = 0
                    async for piece in resp.aiter_raw():
                        buf[pos:pos + len(piece)] = piece
                        pos += len(piece)
                assert pos == len(data)

            def get(query: str, n: int) -> Callable[[], Awaitable[None]]:
                async def go() -> None:
                    async with await transfer.get(url + path + query, {}) as resp:
                        assert resp.status_code == 200
                        buf = receive_buffer(resp.content_length or 0)
                        async for got in resp.body_into(buf):
                            pass
                    assert got == n
                return go

            def raw(first: int, last: int, n: int) -> Callable[[], Awaitable[None]]:
                async def go() -> None:
                    writer.write(f"{seed} {first} {last}\n".encode())
                    buf = bytearray(n)
                    pos = 0
                    while pos < n:
                        piece = await reader.read(min(CHUNK, n - pos))
                        if not piece:
                            raise ConnectionError("raw server closed")
                        buf[pos:pos + len(piece)] = piece
                        pos += len(piece)
                return go

            pids = {"client": os.getpid()}
            if server_pid is not None:
                pids["server"] = server_pid
            usage = ProcessUsage(pids)
            t = await _interleaved({
                "fetch": fetch_whole, "range": fetch_range, "httpx_fetch": fetch_httpx,
                "get": get("", len(data)),
                "get_range": get(f"?layers={RANGE[0]}-{RANGE[1]}", len(ranged)),
                "unverified": unverified,
                "raw": raw(0, LAYERS - 1, len(data)), "raw_range": raw(*RANGE, len(ranged)),
            }, repeat, usage)
            t_fetch, t_range, t_plain, t_raw, t_raw_range = (
                t["fetch"], t["range"], t["unverified"], t["raw"], t["raw_range"])
            first_layer_ms = statistics.median(first_layer[2:]) * 1000
            mb = lambda n, t: round(n / t / 1e6, 1)  # noqa: E731
            out.append({
                "block_bytes": len(data),
                "layers": LAYERS,
                "fetch_mb_per_s": mb(len(data), t_fetch),
                "first_layer_ms": round(first_layer_ms, 3),
                "whole_block_ms": round(t_fetch * 1000, 3),
                "range": f"{RANGE[0]}-{RANGE[1]}",
                "range_bytes": len(ranged),
                "range_mb_per_s": mb(len(ranged), t_range),
                "httpx_fetch_mb_per_s": mb(len(data), t["httpx_fetch"]),
                "get_mb_per_s": mb(len(data), t["get"]),
                "get_range_mb_per_s": mb(len(ranged), t["get_range"]),
                "unverified_httpx_mb_per_s": mb(len(data), t_plain),
                "raw_tcp_mb_per_s": mb(len(data), t_raw),
                "raw_tcp_range_mb_per_s": mb(len(ranged), t_raw_range),
                "ratio": round(t_raw / t_fetch, 3),
                "range_ratio": round(t_raw_range / t_range, 3),
                "get_ratio": round(t_raw / t["get"], 3),
                "get_range_ratio": round(t_raw_range / t["get_range"], 3),
                "unverified_ratio": round(t_raw / t_plain, 3),
                # The client must hash every octet twice (§6.7: Repr-Digest, then the layer
                # digests): the CPU that alone takes, beside what each process spent.
                "two_sha256_passes_ms": round(2 * len(data) / sha_mb_per_s / 1e3, 3),
                "cpu_ms_per_request": {
                    name: usage.per_block(name, repeat).get("cpu_ms_per_block", {})
                    for name in ("fetch", "get", "raw", "range", "raw_range")},
            })
    finally:
        writer.close()
        await fetcher.aclose()
        await via_httpx.aclose()
        await plain.aclose()
        await transfer.aclose()
    return out


def _sha256_mb_per_s() -> float:
    data = bytes(16 << 20)
    best = min(_timed(lambda: hashlib.sha256(data).digest()) for _ in range(3))
    return round(len(data) / best / 1e6, 1)


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _start_server(sizes: list[int], loop: str) -> tuple[subprocess.Popen, dict[str, Any]]:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvsp_moq.bench.http_blocks", "--serve", loop,
         *(str(s) for s in sizes)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline() if ready else b""
    if not line:
        proc.kill()
        raise RuntimeError("the benchmark holder did not start")
    return proc, json.loads(line)


def run_blocks(quick: bool = False, *, loop: str = "asyncio") -> dict[str, Any]:
    """Measure, and return the figures as JSON-ready data."""
    sizes = [2 << 20, 16 << 20]
    repeat = 5 if quick else 25
    sha_mb_per_s = _sha256_mb_per_s()
    server, info = _start_server(sizes, loop)
    try:
        loop_name, factory = _loop_factory(loop)
        event_loop = factory()
        try:
            blocks = event_loop.run_until_complete(
                _measure(info["url"], info["raw_port"], sizes, repeat, sha_mb_per_s, server.pid))
        finally:
            event_loop.close()
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
    return {
        "benchmark": "http_blocks",
        "repeats": repeat,
        "holder_loop": "uvicorn's choice (uvloop when installed)",
        "client_and_raw_server_loop": loop_name,
        "sha256_mb_per_s_one_thread": sha_mb_per_s,
        "blocks": blocks,
        "targets": {"ratio": ">= 0.5"},
    }


def run(*, quick: bool = False) -> dict[str, Any]:
    """Entry point of `kvsp bench http_blocks`."""
    return run_blocks(quick)


if __name__ == "__main__":
    tune_allocator()
    if sys.argv[1:2] == ["--serve"]:
        serve([int(x) for x in sys.argv[3:]], sys.argv[2])
    else:
        print(json.dumps(run_blocks(quick="--quick" in sys.argv,
                                    loop="uvloop" if "--uvloop" in sys.argv else "asyncio"),
                         indent=2))
