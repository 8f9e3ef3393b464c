"""`kvsp bench http_lookup`: Index Service lookups over HTTP against a bare Starlette endpoint.

Both servers run in their own process under the same uvicorn setup (`kvsp_moq.web`). The index
is filled in its own process (not over HTTP); the bare endpoint decodes the same request JSON
and answers with a prebuilt body of the same size, so the ratio shows what the index itself
costs on top of HTTP. Requests alternate between the two one by one, in one run, from one
httpx client that reads every response in full.
"""

from __future__ import annotations

import gc
import hashlib
import json
import multiprocessing as mp
import os
import random
import statistics
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


def _fill(store: Any, records: int) -> dict[str, Any]:
    """Records like a 32-layer model's 2 MiB blocks split over device and host tiers."""
    from kvsp_moq.protocol.records import ReplicaRecord, Residency

    rng = random.Random(7)
    digests = []
    for _ in range(256):  # distinct digests cost time to make, not to store: reuse a pool
        layer = tuple(rng.randbytes(32).hex() for _ in range(LAYERS))
        whole = hashlib.sha256(b"".join(bytes.fromhex(d) for d in layer)).hexdigest()
        digests.append((layer, "sha-256:" + whole))
    residency = (Residency("device", (0, LAYERS // 2 - 1)),
                 Residency("host", (LAYERS // 2, LAYERS - 1), 400_000))
    gc.collect()
    before = _rss()
    start = time.perf_counter()
    n = 0
    for i in range(keys_for(records)):
        key = block_key(i)
        for r in range(replicas_of(i)):
            if n == records:
                break
            layer, whole = digests[(i + r) & 255]
            record = ReplicaRecord(key, COMPAT, SCOPE, HOLDERS[(i + r) & 7], 1, BLOCK_BYTES,
                                   whole, 600_000, layer, residency)
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


def _summary(latencies: list[float]) -> dict[str, Any]:
    ordered = sorted(latencies)
    return {
        "requests": len(ordered),
        "lookups_per_s": round(len(ordered) / sum(ordered), 1),
        "p50_ms": round(ordered[len(ordered) // 2] * 1e3, 3),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3, 3),
    }


def run_lookup(quick: bool = False, *, records: int | None = None, requests: int | None = None,
               keys_per_lookup: int = LOOKUP_KEYS) -> dict[str, Any]:
    """Lookups of 2,048 keys against 1,000,000 records (100,000 when quick)."""
    records = records or (100_000 if quick else 1_000_000)
    per_server = requests or (150 if quick else 600)
    n_keys = keys_for(records)
    rng = random.Random(3)
    bodies = []
    for _ in range(64):
        keys = [block_key(i) for i in rng.sample(range(n_keys), keys_per_lookup)]
        bodies.append(json.dumps({"scope_id": SCOPE, "compat_id": COMPAT,
                                  "block_keys": keys}).encode())
    headers = {"content-type": "application/json"}
    procs = []
    try:
        proc, index_info = _start(_index_server, records, keys_per_lookup)
        procs.append(proc)
        index_url = f"http://127.0.0.1:{index_info['port']}/lookup"
        with httpx.Client(timeout=60) as client:
            _wait_ready(client, index_url, bodies[0])
            sizes = []
            for body in bodies[:16]:
                r = client.post(index_url, content=body, headers=headers)
                r.raise_for_status()
                doc = r.json()
                if doc["matched"] != keys_per_lookup:
                    raise RuntimeError(f"index matched {doc['matched']} of {keys_per_lookup}")
                sizes.append(len(r.content))
            body_len = round(statistics.mean(sizes))
            proc, bare_info = _start(_bare_server, body_len)
            procs.append(proc)
            bare_url = f"http://127.0.0.1:{bare_info['port']}/lookup"
            _wait_ready(client, bare_url, bodies[0])
            latencies: dict[str, list[float]] = {"index": [], "bare": []}
            urls = {"index": index_url, "bare": bare_url}
            for name in urls:  # warm both
                for body in bodies[:5]:
                    client.post(urls[name], content=body, headers=headers)
            # Alternate request by request, so that drift in the machine's load hits both alike.
            for n in range(per_server):
                body = bodies[n % len(bodies)]
                for name, url in urls.items():
                    t = time.perf_counter()
                    r = client.post(url, content=body, headers=headers)
                    _ = r.content
                    latencies[name].append(time.perf_counter() - t)
                    if r.status_code != 200:
                        raise RuntimeError(f"{name} answered {r.status_code}")
    finally:
        for proc in procs:
            proc.kill()
            proc.join(10)
    index, bare = _summary(latencies["index"]), _summary(latencies["bare"])
    return {
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


def run(*, quick: bool = False) -> dict[str, Any]:
    """Entry point of `kvsp bench http_lookup`."""
    return run_lookup(quick)
