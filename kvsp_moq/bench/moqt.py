"""`kvsp bench moqt`: KV blocks through a MOQT relay, against HTTP and aiomoqt, in one run.

Three processes for the MOQT path, as deployed: a holder (its BlockStore served over HTTP
and, by a BlockPublisher on the same event loop, over MOQT), a relay (`python -m
relay.service`) and the client (this process). Blocks of 32 layers, 2 MiB and 16 MiB:

    moqt_fetch_cold   MoqtBlockFetcher FETCH through the relay, which asks the holder
    moqt_fetch_cached the same block again, answered from the relay's cache
    moqt_subscribe    SUBSCRIBE through the relay (a new feed: the holder streams the block)
    http              HttpFetcher against the same holder (Repr-Digest and layer digests)
    aiomoqt           aiomoqt's relay with aiomoqt's publisher and subscriber carrying the
                      same bytes (SUBSCRIBE, the relay in the path)

The variants run in turns, each repeat on a fresh block for the cold paths, so a machine
whose speed drifts (shared cores) slows them alike. aiomoqt binds wildcard addresses, so the
whole measurement runs inside a private network namespace (`unshare -n`, loopback only); when
that is not possible ours run alone and the JSON says why aiomoqt did not. Every MOQT and HTTP
layer is verified against its layer digest before it counts. Figures are medians: MB/s (10^6
octets per second), milliseconds to the first verified layer and to the whole block. The
ratios compare like with like: ours_vs_aiomoqt divides our SUBSCRIBE rate by aiomoqt's,
ours_vs_http our cold FETCH by HTTP (ours_cached_vs_http: the relay's cache answering).
`cpu_parallelism` tells how many cores' worth of work two busy processes got at once.
Each variant also reports, per block, the CPU milliseconds and minor page faults of each of
our processes (relay, holder, client) while it ran: where the time goes, run by run.

One run measures a matrix of QUIC engines x datagram sizes (`--engine`, default aioquic,qh3;
`--datagram-size`, default 1452,9000,loopback, or KVSP_MOQT_DATAGRAM_SIZE alone when it is
set): each cell is its own holder, relay and client with KVSP_QUIC_ENGINE and
KVSP_MOQT_DATAGRAM_SIZE set for them, beside the bare engine at the same size
(kvsp_moq.bench.quic_engine), so the MOQT layer's own cost shows. HTTP and aiomoqt do not
depend on our engine: they run once, in turns with the reference cell (the default engine and
size), whose figures also fill the top-level keys as before. MATRIX_NOTE defines the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from kvsp_moq.bench.usage import ProcessUsage
from kvsp_moq.errors import SettingError

LAYERS = 32
SIZES = (2 << 20, 16 << 20)
MB = 1e6
ROOT = Path(__file__).resolve().parents[2]
PEER_VENV = ROOT / "interop" / ".venv-aiomoqt"
PEER_SCRIPT = ROOT / "interop" / "peers" / "aiomoqt_bench.py"
COMPAT = "c0" * 32
SCOPE = "5c" * 16


def layer_bytes(seed: str, layer: int, size: int) -> bytes:
    """Layer payloads (K||V) shared with the aiomoqt publisher, so both carry the same bytes."""
    return hashlib.shake_256(f"{seed}:0:{layer}".encode()).digest(size)


def block_bytes(seed: str, size: int) -> bytes:
    from kvsp_moq.protocol.container import encode

    per = size // LAYERS
    layers = [layer_bytes(seed, i, per) for i in range(LAYERS)]
    return encode(0, 256, [(p[:per // 2], p[per // 2:]) for p in layers])


def block_seed(base: str, size: int, index: int) -> str:
    return f"{base}-{size}-{index}"


def block_label(size: int) -> str:
    """"16MiB": how the report names a block size."""
    return f"{size >> 20}MiB" if size % (1 << 20) == 0 else f"{size >> 10}KiB"


def block_key(seed: str) -> str:
    return hashlib.sha256(seed.encode()).hexdigest()


# --------------------------------------------------------------------------- the holder process


def holder_main(args: argparse.Namespace) -> int:
    """Serve generated blocks over HTTP and MOQT; print one JSON line of records."""
    from kvsp_moq.holder.moqt_publisher import BlockPublisher
    from kvsp_moq.holder.service import Holder
    from kvsp_moq.holder.settings import HolderSettings
    from kvsp_moq.holder.store import BlockId

    holder = Holder(HolderSettings(listen="127.0.0.1:0", host_bytes=2 << 30, disk_bytes=0)).start()
    records: dict[str, list[dict[str, Any]]] = {}
    for size in args.sizes:
        records[str(size)] = []
        for index in range(args.count):
            seed = block_seed(args.seed, size, index)
            bid = BlockId(COMPAT, SCOPE, block_key(seed))
            entry = holder.call(holder.store.put(bid, block_bytes(seed, size)))
            records[str(size)].append(holder.publisher.record_for(entry).to_json())
    publisher = BlockPublisher(holder.store, args.relay, holder.url, cafile=args.cafile)
    holder.call(publisher.start())
    holder.call(publisher.wait_connected(30))
    print(json.dumps({"holder": holder.url, "records": records}), flush=True)
    try:
        sys.stdin.read()  # until the bench closes our stdin
    finally:
        holder.call(publisher.aclose())
        holder.stop()
    return 0


# --------------------------------------------------------------------------- the client


class _Child:
    """A child process whose output lines are read with a deadline."""

    def __init__(self, argv: list[str], log: Path, stdin: bool = False,
                 env: dict[str, str] | None = None) -> None:
        self.argv = argv
        self.log = open(log, "wb")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.log, cwd=str(ROOT),
                                     stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                     env=None if env is None else {**os.environ, **env})
        self._buffer = b""

    def read_line(self, prefix: str, timeout: float = 60.0) -> str:
        """The next output line starting with `prefix` (others are skipped)."""
        import select

        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\n", 1)
                line = raw.decode(errors="replace")
                if line.startswith(prefix):
                    return line.strip()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(f"no {prefix!r} line from {self.argv[:3]} in {timeout}s; see {self.log.name}")
            ready, _, _ = select.select([fd], [], [], remaining)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise RuntimeError(f"{self.argv[:3]} exited ({self.proc.wait()}); see {self.log.name}")
                self._buffer += chunk

    def stop(self) -> None:
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _summary(size: int, runs: list[tuple[float, float]]) -> dict[str, Any]:
    totals = [t for _, t in runs]
    firsts = [f for f, _ in runs]
    return {
        "mb_per_s": round(size / _median(totals) / MB, 1),
        "first_layer_ms": round(_median(firsts) * 1000, 2),
        "whole_block_ms": round(_median(totals) * 1000, 2),
        "runs": len(runs),
    }


async def _timed(stream_factory: Callable[[], Any], expected: bytes) -> tuple[float, float]:
    """(seconds to the first layer, seconds to the whole block) of one verified transfer."""
    start = time.perf_counter()
    first = None
    digest = hashlib.sha256()
    async for layer in stream_factory():
        if first is None:
            first = time.perf_counter() - start
        digest.update(layer.k)
        digest.update(layer.v)
    total = time.perf_counter() - start
    if digest.digest() != expected:
        raise RuntimeError("the layers received differ from the block")
    return first or total, total


def _payload_digest(data: bytes) -> bytes:
    from kvsp_moq.protocol.container import Container

    whole = Container(data)
    return hashlib.sha256(bytes(whole.payload(0, whole.last_layer))).digest()


class _Aiomoqt:
    """aiomoqt's relay, publisher and a subscriber taking track names on stdin."""

    def __init__(self, work: Path, seed: str, sizes: tuple[int, ...] = SIZES) -> None:
        from kvsp_moq.allocator import allocator_environment
        from kvsp_moq.moqt.certs import generate_self_signed

        py = str(PEER_VENV / "bin" / "python")
        cert, key = work / "aiomoqt-cert.pem", work / "aiomoqt-key.pem"
        generate_self_signed().write(cert, key)
        port = _free_udp_port()
        url = f"moqt://127.0.0.1:{port}"
        namespace = f"kvsp-bench/{seed}"
        # The peer's processes get the allocator settings ours give themselves
        # (kvsp_moq.allocator), so that the comparison is of the two stacks alone.
        env = allocator_environment()
        self.children: list[_Child] = []
        self.children.append(_Child(
            [str(PEER_VENV / "bin" / "moq-interop-relay"), "--quic", "--bind", "127.0.0.1", "--port", str(port),
             "--cert", str(cert), "--key", str(key), "--draft", "18", "--stream-ring-cap", str(2 << 20),
             "--max-inflight-bytes", str(1 << 20)], work / "aiomoqt-relay.log", env=env))
        time.sleep(1.0)
        pub = _Child([py, str(PEER_SCRIPT), "pub", url, namespace, seed, str(LAYERS),
                      ",".join(str(x) for x in sizes)], work / "aiomoqt-pub.log", env=env)
        self.children.append(pub)
        pub.read_line("READY", 60)
        self.sub = _Child([py, str(PEER_SCRIPT), "sub", url, namespace, str(LAYERS)], work / "aiomoqt-sub.log",
                          stdin=True, env=env)
        self.children.append(self.sub)
        self.sub.read_line("READY", 60)
        self.count = 0

    def transfer(self, size: int, expected: str) -> tuple[float, float]:
        """One block of `size` through aiomoqt's relay: (first object s, last object s)."""
        self.count += 1
        assert self.sub.proc.stdin is not None
        self.sub.proc.stdin.write(f"b{size}-{self.count}\n".encode())
        self.sub.proc.stdin.flush()
        result = json.loads(self.sub.read_line("{", 120))
        if result["sha256"] != expected or result["bytes"] != size:
            raise RuntimeError("aiomoqt delivered other bytes than were sent")
        return result["first_s"], result["total_s"]

    def stop(self) -> None:
        for child in reversed(self.children):
            child.stop()


def _free_udp_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _client(relay_url: str, cafile: str, holder_url: str, records: dict[str, list[dict[str, Any]]],
                  base_seed: str, reps: int, aiomoqt: _Aiomoqt | None,
                  pids: dict[str, int] | None = None, with_http: bool = True,
                  sizes: tuple[int, ...] = SIZES) -> dict[str, Any]:
    """Every variant in turns, each repeat a fresh block for the cold paths (HTTP left out
    of the matrix's other cells: it does not depend on the QUIC engine)."""
    from kvsp_moq.fetch.http import HttpFetcher
    from kvsp_moq.fetch.moqt import MoqtBlockFetcher
    from kvsp_moq.naming import BlockTrack, moqt_record
    from kvsp_moq.protocol.records import ReplicaRecord

    cadata = Path(cafile).read_bytes()
    out: dict[str, Any] = {}
    async with MoqtBlockFetcher(cadata=cadata, timeout=30, layer_timeout=30) as moqt, HttpFetcher() as http:
        connection = await moqt.connection(relay_url)
        for size in sizes:
            http_records = [ReplicaRecord.from_json(r) for r in records[str(size)]]
            moqt_records = [moqt_record(r, relay_url) for r in http_records]
            expected = [_payload_digest(block_bytes(block_seed(base_seed, size, i), size))
                        for i in range(len(http_records))]
            theirs = hashlib.sha256(b"".join(layer_bytes(block_seed(base_seed, size, 0), i, size // LAYERS)
                                             for i in range(LAYERS))).hexdigest()
            runs: dict[str, list[tuple[float, float]]] = {
                "moqt_fetch_cold": [], "moqt_fetch_cached": [], "moqt_subscribe": []}
            if with_http:
                runs["http"] = []
            if aiomoqt is not None:
                runs["aiomoqt"] = []
                aiomoqt.transfer(size, theirs)  # warm-up, not counted
            # A warm-up transfer of each kind (not counted) settles connections and windows.
            if with_http:
                await _timed(lambda: http.layers([holder_url], http_records[0]), expected[0])
            await _timed(lambda: moqt.layers([], moqt_records[0]), expected[0])
            usage = ProcessUsage({**(pids or {}), "client": os.getpid()})
            for rep in range(reps):
                fetch_i, sub_i = 1 + 2 * rep, 2 + 2 * rep
                runs["moqt_fetch_cold"].append(await usage.measure("moqt_fetch_cold", _timed(
                    lambda: moqt.layers([], moqt_records[fetch_i]), expected[fetch_i])))
                runs["moqt_fetch_cached"].append(await usage.measure("moqt_fetch_cached", _timed(
                    lambda: moqt.layers([], moqt_records[fetch_i]), expected[fetch_i])))
                if with_http:
                    runs["http"].append(await usage.measure("http", _timed(
                        lambda: http.layers([holder_url], http_records[fetch_i]), expected[fetch_i])))
                namespace = moqt_records[sub_i].moqt_namespace
                if namespace is None:
                    raise RuntimeError("the holder's MOQT record has no moqt_namespace")
                track = BlockTrack.from_record_namespace(namespace)
                runs["moqt_subscribe"].append(await usage.measure(
                    "moqt_subscribe", _subscribe_timed(connection, track, expected[sub_i])))
                if aiomoqt is not None:
                    runs["aiomoqt"].append(aiomoqt.transfer(size, theirs))
            out[block_label(size)] = {name: {**_summary(size, r), **usage.per_block(name, len(r))}
                                       for name, r in runs.items()}
    return out


async def _subscribe_timed(connection: Any, track: Any, expected: bytes) -> tuple[float, float]:
    """A raw SUBSCRIBE of a stored block through the relay; each layer object checked."""
    start = time.perf_counter()
    subscription = await connection.subscribe(track.namespace, track.track_name, timeout=30)
    first = None
    digest = hashlib.sha256()
    count = 0
    async for obj in subscription:
        if first is None:
            first = time.perf_counter() - start
        digest.update(obj.payload)
        count += 1
        if count == LAYERS:
            break
    total = time.perf_counter() - start
    await subscription.aclose()
    if digest.digest() != expected:
        raise RuntimeError("the subscribed layers differ from the block")
    return first or total, total


def _burn(_: int = 0) -> float:
    start = time.perf_counter()
    x = 0
    for i in range(2_000_000):
        x += i
    return time.perf_counter() - start


def cpu_parallelism() -> float:
    """How many cores' worth of work two busy processes get here at once (2.0 on two idle
    cores; about 1.0 where the cores are shared), to read the figures by."""
    from concurrent.futures import ProcessPoolExecutor

    alone = min(_burn() for _ in range(3))
    with ProcessPoolExecutor(2) as pool:
        together = max(pool.map(_burn, [0, 1]))
    return round(2 * alone / together, 2)


# --------------------------------------------------------------------------- run


def measure(reps: int, with_aiomoqt: bool, with_http: bool = True,
            sizes: tuple[int, ...] = SIZES) -> dict[str, Any]:
    """Start the processes, run every variant in turns, return the figures (the QUIC engine
    and datagram size: this process's KVSP_QUIC_ENGINE / KVSP_MOQT_DATAGRAM_SIZE, which the
    relay and holder inherit)."""
    from kvsp_moq.moqt.quic import new_event_loop

    seed = os.urandom(4).hex()
    work = Path(tempfile.mkdtemp(prefix="kvsp-bench-moqt-"))
    children: list[_Child] = []
    aiomoqt: _Aiomoqt | None = None
    report: dict[str, Any] = {}
    try:
        relay = _Child([sys.executable, "-m", "relay.service", "--listen", "127.0.0.1:0", "--cert-dir",
                        str(work), "--cache-bytes", str(1 << 30), "--subscriber-queue-bytes", str(256 << 20)],
                       work / "relay.log")
        children.append(relay)
        relay_url = relay.read_line("relay listening on ").split()[-1]
        cafile = str(work / "relay-cert.pem")
        holder = _Child([sys.executable, "-m", "kvsp_moq.bench.moqt", "holder", "--relay", relay_url,
                         "--cafile", cafile, "--seed", seed, "--count", str(1 + 2 * reps),
                         "--sizes", ",".join(map(str, sizes))],
                        work / "holder.log", stdin=True)
        children.append(holder)
        info = json.loads(holder.read_line("{", 300))
        if with_aiomoqt:
            try:
                aiomoqt = _Aiomoqt(work, seed, sizes)
            except (OSError, RuntimeError) as e:
                report["aiomoqt_error"] = f"aiomoqt did not start: {e}"
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            report["ours"] = runner.run(_client(relay_url, cafile, info["holder"], info["records"], seed, reps,
                                                aiomoqt, {"relay": relay.proc.pid, "holder": holder.proc.pid},
                                                with_http, sizes))
    finally:
        if aiomoqt is not None:
            aiomoqt.stop()
        for child in reversed(children):
            child.stop()
        shutil.rmtree(work, ignore_errors=True)
    return report


# --------------------------------------------------------------------------- the matrix

#: `--datagram-size` word for the loopback default (LOOPBACK_DATAGRAM_SIZE, capped by the engine).
LOOPBACK = "loopback"
DEFAULT_DATAGRAM_SIZES = f"1452,9000,{LOOPBACK}"
#: Octets of the bare engine transfer set beside each cell (quick: the 16 MiB block's size).
BARE_BYTES = 64 << 20
BARE_BYTES_QUICK = 16 << 20
BARE_RUNS = 3
GB = 1e9
CELL_TIMEOUT = 1200
MATRIX_NOTE = (
    "matrix: one cell per QUIC engine x datagram size, each a separate holder, relay and client "
    "run with KVSP_QUIC_ENGINE and KVSP_MOQT_DATAGRAM_SIZE set (unset for 'loopback'), beside the "
    "bare engine (kvsp_moq.bench.quic_engine.run_bare: one stream, two processes, no MOQT; qh3 "
    "with GSO/GRO as its MOQT adapter; aioquic above 16384 with the adapter's long-frame patch). "
    "HTTP and aiomoqt's relay are measured once, in the reference cell's run; every ratio uses "
    "figures of this run. vs_http, vs_aiomoqt, vs_aioquic and vs_bare divide the cell's cold "
    "FETCH MB/s by HTTP's, aiomoqt's SUBSCRIBE through its relay, the aioquic cell of the same "
    "datagram size, and the bare engine's. A hop is the bytes crossing one QUIC connection, "
    "paid by a sender end and a receiver end; the relay pays the receiver end of holder->relay "
    "and the sender end of relay->client, one hop's worth, with no digest checks. So "
    "moqt_cpu_s_per_gb_per_hop = relay CPU seconds per cold FETCH block / block GB (payload "
    "octets, 10^9), bare_cpu_s_per_gb_per_hop = bare server + client CPU seconds per GB, "
    "cpu_vs_bare their ratio (the MOQT layer's and the relay cache's own cost on top of the "
    "engine); path_cpu_s_per_gb_per_hop = (holder + relay + client) CPU per block / block GB / "
    "2 hops, which also counts the holder's store reads and the client's digest checks. "
    "matrix_summary: the largest block.")


def parse_engines(text: str | None) -> tuple[str, ...]:
    """The engines of `--engine` (comma-separated; default: every engine, where one not
    installed becomes an "unsupported" cell). SettingError (one line, exit 2) for an unknown
    engine or a named one not installed."""
    from kvsp_moq.moqt.quic.settings import ENGINES, check_engine

    if text is None:
        return tuple(ENGINES)
    names: list[str] = []
    for name in (n.strip() for n in text.split(",")):
        if not name:
            raise SettingError(f"--engine {text!r}: an empty engine name")
        try:
            check_engine(name)
        except SettingError as exc:
            raise SettingError(f"--engine: {exc}") from None
        if name not in names:
            names.append(name)
    return tuple(names)


def parse_datagram_sizes(text: str | None) -> tuple[int | None, ...]:
    """The datagram sizes of `--datagram-size` (None: loopback's default). Without it,
    KVSP_MOQT_DATAGRAM_SIZE alone when set (it keeps choosing the size of a default run),
    else 1452, 9000 and loopback. SettingError (one line, exit 2) for an invalid size."""
    from kvsp_moq.moqt.quic.settings import configured_datagram_size

    if text is None:
        configured = configured_datagram_size()
        if configured is not None:
            return (configured,)
        text = DEFAULT_DATAGRAM_SIZES
    sizes: list[int | None] = []
    for word in (w.strip() for w in text.split(",")):
        if word == LOOPBACK:
            size = None
        else:
            try:
                size = int(word)
            except ValueError:
                raise SettingError(f"--datagram-size: {word!r} is neither a number of bytes nor "
                                   f"{LOOPBACK!r}") from None
            if not 1200 <= size <= 65507:
                raise SettingError(f"--datagram-size: {size}: QUIC needs at least 1,200 bytes and "
                                   "UDP carries at most 65,507")
        if size not in sizes:
            sizes.append(size)
    return tuple(sizes)


def _label(size: int | None) -> str:
    return LOOPBACK if size is None else str(size)


def _effective_size(engine: str, size: int | None) -> int:
    """The size an endpoint of `engine` uses: loopback's is capped at what the engine sends."""
    from kvsp_moq.moqt.quic.settings import LOOPBACK_DATAGRAM_SIZE, engine_module

    if size is not None:
        return size
    return min(LOOPBACK_DATAGRAM_SIZE, engine_module(engine).LARGEST_DATAGRAM_SIZE)


def _unsupported(engine: str, size: int | None) -> str | None:
    """Why MOQT over `engine` cannot use this size here, or None."""
    from kvsp_moq.moqt.quic.settings import engine_module

    try:
        engine_module(engine).check_datagram_size(_effective_size(engine, size))
    except SettingError as exc:
        return str(exc)
    return None


def cell_environment(engine: str, size: int | None) -> dict[str, str]:
    """This process's environment with the cell's engine and datagram size, for its children."""
    from kvsp_moq.moqt.quic.settings import DATAGRAM_SIZE_ENV, ENGINE_ENV

    env = {**os.environ, ENGINE_ENV: engine}
    if size is None:
        env.pop(DATAGRAM_SIZE_ENV, None)
    else:
        env[DATAGRAM_SIZE_ENV] = str(size)
    return env


def _measure_argv(reps: int, sizes: tuple[int, ...], *flags: str) -> list[str]:
    return [sys.executable, "-m", "kvsp_moq.bench.moqt", "measure", "--reps", str(reps),
            "--sizes", ",".join(map(str, sizes)), *flags]


def _measure_child(reps: int, sizes: tuple[int, ...], env: dict[str, str], with_http: bool) -> dict[str, Any]:
    """One measurement in a child process with `env` (the client reads its engine from it)."""
    try:
        done = subprocess.run(_measure_argv(reps, sizes, *([] if with_http else ["--no-http"])),
                              capture_output=True, timeout=CELL_TIMEOUT, cwd=str(ROOT), env=env)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the measurement took over {CELL_TIMEOUT}s") from None
    if done.returncode != 0:
        tail = (done.stderr.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the measurement failed (exit {done.returncode}): {tail}")
    return json.loads(done.stdout.decode())


def _in_namespace(reps: int, sizes: tuple[int, ...] = SIZES,
                  env: dict[str, str] | None = None) -> dict[str, Any] | str:
    """The measurement with HTTP and aiomoqt in a private network namespace (aiomoqt binds
    wildcard addresses); the report, or why it could not run."""
    if not (PEER_VENV / "bin" / "moq-interop-relay").exists():
        return f"aiomoqt is not installed ({PEER_VENV}); run interop/install-peer.sh"
    if shutil.which("unshare") is None:
        return "unshare is not available to isolate aiomoqt's wildcard sockets"
    inner = "ip link set lo up && exec " + " ".join(_measure_argv(reps, sizes, "--aiomoqt"))
    try:
        done = subprocess.run(["unshare", "-n", "sh", "-c", inner], capture_output=True, timeout=CELL_TIMEOUT,
                              cwd=str(ROOT), env=env)
    except subprocess.TimeoutExpired:
        return "the run in a private network namespace timed out"
    if done.returncode != 0:
        tail = (done.stderr.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
        return f"could not run in a private network namespace: {tail}"
    return json.loads(done.stdout.decode())


def _baseline(reps: int, sizes: tuple[int, ...], env: dict[str, str]) -> dict[str, Any]:
    """The reference cell with HTTP and, where it can run, aiomoqt's relay in turns."""
    inner = _in_namespace(reps, sizes, env)
    if isinstance(inner, str):
        measured = _measure_child(reps, sizes, env, with_http=True)
        measured["aiomoqt_error"] = inner
        return measured
    return inner


def _bare(engine: str, size: int, octets: int, runs: int = BARE_RUNS) -> dict[str, Any]:
    """The bare engine at the cell's datagram size: the median of `runs` transfers, each
    figure apart (one transfer on shared cores varied by half from run to run)."""
    from kvsp_moq.bench.quic_engine import run_bare

    results = []
    for _ in range(runs):
        try:
            result = run_bare(engine, size, octets, gso=True, timeout=120.0, long_frames=True)
        except Exception as exc:  # one cell's failure is a figure
            return {"error": f"{type(exc).__name__}: {exc}"}
        if "unsupported" in result:
            return {"unsupported": result["unsupported"]}
        results.append(result)
    out: dict[str, Any] = {k: results[0][k] for k in ("bytes", "gso", "long_frames") if k in results[0]}
    for key in ("mb_per_s", "server_cpu_s_per_gb", "client_cpu_s_per_gb"):
        out[key] = round(_median([r[key] for r in results]), 2)
    out["largest_datagram_received"] = max(r["largest_datagram_received"] for r in results)
    out["runs"] = runs
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def _cpu_per_hop(figures: dict[str, Any], size: int, bare: dict[str, Any]) -> dict[str, Any]:
    """The MOQT relay's CPU per GB for one hop against the bare engine's (see MATRIX_NOTE)."""
    cpu = figures.get("moqt_fetch_cold", {}).get("cpu_ms_per_block") or {}
    gigabytes = size / GB
    out: dict[str, Any] = {}
    if "relay" in cpu:
        out["moqt_cpu_s_per_gb_per_hop"] = round(cpu["relay"] / 1000 / gigabytes, 2)
    if all(k in cpu for k in ("holder", "relay", "client")):
        out["path_cpu_s_per_gb_per_hop"] = round(
            (cpu["holder"] + cpu["relay"] + cpu["client"]) / 1000 / gigabytes / 2, 2)
    if "server_cpu_s_per_gb" in bare:
        out["bare_cpu_s_per_gb_per_hop"] = round(bare["server_cpu_s_per_gb"] + bare["client_cpu_s_per_gb"], 2)
    out["cpu_vs_bare"] = _ratio(out.get("moqt_cpu_s_per_gb_per_hop"), out.get("bare_cpu_s_per_gb_per_hop"))
    return out


def _reference(cells: list[tuple[str, int | None]]) -> tuple[str, int | None]:
    """The cell the top-level keys report: the process's default engine and datagram size
    when measured, else the default engine's first cell, else the first."""
    from kvsp_moq.moqt.quic.settings import configured_datagram_size, default_engine

    engine, size = default_engine(), configured_datagram_size()
    if (engine, size) in cells:
        return engine, size
    return next((c for c in cells if c[0] == engine), cells[0])


def _matrix(quick: bool, reps: int, sizes: tuple[int, ...], engines: tuple[str, ...],
            datagram_sizes: tuple[int | None, ...]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Measure every cell: (the reference cell's raw measurement, its key, the matrix)."""
    matrix: dict[str, dict[str, Any]] = {engine: {} for engine in engines}
    cells: list[tuple[str, int | None]] = []
    for engine in engines:
        for size in datagram_sizes:
            why = _unsupported(engine, size)
            matrix[engine][_label(size)] = {"unsupported": why}  # in the order asked for
            if why is None:
                cells.append((engine, size))
    if not cells:
        raise SettingError("no engine can use any of the datagram sizes asked for: "
                           + "; ".join(f"{e}/{k}: {c['unsupported']}" for e, row in matrix.items()
                                       for k, c in row.items()))
    ref_engine, ref_size = _reference(cells)
    baseline = _baseline(reps, sizes, cell_environment(ref_engine, ref_size))
    for engine, size in [(ref_engine, ref_size)] + [c for c in cells if c != (ref_engine, ref_size)]:
        effective = _effective_size(engine, size)
        cell: dict[str, Any] = {"engine": engine, "datagram_size": effective}
        if (engine, size) == (ref_engine, ref_size):
            measured = baseline["ours"]
            cell["reference"] = True
        else:
            try:
                measured = _measure_child(reps, sizes, cell_environment(engine, size), with_http=False)["ours"]
            except (RuntimeError, ValueError) as exc:
                matrix[engine][_label(size)] = {**cell, "error": str(exc)}
                continue
        cell["blocks"] = {label: {k: v for k, v in figures.items() if k not in ("http", "aiomoqt")}
                          for label, figures in measured.items()}
        cell["bare"] = _bare(engine, effective, BARE_BYTES_QUICK if quick else BARE_BYTES)
        cell["cpu"] = {block_label(n): _cpu_per_hop(cell["blocks"][block_label(n)], n, cell["bare"])
                       for n in sizes}
        matrix[engine][_label(size)] = cell
    _matrix_ratios(matrix, baseline["ours"], sizes)
    return baseline, {"engine": ref_engine, "datagram_size": _label(ref_size)}, matrix


def _matrix_ratios(matrix: dict[str, dict[str, Any]], baseline: dict[str, Any], sizes: tuple[int, ...]) -> None:
    """Each measured cell's ratios, per block size, from this run's figures."""
    for engine, row in matrix.items():
        for label, cell in row.items():
            if "blocks" not in cell:
                continue
            ratios = {}
            peer = matrix.get("aioquic", {}).get(label, {}).get("blocks")
            for n in sizes:
                block = block_label(n)
                ours = cell["blocks"][block]
                cold = ours["moqt_fetch_cold"]["mb_per_s"]
                theirs = baseline[block].get("aiomoqt", {}).get("mb_per_s")
                ratios[block] = {
                    "vs_http": _ratio(cold, baseline[block]["http"]["mb_per_s"]),
                    "vs_aiomoqt": _ratio(cold, theirs),
                    "subscribe_vs_aiomoqt": _ratio(ours["moqt_subscribe"]["mb_per_s"], theirs),
                    "vs_aioquic": _ratio(cold, peer[block]["moqt_fetch_cold"]["mb_per_s"]) if peer else None,
                    "vs_bare": _ratio(cold, cell["bare"].get("mb_per_s")),
                }
            cell["ratios"] = ratios


def _summary_rows(matrix: dict[str, dict[str, Any]], size: int) -> list[dict[str, Any]]:
    """One line per cell for the largest block: what the issue asks to compare at a glance."""
    block = block_label(size)
    rows = []
    for engine, row in matrix.items():
        for label, cell in row.items():
            entry: dict[str, Any] = {"cell": f"{engine}/{label}"}
            if "blocks" not in cell:
                entry["skipped"] = cell.get("unsupported") or cell.get("error")
            else:
                cpu, ratios = cell["cpu"][block], cell["ratios"][block]
                entry.update({
                    "datagram_size": cell["datagram_size"],
                    "fetch_cold_mb_s": cell["blocks"][block]["moqt_fetch_cold"]["mb_per_s"],
                    "vs_http": ratios["vs_http"], "vs_aioquic": ratios["vs_aioquic"],
                    "vs_aiomoqt": ratios["vs_aiomoqt"],
                    "bare_mb_s": cell["bare"].get("mb_per_s"),
                    "moqt_cpu_s_per_gb_per_hop": cpu.get("moqt_cpu_s_per_gb_per_hop"),
                    "bare_cpu_s_per_gb_per_hop": cpu.get("bare_cpu_s_per_gb_per_hop"),
                    "cpu_vs_bare": cpu.get("cpu_vs_bare"),
                })
            rows.append(entry)
    return rows


def run(quick: bool = False, engines: str | None = None, datagram_sizes: str | None = None,
        sizes: tuple[int, ...] = SIZES) -> dict[str, Any]:
    """Measure and return the JSON-ready report: the top-level keys as before (the reference
    cell, HTTP, aiomoqt), and "matrix" over `engines` x `datagram_sizes` (comma-separated, as
    `--engine` / `--datagram-size` take them), all from one run so the ratios compare alike."""
    engine_list = parse_engines(engines)
    size_list = parse_datagram_sizes(datagram_sizes)
    sizes = tuple(sizes)
    reps = 2 if quick else 5
    started = time.monotonic()
    report: dict[str, Any] = {
        "layers": LAYERS, "repeats": reps, "cpus": os.cpu_count(), "cpu_parallelism": cpu_parallelism(),
        "note": "medians; variants run in turns; MOQT and HTTP layers verified against their digests; "
                "three processes (holder, relay, client) for MOQT, two (holder, client) for HTTP; "
                "top-level figures: the reference cell of the matrix",
    }
    measured, reference, matrix = _matrix(quick, reps, sizes, engine_list, size_list)
    ours = measured["ours"]
    report["reference"] = reference
    report["ours"] = {label: {k: v for k, v in figures.items() if k != "aiomoqt"} for label, figures in ours.items()}
    if "aiomoqt_error" in measured:
        report["aiomoqt_relay"] = {"error": measured["aiomoqt_error"]}
    else:
        report["aiomoqt_relay"] = {label: figures["aiomoqt"] for label, figures in ours.items()}
    ratios: dict[str, Any] = {}
    for label, figures in ours.items():
        entry: dict[str, Any] = {
            "ours_vs_http": round(figures["moqt_fetch_cold"]["mb_per_s"] / figures["http"]["mb_per_s"], 3),
            "ours_cached_vs_http": round(figures["moqt_fetch_cached"]["mb_per_s"] / figures["http"]["mb_per_s"], 3),
        }
        if "aiomoqt" in figures:
            theirs = figures["aiomoqt"]["mb_per_s"]
            entry["ours_vs_aiomoqt"] = round(figures["moqt_subscribe"]["mb_per_s"] / theirs, 3)
            entry["ours_fetch_vs_aiomoqt"] = round(figures["moqt_fetch_cold"]["mb_per_s"] / theirs, 3)
        ratios[label] = entry
    report["ratios"] = ratios
    report["targets"] = {"ours_vs_aiomoqt": ">= 1.0", "ours_vs_http": ">= 0.5"}
    report["matrix"] = matrix
    report["matrix_summary"] = _summary_rows(matrix, max(sizes))
    report["matrix_note"] = MATRIX_NOTE + (
        f" Quick: {reps} repeats per variant; bare: median of {BARE_RUNS} transfers of "
        f"{BARE_BYTES_QUICK >> 20} MiB." if quick else
        f" Bare: median of {BARE_RUNS} transfers of {BARE_BYTES >> 20} MiB.")
    report["wall_s"] = round(time.monotonic() - started, 1)
    return report


def _sizes_arg(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvsp_moq.bench.moqt")
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("holder", help="(internal) the holder process")
    p.add_argument("--relay", required=True)
    p.add_argument("--cafile", required=True)
    p.add_argument("--seed", required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--sizes", type=_sizes_arg, default=SIZES)
    p.set_defaults(func=holder_main)
    p = sub.add_parser("measure", help="(internal) one measurement, in the current network namespace")
    p.add_argument("--reps", type=int, required=True)
    p.add_argument("--aiomoqt", action="store_true")
    p.add_argument("--no-http", dest="http", action="store_false")
    p.add_argument("--sizes", type=_sizes_arg, default=SIZES)
    p.set_defaults(func=lambda a: print(json.dumps(measure(a.reps, a.aiomoqt, a.http, a.sizes))) or 0)
    p = sub.add_parser("run", help="the whole benchmark")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--engine", metavar="ENGINE[,ENGINE...]")
    p.add_argument("--datagram-size", metavar="SIZE[,SIZE...]")
    p.add_argument("--block-sizes", type=_sizes_arg, default=SIZES, help="block octets, comma-separated")
    p.set_defaults(func=lambda a: print(json.dumps(run(a.quick, a.engine, a.datagram_size, a.block_sizes),
                                                   indent=2)) or 0)
    args = parser.parse_args(argv)
    from kvsp_moq.allocator import tune_allocator

    tune_allocator()
    try:
        return args.func(args)
    except SettingError as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
