"""`kvsp bench vllm`: time to first token in vLLM with 90% of a 2,048-token prompt in KVSP, against
recomputing it, over HTTP and over MOQT (needs vLLM: run it in `.venv-vllm`).

The model is large enough that computing takes visible time (16 layers, hidden 1,024, made
locally like the tiny model, float32). A producer engine computes the cached prefix once and
PUTs its blocks to a holder in its own process, which publishes them over HTTP and, through a
relay in its own process, over MOQT. Then, in engines that only load (kv_role "kv_consumer"),
each run asks for one token of the cached prefix plus a fresh suffix:

    recompute           a fresh prompt of the same length: nothing cached
    pipelined           the prefix loaded over HTTP while the forward pass runs (the connector)
    pipelined_moqt      the same through the relay
    load_then_compute   the prefix loaded over HTTP first, then the forward pass ("pipelined":
                        false); its load time (`load_ms`, from the connector's timeline) and the
                        rest (`compute_ms`) are the two parts that pipelining overlaps

Targets: pipelined / recompute <= 0.5, pipelined / max(load, compute) <= 1.15. Every figure is
the median over the rounds (3 with --quick, 7 without); variants alternate within a round where
the engines allow. Engines run in this process (vLLM's one-process mode), twice:

    shared          (the top-level figures) the model's threads on every core, and the loader's
                    threads (network, hashing, copies), the holder and the relay beside them
    reserved_core   the placement of `vllm serve` on a CPU with a KV connector: the model's
                    threads on every core but the last, which vLLM keeps for the connector; the
                    loader ("cpus": "auto"), holder and relay there

On shared cores the loader's work is taken from the model's, so the overlap shows only where
the two have cores of their own, as in `reserved_core` or on a GPU. `pipelined_cpu_ms` is the
CPU time one pipelined request costs (the engine's process, the holder and the relay) and
`pipelined_over_cpu_floor` the TTFT against that time spread over every core: how close to
what the machine allows the pipelined TTFT is.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

#: Grouped-query attention 4:1, as in `kvsp bench ttft`: 32 KiB of float32 KV per token.
MODEL = {"layers": 16, "hidden": 1024, "heads": 16, "kv_heads": 4, "intermediate": 2048}
BLOCK = 32
PROMPT = 2048
CACHED = 0.9


def _tokens(n: int, seed: int) -> list[int]:
    return [3 + (i * 7919 + seed * 104729) % 4090 for i in range(n)]


def _engine(model: Path, extra: dict[str, Any] | None, kv_role: str = "kv_consumer") -> Any:
    from vllm import LLM

    kw: dict[str, Any] = dict(model=str(model), dtype="float32", enforce_eager=True,
                              block_size=BLOCK, enable_prefix_caching=False, max_model_len=PROMPT + 64,
                              max_num_seqs=2, max_num_batched_tokens=4096, seed=0,
                              distributed_executor_backend="uni")
    if extra is not None:
        kw["disable_hybrid_kv_cache_manager"] = True
        kw["kv_transfer_config"] = {
            "kv_connector": "KVSPConnector", "kv_connector_module_path": "kvsp_moq.integrations.vllm",
            "kv_role": kv_role, "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra}
    return LLM(**kw)


def _ttft(llm: Any, tokens: list[int]) -> tuple[float, int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=tokens)],
                       SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)[0]
    return (time.perf_counter() - started) * 1000, int(out.num_cached_tokens or 0)


def _close(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()


def _worker_stats() -> dict[str, Any]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().stats()


def _load_ms(timeline: list[dict[str, Any]]) -> float:
    start = min(t["load_start"] for t in timeline if t["load_start"] is not None)
    return (max(t["arrived"] for t in timeline) - start) * 1000


def _wait_published(index_url: str, compat: str, scope: str, keys: list[str]) -> None:
    from kvsp_moq.index_client import IndexClient

    async def complete() -> bool:
        async with IndexClient(index_url) as index:
            result = await index.lookup(scope, compat, keys)
            return result.matched == len(keys) and all(
                any(r.is_moqt for r in b.replicas) for b in result.blocks)

    deadline = time.monotonic() + 60
    while not asyncio.run(complete()):
        if time.monotonic() > deadline:
            raise RuntimeError("the holder did not publish the prefix's records")
        time.sleep(0.1)


def run(*, quick: bool = False, layers_per_request: int | None = None,
        load_concurrency: int | None = None) -> dict[str, Any]:
    for name, value in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
                        "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2",
                        "VLLM_NO_USAGE_STATS": "1",
                        # vLLM logs to stdout by default, where the benchmark's JSON goes
                        "VLLM_LOGGING_STREAM": "ext://sys.stderr"}.items():
        os.environ.setdefault(name, value)
    from agent.tiny import ensure_tiny_model
    from index.app import IndexSettings, create_app
    from kvsp_moq.bench.ttft import _start_holder, _start_relay, _stop
    from kvsp_moq.model_descriptor import model_descriptor
    from kvsp_moq.protocol.compat import CompatDescriptor
    from kvsp_moq.protocol.keys import block_keys, scope_id
    from kvsp_moq.scope_keys import OPEN_SCOPE_KEY
    from kvsp_moq.web import BackgroundServer

    rounds = 3 if quick else 7
    cache = Path(os.environ.get("KVSP_BENCH_MODELS") or Path(tempfile.gettempdir()) / "kvsp-bench-models")
    model = ensure_tiny_model(cache / "bench-16x1024", **MODEL)
    compat = CompatDescriptor.from_dict(model_descriptor(model, dtype="float32", block_tokens=BLOCK))
    cached_blocks = int(PROMPT * CACHED) // BLOCK
    prefix = _tokens(cached_blocks * BLOCK, seed=1)
    keys = [k.hex() for k in block_keys(OPEN_SCOPE_KEY, compat.compat_id, prefix, BLOCK)]
    seed = iter(range(100, 10_000))

    def fresh(n: int) -> list[int]:
        return _tokens(n, seed=next(seed))

    with tempfile.TemporaryDirectory() as certs, BackgroundServer(create_app(IndexSettings())) as index:
        relay_proc, relay_url = _start_relay(certs)
        holder_proc, holder_url = _start_holder(index.url, relay_url)
        try:
            base: dict[str, Any] = {"index": index.url, "holder": None, "timeline": True}
            if layers_per_request is not None:
                base["layers_per_request"] = layers_per_request
            if load_concurrency is not None:
                base["load_concurrency"] = load_concurrency
            producer = _engine(model, {**base, "holder": holder_url}, kv_role="kv_producer")
            _ttft(producer, prefix + [5])
            _close(producer)
            _wait_published(index.url, compat.compat_hex, scope_id(OPEN_SCOPE_KEY).hex(), keys)

            others = [holder_proc.pid, relay_proc.pid]
            layouts = {"shared": _measure(model, base, relay_url, prefix, fresh, rounds, "none",
                                          others)}
            with _reserved_core(others) as placement:
                layouts["reserved"] = {**placement,
                                       **_measure(model, base, relay_url, prefix, fresh, rounds,
                                                   "auto", others)}
        finally:
            _stop(holder_proc)
            _stop(relay_proc)

    shared = layouts["shared"]
    return {
        "model": {**MODEL, "dtype": "float32", "block_tokens": BLOCK},
        "prompt_tokens": PROMPT, "cached_tokens": len(prefix), "rounds": rounds,
        **shared,
        "reserved_core": layouts["reserved"],
        "targets": {"pipelined_over_recompute": 0.5, "pipelined_over_max_load_compute": 1.15},
    }


def _measure(model: Path, base: dict[str, Any], relay_url: str, prefix: list[int],
             fresh: Callable[[int], list[int]], rounds: int, cpus: str,
             others: list[int]) -> dict[str, Any]:
    """Every variant in engines of their own; the connector's threads placed by `cpus`. The CPU
    time of each pipelined request (this process, and the `others`: holder and relay) over the
    cores they may use is the TTFT that no overlap can beat."""
    base = {**base, "cpus": cpus}
    results: dict[str, list[float]] = {k: [] for k in (
        "recompute", "pipelined", "load_then_compute", "pipelined_moqt")}
    loads: dict[str, list[float]] = {k: [] for k in ("pipelined", "load_then_compute",
                                                     "pipelined_moqt")}
    hits: dict[str, list[int]] = {k: [] for k in loads}
    cpu: list[float] = []

    def measure(llm: Any, variant: str) -> None:
        cpu_before = _cpu_ms(others)
        suffix = fresh(PROMPT - len(prefix))
        if variant == "recompute":
            ms, _ = _ttft(llm, fresh(PROMPT))
        else:
            before = len(_worker_stats()["timelines"])
            ms, cached = _ttft(llm, prefix + suffix)
            timelines = _worker_stats()["timelines"]
            hits[variant].append(cached)
            if len(timelines) > before:
                loads[variant].append(_load_ms(timelines[-1]))
        results[variant].append(ms)
        if variant == "pipelined":
            cpu.append(_cpu_ms(others) - cpu_before)

    for variant, extra in (("pipelined", {}), ("load_then_compute", {"pipelined": False}),
                           ("pipelined_moqt", {"relay": relay_url})):
        llm = _engine(model, {**base, **extra})
        _ttft(llm, fresh(64))  # warm up the engine's kernels
        for _ in range(rounds):
            if variant == "pipelined":
                measure(llm, "recompute")  # alternating with the variant it is compared with
            measure(llm, variant)
        _close(llm)

    cores = len(os.sched_getaffinity(0) | set().union(*(os.sched_getaffinity(p) for p in others)))
    med = {k: statistics.median(v) for k, v in results.items()}
    load_ms = statistics.median(loads["load_then_compute"]) if loads["load_then_compute"] else 0.0
    compute_ms = med["load_then_compute"] - load_ms
    bound = max(load_ms, compute_ms)
    return {
        "cached_tokens_reported": {k: sorted(set(v)) for k, v in hits.items()},
        "recompute_ms": round(med["recompute"], 1),
        "pipelined_ms": round(med["pipelined"], 1),
        "pipelined_moqt_ms": round(med["pipelined_moqt"], 1),
        "load_then_compute_ms": round(med["load_then_compute"], 1),
        "load_ms": round(load_ms, 1),
        "compute_ms": round(compute_ms, 1),
        "pipelined_load_ms": round(statistics.median(loads["pipelined"]), 1) if loads["pipelined"] else None,
        "pipelined_moqt_load_ms": (round(statistics.median(loads["pipelined_moqt"]), 1)
                                   if loads["pipelined_moqt"] else None),
        "pipelined_over_recompute": round(med["pipelined"] / med["recompute"], 3),
        "pipelined_moqt_over_recompute": round(med["pipelined_moqt"] / med["recompute"], 3),
        "pipelined_over_max_load_compute": round(med["pipelined"] / bound, 3) if bound > 0 else None,
        "pipelined_moqt_over_max_load_compute": (round(med["pipelined_moqt"] / bound, 3)
                                                 if bound > 0 else None),
        "pipelined_cpu_ms": round(statistics.median(cpu), 1),
        "cores": cores,
        "pipelined_over_cpu_floor": round(med["pipelined"] / (statistics.median(cpu) / cores), 3),
    }


def _cpu_ms(pids: list[int]) -> float:
    """CPU time used so far by this process and by `pids`, in milliseconds."""
    total = time.process_time() * 1000
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) * 1000 / tick
    return total


@contextlib.contextmanager
def _reserved_core(others: list[int]) -> Iterator[dict[str, Any]]:
    """The CPU placement of `vllm serve` on this machine, in this process: the model's threads on
    every usable core but the ones vLLM keeps for a KV connector, the connector's threads (its
    "cpus": "auto") and the holder and relay processes (`others`, which stand for machines
    elsewhere) on those. Restored on the way out."""
    import torch

    from kvsp_moq.cpus import place_process, reserved_cpus, usable_cpus

    usable = usable_cpus() & frozenset(os.sched_getaffinity(0))
    kept = reserved_cpus(usable)
    model = usable - kept or usable
    threads = torch.get_num_threads()
    # vLLM's CPU worker replaces torch.set_num_threads once it has bound its threads; this
    # stands in for that binding, so it calls the function underneath.
    set_threads = torch._C.set_num_threads
    set_threads(len(model))
    os.sched_setaffinity(0, model)
    for pid in others:
        place_process(pid, kept)
    try:
        yield {"model_cpus": sorted(model), "connector_cpus": sorted(kept)}
    finally:
        set_threads(threads)
        os.sched_setaffinity(0, usable)
        for pid in others:
            place_process(pid, usable)
