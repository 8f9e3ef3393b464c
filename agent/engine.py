"""Generation on the inference instance (KVSP §4.2, §6.1, §6.8; DESIGN §5, §6).

A request's prompt is cut into blocks and named by the Block Key chain of its scope; the
leading blocks that this agent holds or the Index Service knows are loaded into a `KVPool`
while the model computes the rest (`PrefixLoader`); the tokens after the loaded prefix are
prefilled and the sampler decodes from there. Every complete block computed here, prompt or
generated, goes into the agent's own holder store and is published through its publisher, so
the next request anywhere can load it (`agent.export`).

`Engine` admits requests and resumes, plans and runs each session (`agent.sessions`), has
tracked sessions checkpointed to the Placement Controller and resumes them from a checkpoint
(§6.8, `agent.checkpoints`), and forgets finished sessions after a while. Sequence-sharded
contexts (§6.9) are `agent.shards`.

The model runs on one worker thread: forward passes of all sessions queue there one at a time,
so decoding sessions interleave step by step while the event loop stays free for I/O.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Collection, Mapping, Sequence

import httpx
import torch

from agent.checkpoints import Checkpointer, read_resume, resume_point
from agent.choice import choose
from agent.export import BlockExporter
from agent.live import LivePass, LiveProducer, Outpaced, Produce, audit_live_loads, watch_rivals
from agent.model import DecodeState, KVPrefix, ModelAdapter, OnLayer, TokenSampler
from agent.options import EngineOptions
from agent.pool import KVPool
from agent.requests import GenerateRequest, PrefillRequest
from agent.sessions import Session, TokenSequence
from kvsp_moq.auth import OPEN, Principal
from kvsp_moq.errors import (
    BadRecord,
    ForbiddenScope,
    KvspError,
    NoLiveKV,
    NotActive,
    NotFound,
    PrefixUnavailable,
    SessionConflict,
)
from kvsp_moq.fetch.leases import LeaseClient
from kvsp_moq.fetch.prefix import LoadReport, PrefixLoader, Timeline
from kvsp_moq.fetch.sources import LayerSource, LocalLayerSource, MoqtLayerSource, order_candidates
from kvsp_moq.fetch.sources import SourceCandidate as Candidate
from kvsp_moq.holder.store import BlockId, BlockStore
from kvsp_moq.index_client import IndexClient
from kvsp_moq.naming import BlockTrack
from kvsp_moq.protocol.compat import CompatDescriptor
from kvsp_moq.protocol.keys import BlockKeyChain
from kvsp_moq.protocol.keys import scope_id as scope_id_of
from kvsp_moq.protocol.records import LIVE_DIGEST, ReplicaRecord
from kvsp_moq.protocol.urls import base_url
from kvsp_moq.tasks import TaskSet

if TYPE_CHECKING:
    from kvsp_moq.instance_status import Meters

log = logging.getLogger("kvsp.agent.engine")


class Engine:
    """Generates for requests and sessions with the agent's model, store and index."""

    def __init__(self, adapter: ModelAdapter, *, store: BlockStore, announce: Callable[[Any], None],
                 is_published: Callable[[BlockId], bool], record_for: Callable[[Any], ReplicaRecord],
                 client: httpx.AsyncClient, index: IndexClient | None, leases: LeaseClient,
                 sources: Sequence[LayerSource], local: LocalLayerSource,
                 scope_keys: Mapping[str, bytes], default_scope: str | None,
                 self_url: Callable[[], str], pc_url: str | None = None, token: str | None = None,
                 options: EngineOptions | None = None, meters: "Meters | None" = None,
                 prefetching: Callable[[BlockId], "asyncio.Future[Any] | None"] | None = None,
                 measure_link: Callable[[str, Sequence[ReplicaRecord]], object] | None = None,
                 produce: Produce | None = None) -> None:
        self.adapter = adapter
        #: a prefetch's load of a block in flight (`Prefetcher.adopt`): a request waits for it
        #: rather than loading the same block a second time beside it
        self.prefetching = prefetching
        #: loads (scope ID, these blocks) in the background to measure the links again, while
        #: the request that found the measurement due recomputes (`Prefetcher.measure`); without
        #: it that request loads them itself
        self.measure_link = measure_link
        self._recomputed_in_a_row = 0
        self.options = options or EngineOptions()
        self.block_tokens = self.options.block_tokens
        self.descriptor = CompatDescriptor.from_dict(adapter.descriptor(self.block_tokens))
        self.compat_id = self.descriptor.compat_hex
        self.store = store
        self.announce = announce
        self.is_published = is_published
        self.record_for = record_for
        self.client = client
        self.index = index
        self.leases = leases
        self.sources = list(sources)
        self.local = local
        self.scope_keys = dict(scope_keys)
        self.scopes_by_id = {scope_id_of(k).hex(): k for k in self.scope_keys.values()}
        self.default_scope = default_scope
        self.self_url = self_url
        self.pc_url = pc_url or None  # one URL, or several PCs on one store (comma-separated)
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.meters = meters
        self.model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvsp-model")
        self.sessions: dict[str, Session] = {}
        #: live KV (DESIGN §9): prompt blocks published layer by layer while they are computed
        element = torch.empty((), dtype=adapter.dtype).element_size()
        self.live = (LiveProducer(produce, num_layers=adapter.num_layers, block_tokens=self.block_tokens,
                                  compat_id=self.compat_id, layer_octets=2 * self.block_tokens
                                  * adapter.num_kv_heads * adapter.head_dim * element)
                     if produce is not None and self.options.live_kv else None)
        #: requests (generate and resume) admitted since start: the status record's "admitted"
        self.admitted = 0
        #: prefills computed for other instances, running now (`prefill_for_other`)
        self.prefilling = 0
        #: blocks loaded live and compared with their producer's complete record, and those
        #: whose record listed other digests (`agent.live.audit_live_loads`)
        self.live_audited = 0
        self.live_mismatches = 0
        #: prefills stopped because another instance computed the same prefix and won
        self.live_outpaced = 0
        #: whether this instance's in-production record of a block is in the index, and a wait
        #: (bounded) for the next batch of records sent: with both, a prefill that another
        #: instance computes too gives way (`agent.live.watch_rivals`)
        self.live_records_in: Callable[[BlockId], bool] | None = None
        self.records_sent: Callable[[float], Awaitable[None]] | None = None
        self.state = "active"
        self._tasks = TaskSet()
        self._finished: deque[tuple[float, Session]] = deque()  # (forget at, session), in order
        self._sweeper: asyncio.Task | None = None
        self._loaders: set[PrefixLoader] = set()
        self._last_logits: dict[str, torch.Tensor] = {}
        #: §6.8: checkpoints of tracked sessions to the PC
        self.checkpoints = Checkpointer(client, self.pc_url, headers=self.headers,
                                        instance_url=self_url, options=self.options,
                                        block_tokens=self.block_tokens, spawn=self._spawn)
        #: complete blocks into the store, the index and the replicate_to holders
        self.exporter = BlockExporter(adapter, store=store, announce=announce,
                                      is_published=is_published, client=client, headers=self.headers,
                                      indexed=index is not None, compat_id=self.compat_id,
                                      block_tokens=self.block_tokens, options=self.options,
                                      run_model=self.run_model, spawn=self._spawn)

    # ---------------------------------------------------------------- bookkeeping

    @property
    def running(self) -> int:
        """Sessions decoding, and prefills computed for other instances."""
        return sum(1 for s in self.sessions.values() if s.state == "running") + self.prefilling

    @property
    def queued(self) -> int:
        return sum(1 for s in self.sessions.values() if s.state == "loading")

    def _spawn(self, coro: Any, name: str | None = None) -> asyncio.Task:
        return self._tasks.spawn(coro, name=name)

    def scope_key(self, name: str | None) -> bytes:
        name = name or self.default_scope
        if name is None or name not in self.scope_keys:
            raise BadRecord(f"unknown scope {name!r}", member="scope")
        return self.scope_keys[name]

    async def close(self) -> None:
        """Stop every session (not finished: the PC fails them over) and the model thread."""
        for loader in list(self._loaders):
            loader.fail(asyncio.CancelledError())
        for s in self.sessions.values():
            if s.task is not None and not s.task.done():
                s.task.cancel()
        tasks = [s.task for s in self.sessions.values() if s.task is not None] + list(self._tasks)
        self._tasks.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in self.sessions.values():
            s.end("cancelled", "the instance stopped")
        self.model_thread.shutdown(wait=False, cancel_futures=True)

    def _forget_later(self, session: Session) -> None:
        """Forget a finished session after keep_finished_s, or sooner when more than
        keep_finished are kept; one sweeper for all of them, not a sleeping task each."""
        loop = asyncio.get_running_loop()
        self._finished.append((loop.time() + self.options.keep_finished_s, session))
        while len(self._finished) > self.options.keep_finished:
            self._forget(self._finished.popleft()[1])
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = self._spawn(self._sweep(), name="forget-finished-sessions")

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        while self._finished:
            at, session = self._finished[0]
            if at > loop.time():
                await asyncio.sleep(at - loop.time())
                continue
            self._finished.popleft()
            self._forget(session)

    def _forget(self, session: Session) -> None:
        if self.sessions.get(session.id) is session:
            del self.sessions[session.id]

    async def run_model(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the model thread, after the forward passes queued before it."""
        return await asyncio.get_running_loop().run_in_executor(self.model_thread, fn, *args)

    async def warmup(self, tokens: int) -> None:
        """Run the model once before serving: its one-time costs stay out of the first request,
        and the first status report carries measured prefill and decode rates."""
        vocab = self.adapter.vocab_size
        prompt = [3 + (i * 7919) % max(1, vocab - 3) for i in range(max(1, tokens))]

        def run() -> tuple[float, float]:
            self.adapter.prefill(prompt, return_kv=False)
            started = time.perf_counter()
            result = self.adapter.prefill(prompt, return_kv=False)
            prefill_s = time.perf_counter() - started
            started = time.perf_counter()
            for _ in range(4):
                self.adapter.decode(prompt[0], result.state)
            return prefill_s, (time.perf_counter() - started) / 4

        prefill_s, decode_s = await self.run_model(run)
        if self.meters is not None:
            self.meters.prefilled(len(prompt), prefill_s)
            self.meters.decoded(1, decode_s)

    # ---------------------------------------------------------------- entry points

    async def generate(self, req: GenerateRequest) -> Session:
        """Admit a request and start it; the session's `done` is set when it ends."""
        if self.state != "active":
            raise NotActive(f"this instance is {self.state}")
        if len(req.tokens) + req.max_new_tokens > self.adapter.config.max_position_embeddings:
            raise BadRecord("prompt plus max_new_tokens exceed the model's context",
                            member="max_new_tokens")
        if max(req.tokens) >= self.adapter.vocab_size:
            raise BadRecord(f"token ids must be below {self.adapter.vocab_size}", member="tokens")
        key = self.scope_key(req.scope)
        sid = req.session or str(uuid.uuid4())
        existing = self.sessions.get(sid)
        if existing is not None and (req.session is not None or not existing.finished):
            raise SessionConflict(f"session {sid} exists on this instance", member="session")
        b = self.block_tokens
        chain = BlockKeyChain(key, self.descriptor.compat_id, b)
        chain.extend(list(req.tokens))
        full = len(req.tokens) // b
        session = Session(sid, epoch=req.epoch, tracked=req.session is not None and self.pc_url is not None,
                          scope_key=key, compat_id=self.compat_id,
                          sequence=TokenSequence(chain, 0, list(req.tokens)),
                          prompt_blocks=[k.hex() for k in chain.keys[:full]],
                          prompt_tail=list(req.tokens[full * b:]), sampler=req.sampler,
                          max_new_tokens=req.max_new_tokens)
        if req.prefill_at is None or base_url(req.prefill_at) == base_url(self.self_url()):
            pass
        elif self._moqt_source() is None:  # no relay to subscribe through: computed here
            log.info("session %s: prefill_at %s ignored (this instance has no relay)", sid, req.prefill_at)
        else:
            session.prefill_at = base_url(req.prefill_at)
            session.prefill_blocks = req.prefill_blocks
            session.prefill_passes = req.prefill_passes
        self.sessions[sid] = session
        self.admitted += 1
        if session.tracked:  # the PC learns of the session beside the prefill, not after it
            self.checkpoints.request(session)
        session.task = self._spawn(self._run(session, None, want_timeline=req.timeline),
                                   name=f"session-{sid}")
        return session

    def stop(self, sid: str, by: Principal = OPEN) -> Session:
        """DELETE {ii}sessions/{id}: the client needs no more tokens (a stop string, a closed
        connection): the session stops here and is not resumed elsewhere."""
        session = self.sessions.get(sid)
        if session is None:
            raise NotFound(f"no session {sid} here")
        by.require_scope(session.scope_id)
        if not session.finished and session.task is not None and not session.task.done():
            session.stopped_by_client = True
            session.task.cancel()
        return session

    async def prefill_for_other(self, req: PrefillRequest) -> dict[str, Any]:
        """POST {ii}prefill: compute the prompt's complete blocks for another instance, which
        subscribes to them (DESIGN §9); answered once their live blocks exist, before the pass."""
        if self.state != "active":
            raise NotActive(f"this instance is {self.state}")
        if self.live is None:
            raise NoLiveKV("this instance publishes no live KV (it has no relay, or --no-live-kv)")
        if max(req.tokens) >= self.adapter.vocab_size:
            raise BadRecord(f"token ids must be below {self.adapter.vocab_size}", member="tokens")
        if len(req.tokens) > self.adapter.config.max_position_embeddings:
            raise BadRecord("the prompt exceeds the model's context", member="tokens")
        key = self.scope_key(req.scope)
        b = self.block_tokens
        chain = BlockKeyChain(key, self.descriptor.compat_id, b)
        full = len(req.tokens) // b
        chain.extend(list(req.tokens[:full * b]))
        keys = [k.hex() for k in chain.keys[:full]]
        sid = scope_id_of(key).hex()
        stored = next((i for i, k in enumerate(keys) if BlockId(self.compat_id, sid, k) not in self.store),
                      full)
        live = self.live.open(sid, keys, stored, 0, skip=lambda bid: bid in self.store) if stored < full else None
        produced = len(live.blocks) if live is not None else 0
        if live is not None:
            self.prefilling += 1
            self._spawn(self._prefill_only(live, list(req.tokens[:(stored + produced) * b])),
                        name="prefill-for-other")
        # The pass tracks' layout (DESIGN §9.4): where each begins and how many blocks it has,
        # for the decode instance's generate ("prefill_passes").
        passes, first = [], stored
        for track in live.tracks if live is not None else ():
            passes.append([first, len(track.blocks)])
            first += len(track.blocks)
        return {"prompt_blocks": full, "stored": stored, "live": keys[stored:stored + produced],
                "passes": passes}

    async def _prefill_only(self, live: LivePass, tokens: list[int]) -> None:
        try:
            started = time.perf_counter()
            await self.run_model(self._prefill_pass, tokens, live.on_layer)
            if self.meters is not None:
                self.meters.prefilled(len(tokens), time.perf_counter() - started)
            for block in live.blocks:
                entry = await block.finish()
                if entry is not None:
                    self.announce(entry)
        except BaseException as e:
            live.abort(f"the prefill failed: {type(e).__name__}")
            if not isinstance(e, Exception):
                raise
            log.warning("prefill for another instance failed: %s", e)
        finally:
            self.prefilling -= 1

    async def resume(self, sid: str, body: Any, by: Principal = OPEN) -> Session:
        """POST {ii}sessions/{id}/resume (§6.8): continue a session under a new epoch, for
        principal `by`, who must hold the checkpoint's scope."""
        existing = self.sessions.get(sid)
        cp, epoch = read_resume(sid, body, current_epoch=existing.epoch if existing is not None else None)
        by.require_scope(cp.scope_id)
        if existing is not None and existing.scope_id != cp.scope_id.lower():
            raise ForbiddenScope(f"session {sid} here belongs to another scope", member="scope_id")
        if self.state != "active":
            raise NotActive(f"this instance is {self.state}")
        point = resume_point(cp, epoch, descriptor=self.descriptor, scopes_by_id=self.scopes_by_id,
                             block_tokens=self.block_tokens, max_new_tokens=self.options.max_new_tokens)
        sequence = TokenSequence(point.chain, len(cp.prompt_blocks), point.known)
        plan = await self._plan(cp.scope_id, [k.hex() for k in point.chain.keys], sequence)
        if len(plan) < len(cp.prompt_blocks):
            raise PrefixUnavailable(f"{len(cp.prompt_blocks) - len(plan)} of {len(cp.prompt_blocks)} "
                                    "prompt blocks have no replica here or in the index")
        if existing is not None and existing.task is not None and not existing.task.done():
            existing.task.cancel()
            existing.end("moved", f"resumed under epoch {epoch}")
        session = Session(sid, epoch=epoch, tracked=self.pc_url is not None, scope_key=point.scope_key,
                          compat_id=self.compat_id, sequence=sequence,
                          prompt_blocks=list(cp.prompt_blocks), prompt_tail=list(cp.prompt_tail),
                          sampler=point.sampler, max_new_tokens=point.max_new_tokens,
                          generated=point.generated, step_base=point.step_base)
        session.first_checkpoint_sent = True
        self.sessions[sid] = session
        self.admitted += 1
        session.task = self._spawn(self._run(session, plan, want_timeline=False),
                                   name=f"session-{sid}")
        return session

    # ---------------------------------------------------------------- planning

    async def _plan(self, scope_id: str, keys: list[str], sequence: TokenSequence,
                    prefetched: dict[str, int] | None = None) -> list[list[Candidate]]:
        """Candidates for the leading blocks that can be loaded, at most all but the last token
        (`prefetched` counts, by transport, the blocks a prefetch brought meanwhile)."""
        b = self.block_tokens
        limit = min(len(keys), (sequence.length - 1) // b)
        if limit <= 0:
            return []
        if self.prefetching is not None:
            # A prefetch directive (sent by the PC just before this request) is loading some
            # of these blocks already: wait for those, then take them from the store.
            adopt = self.prefetching
            loads = [f for key in keys[:limit]
                     if (f := adopt(BlockId(self.compat_id, scope_id, key))) is not None]
            if loads:
                await asyncio.wait(loads)
                for f in loads:
                    kind = None if f.cancelled() or f.exception() else f.result()
                    if prefetched is not None and kind in ("moqt", "http"):
                        prefetched[kind] = prefetched.get(kind, 0) + 1
        local: list[ReplicaRecord | None] = []
        for key in keys[:limit]:
            entry = self.store.get(BlockId(self.compat_id, scope_id, key))
            local.append(self.record_for(entry) if entry is not None else None)
        remote: dict[int, list[ReplicaRecord]] = {}
        leading_local = next((i for i, r in enumerate(local) if r is None), limit)
        if leading_local < limit and self.index is not None:
            try:
                result = await self.index.lookup(scope_id, self.compat_id, keys[:limit])
            except KvspError as e:
                log.warning("lookup failed (%s); computing without the index", e.detail)
            else:
                for i, block in enumerate(result.blocks[:result.matched]):
                    remote[i] = list(block.replicas)
        me = self.self_url().rstrip("/") + "/"
        plan: list[list[Candidate]] = []
        for i in range(limit):
            # Not this agent's own replicas, over HTTP or (through the relay) over MOQT.
            records = [r for r in remote.get(i, [])
                       if (r.holder.rstrip("/") + "/") != me
                       and (r.http_holder or "").rstrip("/") + "/" != me]
            own = local[i]
            if own is not None:
                records.insert(0, own)
            candidates = order_candidates(records, [self.local, *self.sources])
            if not candidates:
                break
            plan.append(candidates)
        return plan

    def _moqt_source(self) -> MoqtLayerSource | None:
        return next((s for s in self.sources if isinstance(s, MoqtLayerSource)), None)

    def _plan_live(self, session: Session, producer: str) -> list[list[Candidate]]:
        """Candidates for the prompt blocks another instance computes for this session: its
        live tracks through this instance's relay (DESIGN §9), after any replica held here.
        Subscribed at once: no lookup, and the relay holds a SUBSCRIBE for a track whose
        producer has not announced it yet."""
        source = self._moqt_source()
        assert source is not None  # checked when the request came
        seq = session.sequence
        b = self.block_tokens
        limit = min(len(seq.chain.keys), (seq.length - 1) // b)
        if session.prefill_blocks is not None:
            limit = min(limit, session.prefill_blocks)
        # Blocks of the producer's pass tracks, as its prefill answer laid them out: slots of
        # the track in the namespace of the pass's first block (checked against the Block Key
        # each slot carries before use: the layout came through the front end).
        slots: dict[int, tuple[str, int]] = {}
        for first, count in session.prefill_passes:
            if first < limit:
                ns = BlockTrack.for_holder(self.compat_id, session.scope_id, seq.chain.keys[first].hex(),
                                           producer).moqt_namespace
                for j in range(min(count, limit - first)):
                    slots[first + j] = (ns, j)
        plan: list[list[Candidate]] = []
        for i in range(limit):
            key = seq.chain.keys[i].hex()
            bid = BlockId(self.compat_id, session.scope_id, key)
            track = BlockTrack.for_holder(self.compat_id, session.scope_id, key, producer)
            live = ReplicaRecord(block_key=key, compat_id=self.compat_id, scope_id=session.scope_id,
                                 holder=source.relay, codec=1, size=0, digest=LIVE_DIGEST,
                                 ttl_ms=self.options.lease_ms, moqt_namespace=track.moqt_namespace,
                                 http_holder=producer, live=True, live_pass=slots.get(i))
            entry = self.store.get(bid)
            records = [self.record_for(entry), live] if entry is not None else [live]
            plan.append(order_candidates(records, [self.local, *self.sources]))
        return plan

    def _choose(self, session: Session, plan: list[list[Candidate]]) -> list[list[Candidate]]:
        """The plan, or only its leading resident blocks when recomputing the rest is cheaper
        than loading it (`agent.choice`); the choice is kept on the session."""
        resident = next((i for i, c in enumerate(plan) if c[0].source.kind != "local"), len(plan))
        remote = [c[0].record for c in plan if c[0].source.kind != "local"]
        meters = self.meters
        due = self._recomputed_in_a_row + 1 >= self.options.probe_every
        choice = choose(instance=self.self_url(),
                        prefill_tokens_per_s=meters.prefill.value if meters else None,
                        links=meters.links() if meters else (), matched_blocks=len(plan),
                        resident_blocks=resident, remote=remote, block_tokens=self.block_tokens,
                        total_tokens=session.sequence.length,
                        probe=due and self.measure_link is None)
        session.load_choice = choice
        if remote:
            if choice.load:
                self._recomputed_in_a_row = 0
            elif due and self.measure_link is not None:
                # The links are measured again beside this request, which need not pay for it.
                self.measure_link(session.scope_id, remote)
                self._recomputed_in_a_row = 0
            else:
                self._recomputed_in_a_row += 1
        if choice.load:
            return plan
        log.info("session %s: %s", session.id, choice.reason)
        return plan[:resident]

    # ---------------------------------------------------------------- the session task

    async def _run(self, session: Session, plan: list[list[Candidate]] | None, *,
                   want_timeline: bool) -> None:
        try:
            await self._generate(session, plan, want_timeline)
        except asyncio.CancelledError:
            if session.stopped_by_client:
                session.end("cancelled", "stopped by the client")
                if session.tracked:  # over for good: the PC must not resume it elsewhere
                    self._spawn(self.checkpoints.drop(session), name=f"drop-{session.id}")
                return
            session.end("cancelled", "cancelled")
            raise
        except KvspError as e:
            log.warning("session %s failed: %s", session.id, e.detail)
            session.end("failed", e.detail)
        except Exception as e:
            log.exception("session %s failed", session.id)
            session.end("failed", f"{type(e).__name__}: {e}")
        finally:
            self._last_logits.pop(session.id, None)
            for live in session.live.values():  # not stored: their records are withdrawn
                live.abort(f"session {session.state}")
            session.live.clear()
            self._forget_later(session)

    async def _generate(self, session: Session, plan: list[list[Candidate]] | None,
                        want_timeline: bool) -> None:
        seq = session.sequence
        b = self.block_tokens
        if len(session.generated) >= session.max_new_tokens:
            await self._finish(session)
            return
        if plan is None and session.prefill_at is not None:
            plan = self._plan_live(session, session.prefill_at)
        elif plan is None:
            plan = await self._plan(session.scope_id, [k.hex() for k in seq.chain.keys], seq,
                                    session.prefetched)
            if self.options.choose_by_cost and seq.known_blocks == 0:
                plan = self._choose(session, plan)
        sampler = session.sampler.model_sampler()
        step = session.step_base + len(session.generated)
        try:
            state, token, report, timeline = await self._prefill(session, plan, sampler, step)
        except Outpaced as e:
            state, token, report, timeline = await self._give_way(session, e, sampler, step)
        session.first_logits = self._last_logits.pop(session.id, None)
        session.timeline = timeline if want_timeline else None
        session.state = "running"
        # Loaded blocks are stored here too (after the first token): the next request with
        # this prefix finds them local, and the index gets one more replica to place by.
        session.loaded = report.loaded if report else 0
        self._produced(session, token)
        await self.exporter.export(session, state)
        if session.live_loaded and self.index is not None:
            self._spawn(self._audit_live(session.scope_id, dict(session.live_loaded)), name="audit-live")
        while len(session.generated) < session.max_new_tokens:
            if session.finished:
                return
            await self.checkpoints.backpressure(session)
            if self.options.token_interval_s > 0:
                await asyncio.sleep(self.options.token_interval_s)
            step = session.step_base + len(session.generated)
            started = time.perf_counter()
            token = await self.run_model(self._decode_sample, session.generated[-1], state, sampler, step)
            if self.meters is not None:
                self.meters.decoded(1, time.perf_counter() - started)
            self._produced(session, token)
            await self.exporter.export(session, state)
        if seq.length % b == 0 and state.length == seq.length - 1:
            # The last token completes a block: feed it so that the block can be stored too.
            await self.run_model(self.adapter.extend, state, [session.generated[-1]])
            await self.exporter.export(session, state)
        await self._finish(session)

    async def _give_way(self, session: Session, outpaced: Outpaced, sampler: TokenSampler,
                        step: int) -> tuple[DecodeState, int, LoadReport | None, Timeline | None]:
        """Another instance computes this prompt's new prefix too, and wins: this one stopped
        its pass (its in-production records are withdrawn) and loads the prefix from the
        winner's live tracks, found by a new lookup, computing only what the winner does not."""
        log.info("session %s: %s; loading it from there", session.id, outpaced)
        self.live_outpaced += 1
        session.outpaced_by = outpaced.winner
        for key, block in list(session.live.items()):
            if block.error is not None:
                del session.live[key]
        seq = session.sequence
        plan = await self._plan(session.scope_id, [k.hex() for k in seq.chain.keys], seq, session.prefetched)
        return await self._prefill(session, plan, sampler, step)

    async def _prefill(self, session: Session, plan: list[list[Candidate]], sampler: TokenSampler,
                       step: int) -> tuple[DecodeState, int, LoadReport | None, Timeline | None]:
        seq = session.sequence
        b = self.block_tokens
        if len(plan) < seq.known_blocks:
            raise PrefixUnavailable("the prompt blocks of this session cannot be loaded")
        report: LoadReport | None = None
        timeline: Timeline | None = None
        session.timing["plan_ms"] = round((time.perf_counter() - session.started) * 1000, 3)
        if not plan:
            started = time.perf_counter()
            live = self._open_live(session, 0)
            state, token = await self._run_prefill(live, session.id, seq.tokens_from(0), None, sampler, step)
            self._note_prefill(session, seq.length, time.perf_counter() - started)
            session.timing["forward_ms"] = round((time.perf_counter() - started) * 1000, 3)
            loaded = 0
        else:
            n = len(plan)
            keys = [k.hex() for k in seq.chain.keys[:n]]
            pool = KVPool.for_adapter(self.adapter, b, keys)
            timeline = Timeline(self.adapter.num_layers, t0=session.started)
            loader = PrefixLoader(pool, plan, leases=self.leases, lease_ms=self.options.lease_ms,
                                  concurrency=self.options.load_concurrency,
                                  layers_per_request=self.options.layers_per_request,
                                  on_transfer=self.meters.transfer if self.meters else None,
                                  timeline=timeline)
            self._loaders.add(loader)
            prefix = KVPrefix(length=n * b, layers=pool.prefix(n), wait_for_layer=loader.wait_for_layer)
            suffix = seq.tokens_from(n * b)
            live = self._open_live(session, n)
            run_forward = functools.partial(self._run_prefill, live, session.id, suffix, prefix, sampler,
                                            step, timeline)
            forward = asyncio.ensure_future(run_forward()) if self.options.pipelined else None
            try:
                report = await loader.run()
            except BaseException:
                if forward is not None:
                    forward.cancel()
                if live is not None:
                    live.abort("the prefill failed")
                raise
            finally:
                self._loaders.discard(loader)
                self._spawn(loader.release_leases())
            if forward is None:  # the baseline: the whole prefix first, then the computation
                forward = asyncio.ensure_future(run_forward())
            loaded = report.loaded
            try:
                state, token = await forward
                waited = sum((c - w) for w, c in zip(timeline.wait_start, timeline.compute_start)
                             if w is not None and c is not None)
                elapsed = (timeline.forward_end or 0.0) - (timeline.forward_start or 0.0)
                self._note_prefill(session, len(suffix), max(elapsed - waited, 1e-6))
                session.timing["forward_ms"] = round(elapsed * 1000, 3)
            except Outpaced:
                raise
            except Exception as e:
                if loaded == n:
                    raise
                # Part of the prefix could not be loaded: recompute after the part that was.
                log.info("session %s: %d of %d blocks loaded (%s); recomputing the rest",
                         session.id, loaded, n, e)
                if loaded < seq.known_blocks:
                    raise PrefixUnavailable(
                        "the prompt blocks of this session could not be loaded") from None
                pool.synchronize()
                past = KVPrefix.from_kv(pool.prefix(loaded)) if loaded else None
                started = time.perf_counter()
                rest = seq.tokens_from(loaded * b)
                if live is not None:  # computed again from block `loaded`: published anew
                    live.abort("the prefix could not be loaded; computing it again")
                live = self._open_live(session, loaded, distrusted=loader.failed_producers)
                state, token = await self._run_prefill(live, session.id, rest, past, sampler, step)
                self._note_prefill(session, len(rest), time.perf_counter() - started)
            # Blocks loaded from a producer's live track: held to its complete record later.
            session.live_loaded = {keys[i]: base_url(c[0].record.http_holder or c[0].record.holder)
                                   for i, c in enumerate(plan[:report.loaded]) if c and c[0].record.live}
            by_kind = report.by_kind
            session.sources["moqt"] = by_kind.get("moqt", 0)
            session.sources["http"] = by_kind.get("http", 0)
            local = by_kind.get("local", 0)
            for kind, count in session.prefetched.items():  # local now, but loaded for this request
                moved = min(count, local)
                session.sources[kind] += moved
                local -= moved
            if local:
                session.sources["local"] = local
            session.load = {"planned": report.planned, "loaded": report.loaded, "octets": report.octets,
                            "seconds": round(report.seconds, 6), "failures": report.failures}
            session.timing["load_ms"] = round(report.seconds * 1000, 3)
            pool.synchronize()
        if plan:
            session.loaded_pool = pool
            session.loaded_digests = [loader.layer_digests(i) for i in range(loaded)]
        session.cached_tokens = loaded * b
        session.sources["recompute"] = max(0, seq.length // b - loaded)
        session.ttft_ms = round((time.perf_counter() - session.started) * 1000, 3)
        return state, token, report, timeline

    def _open_live(self, session: Session, first: int, distrusted: Collection[str] = ()) -> LivePass | None:
        """The live blocks of a prefill computing the sequence from block `first` on: the
        complete blocks of the sequence it computes, which the session then stores. Instances
        in `distrusted` (whose live layers failed this request) are never given way to."""
        if self.live is None:
            return None
        seq = session.sequence
        keys = [k.hex() for k in seq.chain.keys[:seq.length // self.block_tokens]]
        live = self.live.open(session.scope_id, keys, first, first * self.block_tokens,
                              skip=lambda bid: bid in self.store)
        if live is not None:
            for j, block in enumerate(live.blocks):
                session.live[keys[first + j]] = block
            # A pass of only the block that holds the last prompt token is computed here whatever
            # is loaded (the last token is always computed): giving way to another producer of
            # that block (the decode instance's last block, which a prefill instance computes
            # too when the prompt is whole blocks) would only load the prefix again.
            must_compute = first >= (seq.length - 1) // self.block_tokens
            if (session.outpaced_by is None and not must_compute and self.index is not None
                    and self.live_records_in is not None):
                self._spawn(watch_rivals(live, self.index, me=self.self_url(), records_in=self.live_records_in,
                                         sent=self.records_sent, distrusted=frozenset(distrusted)),
                            name=f"rivals-{session.id}")
        return live

    async def _run_prefill(self, live: LivePass | None, sid: str, tokens: list[int], past: KVPrefix | None,
                           sampler: TokenSampler, step: int,
                           timeline: Timeline | None = None) -> tuple[DecodeState, int]:
        """The prefill pass on the model thread, publishing its blocks' layers as they are
        computed when `live`; a failed pass abandons them."""
        try:
            return await self.run_model(self._prefill_sample, sid, tokens, past, sampler, step, timeline,
                                        live.on_layer if live is not None else None)
        except Outpaced as e:
            assert live is not None
            live.abort(str(e))
            raise
        except BaseException:
            if live is not None:
                live.abort("the prefill failed")
            raise

    async def _audit_live(self, scope_id: str, producers: dict[str, str]) -> None:
        assert self.index is not None
        compared, bad = await audit_live_loads(self.index, self.store, compat_id=self.compat_id,
                                               scope_id=scope_id, producers=producers)
        self.live_audited += len(compared)
        self.live_mismatches += len(bad)

    def _note_prefill(self, session: Session, tokens: int, seconds: float) -> None:
        if self.meters is not None and tokens > 0:
            self.meters.prefilled(tokens, seconds)

    # model-thread functions ------------------------------------------------

    def _prefill_sample(self, sid: str, tokens: list[int], past: KVPrefix | None, sampler: TokenSampler,
                        step: int, timeline: Timeline | None = None,
                        on_layer: OnLayer | None = None) -> tuple[DecodeState, int]:
        if timeline is not None:
            timeline.forward_start = time.perf_counter()
        result = self.adapter.prefill(tokens, past=past, return_kv=False, on_layer=on_layer)
        if timeline is not None:
            timeline.forward_end = time.perf_counter()
        if self.options.keep_first_logits:
            self._last_logits[sid] = result.logits.detach().to("cpu")
        return result.state, sampler.sample(result.logits, step)

    def _prefill_pass(self, tokens: list[int], on_layer: OnLayer) -> None:
        self.adapter.prefill(tokens, return_kv=False, on_layer=on_layer)

    def _decode_sample(self, token: int, state: DecodeState, sampler: TokenSampler, step: int) -> int:
        return sampler.sample(self.adapter.decode(token, state), step)


    # ---------------------------------------------------------------- tokens

    def _produced(self, session: Session, token: int) -> None:
        session.add_token(token)
        self.checkpoints.after_token(session)

    async def wait_published(self, session: Session) -> None:
        """Until the blocks this session stored are in the index (bounded): a client that got
        the answer can count on the next lookup finding them."""
        await self.exporter.wait_published(session)

    async def _finish(self, session: Session) -> None:
        if session.tracked:
            await self.checkpoints.end(session)
        session.release(len(session.generated))
        session.end("finished")


__all__ = ["Engine"]
