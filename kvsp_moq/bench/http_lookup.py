"""`kvsp bench http_lookup`: Index Service lookups over HTTP against a bare Starlette endpoint.

Both servers run in their own process under the same uvicorn setup (`kvsp_moq.web`). The index
is filled in its own process (not over HTTP); the bare endpoint decodes the same request JSON
and answers with a prebuilt body of the same size, so the ratio shows what the index itself
costs on top of HTTP. Requests alternate between the two one by one, in one run, from one
httpx client that reads every response in full.

When `redis-server` and redis-py are at hand (or `redis=True`), the same records also go into
a Redis started for the run, and an Index Service on the Redis store joins the alternation.
Then two client processes load one and then two IS processes on that Redis at once, beside
the in-memory IS under the same load. `KVSP_BENCH_REDIS=0` leaves Redis out of `kvsp bench`.
"""

from __future__ import annotations

import gc
import hashlib
import json
import multiprocessing as mp
import os
import random
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from typing import Any

import httpx

LOOKUP_KEYS = 2048
COMPAT = "c0" * 32
SCOPE = "5c" * 16
LAYERS = 32
BLOCK_BYTES = 2 << 20
HOLDERS = [f"http://h{i}.bench.invalid:8801/kvsp/" for i in range(8)]


def block_key(i: int) -> str:
    """Key i of the filled index; the client derives the same keys to look up."""
    return hashlib.blake2b(i.to_bytes(8, "big"), digest_size=32).hexdigest()


def replicas_of(i: int) -> int:
    """1 or 2 replicas per key (1.5 on average), as blocks shared by two instances would be."""
    return 1 + (i & 1)


def keys_for(records: int) -> int:
    n, i = 0, 0
    while n < records:
        n += replicas_of(i)
        i += 1
    return i


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _digests() -> list[tuple[tuple[str, ...], str]]:
    """Distinct digests cost time to make, not to store: records reuse a pool of them."""
    rng = random.Random(7)
    digests = []
    for _ in range(256):
        layer = tuple(rng.randbytes(32).hex() for _ in range(LAYERS))
        whole = hashlib.sha256(b"".join(bytes.fromhex(d) for d in layer)).hexdigest()
        digests.append((layer, "sha-256:" + whole))
    return digests


def _records(records: int, digests: list[tuple[tuple[str, ...], str]]) -> Any:
    """(key, ReplicaRecord) of the filled index, record by record."""
    from kvsp_moq.protocol.records import ReplicaRecord, Residency

    residency = (Residency("device", (0, LAYERS // 2 - 1)),
                 Residency("host", (LAYERS // 2, LAYERS - 1), 400_000))
    n = 0
    for i in range(keys_for(records)):
        key = block_key(i)
        for r in range(replicas_of(i)):
            if n == records:
                return
            layer, whole = digests[(i + r) & 255]
            yield key, ReplicaRecord(key, COMPAT, SCOPE, HOLDERS[(i + r) & 7], 1, BLOCK_BYTES,
                                     whole, 600_000, layer, residency)
            n += 1


def _fill(store: Any, records: int) -> dict[str, Any]:
    """Records like a 32-layer model's 2 MiB blocks split over device and host tiers."""
    digests = _digests()
    gc.collect()
    before = _rss()
    start = time.perf_counter()
    n = 0
    for _, record in _records(records, digests):
        store.put_sync(record, 0.0)
        n += 1
    elapsed = time.perf_counter() - start
    gc.collect()
    grown = _rss() - before
    from index.store import record_json

    json_bytes = len(record_json(record))
    return {
        "records": n,
        "keys": keys_for(records),
        "fill_s": round(elapsed, 2),
        "record_json_bytes": json_bytes,
        "rss_bytes_per_record": round(grown / n),
        "index_overhead_bytes_per_record": round(grown / n - json_bytes),
    }


def _in_process(store: Any, n_keys: int, per_lookup: int, rounds: int = 30) -> float:
    """Median ms of store lookup plus making the response's octets, without HTTP."""
    import asyncio

    from index.app import lookup_pieces

    rng = random.Random(11)
    times = []

    async def go() -> None:
        for _ in range(rounds):
            keys = [block_key(i) for i in rng.sample(range(n_keys), per_lookup)]
            t = time.perf_counter()
            hits = await store.lookup(COMPAT, SCOPE, keys, 1.0)
            for _ in lookup_pieces(hits, None)[1]:
                pass
            times.append(time.perf_counter() - t)
        if hasattr(store, "aclose"):  # connections made on this loop
            await store.aclose()

    asyncio.run(go())
    return round(statistics.median(times) * 1e3, 3)


def _serve(app: Any, conn: Any, info: dict[str, Any]) -> None:
    import uvicorn

    from kvsp_moq.web import bind_tcp, uvicorn_config

    sock = bind_tcp("127.0.0.1", 0)
    info["port"] = sock.getsockname()[1]
    conn.send(info)
    conn.close()
    uvicorn.Server(uvicorn_config(app)).run(sockets=[sock])


def _index_server(records: int, per_lookup: int, conn: Any) -> None:
    from index.app import IndexSettings, create_app
    from index.store import MemoryReplicaStore

    store = MemoryReplicaStore()
    info = _fill(store, records)
    info["in_process_lookup_ms"] = _in_process(store, info["keys"], per_lookup)
    # A clock that never reaches the records' expiry, and no sweeper, keep the run steady.
    app = create_app(IndexSettings(store=store, clock=lambda: 1.0, sweep_interval_s=None))
    _serve(app, conn, info)


# ---------------------------------------------------------------------- Redis


def redis_unavailable() -> str | None:
    """Why the Redis part cannot run on this machine, or None when it can."""
    try:
        import redis  # noqa: F401
    except ImportError:
        return "redis-py is not installed (pip install 'kvsp-moq[redis]')"
    if shutil.which("redis-server") is None:
        return "redis-server is not installed (apt-get install redis-server)"
    return None


class _RedisServer:
    """A redis-server for the run: 127.0.0.1, a free port, no persistence, gone afterwards."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvsp-bench-redis-")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir, "--daemonize", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("redis-server did not start")
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def _fill_redis(url: str, records: int) -> dict[str, Any]:
    """The records of `_fill`, put through the store's own PUT script, 1,000 per round trip
    with four round trips in flight; what Redis then holds per record."""
    import asyncio

    from index.redis_store import RedisReplicaStore
    from index.store import record_json
    from kvsp_moq.protocol.records import replica_id

    head = b'{"block_key":"'

    async def go() -> dict[str, Any]:
        store = RedisReplicaStore(url, socket_timeout=120)
        client = store.client()
        before = (await client.info("memory"))["used_memory"]
        tails: dict[tuple[str, str], bytes] = {}  # the JSON after the key, per template
        rids = {h: replica_id(h) for h in HOLDERS}
        pending: set[asyncio.Task] = set()

        async def send(items: list) -> None:
            nonlocal pending
            if len(pending) >= 4:  # four round trips in flight, no more batches held
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()
            pending.add(asyncio.create_task(store.put_prepared(COMPAT, SCOPE, items)))

        start = time.perf_counter()
        items: list = []
        for key, record in _records(records, _digests()):
            if len(items) >= 1000 and items[-1][0] != key:
                # Batches run side by side: a key's replicas stay in one, in their order.
                await send(items)
                items = []
            tail = tails.get((record.digest, record.holder))
            if tail is None:
                tail = tails[record.digest, record.holder] = \
                    record_json(record)[len(head) + 64:]
            items.append((key, rids[record.holder], record.ttl_ms,
                          head + key.encode() + tail))
        if items:
            await send(items)
        for task in pending:
            await task
        elapsed = time.perf_counter() - start
        held = await store.count()
        used = (await client.info("memory"))["used_memory"] - before
        space = store.space(COMPAT, SCOPE)
        one, two = block_key(0), block_key(1)  # one replica, two replicas (replicas_of)
        usage = {
            "record_key": await client.memory_usage(f"{space}r:{one}:{rids[HOLDERS[0]]}"),
            "index_key_one_replica": await client.memory_usage(f"{space}b:{one}"),
            "index_key_two_replicas": await client.memory_usage(f"{space}b:{two}"),
        }
        json_bytes = len(record_json(record))
        await store.aclose()
        return {
            "records": held,
            "fill_s": round(elapsed, 2),
            "record_json_bytes": json_bytes,
            "used_memory_bytes_per_record": round(used / held),
            "overhead_bytes_per_record": round(used / held - json_bytes),
            "memory_usage": usage,
        }

    return asyncio.run(go())


def _redis_stats(url: str, per_lookup: int = 0, *, reset: bool = False) -> float | None:
    """Milliseconds Redis itself spent per lookup since the last reset (its commandstats)."""
    import redis

    with redis.Redis.from_url(url) as client:
        if reset:
            client.config_resetstat()
            return None
        stats = client.info("commandstats").get("cmdstat_sort_ro")
    if not stats or not stats["calls"]:
        return None
    return round(stats["usec"] / 1e3 / (stats["calls"] / per_lookup), 3)


def _redis_index_server(url: str, n_keys: int, per_lookup: int, measure: bool,
                        conn: Any) -> None:
    from index.app import IndexSettings, create_app
    from index.redis_store import RedisReplicaStore

    info: dict[str, Any] = {}
    if measure:
        info["in_process_lookup_ms"] = _in_process(RedisReplicaStore(url), n_keys, per_lookup)
    app = create_app(IndexSettings(store=RedisReplicaStore(url), clock=lambda: 1.0,
                                   sweep_interval_s=None))
    _serve(app, conn, info)


def _load_worker(url: str, bodies: list[bytes], n: int, conn: Any) -> None:
    """One client process of `_under_load`: warm, wait for the start, send `n` lookups."""
    headers = {"content-type": "application/json"}
    with httpx.Client(timeout=120) as client:
        for body in bodies[:3]:
            client.post(url, content=body, headers=headers).raise_for_status()
        conn.send("ready")
        conn.recv()
        latencies = []
        start = time.perf_counter()
        for k in range(n):
            t = time.perf_counter()
            r = client.post(url, content=bodies[k % len(bodies)], headers=headers)
            _ = r.content
            latencies.append(time.perf_counter() - t)
            if r.status_code != 200:
                raise RuntimeError(f"{url} answered {r.status_code}")
        conn.send((latencies, time.perf_counter() - start))


def _under_load(urls: list[str], bodies: list[bytes], n: int) -> dict[str, Any]:
    """One client process per URL, all sending at once: lookups/s together, and latency."""
    ctx = mp.get_context("spawn")
    workers = []
    try:
        for i, url in enumerate(urls):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_load_worker,
                               args=(url, bodies[i::len(urls)], n, child), daemon=True)
            proc.start()
            workers.append((proc, parent))
        for _, conn in workers:
            if not conn.poll(120) or conn.recv() != "ready":
                raise RuntimeError("a load client did not start")
        for _, conn in workers:
            conn.send("go")
        latencies: list[float] = []
        wall = 0.0
        for _, conn in workers:
            if not conn.poll(600):
                raise RuntimeError("a load client did not finish")
            got, seconds = conn.recv()
            latencies += got
            wall = max(wall, seconds)
    finally:
        for proc, _ in workers:
            proc.kill()
            proc.join(10)
    out = _summary(latencies)
    out["lookups_per_s"] = round(len(latencies) / wall, 1)  # all clients together
    out["clients"] = len(urls)
    return out


def _bare_server(body_len: int, conn: Any) -> None:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from kvsp_moq.web import KVSP_JSON

    body = b'{"pad":"' + b"x" * max(0, body_len - 10) + b'"}'

    async def lookup(request: Request) -> Response:
        json.loads(await request.body())
        return Response(body, media_type=KVSP_JSON)

    _serve(Starlette(routes=[Route("/lookup", lookup, methods=["POST"])]), conn, {})


def _start(target: Any, *args: Any) -> tuple[Any, dict[str, Any]]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(*args, child), daemon=True)
    proc.start()
    child.close()
    if not parent.poll(600):
        proc.kill()
        raise RuntimeError("benchmark server did not start")
    return proc, parent.recv()


def _wait_ready(client: httpx.Client, url: str, body: bytes) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            client.post(url, content=body, headers={"content-type": "application/json"})
            return
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _check_same(url: str, got: httpx.Response, want: httpx.Response) -> None:
    """Raise, saying where and how, when `got` is not the octets of the in-memory answer."""
    if got.status_code == want.status_code and got.content == want.content:
        return
    a, b = got.content, want.content
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    raise RuntimeError(
        f"{url} answered otherwise than the in-memory index: status {got.status_code} "
        f"(in-memory {want.status_code}), {len(a)} octets ({len(b)}), first difference at "
        f"{at}: {a[max(0, at - 80):at + 120]!r} against {b[max(0, at - 80):at + 120]!r}")


def _summary(latencies: list[float]) -> dict[str, Any]:
    ordered = sorted(latencies)
    return {
        "requests": len(ordered),
        "lookups_per_s": round(len(ordered) / sum(ordered), 1),
        "p50_ms": round(ordered[len(ordered) // 2] * 1e3, 3),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3, 3),
    }


def run_lookup(quick: bool = False, *, records: int | None = None, requests: int | None = None,
               keys_per_lookup: int = LOOKUP_KEYS, redis: bool | None = None,
               load_requests: int | None = None) -> dict[str, Any]:
    """Lookups of 2,048 keys against 1,000,000 records (100,000 when quick).

    `redis`: also on the Redis store (True: or fail; None: when this machine can, unless
    KVSP_BENCH_REDIS=0). `load_requests`: per client in the runs under load.
    """
    records = records or (100_000 if quick else 1_000_000)
    per_server = requests or (150 if quick else 600)
    per_client = load_requests or (30 if quick else 120)
    skipped = None
    if redis is None:
        skipped = "KVSP_BENCH_REDIS=0" if os.environ.get("KVSP_BENCH_REDIS") == "0" \
            else redis_unavailable()
        redis = skipped is None
    elif redis and redis_unavailable():
        raise RuntimeError(redis_unavailable())
    n_keys = keys_for(records)
    rng = random.Random(3)
    bodies = []
    for _ in range(64):
        keys = [block_key(i) for i in rng.sample(range(n_keys), keys_per_lookup)]
        bodies.append(json.dumps({"scope_id": SCOPE, "compat_id": COMPAT,
                                  "block_keys": keys}).encode())
    headers = {"content-type": "application/json"}
    procs = []
    redis_server = None
    redis_info: dict[str, Any] = {}
    try:
        proc, index_info = _start(_index_server, records, keys_per_lookup)
        procs.append(proc)
        urls = {"index": f"http://127.0.0.1:{index_info['port']}/lookup"}
        if redis:
            # Filled after the in-memory index, so that neither fill nor the in-process figures
            # share the machine with the other.
            redis_server = _RedisServer()
            redis_info = _fill_redis(redis_server.url, records)
            proc, info = _start(_redis_index_server, redis_server.url, n_keys, keys_per_lookup,
                                True)
            procs.append(proc)
            redis_info.update(info)
            proc, second = _start(_redis_index_server, redis_server.url, n_keys,
                                  keys_per_lookup, False)
            procs.append(proc)
            urls["redis"] = f"http://127.0.0.1:{info['port']}/lookup"
            redis_second = f"http://127.0.0.1:{second['port']}/lookup"
        with httpx.Client(timeout=60) as client:
            for url in urls.values():
                _wait_ready(client, url, bodies[0])
            sizes = []
            for body in bodies[:16]:
                r = client.post(urls["index"], content=body, headers=headers)
                r.raise_for_status()
                doc = r.json()
                if doc["matched"] != keys_per_lookup:
                    raise RuntimeError(f"index matched {doc['matched']} of {keys_per_lookup}")
                sizes.append(len(r.content))
                for url in urls.values():  # every store answers the same octets
                    if url != urls["index"]:
                        _check_same(url, client.post(url, content=body, headers=headers), r)
            body_len = round(statistics.mean(sizes))
            proc, bare_info = _start(_bare_server, body_len)
            procs.append(proc)
            urls["bare"] = f"http://127.0.0.1:{bare_info['port']}/lookup"
            _wait_ready(client, urls["bare"], bodies[0])
            latencies: dict[str, list[float]] = {name: [] for name in urls}
            for name in urls:  # warm every server
                for body in bodies[:5]:
                    client.post(urls[name], content=body, headers=headers)
            if redis_server is not None:
                _redis_stats(redis_server.url, reset=True)
            # Alternate request by request, so that drift in the machine's load hits all alike.
            for n in range(per_server):
                body = bodies[n % len(bodies)]
                for name, url in urls.items():
                    t = time.perf_counter()
                    r = client.post(url, content=body, headers=headers)
                    _ = r.content
                    latencies[name].append(time.perf_counter() - t)
                    if r.status_code != 200:
                        raise RuntimeError(f"{name} answered {r.status_code}")
        if redis_server is not None:
            redis_info["redis_ms_per_lookup"] = _redis_stats(redis_server.url, keys_per_lookup)
            redis_info["under_load"] = {
                "memory_one_is": _under_load([urls["index"]] * 2, bodies, per_client),
                "redis_one_is": _under_load([urls["redis"]] * 2, bodies, per_client),
                "redis_two_is": _under_load([urls["redis"], redis_second], bodies, per_client),
            }
    finally:
        for proc in procs:
            proc.kill()
            proc.join(10)
        if redis_server is not None:
            redis_server.close()
    index, bare = _summary(latencies["index"]), _summary(latencies["bare"])
    out = {
        "benchmark": "http_lookup",
        "records": index_info["records"],
        "keys_stored": index_info["keys"],
        "keys_per_lookup": keys_per_lookup,
        "matched_per_lookup": keys_per_lookup,
        "replicas_per_key": 1.5,
        "response_bytes": body_len,
        "index": index,
        "bare_starlette": bare,
        "ratio": round(index["lookups_per_s"] / bare["lookups_per_s"], 3),
        "ratio_of_p50": round(bare["p50_ms"] / index["p50_ms"], 3),
        "in_process_lookup_ms": index_info["in_process_lookup_ms"],
        "memory": {k: index_info[k] for k in ("record_json_bytes", "rss_bytes_per_record",
                                             "index_overhead_bytes_per_record")},
        "fill_s": index_info["fill_s"],
        "targets": {"ratio": ">= 0.7"},
    }
    if redis:
        on_redis = _summary(latencies["redis"])
        load = redis_info.pop("under_load")
        out["redis"] = {
            "index": on_redis,
            "ratio_to_memory": round(on_redis["lookups_per_s"] / index["lookups_per_s"], 3),
            "ratio_to_bare": round(on_redis["lookups_per_s"] / bare["lookups_per_s"], 3),
            "in_process_lookup_ms": redis_info.pop("in_process_lookup_ms"),
            "under_load": load,
            "two_is_over_one": round(load["redis_two_is"]["lookups_per_s"]
                                     / load["redis_one_is"]["lookups_per_s"], 3),
            "parser": _redis_parser(),
            **{k: v for k, v in redis_info.items() if k != "port"},
        }
    else:
        out["redis"] = {"skipped": skipped}
    return out


def _redis_parser() -> str:
    """Which RESP parser redis-py uses here: the C one (hiredis) reads replies much faster."""
    try:
        import hiredis  # noqa: F401
    except ImportError:
        return "python"
    return "hiredis"


def run(*, quick: bool = False) -> dict[str, Any]:
    """Entry point of `kvsp bench http_lookup`."""
    return run_lookup(quick)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100,000 records, fewer requests")
    parser.add_argument("--records", type=int, help="records to fill each store with")
    parser.add_argument("--requests", type=int, help="sequential lookups per server")
    parser.add_argument("--redis", action=argparse.BooleanOptionalAction, default=None,
                        help="include the Redis store (default: when redis-server is found)")
    opts = parser.parse_args()
    print(json.dumps(run_lookup(opts.quick, records=opts.records, requests=opts.requests,
                                redis=opts.redis), indent=2))
