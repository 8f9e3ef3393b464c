"""`kvsp bench gateway --overhead-only`: the gateway's own time per request, without vLLM.

The gateway's own time is what it adds before a request reaches an engine: reading and
tokenizing the request, deriving the Block Keys and asking the PC to route (`POST {pc}route`).
`kvsp bench gateway` measures it among vLLM engines; this measures it alone, where the engines
cost nothing: `kvsp index` (IS and PC, a process) with two OpenAI engines registered (§6.3
records), engines that answer at once with a few token ids (threads of the benchmark), and
`kvsp gateway --instance-api openai` (a process) in front. The prompts are `kvsp bench
gateway`'s (system prompts x questions, as token ids), sent one at a time, streamed.

    gateway_ms_per_request   the gateway's `X-KVSP-Gateway-Ms`: p50 (and _p99, _mean), with
                             its two parts' means from its /metrics (tokenize, route)
    route_call               `POST {pc}route` from this process to the same PC with the same
                             bodies, one after the other: through the gateway's client
                             (`kvsp_moq.gateway.pc_client`), through httpx (the path it
                             replaced, the baseline), and a bare round trip (`GET /healthz`)
                             on the gateway's client, what HTTP alone costs
    route_vs_httpx           the route call's p50 over the baseline's (< 1: faster)

Both figures are times on this machine while it does other work: its load average is
reported with them.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, AsyncIterator, Sequence

import httpx

from kvsp_moq.bench.gateway import (
    KVSP,
    OVERHEAD_HEADER,
    Servers,
    _metric,
    _pct,
    _workload,
    requests_of,
)
from kvsp_moq.demo.cluster import free_port

BLOCK = 32
#: Passes over the workload's prompts (the full run); the quick run makes one.
PASSES = 3
FAKE_MODEL = "engine"


def _engine_app() -> Any:
    """An OpenAI engine that answers every completion at once: `max_tokens` token ids, then the
    usage and [DONE], as vLLM streams them."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": FAKE_MODEL, "object": "model"}]})

    async def completions(request: Request) -> Response:
        body = await request.json()
        n = max(1, int(body.get("max_tokens") or 1))
        prompt = len(body.get("prompt") or ())

        async def events() -> AsyncIterator[bytes]:
            for i in range(n):
                choice = {"index": 0, "text": "", "token_ids": [3 + i],
                          "finish_reason": "length" if i == n - 1 else None}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n".encode()
            usage = {"prompt_tokens": prompt, "completion_tokens": n,
                     "prompt_tokens_details": {"cached_tokens": 0}}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models, methods=["GET"]),
                             Route("/v1/completions", completions, methods=["POST"])])


def _register(pc: str, engines: Sequence[str]) -> None:
    """§6.3 status records of the engines, as their connectors report them."""
    from kvsp_moq.protocol.instances import instance_id

    for url in engines:
        record = {"instance": url, "epoch": 1, "state": "active", "ttl_ms": 3_600_000,
                  "running": 0, "queued": 0, "batch_size": 4, "kv_utilization": 0.1,
                  "prefill_tokens_per_s": 2_000.0, "decode_tokens_per_s": 50.0, "links": []}
        httpx.put(f"{pc}instances/{instance_id(url)}/status", json=record, timeout=10,
                  trust_env=False).raise_for_status()


def _stats(values: Sequence[float]) -> dict[str, float]:
    return {"ms_p50": round(statistics.median(values), 3), "ms_p99": round(_pct(values, 0.99), 3),
            "ms_mean": round(statistics.fmean(values), 3)}


async def _through_gateway(gw: str, prompts: Sequence[list[int]], max_tokens: int
                           ) -> list[float]:
    """Each prompt streamed through the gateway, one at a time; its X-KVSP-Gateway-Ms."""
    out = []
    async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
        for tokens in prompts:
            body = {"model": FAKE_MODEL, "prompt": tokens, "max_tokens": max_tokens,
                    "temperature": 0, "stream": True}
            async with client.stream("POST", gw + "v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"gateway: {r.status_code} {(await r.aread())[:300]!r}")
                async for _ in r.aiter_bytes():
                    pass
                out.append(float(r.headers[OVERHEAD_HEADER]))
    return out


async def _route_calls(pc: str, bodies: Sequence[dict[str, Any]]) -> dict[str, list[float]]:
    """The same route bodies through the gateway's client and through httpx, alternately, and
    a bare round trip on the gateway's client after each."""
    from kvsp_moq.gateway.pc_client import PCClient

    lean, old = PCClient(pc, timeout_s=30), PCClient(pc, timeout_s=30, lean=False)
    times: dict[str, list[float]] = {"client": [], "httpx": [], "bare_round_trip": []}
    try:
        for body in bodies[:4]:  # first connections, first-call costs
            await lean.route(body)
            await old.route(body)
        for body in bodies:
            times["client"].append((await lean.route(body))[1])
            times["httpx"].append((await old.route(body))[1])
            t0 = time.perf_counter()
            await lean.call("GET", "healthz")
            times["bare_round_trip"].append((time.perf_counter() - t0) * 1000)
    finally:
        await lean.aclose()
        await old.aclose()
    return times


def _route_bodies(model: Path, prompts: Sequence[list[int]]) -> list[dict[str, Any]]:
    """The route bodies the gateway sends for the prompts (open scope, the model's compat)."""
    from kvsp_moq.gateway.backend import Job, route_body
    from kvsp_moq.gateway.scopes import ScopeChooser
    from kvsp_moq.model_descriptor import model_descriptor
    from kvsp_moq.protocol.compat import CompatDescriptor
    from kvsp_moq.scope_keys import OPEN_SCOPE, OPEN_SCOPE_KEY

    compat = CompatDescriptor.from_dict(model_descriptor(model, dtype="float32",
                                                         block_tokens=BLOCK)).compat_hex
    scope = ScopeChooser({OPEN_SCOPE: OPEN_SCOPE_KEY}).scopes[OPEN_SCOPE]
    return [route_body(Job(tuple(p), 1, {"method": "greedy"}, scope), compat, BLOCK)
            for p in prompts]


def run(*, quick: bool = False) -> dict[str, Any]:
    from agent.tiny import ensure_tiny_model
    from kvsp_moq.web import BackgroundServer

    w = _workload(quick)
    prompts = requests_of(w) * (1 if quick else PASSES)
    cache = Path(os.environ.get("KVSP_BENCH_MODELS") or Path(tempfile.gettempdir()) / "kvsp-bench-models")
    model = ensure_tiny_model(cache / "tiny")
    index, gateway = (f"127.0.0.1:{free_port()}" for _ in range(2))
    pc, gw = f"http://{index}/", f"http://{gateway}/"

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="kvsp-bench-gateway-overhead-") as tmp, \
            BackgroundServer(_engine_app()) as e0, BackgroundServer(_engine_app()) as e1, \
            Servers(Path(tmp)) as servers:
        servers.start("index", KVSP + ["index", "--listen", index, "--block-tokens", str(BLOCK)],
                      pc + "healthz")
        servers.wait()
        _register(pc, [e0.url, e1.url])
        servers.start("gateway", KVSP + ["gateway", "--listen", gateway, "--pc", pc, "--model",
                                         str(model), "--block-tokens", str(BLOCK),
                                         "--served-model-name", FAKE_MODEL,
                                         "--instance-api", "openai"], gw + "healthz")
        servers.wait()
        try:
            asyncio.run(_through_gateway(gw, prompts[:4], w["max_tokens"]))  # first-request costs
            parts = ("requests", "ms_tokenize_sum", "ms_route_sum")
            before = {k: _metric(gw, f"kvsp_gateway_overhead_{k}") for k in parts}
            log(f"bench gateway --overhead-only: {len(prompts)} requests through the gateway")
            overheads = asyncio.run(_through_gateway(gw, prompts, w["max_tokens"]))
        except RuntimeError as e:
            logs = "\n".join(f"--- {name}:\n{path.read_text(errors='replace')[-2000:]}"
                             for name, _, path in servers.procs)
            raise RuntimeError(f"{e}\n{logs}") from None
        after = {k: _metric(gw, f"kvsp_gateway_overhead_{k}") - before[k] for k in parts}
        log("bench gateway --overhead-only: route calls")
        calls = asyncio.run(_route_calls(pc, _route_bodies(model, prompts)))
        load = os.getloadavg()
    n = max(1.0, after["requests"])
    route = {k: _stats(v) for k, v in calls.items()}
    return {
        "workload": {"prompts": len(prompts), "prompt_tokens": w["prefix_tokens"] + w["question_tokens"],
                     "prefixes": w["prefixes"], "block_tokens": BLOCK, "max_tokens": w["max_tokens"],
                     "engines": 2, "concurrency": 1,
                     "engine": "answers at once (no model): the gateway's and the PC's time only",
                     "cpus": os.cpu_count(), "load_average_1m": round(load[0], 2)},
        "gateway_ms_per_request": round(statistics.median(overheads), 3),
        "gateway_ms_p99": round(_pct(overheads, 0.99), 3),
        "gateway_ms_mean": round(statistics.fmean(overheads), 3),
        "gateway_tokenize_ms_mean": round(after["ms_tokenize_sum"] / n, 3),
        "gateway_route_ms_mean": round(after["ms_route_sum"] / n, 3),
        "route_call": route,
        "route_vs_httpx": round(route["client"]["ms_p50"] / route["httpx"]["ms_p50"], 3),
        "route_vs_bare_round_trip": round(route["client"]["ms_p50"]
                                          / route["bare_round_trip"]["ms_p50"], 3),
        "targets": {"gateway_ms_per_request": 5.0},
    }
