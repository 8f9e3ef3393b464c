"""The scheduler's half of the connector: which prompt blocks KVSP has, and which to save.

Each new request's prompt is cut into Block Keys of the configured scope (§4.2) and looked up
at the Index Service (§6.2) on this role's own loop thread, started as soon as vLLM sees the
request (`on_new_request`). `matched_tokens` never blocks the scheduler: until the answer is
in it says "ask again" (None), and after `lookup_timeout_ms` it gives up on KVSP for that
request (0). vLLM must compute at least one token, so at most the complete blocks before the
prompt's last token are offered.

Per step (`build_connector_meta`) each request gets the blocks to load into its freshly
allocated paged blocks (synchronous loads, so the worker can pipeline them layer by layer with
the forward pass), and the prompt blocks that become complete in this step, to be saved.

A load of blocks another instance is still computing (prefill and decode apart) is asynchronous
instead ("load_async", default "live"): vLLM parks the request in WAITING_FOR_REMOTE_KVS with
its blocks allocated, the worker loads beside the engine's steps and reports the request in
`get_finished`, and every other request keeps decoding meanwhile; a synchronous load would hold
the whole step until the producer's last layer. Such a load is planned the moment its blocks
are allocated (`after_alloc`), since the request is not scheduled again until it is in. Its
blocks that failed shorten what a retry (after a preemption) may offer, and a request gets at
most `ASYNC_TRIES` asynchronous loads. A
chunked prefill completes blocks over several steps; a load error makes vLLM roll the request
back to its first bad block and recompute, which shows here as fewer computed tokens than the
last step left: blocks from there on are saved again, once recomputed.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from kvsp_moq.errors import KvspError
from kvsp_moq.index_client import IndexClient, LookupResult
from kvsp_moq.integrations.vllm.config import ConnectorConfig
from kvsp_moq.integrations.vllm.loop import LoopThread
from kvsp_moq.integrations.vllm.metadata import (
    KVSPMetadata,
    KVSPWorkerMetadata,
    LoadSpec,
    RequestSpec,
    SaveSpec,
)
from kvsp_moq.integrations.vllm.status import EngineStatus
from kvsp_moq.naming import BlockTrack
from kvsp_moq.protocol import validate as v
from kvsp_moq.protocol.compat import CompatDescriptor
from kvsp_moq.protocol.keys import BlockKeyChain
from kvsp_moq.protocol.keys import scope_id as scope_id_of
from kvsp_moq.protocol.records import LIVE_DIGEST, ReplicaRecord
from kvsp_moq.protocol.urls import base_url

log = logging.getLogger("kvsp.vllm.scheduler")

__all__ = ["ASYNC_TRIES", "SchedulerSide"]

#: asynchronous loads one request may get (a retry follows a preemption or a failed load)
ASYNC_TRIES = 2


@dataclass(eq=False)
class _Request:
    req_id: str
    keys: list[str]
    #: the leading complete blocks before the prompt's last token
    cap: int
    prompt_tokens: int = 0
    asked_at: float = field(default_factory=time.monotonic)
    lookup: "concurrent.futures.Future[LookupResult] | None" = None
    #: Replica Records (JSON text) of each leading block the IS has; None until answered
    found: list[tuple[str, ...]] | None = None
    #: tokens to load at the next allocation (vLLM's num_external_tokens)
    pending: int = 0
    block_ids: list[int] = field(default_factory=list)
    #: tokens computed once the last scheduled step has run; None before the first step
    expected: int | None = None
    saved: set[int] = field(default_factory=set)
    #: the records are of blocks another instance is computing (kvsp_prefill_at)
    live: bool = False
    #: tokens vLLM had computed when it last asked, and whether the load offered then is async
    local: int = 0
    offered_async: bool = False
    #: an asynchronous load planned at allocation, for the next metadata
    async_plan: tuple[LoadSpec, ...] | None = None
    #: paged id -> block index, of the asynchronous load in flight
    async_slots: dict[int, int] = field(default_factory=dict)
    async_tries: int = 0


class SchedulerSide:
    """Lookups and per-step plans; all state per request, none global."""

    def __init__(self, config: ConnectorConfig, descriptor: CompatDescriptor, *,
                 load: bool = True, save: bool = True) -> None:
        self.config = config
        self.block_size = descriptor.block_tokens
        self.compat_id = descriptor.compat_hex
        self._compat = descriptor.compat_id
        self.scope_id = scope_id_of(config.scope_key).hex()
        self.load = load
        self.save = save
        self._reqs: dict[str, _Request] = {}
        self.stats: dict[str, int] = {"lookups": 0, "lookup_failures": 0, "lookup_timeouts": 0,
                                      "hit_requests": 0, "hit_tokens": 0, "load_errors": 0,
                                      "saves_planned": 0, "live_requests": 0,
                                      "async_loads": 0}
        self._loop = LoopThread("kvsp-vllm-scheduler") if load or config.pc else None
        self._index: IndexClient | None = None
        if self._loop is not None and load:
            self._index = self._loop.call(self._make_index())
        #: the engine's status at the PC, with `pc` configured (`integrations.vllm.status`)
        self.status = EngineStatus(config, self._loop) if config.pc and self._loop is not None else None

    async def _make_index(self) -> IndexClient:
        return IndexClient(self.config.index, token=self.config.token, timeout=5.0)

    # ---------------------------------------------------------------- requests

    def _keys(self, tokens: Sequence[int]) -> list[str]:
        chain = BlockKeyChain(self.config.scope_key, self._compat, self.block_size)
        return [k.hex() for k in chain.extend(list(tokens))]

    def _state(self, request: Any) -> _Request | None:
        st = self._reqs.get(request.request_id)
        if st is not None:
            return st
        tokens = request.prompt_token_ids
        if tokens is None:  # prompt embeddings: no tokens, no Block Keys
            return None
        keys = self._keys(tokens)
        st = _Request(request.request_id, keys, cap=min(len(keys), (len(tokens) - 1) // self.block_size),
                      prompt_tokens=len(tokens))
        self._reqs[st.req_id] = st
        producer = self._prefill_at(request)
        if producer is not None and self.load and st.cap > 0:
            st.found = self._live_records(st, *producer)
            st.live = True
            self.stats["live_requests"] += 1
        elif self.load and st.cap > 0 and self._loop is not None and self._index is not None:
            st.lookup = self._loop.submit(self._index.lookup(self.scope_id, self.compat_id, keys[:st.cap]))
            self.stats["lookups"] += 1
        else:
            st.found = []
        return st

    def _prefill_at(self, request: Any) -> tuple[str, int | None] | None:
        """The instance computing this prompt's blocks for this engine (prefill and decode
        apart), from the request's `kv_transfer_params`: {"kvsp_prefill_at": its holder's HTTP
        base URL, "kvsp_prefill_blocks": how many leading blocks it computes (optional)}. None
        without them, or without a relay to subscribe through."""
        params = getattr(request, "kv_transfer_params", None)
        if not isinstance(params, dict) or not params.get("kvsp_prefill_at"):
            return None
        if not self.config.relay:
            log.info("request %s: kvsp_prefill_at ignored (no relay to subscribe through)",
                     request.request_id)
            return None
        try:
            at = v.url(params["kvsp_prefill_at"], "kvsp_prefill_at", schemes=("http", "https"))
            blocks = params.get("kvsp_prefill_blocks")
            count = None if blocks is None else v.integer(blocks, "kvsp_prefill_blocks")
        except KvspError as e:
            log.warning("request %s: %s; loading as usual", request.request_id, e.detail)
            return None
        return base_url(at), count

    def _live_records(self, st: _Request, producer: str, count: int | None) -> list[tuple[str, ...]]:
        """In-production records of the blocks `producer` computes, derived from its URL (no
        lookup): the worker subscribes to their tracks through the relay at once, and the relay
        holds the SUBSCRIBE until the producer publishes them (DESIGN §9)."""
        assert self.config.relay is not None
        n = st.cap if count is None else min(st.cap, count)
        out: list[tuple[str, ...]] = []
        for key in st.keys[:n]:
            track = BlockTrack.for_holder(self.compat_id, self.scope_id, key, producer)
            record = ReplicaRecord(block_key=key, compat_id=self.compat_id, scope_id=self.scope_id,
                                   holder=self.config.relay, codec=1, size=0, digest=LIVE_DIGEST,
                                   ttl_ms=self.config.lease_ms, moqt_namespace=track.moqt_namespace,
                                   http_holder=producer, live=True)
            out.append((json.dumps(record.to_json(), separators=(",", ":")),))
        return out

    def on_new_request(self, request: Any) -> None:
        """Start the lookup now, so it is likely in by the time the request is scheduled."""
        self._state(request)
        if self.status is not None:
            self.status.seen(request.request_id)

    def _answer(self, st: _Request) -> list[tuple[str, ...]] | None:
        """The lookup's blocks, or None while it is still out (and not timed out)."""
        if st.found is not None:
            return st.found
        assert st.lookup is not None
        if not st.lookup.done():
            if (time.monotonic() - st.asked_at) * 1000 < self.config.lookup_timeout_ms:
                return None
            st.lookup.cancel()
            self.stats["lookup_timeouts"] += 1
            log.warning("lookup for %s took over %d ms; computing without KVSP", st.req_id,
                        self.config.lookup_timeout_ms)
            st.found = []
            return st.found
        try:
            result = st.lookup.result()
        except Exception as e:  # the index is advisory: compute instead
            self.stats["lookup_failures"] += 1
            log.warning("lookup for %s failed (%s); computing without KVSP", st.req_id,
                        getattr(e, "detail", None) or repr(e))
            st.found = []
            return st.found
        found: list[tuple[str, ...]] = []
        for i, block in enumerate(result.blocks[:result.matched]):
            if i >= st.cap or block.block_key != st.keys[i] or not block.replicas:
                break
            found.append(tuple(json.dumps(r.to_json(), separators=(",", ":")) for r in block.replicas))
        st.found = found
        return found

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """vLLM's get_num_new_matched_tokens: tokens beyond `num_computed_tokens` that KVSP
        can load (None: ask again), and whether they load asynchronously ("load_async")."""
        st = self._state(request)
        if st is None or st.cap == 0 or num_computed_tokens >= st.cap * self.block_size:
            return 0, False
        found = self._answer(st)
        if found is None:
            return None, False
        tokens = max(0, min(len(found), st.cap) * self.block_size - num_computed_tokens)
        st.local = num_computed_tokens
        st.offered_async = tokens > 0 and self._loads_async(st)
        return tokens, st.offered_async

    def _loads_async(self, st: _Request) -> bool:
        mode = self.config.load_async
        return (mode == "all" or (mode == "live" and st.live)) and st.async_tries < ASYNC_TRIES

    def after_alloc(self, request: Any, num_external_tokens: int, blocks: Any = None) -> None:
        """vLLM's update_state_after_alloc: the next step loads `num_external_tokens`; an
        asynchronous load is planned here, in the blocks just allocated (`blocks`)."""
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        st.pending = num_external_tokens
        if num_external_tokens > 0:
            self.stats["hit_requests"] += 1
            self.stats["hit_tokens"] += num_external_tokens
        if num_external_tokens > 0 and st.offered_async and blocks is not None:
            self._plan_async(st, list(blocks.get_block_ids()[0]), num_external_tokens)
        st.offered_async = False

    def _plan_async(self, st: _Request, block_ids: list[int], tokens: int) -> None:
        b = self.block_size
        found = st.found or []
        first, last = st.local // b, min((st.local + tokens) // b, len(block_ids))
        st.async_plan = tuple(LoadSpec(block_ids[i], st.keys[i], found[i] if i < len(found) else ())
                              for i in range(first, last))
        st.async_slots = {block_ids[i]: i for i in range(first, last)}
        st.async_tries += 1
        st.pending = 0  # loaded before the request is scheduled, not in its first step
        self.stats["async_loads"] += 1

    def finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's request_finished: the blocks can be freed at once, saves copy synchronously."""
        st = self._reqs.pop(request.request_id, None)
        if st is not None and st.lookup is not None and not st.lookup.done():
            st.lookup.cancel()
        if self.status is not None:
            self.status.finished(request.request_id)
        return False, None

    def connector_output(self, output: Any) -> None:
        """vLLM's update_connector_output: counts the blocks workers could not load; an
        asynchronous load's failed blocks are offered no more (a retry stops before them)."""
        invalid = getattr(output, "invalid_block_ids", None) or set()
        if invalid:
            self.stats["load_errors"] += len(invalid)
            for st in self._reqs.values():
                bad = [i for pid, i in st.async_slots.items() if pid in invalid]
                if bad and st.found is not None:
                    st.found = st.found[:min(bad)]
        for req_id in getattr(output, "finished_recving", None) or ():
            if req_id in self._reqs:
                self._reqs[req_id].async_slots = {}
        links = getattr(output, "kv_connector_worker_meta", None)
        if self.status is not None and isinstance(links, KVSPWorkerMetadata):
            self.status.links(links)

    # ---------------------------------------------------------------- steps

    def build(self, scheduler_output: Any) -> KVSPMetadata:
        """vLLM's build_connector_meta: this step's loads and saves, as plain data."""
        meta = KVSPMetadata(compat_id=self.compat_id)
        scheduled = scheduler_output.num_scheduled_tokens
        if self.status is not None:
            self.status.stepped(self._steps(scheduler_output))
        for waiting in self._reqs.values():
            if waiting.async_plan is not None:  # allocated in this pass, not scheduled
                meta.requests.append(RequestSpec(waiting.req_id, self.scope_id,
                                                 waiting.async_plan, async_load=True))
                waiting.async_plan = None
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0]) if new.block_ids else []
            self._step(meta, st, new.num_computed_tokens, scheduled.get(new.req_id, 0), resumed=True)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            resumed = req_id in cached.resumed_req_ids
            if resumed:
                st.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids is not None:
                st.block_ids.extend(new_ids[0])
            self._step(meta, st, cached.num_computed_tokens[i], scheduled.get(req_id, 0),
                       resumed=resumed)
        for req_id in scheduler_output.finished_req_ids:
            self._reqs.pop(req_id, None)
        return meta

    def _steps(self, scheduler_output: Any) -> list[tuple[str, int, int, int | None]]:
        """(request, tokens computed, tokens scheduled, prompt length) of every request of a step."""
        scheduled = scheduler_output.num_scheduled_tokens
        out: list[tuple[str, int, int, int | None]] = []
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            out.append((new.req_id, new.num_computed_tokens, scheduled.get(new.req_id, 0),
                        st.prompt_tokens if st is not None else None))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            out.append((req_id, cached.num_computed_tokens[i], scheduled.get(req_id, 0),
                        st.prompt_tokens if st is not None else None))
        return out

    def _step(self, meta: KVSPMetadata, st: _Request, computed: int, scheduled: int, *,
              resumed: bool) -> None:
        b = self.block_size
        if st.expected is not None and computed < st.expected and not resumed:
            # Rolled back after a load error: what was computed from here is recomputed now.
            st.saved = {i for i in st.saved if i < computed // b}
        loads: list[LoadSpec] = []
        if st.pending and st.found is not None:
            # Every block vLLM counts as loaded gets a spec: one without records fails on the
            # worker and is recomputed, never left holding whatever the slot held before.
            first, last = (computed - st.pending) // b, computed // b
            for i in range(first, min(last, len(st.block_ids))):
                records = st.found[i] if i < len(st.found) else ()
                loads.append(LoadSpec(st.block_ids[i], st.keys[i], records))
            st.pending = 0
        saves: list[SaveSpec] = []
        end = computed + scheduled
        if self.save:
            for i in range(computed // b, min(end // b, len(st.keys), len(st.block_ids))):
                if i not in st.saved:
                    saves.append(SaveSpec(st.block_ids[i], st.keys[i]))
                    st.saved.add(i)
        self.stats["saves_planned"] += len(saves)
        st.expected = end
        if loads or saves:
            meta.requests.append(RequestSpec(st.req_id, self.scope_id, tuple(loads), tuple(saves)))

    def shutdown(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None
        if self._loop is None:
            return
        if self._index is not None:
            try:
                self._loop.call(self._index.aclose(), 5.0)
            except Exception:  # closing anyway
                pass
        self._loop.stop()
        self._loop = None
