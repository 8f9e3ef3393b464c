"""`kvsp bench live`: live KV over MOQT (DESIGN §9) against computing alone and against loading
finished blocks, measured in the same run with the model of `kvsp bench ttft`.

Four agents run in processes of their own (so that each role's CPU time can be read from
/proc, and no two share an interpreter lock), with one relay (its own process) and the Index
Service (in this process). Every run uses a scope of its own, so nothing computed by an earlier
run is found by a later one, while the prompts, and so the greedy outputs, stay the same.

    pd      one prompt of N tokens, decoded at instance B
            single              the whole request at A alone
            streamed            POST prefill at A, at once a generate at B with "prefill_at": A;
                                B subscribes to A's blocks through the relay while A computes
            load_after_prefill  POST prefill at A, then (once A's complete records are in the
                                index) a generate at B, which loads the stored blocks
            TTFT is counted from the first request sent (the prefill's, where there is one)
    herd    4 instances each receive a request for a new shared prefix of P tokens (and a block
            of their own), about at once (`stagger_ms` apart): with live KV one computes and
            the others subscribe to its blocks ("herd"); the same 4 requests with live KV off,
            each recomputing ("without_live"); one instance alone (the pd single run of the
            same length)

The herd's CPU is counted twice. `prefill_cpu_s` is the prefill's: the same runs (herd, and one
instance alone) with one new token per request, so what each instance spends is its prefill
(computed or received and verified, its own suffix, storing and publishing what it holds) up to
its first token. `request_cpu_s` is the whole requests' of the runs above, each decoding NEW
tokens: the herd's then holds four requests' decode steps against one request's, which no
sharing of the prefix can save.

CPU time is read per process (every thread's schedstat) from just before a run until every
process is quiet again after it, so it holds what the run caused after its answer too (storing
and publishing blocks). The two cores are shared by all processes, so next to the TTFTs stands
the floor the CPU allows: all the CPU the run cost spread over every core (`cpu_floor_ms`).
`producer_egress_copies` is what the computing instance sent over MOQT during the herd, in
copies of the prefix's KV: the relay, not the producer, fans out to the subscribers.

Every variant's greedy outputs are compared (streamed, load_after_prefill and single; the herd
with and without live KV; the herd's first request with single): a difference is an error.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import httpx

from agent.tiny import _DEFAULTS as TINY_DEFAULTS
from kvsp_moq.allocator import tune_allocator
from kvsp_moq.bench.moqt import parse_datagram_sizes
from kvsp_moq.bench.ttft import MODEL as TTFT_MODEL
from kvsp_moq.bench.ttft import _stop
from kvsp_moq.errors import SettingError
from kvsp_moq.frontend import decode_at
from kvsp_moq.moqt.quic.settings import DATAGRAM_SIZE_ENV, LOOPBACK_DATAGRAM_SIZE, configured_datagram_size

#: the model of `kvsp bench ttft` (16 layers, hidden 1,024), with room for 8,192-token prompts
MODEL = {**TTFT_MODEL, "max_positions": 8192 + 256}
B = 16
#: tokens decoded per request: enough for the greedy outputs to differ if the KV did
NEW = 4
HERD = 4
#: scope keys each agent holds; every run takes the next one
SCOPES = 96
TARGETS = {"streamed_vs_single": 1.25, "streamed_vs_load_after_prefill": 0.8,
           "prefill_cpu_vs_one": 1.5, "max_ttft_vs_single": 1.5, "producer_egress_copies": 1.2}


def scope_key(i: int) -> bytes:
    return hashlib.sha256(f"kvsp bench live scope {i}".encode()).digest()


# --------------------------------------------------------------------------- agent processes


def serve_agent(spec: dict[str, Any]) -> None:
    """An agent process: prints {"url", "compat_id", "pid"} on one line, then answers one JSON
    line per command on stdin ({"op": "stats"}: its MOQT publisher's counters; {"op": "live",
    "on": bool}: live KV on or off, as `--no-live-kv` would have it) until stdin closes."""
    from agent.service import Agent, AgentSettings, tune_interpreter

    logging.getLogger("kvsp").setLevel(logging.WARNING)
    # As `kvsp agent` runs (cli.py): the allocator tuned, the GIL handed over sooner.
    tune_allocator()
    tune_interpreter()
    keys = {f"s{i}": scope_key(i) for i in range(SCOPES)}
    agent = Agent(AgentSettings(listen="127.0.0.1:0", model=spec["model"], index_url=spec["index"],
                                relay=spec["relay"], relay_timeout_s=30.0, block_tokens=B,
                                warmup_tokens=128, host_bytes=2 << 30, disk_bytes=0,
                                choose_by_cost=False, scope_keys=keys, scope="s0",
                                layers_per_request=spec.get("layers_per_request"))).start()
    producer = agent.engine.live
    # Threads named for the CPU profile: the event loop (HTTP, MOQT, verifying and storing
    # blocks), the model thread; torch's worker threads keep the process's name.
    name_thread("bench-main")
    agent.call(_named("kvsp-loop"))
    agent.engine.model_thread.submit(name_thread, "kvsp-model").result(60)
    print(json.dumps({"url": agent.url, "compat_id": agent.context.compat_id}), flush=True)

    async def set_live(on: bool) -> None:
        agent.engine.live = producer if on else None

    try:
        for line in sys.stdin:
            op = json.loads(line)
            if op["op"] == "stats":
                moqt = agent.context.moqt_publisher
                out: dict[str, Any] = {"bytes_sent": moqt.stats.bytes_sent if moqt else 0,
                                       "subscribes": moqt.stats.subscribes if moqt else 0}
            elif op["op"] == "live":
                agent.call(set_live(bool(op["on"])))
                out = {"live": agent.engine.live is not None}
            else:
                out = {"error": f"unknown op {op['op']!r}"}
            print(json.dumps(out), flush=True)
    finally:
        agent.stop()


def name_thread(name: str) -> None:
    """The calling thread's name in /proc (prctl PR_SET_NAME; Linux only, else nothing)."""
    import ctypes

    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


async def _named(name: str) -> None:
    name_thread(name)


class AgentProcess:
    """`serve_agent` in a child process, and the commands it answers."""

    def __init__(self, spec: dict[str, Any], log_path: Path) -> None:
        env = child_env(spec.get("datagram_size"))
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvsp_moq.bench.live", "--serve-agent",
                                      json.dumps(spec)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env)
        self.log_path = log_path
        self.pid = self.proc.pid
        self.url = ""
        self.compat_id = ""

    def ready(self) -> "AgentProcess":
        """Once it serves (agents start side by side: loading the model takes seconds)."""
        line = self.read()
        self.url = line["url"]
        self.compat_id = line["compat_id"]
        return self

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the agent process ended; its log: {self.log_path}")
        return json.loads(line)

    def ask(self, op: str, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


# --------------------------------------------------------------------------- CPU per role


def _datagram_size(text: str | None) -> int | None:
    """The datagram size the bench's processes use (None: loopback's): `--datagram-size` (one
    size, read as `bench moqt` reads its list), else KVSP_MOQT_DATAGRAM_SIZE as for any
    service; SettingError (one line, exit 2) for a bad one."""
    if text is None:
        return configured_datagram_size()
    sizes = parse_datagram_sizes(text)
    if len(sizes) != 1:
        raise SettingError(f"--datagram-size: bench live runs at one size, not {text!r}")
    return sizes[0]


def child_env(datagram_size: int | None = None) -> dict[str, str]:
    """The environment of the bench's processes: this code first on their path (they run the
    modules this process imported, wherever it was started from), OpenMP threads waiting
    passively as under `kvsp` (cli.py), and the datagram size of the run."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": root + (os.pathsep + path if path else "")}
    env.pop(DATAGRAM_SIZE_ENV, None)
    if datagram_size is not None:
        env[DATAGRAM_SIZE_ENV] = str(datagram_size)
    return env


def start_relay(cert_dir: str, datagram_size: int | None = None) -> tuple[subprocess.Popen, str, str]:
    """`kvsp relay` in its own process with its metrics server: the process, its moqt:// URL
    and its metrics URL."""
    proc = subprocess.Popen([sys.executable, "-m", "relay.service", "--listen", "127.0.0.1:0",
                             "--cache-bytes", "2G", "--cert-dir", cert_dir, "--metrics", "127.0.0.1:0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=child_env(datagram_size))
    assert proc.stdout is not None
    url = metrics = ""
    for _ in range(20):  # the URL, notes, then the metrics line
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("relay listening on "):
            url = line.removeprefix("relay listening on ").strip()
        elif line.startswith("metrics at "):
            metrics = line.removeprefix("metrics at ").strip()
            return proc, url, metrics
    proc.kill()
    raise RuntimeError("the relay process did not start")


#: relay counters reported per herd run
RELAY_COUNTERS = ("subscribes", "upstream_subscribes", "fetches", "upstream_fetches", "cache_hits",
                  "cache_misses", "bytes_received", "bytes_forwarded")


def relay_counters(metrics_url: str) -> dict[str, int]:
    """The relay's counters named in RELAY_COUNTERS, from its Prometheus text."""
    text = httpx.get(metrics_url, timeout=10).text
    out: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        name = name.removeprefix("kvsp_relay_").removesuffix("_total")
        if name in RELAY_COUNTERS:
            out[name] = int(float(value))
    return out


#: thread names of an agent process -> what the profile calls them; any other thread is
#: "other" (in an agent: torch's intra-op threads, which run the model's kernels beside its thread)
THREADS = {"kvsp-model": "model", "kvsp-loop": "event_loop", "bench-main": "main"}


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU time of the threads of `pid` so far, in seconds, by THREADS (schedstat: ns)."""
    out: dict[str, float] = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"/proc/{pid}/task/{task}/comm") as f:
                name = THREADS.get(f.read().strip(), "other")
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
        out[name] = out.get(name, 0.0) + ns / 1e9
    return out


def page_faults(pid: int) -> int:
    """Minor page faults of `pid` so far (every thread's, ended ones included): a fault is a
    new page touched first, which on a virtual machine costs microseconds of kernel time."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[7])  # field 10, minflt, counted after the command's closing ")"
    except (OSError, ValueError, IndexError):
        return 0


def cpu_s(pid: int) -> float:
    """CPU time of every thread of `pid` so far, in seconds."""
    return sum(thread_cpu_s(pid).values())


class Roles:
    """CPU time per named process, between `start` and `stop`; `stop` waits (bounded) until
    every process is quiet, so work a run leaves behind (storing, publishing) is counted."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self._before: dict[str, float] = {}
        self._threads: dict[str, dict[str, float]] = {}
        #: CPU time by thread of each process in the last run (`THREADS`)
        self.last_threads: dict[str, dict[str, float]] = {}
        self._faults: dict[str, int] = {}
        #: minor page faults of each process in the last run
        self.last_faults: dict[str, int] = {}

    def read(self) -> dict[str, float]:
        return {name: cpu_s(pid) for name, pid in self.pids.items()}

    def quiet(self, *, idle_s: float = 0.2, busy_below: float = 0.01, limit_s: float = 15.0) -> None:
        deadline = time.monotonic() + limit_s
        last = self.read()
        while time.monotonic() < deadline:
            time.sleep(idle_s)
            now = self.read()
            if sum(now.values()) - sum(last.values()) < busy_below:
                return
            last = now

    def threads(self) -> dict[str, dict[str, float]]:
        return {name: thread_cpu_s(pid) for name, pid in self.pids.items()}

    def start(self) -> None:
        self.quiet()
        self._threads = self.threads()
        self._before = {name: sum(t.values()) for name, t in self._threads.items()}
        self._faults = {name: page_faults(pid) for name, pid in self.pids.items()}

    def stop(self) -> dict[str, float]:
        self.quiet()
        after = self.threads()
        self.last_threads = {
            name: {k: round(v - self._threads[name].get(k, 0.0), 3) for k, v in t.items()
                   if v - self._threads[name].get(k, 0.0) >= 0.0005}
            for name, t in after.items()}
        self.last_faults = {name: page_faults(pid) - self._faults[name] for name, pid in self.pids.items()}
        return {name: sum(after[name].values()) - self._before[name] for name in self.pids}


# --------------------------------------------------------------------------- requests


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url, json=body, timeout=900)
    if r.status_code >= 300:
        raise RuntimeError(f"POST {url}: {r.status_code} {r.text}")
    return r.json()


def _generate(agent: AgentProcess, tokens: list[int], scope: str, *, new: int = NEW,
              **extra: Any) -> dict[str, Any]:
    return _post(agent.url + "generate", {"tokens": tokens, "max_new_tokens": new, "scope": scope,
                                          **extra})


def _in_threads(calls: Sequence[tuple[float, Callable[[], dict[str, Any]]]]) -> list[dict[str, Any]]:
    """Each call in a thread of its own, started `delay` seconds after the first."""
    out: list[Any] = [None] * len(calls)
    t0 = time.perf_counter()

    def one(i: int, delay: float, call: Callable[[], dict[str, Any]]) -> None:
        time.sleep(max(0.0, t0 + delay - time.perf_counter()))
        try:
            out[i] = call()
        except Exception as e:  # reported below
            out[i] = e

    threads = [threading.Thread(target=one, args=(i, d, c), daemon=True) for i, (d, c) in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    for r in out:
        if isinstance(r, Exception) or r is None:
            raise RuntimeError(f"a request failed: {r!r}")
    return out


def _wait_complete(index_url: str, scope: bytes, compat: str, tokens: list[int]) -> None:
    """Until every loadable block of `tokens` has a complete MOQT record in the index."""
    from kvsp_moq.index_client import IndexClient
    from kvsp_moq.protocol.keys import block_keys, scope_id

    n = (len(tokens) - 1) // B
    keys = [k.hex() for k in block_keys(scope, bytes.fromhex(compat), tokens, B)[:n]]
    sid = scope_id(scope).hex()

    async def poll() -> None:
        async with IndexClient(index_url) as index:
            for _ in range(30_000):
                result = await index.lookup(sid, compat, keys)
                if result.matched == n and all(any(r.is_moqt and not r.live for r in b.replicas)
                                               for b in result.blocks[:n]):
                    return
                await asyncio.sleep(0.005)
            raise RuntimeError("the producer's complete records never reached the index")

    asyncio.run(poll())


# --------------------------------------------------------------------------- the bench


def run(*, quick: bool = False, model: dict[str, Any] | None = None, prompt_tokens: int | None = None,
        rounds: int | None = None, stagger_ms: float = 50.0,
        layers_per_request: int | None = None, datagram_size: str | None = None) -> dict[str, Any]:
    """Entry point of `kvsp bench live`; `model`, `prompt_tokens` and `rounds` override the
    defaults so that a test runs the whole bench on a small model in seconds;
    `layers_per_request` is the agents' setting of that name (default: theirs);
    `datagram_size` (`--datagram-size`: bytes, or "loopback") the QUIC datagram size of every
    process, as a real path's 1,452 B makes a packet's work 40 times loopback's. Without
    --quick the 8,192-token prompts run one round (a round takes minutes on 2 cores)."""
    from agent.tiny import ensure_tiny_model
    from index.app import IndexSettings
    from index.app import create_app as create_index_app
    from kvsp_moq.web import BackgroundServer

    logging.getLogger("kvsp").setLevel(logging.WARNING)
    size = _datagram_size(datagram_size)
    spec_model = dict(model or MODEL)
    sizes = [prompt_tokens] if prompt_tokens else ([2048] if quick else [2048, 8192])
    rounds = rounds or (1 if quick else 3)
    cache = Path(os.environ.get("KVSP_BENCH_MODELS") or Path(tempfile.gettempdir()) / "kvsp-bench-models")
    suffix = "-".join(f"{k}{v}" for k, v in sorted(spec_model.items()))
    model_dir = ensure_tiny_model(cache / f"live-{suffix}", **spec_model)
    work = tempfile.TemporaryDirectory(prefix="kvsp-bench-live-")
    index = BackgroundServer(create_index_app(IndexSettings(max_ttl_ms=3_600_000))).start()
    relay_proc: subprocess.Popen | None = None
    agents: list[AgentProcess] = []
    try:
        relay_proc, relay_url, relay_metrics = start_relay(work.name, size)
        spec = {"model": str(model_dir), "index": index.url, "relay": relay_url,
                "layers_per_request": layers_per_request, "datagram_size": size}
        for i in range(HERD):
            agents.append(AgentProcess(spec, Path(work.name) / f"agent{i}.log"))
        for a in agents:
            a.ready()
        pids = {f"agent{i}": a.pid for i, a in enumerate(agents)}
        pids["relay"] = relay_proc.pid
        bench = Bench(agents, Roles(pids), index.url, {**TINY_DEFAULTS, **spec_model}, stagger_ms,
                      relay_metrics)
        bench.warm_up()
        result: dict[str, Any] = {
            "model": {**spec_model, "dtype": "float32", "block_tokens": B},
            "new_tokens": NEW, "rounds": rounds, "cores": len(os.sched_getaffinity(0)),
            "layers_per_request": layers_per_request,
            "datagram_size": size or f"loopback ({LOOPBACK_DATAGRAM_SIZE})",
        }
        for i, n in enumerate(sizes):
            r = rounds if i == 0 else 1
            figures = {"pd": bench.pd(n, r), "herd": bench.herd(n, r)}
            figures["herd"]["ttft_ms"]["single"] = figures["pd"]["ttft_ms"]["single"]
            figures["herd"]["prefill_cpu_s"]["one_prefill"] = figures["pd"]["single_prefill_cpu_s"]
            figures["herd"]["request_cpu_s"]["one_request"] = figures["pd"]["single_cpu_s"]
            _herd_ratios(figures["herd"])
            if i == 0:
                result.update(figures)
            else:
                result[f"prompt_{n}"] = figures
        result["outputs_identical"] = True  # every comparison above raised otherwise
        result["targets"] = TARGETS
        return result
    finally:
        for a in agents:
            a.stop()
        _stop(relay_proc)
        index.stop()
        work.cleanup()


class OutputsDiffer(RuntimeError):
    """Greedy outputs that should be identical are not: the KV a variant used was wrong."""


def same_outputs(what: str, reference: Any, outputs: list[Any]) -> None:
    """OutputsDiffer unless every one of `outputs` is `reference`."""
    for out in outputs:
        if out != reference:
            raise OutputsDiffer(f"{what}: greedy output {out} differs from {reference}")


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def _herd_ratios(h: dict[str, Any]) -> None:
    cpu, whole, ttft = h["prefill_cpu_s"], h["request_cpu_s"], h["ttft_ms"]
    h["prefill_cpu_vs_one"] = _ratio(cpu["herd"], cpu["one_prefill"])
    h["request_cpu_vs_one"] = _ratio(whole["herd"], whole["one_request"])
    h["without_live_cpu_vs_one"] = _ratio(whole["without_live"], whole["one_request"])
    h["max_ttft_vs_single"] = _ratio(ttft["max_in_herd"], ttft["single"])
    h["max_ttft_without_live_vs_single"] = _ratio(ttft["max_without_live"], ttft["single"])


class Bench:
    """The runs, on agents and a relay already started; each run in a scope of its own."""

    def __init__(self, agents: list[AgentProcess], roles: Roles, index_url: str,
                 model_spec: dict[str, Any], stagger_ms: float, relay_metrics: str) -> None:
        self.agents = agents
        self.relay_metrics = relay_metrics
        self.roles = roles
        self.index_url = index_url
        self.model_spec = model_spec
        self.vocab = int(model_spec["vocab"])
        self.stagger_s = stagger_ms / 1000
        self.compat = agents[0].compat_id
        self._scope = 0

    def scope(self) -> tuple[str, bytes]:
        self._scope += 1
        if self._scope >= SCOPES:
            raise RuntimeError("out of scopes: raise SCOPES")
        return f"s{self._scope}", scope_key(self._scope)

    def block_octets(self) -> int:
        """K and V of one block, float32, every layer."""
        m = self.model_spec
        kv_width = int(m["hidden"]) // int(m["heads"]) * int(m["kv_heads"])
        return 2 * int(m["layers"]) * B * kv_width * 4

    def warm_up(self) -> None:
        """Connections, the relay's sessions and the model's first passes, on a short prompt."""
        prompt = _tokens(8 * B + 3, 7, self.vocab)
        self.streamed(prompt)
        self.herd_once(prompt, [prompt] * HERD)

    # ------------------------------------------------------------------ one run each

    def single(self, prompt: list[int], new: int = NEW) -> dict[str, Any]:
        name, _ = self.scope()
        self.roles.start()
        r = _generate(self.agents[0], prompt, name, new=new)
        cpu = self.roles.stop()
        return {"ttft_ms": r["ttft_ms"], "tokens": r["tokens"], "sources": r["sources"],
                "cpu_s": {"instance": cpu["agent0"], "relay": cpu["relay"]}}

    def streamed(self, prompt: list[int]) -> dict[str, Any]:
        a, b = self.agents[0], self.agents[1]
        name, _ = self.scope()
        before = a.ask("stats")["bytes_sent"]
        self.roles.start()
        t0 = time.perf_counter()
        answer = _post(a.url + "prefill", {"tokens": prompt, "scope": name})
        sent = time.perf_counter()
        r = _generate(b, prompt, name, **decode_at(a.url, answer))
        cpu = self.roles.stop()
        return {"ttft_ms": (sent - t0) * 1000 + r["ttft_ms"], "tokens": r["tokens"],
                "sources": r["sources"], "producer_bytes": a.ask("stats")["bytes_sent"] - before,
                "threads": {"producer": self.roles.last_threads["agent0"],
                            "consumer": self.roles.last_threads["agent1"]},
                "cpu_s": {"producer": cpu["agent0"], "consumer": cpu["agent1"], "relay": cpu["relay"]}}

    def load_after_prefill(self, prompt: list[int]) -> dict[str, Any]:
        a, b = self.agents[0], self.agents[1]
        name, key = self.scope()
        self.roles.start()
        t0 = time.perf_counter()
        _post(a.url + "prefill", {"tokens": prompt, "scope": name})
        _wait_complete(self.index_url, key, self.compat, prompt)
        sent = time.perf_counter()
        r = _generate(b, prompt, name)
        cpu = self.roles.stop()
        return {"ttft_ms": (sent - t0) * 1000 + r["ttft_ms"], "prefill_ms": (sent - t0) * 1000,
                "tokens": r["tokens"], "sources": r["sources"],
                "cpu_s": {"producer": cpu["agent0"], "consumer": cpu["agent1"], "relay": cpu["relay"]}}

    def herd_once(self, prefix: list[int], prompts: list[list[int]], new: int = NEW) -> dict[str, Any]:
        name, _ = self.scope()
        stats = [a.ask("stats") for a in self.agents]
        self.roles.start()
        relay_before = relay_counters(self.relay_metrics)
        calls = [(i * self.stagger_s, functools.partial(_generate, a, p, name, new=new))
                 for i, (a, p) in enumerate(zip(self.agents, prompts))]
        out = _in_threads(calls)
        cpu = self.roles.stop()
        relay_after = relay_counters(self.relay_metrics)
        sent = [a.ask("stats")["bytes_sent"] - s["bytes_sent"] for a, s in zip(self.agents, stats)]
        computed = [i for i, r in enumerate(out) if r["sources"].get("recompute", 0) > 1]
        return {"ttft_ms": [r["ttft_ms"] for r in out], "tokens": [r["tokens"] for r in out],
                "sources": [r["sources"] for r in out], "computed_by": computed,
                "cpu_s": {"instances": sum(cpu[f"agent{i}"] for i in range(HERD)), "relay": cpu["relay"]},
                "moqt_bytes_sent": sent,
                "threads": {f"agent{i}": self.roles.last_threads[f"agent{i}"] for i in range(HERD)},
                "page_faults": dict(self.roles.last_faults),
                "relay": {k: relay_after.get(k, 0) - relay_before.get(k, 0) for k in RELAY_COUNTERS}}

    # ------------------------------------------------------------------ the figures

    def pd(self, n: int, rounds: int) -> dict[str, Any]:
        prompt = _tokens(n, n, self.vocab)
        runs: dict[str, list[dict[str, Any]]] = {"single": [], "streamed": [], "load_after_prefill": []}
        prefills: list[dict[str, Any]] = []
        for _ in range(rounds):  # in turn, so that a noisy neighbour slows every variant alike
            runs["single"].append(self.single(prompt))
            runs["streamed"].append(self.streamed(prompt))
            runs["load_after_prefill"].append(self.load_after_prefill(prompt))
            prefills.append(self.single(prompt, new=1))
        reference = runs["single"][0]["tokens"]
        same_outputs("pd single, first token", reference[:1], [r["tokens"] for r in prefills])
        for variant, rs in runs.items():
            same_outputs(f"pd {variant}", reference, [r["tokens"] for r in rs])
        self.reference = (prompt, reference)

        def med(variant: str, f: Callable[[dict[str, Any]], float], digits: int = 1) -> float:
            return round(statistics.median(f(r) for r in runs[variant]), digits)

        ttft = {v: med(v, lambda r: r["ttft_ms"]) for v in runs}
        def role_cpu(variant: str) -> dict[str, float]:
            return {role: round(statistics.median(r["cpu_s"][role] for r in runs[variant]), 3)
                    for role in ("producer", "consumer", "relay")}

        cpu, cpu_lap = role_cpu("streamed"), role_cpu("load_after_prefill")
        single_cpu = med("single", lambda r: r["cpu_s"]["instance"], 3)
        cores = len(os.sched_getaffinity(0))
        floor_ms = round(sum(cpu.values()) / cores * 1000, 1)
        return {
            "prompt_tokens": n, "rounds": rounds,
            "ttft_ms": ttft,
            "streamed_vs_single": _ratio(ttft["streamed"], ttft["single"]),
            "streamed_vs_load_after_prefill": _ratio(ttft["streamed"], ttft["load_after_prefill"]),
            "cpu_s": cpu,
            "load_after_prefill_cpu_s": cpu_lap,
            "single_cpu_s": single_cpu,
            "single_prefill_cpu_s": round(statistics.median(r["cpu_s"]["instance"] for r in prefills), 3),
            "single_relay_cpu_s": med("single", lambda r: r["cpu_s"]["relay"], 3),
            "streamed_cpu_floor_ms": floor_ms,
            "streamed_vs_cpu_floor": _ratio(ttft["streamed"], floor_ms),
            "load_after_prefill_wait_ms": med("load_after_prefill", lambda r: r["prefill_ms"]),
            "streamed_cpu_by_thread_s": runs["streamed"][len(runs["streamed"]) // 2]["threads"],
            "streamed_producer_egress_copies": med(
                "streamed", lambda r: r["producer_bytes"] / ((n - 1) // B * self.block_octets()), 3),
            "sources": {v: rs[0]["sources"] for v, rs in runs.items()},
        }

    def herd(self, n: int, rounds: int) -> dict[str, Any]:
        """Requests of n tokens: the shared prefix (n - B) and a block of each one's own; the
        first request is the pd prompt, whose output is known."""
        prompt, reference = self.reference
        prefix = prompt[:n - B]
        prompts = [prompt] + [prefix + _tokens(B, 1000 * n + i, self.vocab) for i in range(1, HERD)]
        live: list[dict[str, Any]] = []
        alone: list[dict[str, Any]] = []
        prefills: list[dict[str, Any]] = []
        for _ in range(rounds):
            live.append(self.herd_once(prefix, prompts))
            prefills.append(self.herd_once(prefix, prompts, new=1))
            for a in self.agents:
                a.ask("live", on=False)
            try:
                alone.append(self.herd_once(prefix, prompts))
            finally:
                for a in self.agents:
                    a.ask("live", on=True)
        expected = alone[0]["tokens"]
        same_outputs("herd, first request", reference, [expected[0]])
        same_outputs("herd", expected, [r["tokens"] for r in live + alone])
        same_outputs("herd, first tokens", [t[:1] for t in expected],
                     [r["tokens"] for r in prefills])

        def med(rs: list[dict[str, Any]], f: Callable[[dict[str, Any]], float], digits: int = 1) -> float:
            return round(statistics.median(f(r) for r in rs), digits)

        prefix_octets = (len(prefix) // B) * self.block_octets()
        cpu_live = med(live, lambda r: r["cpu_s"]["instances"], 3)
        relay_live = med(live, lambda r: r["cpu_s"]["relay"], 3)
        cores = len(os.sched_getaffinity(0))
        max_live = med(live, lambda r: max(r["ttft_ms"]))
        return {
            "instances": HERD, "prefix_tokens": len(prefix), "prompt_tokens": n, "rounds": rounds,
            "stagger_ms": round(self.stagger_s * 1000, 1),
            "prefill_cpu_s": {"herd": med(prefills, lambda r: r["cpu_s"]["instances"], 3),
                              "one_prefill": None},
            "request_cpu_s": {"herd": cpu_live, "one_request": None,
                              "without_live": med(alone, lambda r: r["cpu_s"]["instances"], 3)},
            "relay_cpu_s": {"herd": relay_live, "without_live": med(alone, lambda r: r["cpu_s"]["relay"], 3)},
            "ttft_ms": {"single": None, "max_in_herd": max_live,
                        "max_without_live": med(alone, lambda r: max(r["ttft_ms"])),
                        "in_herd": live[len(live) // 2]["ttft_ms"]},
            "herd_cpu_floor_ms": round((cpu_live + relay_live) / cores * 1000, 1),
            "producer_egress_copies": med(live, lambda r: max(r["moqt_bytes_sent"]) / prefix_octets, 3),
            "moqt_bytes_sent_by_instance": live[len(live) // 2]["moqt_bytes_sent"],
            "prefix_octets": prefix_octets,
            "relay_counters": live[len(live) // 2]["relay"],
            "cpu_by_thread_s": live[len(live) // 2]["threads"],
            "prefill_cpu_by_thread_s": prefills[len(prefills) // 2]["threads"],
            "page_faults": live[len(live) // 2]["page_faults"],
            "computed_by_prefill": [r["computed_by"] for r in prefills],
            "computed_by": [r["computed_by"] for r in live],
            "computed_by_without_live": [r["computed_by"] for r in alone],
            "sources": live[0]["sources"],
        }


def main(argv: list[str]) -> None:
    if argv[:1] == ["--serve-agent"]:
        serve_agent(json.loads(argv[1]))
        return
    print(json.dumps(run(quick="--quick" in argv), indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
