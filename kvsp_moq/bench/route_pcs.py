"""`kvsp bench route --pcs N`: route decisions of N PC processes sharing their state in Redis.

A redis-server of its own (on 127.0.0.1, a free port) holds the registry of `bench route`'s 64
instances, written once by this process through `SharedInstanceRegistry`. Then, for each k in
1, 2, ... N, k worker processes each build a PC on that store (the shared registry, read with
one `refresh`; the same in-memory index of replicas, built from the same seed) and route the
same 2,048-key request `routes` times, all starting together; the total is k x routes over the
slowest worker's time. A route reads the process's copy of the registry, never Redis, so the
total grows with the processes until the machine's cores run out (`cores` in the report).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import shutil
import socket
import subprocess
import tempfile
import time
from typing import Any

from kvsp_moq.demo.cluster import free_port
from kvsp_moq.errors import SettingError

__all__ = ["run_pcs"]



class _Redis:
    """A throwaway redis-server for the benchmark (no persistence)."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server") or shutil.which("valkey-server")
        if binary is None:
            raise SettingError("bench route --pcs needs redis-server (or valkey-server) on PATH: "
                               "apt-get install -y redis-server")
        self.dir = tempfile.mkdtemp(prefix="kvsp-bench-redis-")
        self.port = free_port()
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.05)
        self.close()
        raise RuntimeError("redis-server did not start")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def _fill(url: str, seed: int) -> None:
    """The benchmark's 64 instances, reported into the shared registry."""
    from kvsp_moq.bench.route_world import _registry
    from pc.redis_state import RedisState, SharedInstanceRegistry

    local = _registry(seed)
    state = RedisState(url)
    shared = SharedInstanceRegistry(state)
    for status in local.all():
        shared.report(status)
    state.close()


def _worker(url: str, routes: int, start: Any, out: Any) -> None:
    """One PC process: build, wait for the others, route, report (routes, seconds, chosen)."""
    asyncio.run(_route(url, routes, start, out))


async def _route(url: str, routes: int, start: Any, out: Any) -> None:
    from kvsp_moq.bench.route_world import BLOCK_TOKENS, KEYS, _world
    from pc.placement import PlacementSettings, Router, RouteRequest, ScopeKeys
    from pc.redis_state import RedisState, SharedInstanceRegistry

    w = _world()
    state = RedisState(url)
    registry = SharedInstanceRegistry(state, stale_after_s=3600.0)
    registry.refresh()

    async def no_op(instance: str, directive: Any) -> None:
        pass

    router = Router(registry, w["index"].lookup, no_op, PlacementSettings(block_tokens=BLOCK_TOKENS),
                    keys=ScopeKeys({"bench": w["scope_key"]}))
    request = RouteRequest(w["sid"], w["compat"], tuple(w["keys"]), KEYS * BLOCK_TOKENS, BLOCK_TOKENS)
    decision = await router.route(request)  # warm-up
    start.wait(600)
    t = time.perf_counter()
    for _ in range(routes):
        registry.require_fresh()  # what `POST route` checks first
        decision = await router.route(request)
    out.put((routes, time.perf_counter() - t, decision.instance))
    state.close()


def run_pcs(pcs: int, *, quick: bool) -> dict[str, Any]:
    """Totals for 1..pcs processes, and the ratio of the largest to one."""
    from kvsp_moq.bench.route_world import INSTANCES, KEYS

    if pcs < 1:
        raise SettingError("--pcs must be at least 1")
    routes = 40 if quick else 200
    redis = _Redis()
    ctx = multiprocessing.get_context("spawn")
    rows = []
    try:
        _fill(redis.url, seed=7)
        for k in range(1, pcs + 1):
            start, out = ctx.Barrier(k + 1), ctx.Queue()
            procs = [ctx.Process(target=_worker, args=(redis.url, routes, start, out))
                     for _ in range(k)]
            for p in procs:
                p.start()
            start.wait(600)  # every worker has built its PC: all route at once
            results = [out.get(timeout=600) for _ in procs]
            for p in procs:
                p.join(60)
            slowest = max(r[1] for r in results)
            rows.append({"pcs": k, "routes_per_s_total": round(k * routes / slowest, 1),
                         "routes_per_s_each": [round(r[0] / r[1], 1) for r in results],
                         "same_choice": len({r[2] for r in results}) == 1})
    finally:
        redis.close()
    one = rows[0]["routes_per_s_total"]
    return {
        "instances": INSTANCES, "keys_per_prompt": KEYS, "routes_per_process": routes,
        "store": "redis (one server on 127.0.0.1)", "cores": os.cpu_count(),
        "by_pcs": rows,
        "total_ratio_to_one_pc": round(rows[-1]["routes_per_s_total"] / one, 2),
        "note": "each process routes on its copy of the shared registry; Redis is read by "
                "`refresh`, not per route",
    }
