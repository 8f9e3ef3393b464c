"""`kvsp bench load`: many concurrent clients fetching blocks through a relay and over HTTP.

Two processes besides this one, as deployed: a relay with a bounded object cache
(`--cache-bytes`) and a holder that serves its blocks over HTTP and publishes them through the
relay. The data set is larger than the relay's cache, so the cache keeps evicting while the
clients run. Each client is one session of its own (a MoqtBlockFetcher with its own QUIC
connection, or an HttpFetcher with its own connection pool) and fetches whole blocks in a loop,
every layer verified against the Replica Record's layer digest, until the time is up.

What must hold, and is reported: no request fails, no object is lost (every fetch returns
every layer of its block, verified), and the relay's resident memory stays below its cache
budget plus `RSS_MARGIN` (the interpreter, aioquic and per-session buffers), sampled from
/proc/PID/status VmRSS all along. Figures: fetches, layers and MB/s (10^6 octets per second)
per transport, and the p50 / p99 time to the first verified layer (TTFL); `kvsp bench load`
also draws the TTFL distribution (`kvsp_moq.bench.figures`) and reports the PNG's path.

    run_load(seconds=10, clients=64)   # a dict; `run(quick)` is what `kvsp bench load` prints
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvsp_moq.bench import figures
from kvsp_moq.fetch.http import HttpFetcher
from kvsp_moq.fetch.moqt import MoqtBlockFetcher
from kvsp_moq.naming import moqt_record
from kvsp_moq.protocol.container import MEDIA_TYPE, encode
from kvsp_moq.protocol.records import ReplicaRecord

MiB = 1 << 20
MB = 1e6
COMPAT = "10" * 32
SCOPE = "0a" * 16
#: What the relay may use beyond its cache budget: the interpreter and its modules (~60 MiB
#: measured idle), aioquic state and send/receive buffers of up to 64 sessions, and objects
#: queued towards slow subscribers (--subscriber-queue-bytes bounds each queue, not their sum).
RSS_MARGIN = 160 * MiB


def _free_port(kind: int) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _block(n: int, layers: int, layer_bytes: int) -> bytes:
    half = layer_bytes // 2
    seed = hashlib.shake_256(f"load block {n}".encode()).digest(half)
    return encode(0, 16, [(bytes([i]) + seed[1:], bytes([i ^ 0xFF]) + seed[1:]) for i in range(layers)])


def _key(n: int) -> str:
    return hashlib.sha256(f"load key {n}".encode()).hexdigest()


@dataclass
class _Service:
    name: str
    process: subprocess.Popen
    log: Path

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


def _spawn(name: str, argv: list[str], workdir: Path) -> _Service:
    log = workdir / f"{name}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvsp_moq.cli", *argv], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
    return _Service(name, proc, log)


def _wait(service: _Service, ready: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if service.process.poll() is not None:
            raise RuntimeError(f"{service.name} exited:\n{service.tail()}")
        try:
            if ready():
                return
        except (httpx.HTTPError, OSError):
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{service.name} did not start in {timeout:.0f} s:\n{service.tail()}")


@dataclass
class _Tally:
    fetches: int = 0
    layers: int = 0
    octets: int = 0
    ttfl: list[float] = field(default_factory=list)


@dataclass
class _Blocks:
    http: list[ReplicaRecord]
    moqt: list[ReplicaRecord]
    layers: int


async def _client(i: int, transport: str, blocks: _Blocks, relay: str, holder: str, until: float,
                  tally: _Tally, errors: list[str], timeout: float) -> None:
    n = len(blocks.http)
    k = i * 7919 % n  # clients start on different blocks, then walk through all of them
    fetcher: Any = (MoqtBlockFetcher(verify=False, timeout=timeout, layer_timeout=timeout)
                    if transport == "moqt" else HttpFetcher(timeout=timeout))
    async with fetcher:
        while time.monotonic() < until:
            record = (blocks.moqt if transport == "moqt" else blocks.http)[k]
            sources = [relay] if transport == "moqt" else [holder]
            k = (k + 1) % n
            stream = fetcher.layers(sources, record)
            got = 0
            octets = 0
            try:
                async for layer in stream:
                    if layer.index != got:
                        errors.append(f"{transport} client {i}: layer {layer.index} where {got} was due")
                        break
                    got += 1
                    octets += len(layer.k) + len(layer.v)
            except Exception as e:  # every failure is a finding, counted
                errors.append(f"{transport} client {i}: {type(e).__name__}: {e}")
                continue
            if got != blocks.layers:
                errors.append(f"{transport} client {i}: {got} of {blocks.layers} layers (lost objects)")
                continue
            tally.fetches += 1
            tally.layers += got
            tally.octets += octets
            if stream.first_layer_seconds is not None:
                tally.ttfl.append(stream.first_layer_seconds)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _drive(blocks: _Blocks, relay: str, holder: str, *, clients: int, moqt_clients: int,
                 seconds: float, timeout: float) -> tuple[dict[str, _Tally], list[str], float]:
    tallies = {"moqt": _Tally(), "http": _Tally()}
    errors: list[str] = []
    start = time.monotonic()
    until = start + seconds
    await asyncio.gather(*(
        _client(i, "moqt" if i < moqt_clients else "http", blocks, relay, holder, until,
                tallies["moqt" if i < moqt_clients else "http"], errors, timeout)
        for i in range(clients)))
    return tallies, errors, time.monotonic() - start


async def _warm(blocks: _Blocks, relay: str, timeout: float = 20.0) -> None:
    """Wait until the holder's namespace is announced at the relay (a fetch goes through)."""
    deadline = time.monotonic() + timeout
    async with MoqtBlockFetcher(verify=False, timeout=5.0, layer_timeout=5.0) as fetcher:
        while True:
            try:
                await fetcher.fetch_block([relay], blocks.moqt[0])
                return
            except Exception:  # not announced yet
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)


def run_load(*, seconds: float = 10.0, clients: int = 64, moqt_share: float = 0.5,
             blocks: int = 48, layers: int = 8, layer_bytes: int = 128 << 10,
             cache_bytes: int = 32 * MiB, timeout: float = 30.0,
             workdir: str | Path | None = None, figure: Path | None = None) -> dict[str, Any]:
    """Start a relay and a holder, run `clients` concurrent clients for `seconds`, report.

    The data set (blocks x layers x layer_bytes, 48 MiB by default) exceeds the relay's cache
    (32 MiB by default), so the relay evicts all along and its memory bound is exercised.
    With `figure`, the measured time-to-first-layer distribution is drawn there as a PNG
    (`ttfl_png`: its path, null without matplotlib).
    """
    tmp: tempfile.TemporaryDirectory[str] | None = None
    if workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvsp-load-")
        root = Path(tmp.name)
    else:
        root = Path(workdir)
    root.mkdir(parents=True, exist_ok=True)
    relay_port, holder_port = _free_port(socket.SOCK_DGRAM), _free_port(socket.SOCK_STREAM)
    relay_url, holder_url = f"moqt://127.0.0.1:{relay_port}", f"http://127.0.0.1:{holder_port}/"
    services: list[_Service] = []
    samples: list[int] = []
    stop = threading.Event()
    try:
        relay = _spawn("relay", ["relay", "--listen", f"127.0.0.1:{relay_port}",
                                 "--cache-bytes", str(cache_bytes)], root)
        services.append(relay)
        _wait(relay, lambda: "relay listening" in relay.log.read_text(errors="replace"))
        holder = _spawn("holder", ["holder", "--listen", f"127.0.0.1:{holder_port}",
                                   "--host-bytes", str(2 * blocks * layers * layer_bytes + 64 * MiB),
                                   "--relay", relay_url], root)
        services.append(holder)
        _wait(holder, lambda: httpx.get(holder_url + "healthz", timeout=1).status_code == 200)

        http_records, moqt_records = [], []
        with httpx.Client(timeout=30, trust_env=False) as client:
            for n in range(blocks):
                r = client.put(f"{holder_url}blocks/{COMPAT}/{SCOPE}/{_key(n)}",
                               content=_block(n, layers, layer_bytes),
                               headers={"If-None-Match": "*", "Content-Type": MEDIA_TYPE})
                if r.status_code != 201:
                    raise RuntimeError(f"PUT of block {n} failed: {r.status_code} {r.text}")
                record = ReplicaRecord.from_json(r.json())
                http_records.append(record)
                moqt_records.append(moqt_record(record, relay_url))
        data = _Blocks(http_records, moqt_records, layers)
        asyncio.run(_warm(data, relay_url))
        idle_rss = _rss(relay.process.pid)

        def sample() -> None:
            while not stop.is_set():
                samples.append(_rss(relay.process.pid))
                stop.wait(0.2)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        moqt_clients = round(clients * moqt_share)
        tallies, errors, elapsed = asyncio.run(_drive(
            data, relay_url, holder_url, clients=clients, moqt_clients=moqt_clients,
            seconds=seconds, timeout=timeout))
        stop.set()
        sampler.join(2)
        relay_alive = relay.process.poll() is None
        holder_alive = holder.process.poll() is None
    finally:
        stop.set()
        for service in reversed(services):
            service.stop()
        if tmp is not None:
            tmp.cleanup()

    def per(t: _Tally) -> dict[str, Any]:
        p50, p99 = _percentile(t.ttfl, 0.50), _percentile(t.ttfl, 0.99)
        return {"fetches": t.fetches, "layers": t.layers, "octets": t.octets,
                "mb_per_s": round(t.octets / elapsed / MB, 1),
                "fetches_per_s": round(t.fetches / elapsed, 1),
                "ttfl_p50_ms": None if p50 is None else round(p50 * 1000, 2),
                "ttfl_p99_ms": None if p99 is None else round(p99 * 1000, 2)}

    all_ttfl = tallies["moqt"].ttfl + tallies["http"].ttfl
    p99_all = _percentile(all_ttfl, 0.99)
    peak = max(samples, default=0)
    figures_out: dict[str, Any] = {}
    if figure is not None:
        figures_out["ttfl_png"] = figures.write(
            figure, figures.ttfl_figure, {t: [s * 1000 for s in tallies[t].ttfl] for t in ("moqt", "http")},
            {"moqt": moqt_clients, "http": clients - moqt_clients})
    return {
        "clients": clients, "moqt_clients": moqt_clients, "http_clients": clients - moqt_clients,
        "seconds": round(elapsed, 2),
        "data_set_octets": blocks * layers * layer_bytes,
        "block": {"layers": layers, "layer_octets": layer_bytes},
        "moqt": per(tallies["moqt"]), "http": per(tallies["http"]),
        "total_mb_per_s": round((tallies["moqt"].octets + tallies["http"].octets) / elapsed / MB, 1),
        "ttfl_p99_ms": None if p99_all is None else round(p99_all * 1000, 2),
        "errors": len(errors), "error_samples": errors[:10],
        "relay": {"cache_bytes": cache_bytes, "rss_margin_bytes": RSS_MARGIN,
                  "rss_idle_bytes": idle_rss, "rss_peak_bytes": peak,
                  "rss_limit_bytes": cache_bytes + RSS_MARGIN,
                  "rss_within_limit": peak <= cache_bytes + RSS_MARGIN, "samples": len(samples),
                  "alive": relay_alive},
        "holder_alive": holder_alive,
        **figures_out,
    }


def run(quick: bool = False) -> dict[str, Any]:
    """`kvsp bench load`: 60 s (10 s with --quick), or KVSP_LOAD_SECONDS when set."""
    seconds = float(os.environ.get("KVSP_LOAD_SECONDS") or (10 if quick else 60))
    return run_load(seconds=seconds, figure=figures.out_dir() / "kvsp-bench-load-ttfl.png")
