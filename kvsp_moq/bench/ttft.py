"""`kvsp bench ttft`: time to first token with a cached prefix, recomputed, loaded then computed,
and loaded while computing (DESIGN §5), measured in the same run on the same agent.

A model large enough that both loading and computing take visible time (16 layers, hidden
1024; made locally like the tiny model) serves prompts whose leading fraction 0, 0.5 or 0.9 is
cached at a holder running in its own process (so that serving blocks does not share the
agent's interpreter lock). Per fraction:

    recompute          a prompt with nothing cached: the whole prompt is prefilled
    load_then_compute  the cached prefix loaded over HTTP first, then the rest computed
    pipelined          the agent's load path: layer l computes while layer l+1 arrives (HTTP)
    pipelined_moqt     the same, the blocks read over MOQT through a relay (its own process)
    load_ms            loading alone (from the load_then_compute runs)
    compute_ms         computing the uncached rest alone (from the same runs)

and the ratios pipelined / max(load, compute) (target <= 1.15: the overlap hides the shorter
of the two), the same for pipelined_moqt, and pipelined at 0.9 / recompute (target <= 0.4).
The pipelined TTFT also holds what a request costs besides loading and computing (planning:
block keys and the index lookup; sampling; the response), which max(load, compute) does not:
`fixed_ms` is that cost (the load-then-compute TTFT less its load and compute), and
`pipelined_over_fixed_plus_max` compares the pipelined TTFT with fixed_ms + max(load, compute),
the TTFT of a perfect overlap.
The holder publishes every block twice, an HTTP record and a MOQT one (through the relay), so
both variants read the same replicas; the agent's sources are switched between runs: HTTP
alone, or MOQT first with HTTP as the fallback ("sources" says which one served each block).
A figure of one pipelined run's timeline (per layer: when its KV loaded, when it computed; see
`kvsp_moq.bench.figures`) is written as a PNG and its path reported (null without the `plots`
extra).
The variants run in rounds, one of each per round, so that a noisy neighbour slows them alike;
every figure is the median over the rounds, and each run has a fresh uncached suffix.

Environment: KVSP_BENCH_OUT, the directory of the PNGs (default: the temporary directory);
KVSP_BENCH_BLOCK_TOKENS, the block size B (default 16; larger blocks mean fewer, larger HTTP
requests, each of which costs ~2-3 ms of client CPU here whatever its size).

On a CPU-only machine the loader (HTTP client, verification, copies) and the model compete for
the same cores, so overlap hides less than it does when the model runs on an accelerator; the
figures say how much it hides here. Without --quick the whole bench runs again with the loader
on a core of its own, the model on the others (`kvsp agent --loader-cpus auto`; the holder and
relay beside the loader, as they stand for other machines): `reserved_core`, the overlap where
the two do not compete.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

FRACTIONS = (0.0, 0.5, 0.9)
#: Grouped-query attention 4:1, as in Llama 3: 32 KiB of float32 KV per token.
MODEL = {"layers": 16, "hidden": 1024, "heads": 16, "kv_heads": 4, "intermediate": 2048}
B = int(os.environ.get("KVSP_BENCH_BLOCK_TOKENS", "16"))


# --------------------------------------------------------------------------- holder process


def serve_holder(index_url: str, relay_url: str | None = None) -> None:
    """The holder process: prints {"url"} on one line, then serves until terminated; with a
    relay its blocks are published over MOQT too."""
    import uvicorn

    from kvsp_moq.holder.app import create_app
    from kvsp_moq.holder.settings import HolderSettings
    from kvsp_moq.web import bind_tcp, uvicorn_config

    logging.getLogger("kvsp").setLevel(logging.WARNING)
    app = create_app(HolderSettings(index_url=index_url, host_bytes=4 << 30, record_ttl_ms=600_000,
                                    relay=relay_url))
    sock = bind_tcp("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/"
    app.state.publisher.holder_url = url
    print(json.dumps({"url": url}), flush=True)
    uvicorn.Server(uvicorn_config(app)).run(sockets=[sock])


def _start_relay(cert_dir: str) -> tuple[subprocess.Popen, str]:
    """`kvsp relay` in its own process (it forwards every layer; in the agent's process it would
    compete with the model for the interpreter lock); returns it and its moqt:// URL."""
    proc = subprocess.Popen([sys.executable, "-m", "relay.service", "--listen", "127.0.0.1:0",
                             "--cache-bytes", "1G", "--cert-dir", cert_dir],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("relay listening on "):
        proc.kill()
        raise RuntimeError(f"the relay process did not start: {line!r}")
    return proc, line.removeprefix("relay listening on ").strip()


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is None:
        return
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


def _start_holder(index_url: str, relay_url: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "kvsp_moq.bench.ttft", "--serve-holder", index_url,
                             relay_url], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise RuntimeError("the holder process did not start")
    url = json.loads(line)["url"]
    for _ in range(200):
        try:
            if httpx.get(url + "healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the holder process does not answer")


# --------------------------------------------------------------------------- measuring


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def _generate(url: str, tokens: list[int], *, timeline: bool = False) -> dict[str, Any]:
    r = httpx.post(url + "generate", json={"tokens": tokens, "max_new_tokens": 1, "timeline": timeline},
                   timeout=600)
    r.raise_for_status()
    return r.json()


async def _clear(store: Any) -> None:
    for entry in list(store.blocks()):
        await store.discard(entry.id)


def run(*, quick: bool = False, model: dict[str, int] | None = None,
        prompt_tokens: int | None = None, repeats: int | None = None) -> dict[str, Any]:
    """Entry point of `kvsp bench ttft`; `model`, `prompt_tokens` and `repeats` override the
    defaults so that a test can run the whole bench on a small model in seconds.

    Without --quick the bench runs a second time with the agent's loader on a core of its own
    (`kvsp agent --loader-cpus auto`), the holder and relay beside it: `reserved_core`."""
    result = _run(quick=quick, model=model, prompt_tokens=prompt_tokens, repeats=repeats)
    if not quick:
        from kvsp_moq.cpus import reserved_cpus

        loader = reserved_cpus(frozenset(os.sched_getaffinity(0)))
        if os.sched_getaffinity(0) - loader:
            reserved = _run(quick=quick, model=model, prompt_tokens=prompt_tokens,
                            repeats=repeats, loader_cpus=loader)
            result["reserved_core"] = {
                "loader_cpus": sorted(loader), "fractions": reserved["fractions"],
                "timeline": reserved["timeline"], "timeline_png": reserved["timeline_png"]}
    return result


def _run(*, quick: bool, model: dict[str, int] | None, prompt_tokens: int | None,
         repeats: int | None, loader_cpus: frozenset[int] | None = None) -> dict[str, Any]:
    from agent.service import Agent, AgentSettings, tune_interpreter
    from index.app import IndexSettings
    from index.app import create_app as create_index_app
    from kvsp_moq.fetch.moqt import MoqtBlockFetcher
    from kvsp_moq.fetch.sources import MoqtLayerSource
    from kvsp_moq.moqt.certs import client_tls
    from kvsp_moq.web import BackgroundServer

    logging.getLogger("kvsp").setLevel(logging.WARNING)
    tune_interpreter()
    model = dict(model or MODEL)
    n = prompt_tokens or (512 if quick else 2048)
    repeats = repeats or (1 if quick else 3)
    cert_dir = tempfile.TemporaryDirectory(prefix="kvsp-bench-relay-")
    index = BackgroundServer(create_index_app(IndexSettings(max_ttl_ms=3_600_000))).start()
    relay_proc: subprocess.Popen | None = None
    holder_proc: subprocess.Popen | None = None
    agent = None
    fetcher = None
    try:
        relay_proc, relay_url = _start_relay(cert_dir.name)
        holder_proc, holder_url = _start_holder(index.url, relay_url)
        if loader_cpus is not None:  # they stand for other machines: off the model's cores
            from kvsp_moq.cpus import place_process

            place_process(relay_proc.pid, loader_cpus)
            place_process(holder_proc.pid, loader_cpus)
        # MOQT first through the relay, HTTP as the fallback; the sources are switched per run.
        fetcher = MoqtBlockFetcher(tls=client_tls(relay_url))
        moqt_source = MoqtLayerSource(fetcher, relay_url)
        agent = Agent(AgentSettings(listen="127.0.0.1:0", model="tiny", tiny_options=model,
                                    index_url=index.url, block_tokens=B, warmup_tokens=128,
                                    host_bytes=4 << 30, disk_bytes=0, choose_by_cost=False,
                                    layer_sources=[moqt_source],
                                    loader_cpus=loader_cpus)).start()
        ctx = agent.context
        vocab = ctx.adapter.vocab_size
        store = ctx.store
        seed = iter(range(1, 10_000))
        over_moqt = list(ctx.engine.sources)
        over_http = [s for s in over_moqt if s is not moqt_source]

        def fresh(prefix: list[int]) -> list[int]:
            return prefix + _tokens(n - len(prefix), next(seed), vocab)

        def once(tokens: list[int], *, pipelined: bool = True, moqt: bool = False,
                 timeline: bool = False) -> dict[str, Any]:
            ctx.engine.options.pipelined = pipelined
            ctx.engine.sources = over_moqt if moqt else over_http
            try:
                return _generate(agent.url, tokens, timeline=timeline)
            finally:
                agent.call(_clear(store))  # nothing computed here is reused by the next run

        # The prompt whose prefix is cached: computed once, its blocks moved to the holder.
        base = _tokens(n, 0, vocab)
        cached_blocks = int(max(FRACTIONS) * n) // B
        ctx.engine.options.pipelined = True
        _generate(agent.url, base)
        from kvsp_moq.holder.store import BlockId
        from kvsp_moq.protocol.keys import BlockKeyChain, scope_id

        key = ctx.settings.scope_keys[ctx.settings.scope]
        sid = scope_id(key).hex()
        keys = [k.hex() for k in BlockKeyChain(key, bytes.fromhex(ctx.compat_id), B).extend(base)]
        with httpx.Client(timeout=60) as client:
            for k in keys[:cached_blocks]:
                entry = store.get(BlockId(ctx.compat_id, sid, k))
                body = bytes(entry.host.buffer)
                r = client.put(f"{holder_url}blocks/{ctx.compat_id}/{sid}/{k}", content=body,
                               headers={"If-None-Match": "*"})
                r.raise_for_status()
        agent.call(_clear(store))
        # Until both records of every block are in the index: the holder publishes the MOQT
        # one only once the relay has accepted its namespace (its is_published, seen from here).
        for _ in range(600):
            found = agent.call(ctx.index.lookup(sid, ctx.compat_id, keys[:cached_blocks]))
            kinds = [{r.is_moqt for r in b.replicas} for b in found.blocks]
            if found.matched == cached_blocks and len(kinds) == cached_blocks and \
                    all(k == {True, False} for k in kinds):
                break
            time.sleep(0.05)
        else:
            raise RuntimeError("the holder's HTTP and MOQT records never reached the index")

        # Rounds of every variant in turn, so that a noisy neighbour slows all variants alike.
        cached = [f for f in FRACTIONS if f > 0]
        prefixes = {f: base[:int(f * n) // B * B] for f in cached}
        once(fresh(prefixes[max(cached)]))  # warm-up: connections, allocator, caches
        once(fresh(prefixes[max(cached)]), moqt=True)  # and the MOQT session to the relay
        recompute: list[dict[str, Any]] = []
        seq: dict[float, list[dict[str, Any]]] = {f: [] for f in cached}
        pipe: dict[float, list[dict[str, Any]]] = {f: [] for f in cached}
        pipe_moqt: dict[float, list[dict[str, Any]]] = {f: [] for f in cached}
        timeline: list[dict[str, Any]] | None = None
        for _ in range(repeats):
            recompute.append(once(fresh([])))
            for f in cached:
                seq[f].append(once(fresh(prefixes[f]), pipelined=False))
                pipe[f].append(once(fresh(prefixes[f]), timeline=f == max(cached) and timeline is None))
                timeline = timeline or pipe[f][-1].get("timeline")
                pipe_moqt[f].append(once(fresh(prefixes[f]), moqt=True))
        recompute_ms = statistics.median(r["ttft_ms"] for r in recompute)
        rows: list[dict[str, Any]] = [{
            "cached_fraction": 0.0, "cached_tokens": 0, "sources": recompute[0]["sources"],
            "recompute_ms": round(recompute_ms, 1),
            "note": "nothing is cached: every variant is the recompute",
        }]
        for f in cached:
            load_ms = statistics.median(r["timing"].get("load_ms", 0.0) for r in seq[f])
            compute_ms = statistics.median(r["timing"]["forward_ms"] for r in seq[f])
            pipelined_ms = statistics.median(r["ttft_ms"] for r in pipe[f])
            moqt_ms = statistics.median(r["ttft_ms"] for r in pipe_moqt[f])
            # What a request costs besides loading and computing (planning: block keys and the
            # index lookup; sampling; the response), the same in every variant: the TTFT of the
            # load-then-compute runs less their load and compute.
            fixed_ms = statistics.median(
                max(0.0, r["ttft_ms"] - r["timing"].get("load_ms", 0.0) - r["timing"]["forward_ms"])
                for r in seq[f])
            ideal_ms = fixed_ms + max(load_ms, compute_ms)
            rows.append({
                "cached_fraction": f,
                "cached_tokens": pipe[f][0]["cached_tokens"],
                "sources": pipe[f][0]["sources"],
                "recompute_ms": round(recompute_ms, 1),
                "load_then_compute_ms": round(statistics.median(r["ttft_ms"] for r in seq[f]), 1),
                "pipelined_ms": round(pipelined_ms, 1),
                "load_ms": round(load_ms, 1),
                "compute_ms": round(compute_ms, 1),
                "loaded_mb": round(seq[f][0].get("load", {}).get("octets", 0) / 1e6, 1),
                "pipelined_over_max_load_compute": round(pipelined_ms / max(load_ms, compute_ms), 3),
                "pipelined_over_recompute": round(pipelined_ms / recompute_ms, 3),
                "fixed_ms": round(fixed_ms, 1),
                "plan_ms": round(statistics.median(r["timing"].get("plan_ms", 0.0) for r in pipe[f]), 1),
                "pipelined_over_fixed_plus_max": round(pipelined_ms / ideal_ms, 3),
                "pipelined_moqt_over_fixed_plus_max": round(moqt_ms / ideal_ms, 3),
                "pipelined_moqt_ms": round(moqt_ms, 1),
                "pipelined_moqt_sources": pipe_moqt[f][0]["sources"],
                "pipelined_moqt_over_max_load_compute": round(moqt_ms / max(load_ms, compute_ms), 3),
                "all_ms": {"load_then_compute": [r["ttft_ms"] for r in seq[f]],
                           "pipelined": [r["ttft_ms"] for r in pipe[f]],
                           "pipelined_moqt": [r["ttft_ms"] for r in pipe_moqt[f]]},
            })
        png_path = _timeline_png(timeline, reserved=loader_cpus is not None, fraction=max(cached))
        adapter = ctx.adapter
        return {
            "benchmark": "ttft",
            "quick": quick,
            "model": {**model, "kv_dtype": str(adapter.dtype).removeprefix("torch."),
                      "device": str(adapter.device)},
            "prompt_tokens": n,
            "block_tokens": B,
            "repeats": repeats,
            "torch_threads": _torch_threads(),
            "holder": "separate process, HTTP on loopback",
            "relay": "separate process (kvsp relay), MOQT over QUIC on loopback; the holder "
                     "publishes through it",
            "fractions": rows,
            "timeline_png": png_path,
            "timeline": timeline,
            "targets": {"pipelined_over_max_load_compute": "<= 1.15",
                        "pipelined_0.9_over_recompute": "<= 0.4"},
        }
    finally:
        if agent is not None:
            if fetcher is not None:
                try:
                    agent.call(fetcher.aclose())
                except Exception:  # the agent's loop may be gone already
                    pass
            agent.stop()
        _stop(holder_proc)
        _stop(relay_proc)
        index.stop()
        cert_dir.cleanup()


def _timeline_png(timeline: list[dict[str, Any]] | None, *, reserved: bool, fraction: float) -> str | None:
    """The timeline's figure under `figures.out_dir()`: its path, or None without a timeline or
    without matplotlib. The reserved-core run writes a file of its own beside the first."""
    from kvsp_moq.bench import figures

    if not timeline:
        return None
    name = "kvsp-bench-ttft-timeline" + ("-reserved-core" if reserved else "") + ".png"
    title = (f"kvsp bench ttft: one pipelined request, {fraction:.0%} of the prompt cached"
             + (", loader on a core of its own" if reserved else ""))
    return figures.write(figures.out_dir() / name, figures.timeline_figure, timeline, title)


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve-holder"]:
        serve_holder(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
    else:
        print(json.dumps(run(quick="--quick" in sys.argv), indent=2))
