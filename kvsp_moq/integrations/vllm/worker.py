"""The worker's half of the connector: blocks into and out of vLLM's paged KV cache.

Loads are synchronous in vLLM's sense (the request's forward pass runs in the step that loads
its prefix), so `start_load_kv`, which vLLM calls before that forward pass, only starts them,
on this role's loop thread; each attention layer then waits in `wait_for_layer_load` for its
own layer of every loaded block, and layer l+1 keeps arriving while layer l computes.

An asynchronous load (a request vLLM parks in WAITING_FOR_REMOTE_KVS, see `scheduler`) starts
the same way but is waited for by nobody: `finished_loads` (vLLM's get_finished, called every
step, forward pass or not) reports the request once its load has ended, or at once when vLLM
finished the request meanwhile (the load is stopped first: vLLM then frees its blocks), or when
it ran past `load_timeout_s`; its failed blocks are load errors of that same step.

A block counts as loaded only when every one of its layers was written, each verified against
its replica's record. A source that dies, a digest that does not match, a timeout: the block's
paged id goes to `get_block_ids_with_load_errors`, vLLM rolls the request back to its first
such block and recomputes from there ("kv_load_failure_policy": "recompute"). Before the ids
are handed over the load is stopped for good, so nothing is written into blocks that vLLM is
recomputing. Blocks a request computed in a step where its load failed are not saved: they
attended to a prefix with holes.

Loads run on a thread of their own beside the model's, in one interpreter: the model thread
needs the interpreter lock only briefly per kernel, but with Python's default switch interval
(5 ms) it waits that long for it, once per kernel, whenever the load thread is busy parsing and
verifying. So a worker that loads sets the process's switch interval to
`switch_interval_us` (200 µs by default, as `kvsp agent` does; 0 leaves it alone): measured with
`kvsp bench vllm`, a pipelined 90% prefix took 1.08 s with the default and 0.66 s with 200 µs.

On a CPU backend those threads run on the cores vLLM keeps free of the model's OpenMP threads
for a KV connector ("cpus"): `vllm serve` binds its OpenMP threads one per core and leaves the
last core of each NUMA node to a connector, but its binding also ties the worker's main thread,
and every thread started from it, to the model's first core. Left there, the loader would stall
every parallel region of the forward pass while the core kept for it stays idle.

Saves copy each complete prompt block's layer out of the paged cache as the layer is computed
(`save_kv_layer`: one gather per layer), so vLLM may free the blocks as soon as the request
ends; `wait_for_save` makes KVB1 containers of them and hands them to the sink, without
waiting for storage or the Index Service.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from kvsp_moq.cpus import place_thread, usable_cpus
from kvsp_moq.hashing import place_workers
from kvsp_moq.holder.store import BlockId
from kvsp_moq.integrations.vllm.config import ConnectorConfig
from kvsp_moq.integrations.vllm.descriptor import EngineFacts
from kvsp_moq.integrations.vllm.layout import Layout, PagedBlocks, layer_order, layout_for
from kvsp_moq.integrations.vllm.loop import LoopThread
from kvsp_moq.integrations.vllm.metadata import KVSPMetadata, KVSPWorkerMetadata, RequestSpec
from kvsp_moq.integrations.vllm.publish import BlockSink, EmbeddedHolder, make_sink
from kvsp_moq.integrations.vllm.transport import BlockTransport, Load
from kvsp_moq.protocol.container import encode

log = logging.getLogger("kvsp.vllm.worker")

__all__ = ["WorkerSide"]

#: How long, after the forward pass, a load may take to wind down before it is stopped.
FINISH_S = 1.0
#: How long shutting down waits for blocks still being stored.
DRAIN_S = 10.0


@dataclass(eq=False)
class _Step:
    """The loads and saves of the metadata bound for one engine step."""

    meta: KVSPMetadata
    loads: dict[str, Load] = field(default_factory=dict)  # req_id -> its load
    started: bool = False
    finished: bool = False
    #: req_id -> paged block ids that could not be loaded
    failed: dict[str, set[int]] = field(default_factory=dict)
    #: (req_id, slot) -> per layer (K, V) octets of a block being saved
    staged: dict[tuple[str, int], list[Any]] = field(default_factory=dict)
    #: (req_id, slot) -> the block's live counterpart (published layer by layer), when any
    live: dict[tuple[str, int], Any] = field(default_factory=dict)
    live_opened: bool = False


@dataclass(eq=False)
class _AsyncLoad:
    """A load no forward pass waits for; reported in get_finished once ended."""

    spec: RequestSpec
    load: Load
    started: float = field(default_factory=time.monotonic)


class WorkerSide:
    """Loads, saves and their counters for one worker; all state here, none global."""

    def __init__(self, config: ConnectorConfig, facts: EngineFacts, *, load: bool = True,
                 save: bool = True) -> None:
        self.config = config
        self.facts = facts
        self.load_enabled = load
        if load and config.switch_interval_us:
            sys.setswitchinterval(config.switch_interval_us / 1e6)
            log.info("interpreter switch interval set to %d µs for loads beside the model",
                     config.switch_interval_us)
        self.loop = LoopThread("kvsp-vllm-worker")
        #: link measurements since the last step, for the scheduler's status (loop thread adds)
        self._transfers: list[tuple[str, int, float]] = []
        self._rtts: list[tuple[str, float]] = []
        self.transport = BlockTransport(config, self.loop, on_transfer=self._transferred,
                                        on_rtt=self._round_trip) if load else None
        self.sink: BlockSink | None = make_sink(config, self.loop) if save else None
        self.layout: Layout | None = None
        self._layers: list[torch.Tensor] = []
        self._index: dict[str, int] = {}
        self._step: _Step | None = None
        #: req_id -> its asynchronous load, until reported finished
        self._async: dict[str, _AsyncLoad] = {}
        self._errors: set[int] = set()
        self._lock = threading.Lock()  # the counters: sinks report from other threads
        self.stats: dict[str, Any] = {"loads": 0, "loaded_blocks": 0, "loaded_by": {},
                                      "load_errors": 0, "load_failures": [], "saved_blocks": 0,
                                      "save_held": 0, "save_failures": 0, "saves_dropped": 0,
                                      "live_blocks": 0, "live_aborted": 0,
                                      "async_loads": 0, "async_finished": 0}
        #: per load, when timelines are kept (config "timeline")
        self.timelines: deque[list[dict[str, Any]]] = deque(maxlen=64)

    @property
    def holder_url(self) -> str | None:
        return self.sink.url if self.sink is not None else None

    # ---------------------------------------------------------------- caches

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's register_kv_caches: the per-layer paged tensors, and their layout."""
        order = layer_order(list(kv_caches))
        if len(order) != self.facts.layers:
            log.warning("%d KV cache layers registered, the model has %d", len(order),
                        self.facts.layers)
        self._index = order
        self._layers = [t for _, t in sorted(((order[n], t) for n, t in kv_caches.items()),
                                             key=lambda p: p[0])]
        self.layout = layout_for(kv_caches, kv_heads=self.facts.kv_heads,
                                 head_dim=self.facts.head_dim, block_size=self.facts.block_size,
                                 cache_dtype=self.facts.cache_dtype)
        log.info("KVSP connector: %d layers, paged layout %s", len(self._layers), self.layout.isa)
        self._place_threads(next(iter(kv_caches.values())).device.type)

    def _place_threads(self, device_type: str) -> None:
        """The loop and hash workers go to the CPUs kept for the connector (see `cpus`)."""
        cpus = self.config.loader_cpus(device_type)
        if cpus is None:
            return
        moved = [place_thread(t, cpus) for t in [self.loop.thread, *place_workers(cpus)]]
        self.stats["cpus"] = sorted(cpus)
        log.info("KVSP connector threads on CPUs %s (%d of %d moved)", sorted(cpus), sum(moved),
                 len(moved))

    # ---------------------------------------------------------------- steps

    def bind(self, meta: Any) -> None:
        """A new step's metadata; the previous step is over (its loads finished)."""
        if self._step is not None:
            self._finish(self._step)
        self._step = _Step(meta) if isinstance(meta, KVSPMetadata) else None

    def start_loads(self) -> None:
        """vLLM's start_load_kv: start every load of this step (once)."""
        step = self._step
        if step is None or step.started:
            return
        step.started = True
        if self.transport is None or self.layout is None or not step.meta.has_loads:
            return
        for spec in step.meta.requests:
            if not spec.loads:
                continue
            target = PagedBlocks(self.layout, self._layers, [s.block_id for s in spec.loads],
                                 [s.block_key for s in spec.loads])
            load = self.transport.start(target, [s.records for s in spec.loads])
            self.stats["loads"] += 1
            if spec.async_load:
                self._async[spec.req_id] = _AsyncLoad(spec, load)
                self.stats["async_loads"] += 1
            else:
                step.loads[spec.req_id] = load
        if not self.config.pipelined:
            for load in step.loads.values():
                load.wait_all(self.config.load_timeout_s)

    def wait_layer(self, layer_name: str) -> None:
        """vLLM's wait_for_layer_load: until this layer of every block of the step is in."""
        step = self._step
        if step is None:
            return
        if not step.started:  # vLLM starts loads before the forward pass; never rely on it
            self.start_loads()
        if not step.loads:
            return
        layer = self._index.get(layer_name)
        if layer is None:
            return
        for load in step.loads.values():
            load.wait_layer(layer)  # a failure shows when the load is finished

    def save_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        """vLLM's save_kv_layer: copy this layer of every block completed in this step."""
        step = self._step
        if step is None or self.sink is None or not step.meta.has_saves or self.layout is None:
            return
        layer = self._index.get(layer_name)
        if layer is None:
            return
        live = self._live_sink()
        if live is not None and not step.live_opened:
            self._open_live(step, live)
        for spec in step.meta.requests:
            if not spec.saves:
                continue
            sections = self.layout.extract(kv_layer, [s.block_id for s in spec.saves])
            for slot, kv in enumerate(sections):
                staged = step.staged.setdefault((spec.req_id, slot), [None] * len(self._layers))
                staged[layer] = kv
                block = step.live.get((spec.req_id, slot))
                if live is not None and block is not None:
                    live.add_live_layer(block, layer, kv[0], kv[1])

    def _live_sink(self) -> EmbeddedHolder | None:
        """The embedded holder, when it publishes blocks live (config "live_kv", a relay)."""
        sink = self.sink
        if self.config.live_kv and isinstance(sink, EmbeddedHolder) and sink.live_capable:
            return sink
        return None

    def _open_live(self, step: _Step, sink: EmbeddedHolder) -> None:
        """Before the step's first layer is saved: a live block for each block it completes,
        so that subscribers get layer l while vLLM computes layer l+1 (live KV)."""
        step.live_opened = True
        wanted = [(spec.req_id, slot, BlockId(step.meta.compat_id, spec.scope_id, save.block_key))
                  for spec in step.meta.requests for slot, save in enumerate(spec.saves)]
        if not wanted:
            return
        try:
            opened = sink.open_live([(bid, len(self._layers), self.facts.block_size)
                                     for _, _, bid in wanted])
        except Exception as e:  # the blocks are then stored whole, as without live KV
            log.info("live blocks not opened: %s", getattr(e, "detail", e))
            return
        for (req_id, slot, _), block in zip(wanted, opened):
            if block is not None:
                step.live[(req_id, slot)] = block

    def wait_for_save(self) -> None:
        """vLLM's wait_for_save: the step's saves become containers, handed to the sink."""
        step = self._step
        if step is None:
            return
        self._finish(step)
        if self.sink is None or not step.staged:
            return
        for spec in step.meta.requests:
            if not spec.saves:
                continue
            spoiled = bool(step.failed.get(spec.req_id))
            for slot, save in enumerate(spec.saves):
                layers = step.staged.pop((spec.req_id, slot), None)
                live = step.live.pop((spec.req_id, slot), None)
                whole = not spoiled and layers is not None and all(kv is not None for kv in layers)
                if not whole or layers is None:
                    with self._lock:
                        self.stats["saves_dropped"] += 1
                    if live is not None:
                        self._abort_live(live, "its prefix could not be loaded" if spoiled
                                         else "not every layer was saved")
                    continue
                if live is not None and isinstance(self.sink, EmbeddedHolder):
                    # Produced live: stored from the layers subscribers got.
                    with self._lock:
                        self.stats["live_blocks"] += 1
                    self.sink.finish_live(live, self._saved)
                    continue
                container = encode(0, self.facts.block_size, layers)
                bid = BlockId(step.meta.compat_id, spec.scope_id, save.block_key)
                self.sink.put(bid, container, self._saved)
        for live in step.live.values():
            self._abort_live(live, "the step did not save it")
        step.live.clear()
        step.staged.clear()

    def _abort_live(self, live: Any, reason: str) -> None:
        with self._lock:
            self.stats["live_aborted"] += 1
        if isinstance(self.sink, EmbeddedHolder):
            self.sink.abort_live(live, reason)

    def _saved(self, outcome: str) -> None:
        with self._lock:
            key = {"stored": "saved_blocks", "held": "save_held"}.get(outcome, "save_failures")
            self.stats[key] += 1

    def finished_loads(self, finished_req_ids: set[str]) -> set[str] | None:
        """vLLM's get_finished, receiving half: the requests whose asynchronous load ended in
        this step, each reported once; `finished_req_ids` (requests vLLM ended) are stopped
        and reported at once, so that vLLM may free their blocks."""
        if not self._async:
            return None
        done: set[str] = set()
        now = time.monotonic()
        for req_id, pending in list(self._async.items()):
            ended = pending.load.future.done() or req_id in finished_req_ids
            if not ended and now - pending.started < self.config.load_timeout_s:
                continue
            del self._async[req_id]
            self._account(req_id, pending.spec, pending.load.finish(0))
            done.add(req_id)
        with self._lock:
            self.stats["async_finished"] += len(done)
        return done or None

    def _transferred(self, holder: str, octets: int, seconds: float) -> None:
        with self._lock:
            if len(self._transfers) < 1024:  # per step; the status needs a rate, not each one
                self._transfers.append((holder, octets, seconds))

    def _round_trip(self, holder: str, seconds: float) -> None:
        with self._lock:
            if len(self._rtts) < 1024:
                self._rtts.append((holder, seconds))

    def link_meta(self) -> KVSPWorkerMetadata | None:
        """vLLM's build_connector_worker_meta: the links seen since the last step, to the
        scheduler (whose status reports them; the workers are where loads run)."""
        with self._lock:
            if not self._transfers and not self._rtts:
                return None
            meta = KVSPWorkerMetadata(self._transfers, self._rtts)
            self._transfers, self._rtts = [], []
        return meta

    def load_errors(self) -> set[int]:
        """vLLM's get_block_ids_with_load_errors (the step's loads are finished first)."""
        if self._step is not None:
            self._finish(self._step)
        errors, self._errors = self._errors, set()
        return errors

    def _finish(self, step: _Step) -> None:
        """End the step's loads: each block is loaded whole or reported as a load error."""
        if step.finished:
            return
        step.finished = True
        specs = {spec.req_id: spec for spec in step.meta.requests}
        for req_id, load in step.loads.items():
            bad = self._account(req_id, specs[req_id], load.finish(FINISH_S))
            if bad:
                step.failed[req_id] = bad

    def _account(self, req_id: str, spec: RequestSpec, outcome: Any) -> set[int]:
        """A load's counters and its paged ids not loaded (load errors of this step)."""
        bad = {s.block_id for s, ok in zip(spec.loads, outcome.complete) if not ok}
        good = len(spec.loads) - len(bad)
        if bad:
            self._errors |= bad
            log.warning("request %s: %d of %d blocks not loaded (%s); vLLM recomputes them",
                        req_id, len(bad), len(spec.loads),
                        "; ".join(f["reason"] for f in outcome.failures[:3]) or "timed out")
        with self._lock:
            self.stats["loaded_blocks"] += good
            self.stats["load_errors"] += len(bad)
            for kind, n in outcome.by_kind.items():
                self.stats["loaded_by"][kind] = self.stats["loaded_by"].get(kind, 0) + n
            self.stats["load_failures"].extend(outcome.failures[-8:])
        if outcome.timeline is not None:
            self.timelines.append(outcome.timeline)
        return bad

    def shutdown(self) -> None:
        if "cpus" in self.stats:  # the hash workers serve the whole process: back everywhere
            everywhere = usable_cpus()
            for t in place_workers(everywhere):
                place_thread(t, everywhere)
        if self._step is not None:
            self._finish(self._step)
            self._step = None
        for pending in self._async.values():
            pending.load.finish(0)
        self._async.clear()
        if self.sink is not None:
            self.sink.drain(DRAIN_S)
            self.sink.close()
        if self.transport is not None:
            self.transport.close()
        self.loop.stop()

    def snapshot(self) -> dict[str, Any]:
        """The counters, copied (tests and logs)."""
        with self._lock:
            out = dict(self.stats)
            out["loaded_by"] = dict(out["loaded_by"])
            out["load_failures"] = list(out["load_failures"])
        out["holder"] = self.holder_url
        out["timelines"] = list(self.timelines)
        return out
