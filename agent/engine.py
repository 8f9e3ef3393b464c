"""Generation and sessions of the inference instance (KVSP §4.2, §6.1, §6.8; DESIGN §5, §6).

A request's prompt is cut into blocks and named by the Block Key chain of its scope; the
leading blocks that this agent holds or the Index Service knows are loaded into a `KVPool`
while the model computes the rest (`PrefixLoader`); the tokens after the loaded prefix are
prefilled and the sampler decodes from there. Every complete block computed here, prompt or
generated, goes into the agent's own holder store and is published through its publisher, so
the next request anywhere can load it.

Sessions (§6.8): a session carries its epoch, generated tokens and sampler state, and is
checkpointed to the Placement Controller at each completed block of generated tokens and at
least every 64 tokens. Every output token is labelled with its index and the session epoch.
With a non-deterministic sampler (top-p) a token is released to the stream only once the PC has
acknowledged a checkpoint covering it; checkpoints then go out every few tokens, and decoding
runs ahead of the acknowledgements by a bounded number of tokens. A resume loads the prompt
blocks (whose tokens this instance does not know) and whatever generated blocks are available,
recomputes the rest, restores the sampler at its step and continues from output_offset under
the new epoch; anything carrying an older epoch is refused (kvsp-stale-epoch).

Two members travel in the checkpoint beyond §4.4, both ignored by other parties: "instance"
(the serving instance's URL, which the PC needs for a session it has not placed) and
`sampler.params.max_new_tokens` (where the session stops; the sampler object is the only part
of the checkpoint the PC keeps verbatim).

The model runs on one worker thread: forward passes of all sessions queue there one at a time,
so decoding sessions interleave step by step while the event loop stays free for I/O.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Mapping, Sequence

import httpx
import torch

from agent.loader import (Candidate, LayerSource, LeaseClient, LoadReport,
                          LocalLayerSource, PrefixLoader, Timeline, order_candidates)
from agent.choice import LoadChoice, choose
from agent.model import DecodeState, KVPrefix, ModelAdapter, TokenSampler
from agent.pool import KVPool, block_container, tensor_from_octets
from kvsp_moq.errors import (BadRecord, DigestMismatch, KvspError, NotActive, NotFound, PrefixUnavailable,
                             SessionConflict, StaleEpoch, TransportError)
from kvsp_moq.fetch.http import parse_repr_digest
from kvsp_moq.holder.store import BlockId, BlockStore
from kvsp_moq.index_client import IndexClient, raise_for_problem
from kvsp_moq.protocol import validate as v
from kvsp_moq.protocol.compat import CompatDescriptor
from kvsp_moq.protocol.container import Container
from kvsp_moq.protocol.keys import BlockKeyChain, scope_id as scope_id_of
from kvsp_moq.protocol.records import (ReplicaRecord, ReshardDecision, ReshardPlan, SessionCheckpoint,
                                       parse_reshard)
from kvsp_moq.protocol.records import Sampler as SamplerRecord
from kvsp_moq.protocol.urls import base_url

if TYPE_CHECKING:
    from agent.status import Meters

log = logging.getLogger("kvsp.agent.engine")

METHODS = ("greedy", "top-p")
#: Checkpoints at least this often (§6.8), whatever the block size.
CHECKPOINT_EVERY = 64




class StreamBroken(Exception):
    """Ends an output stream abnormally: the session no longer continues on this instance."""



# --------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class SamplerSpec:
    """The sampler of a request or checkpoint: method, parameters and seed."""

    method: str = "greedy"
    params: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0

    @classmethod
    def from_json(cls, data: Any, member: str = "sampler") -> "SamplerSpec":
        data = v.obj(data, member)
        method = v.string(data.get("method", "greedy"), member + ".method", max_len=32)
        if method not in METHODS:
            raise BadRecord(f"must be one of {', '.join(METHODS)}", member=member + ".method")
        params = dict(v.obj(data.get("params", {}), member + ".params"))
        if method == "top-p":
            v.number(params.get("p", 1.0), member + ".params.p", low=0.0, high=1.0, low_open=True)
            v.number(params.get("temperature", 1.0), member + ".params.temperature", low=0.0,
                     low_open=True)
        return cls(method, params, v.integer(data.get("seed", 0), member + ".seed"))

    @property
    def deterministic(self) -> bool:
        """Greedy decoding gives the same tokens on every instance of one model build."""
        return self.method == "greedy"

    def model_sampler(self) -> TokenSampler:
        if self.method == "greedy":
            return TokenSampler(seed=self.seed)
        return TokenSampler(temperature=float(self.params.get("temperature", 1.0)),
                            top_p=float(self.params.get("p", 1.0)), seed=self.seed)

    def record(self, step: int, max_new_tokens: int) -> SamplerRecord:
        params = {k: val for k, val in self.params.items() if k != "max_new_tokens"}
        params["max_new_tokens"] = max_new_tokens
        return SamplerRecord(self.method, params, self.seed, step, self.deterministic)


@dataclass(frozen=True)
class GenerateRequest:
    """POST {ii}generate (DESIGN §6)."""

    tokens: tuple[int, ...]
    max_new_tokens: int
    sampler: SamplerSpec = SamplerSpec()
    session: str | None = None
    stream: bool = False
    scope: str | None = None
    timeline: bool = False

    @classmethod
    def from_json(cls, data: Any, *, max_tokens: int) -> "GenerateRequest":
        data = v.obj(data, "body")
        tokens = v.tokens(v.required(data, "tokens"), "tokens")
        if not tokens:
            raise BadRecord("needs at least one token", member="tokens")
        n = v.integer(v.required(data, "max_new_tokens"), "max_new_tokens", low=1, high=max_tokens)
        session = data.get("session")
        if session is not None:
            session = v.uuid_text(session, "session")
        scope = data.get("scope")
        if scope is not None:
            scope = v.string(scope, "scope", max_len=256)
        return cls(tuple(tokens), n, SamplerSpec.from_json(data.get("sampler", {})), session,
                   v.boolean(data.get("stream", False), "stream"), scope,
                   v.boolean(data.get("timeline", False), "timeline"))


# --------------------------------------------------------------------------- sessions


@dataclass
class Sequence_:
    """The token sequence of a session as far as this instance knows it.

    Blocks before `known_blocks` are known by key only (a resumed session's prompt blocks);
    `tokens` are the tokens from there on, generated ones included.
    """

    chain: BlockKeyChain
    known_blocks: int
    tokens: list[int]

    @property
    def length(self) -> int:
        return self.known_blocks * self.chain.block_tokens + len(self.tokens)

    def tokens_from(self, position: int) -> list[int]:
        start = position - self.known_blocks * self.chain.block_tokens
        if start < 0:
            raise ValueError("the tokens of the requested position are not known here")
        return self.tokens[start:]

    def append(self, token: int) -> None:
        self.tokens.append(token)
        self.chain.extend([token])


class Session:
    """One generation: its tokens, epoch, sampler state and the streams reading it."""

    def __init__(self, sid: str, *, epoch: int, tracked: bool, scope_key: bytes, compat_id: str,
                 sequence: Sequence_, prompt_blocks: list[str], prompt_tail: list[int],
                 sampler: SamplerSpec, max_new_tokens: int, generated: Sequence[int] = (),
                 step_base: int = 0) -> None:
        self.id = sid
        self.epoch = epoch
        self.tracked = tracked  # checkpointed to the PC (the request named the session)
        self.scope_key = scope_key
        self.scope_id = scope_id_of(scope_key).hex()
        self.compat_id = compat_id
        self.sequence = sequence
        self.prompt_blocks = prompt_blocks
        self.prompt_tail = prompt_tail
        self.sampler = sampler
        self.max_new_tokens = max_new_tokens
        self.generated: list[int] = list(generated)
        self.step_base = step_base
        self.released = len(self.generated)
        self.acked = len(self.generated)
        self.checkpointed = len(self.generated)  # output_offset last sent
        self.state = "loading"
        self.error: str | None = None
        self.ttft_ms: float | None = None
        self.cached_tokens = 0
        self.sources: dict[str, int] = {"moqt": 0, "http": 0, "recompute": 0}
        #: blocks a prefetch directive brought for this request, by transport
        self.prefetched: dict[str, int] = {}
        #: whether the instance loaded or recomputed the cached prefix, and why
        self.load_choice: LoadChoice | None = None
        self.load: dict[str, Any] | None = None
        #: milliseconds: until the load plan was made, loading, the prefill's forward pass
        self.timing: dict[str, float] = {}
        self.timeline: Timeline | None = None
        #: float32 next-token logits after the prefill (what the first token was sampled from)
        self.first_logits: torch.Tensor | None = None
        self.exported = 0  # blocks [0, exported) are stored (or were not stored, and never will be)
        self.loaded = 0  # blocks [0, loaded) came from other holders (not replicated again)
        self.started = time.perf_counter()
        self.task: asyncio.Task | None = None
        self.done = asyncio.Event()
        self._changed = asyncio.Event()
        self._ckpt_wake = asyncio.Event()
        self._acked_event = asyncio.Event()
        self.first_checkpoint_sent = False
        self.checkpointer: asyncio.Task | None = None
        self.closing = False  # no more checkpoints: the session is being ended at the PC

    @property
    def finished(self) -> bool:
        return self.state in ("finished", "failed", "moved", "cancelled")

    def notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def release(self, upto: int) -> None:
        if upto > self.released:
            self.released = min(upto, len(self.generated))
            self.notify()

    def end(self, state: str, error: str | None = None) -> None:
        if self.finished:
            return
        self.state = state
        self.error = error
        self.done.set()
        self._ckpt_wake.set()
        self._acked_event.set()
        self.notify()

    async def stream(self, start: int = 0) -> AsyncIterator[dict[str, Any]]:
        """Released tokens from index `start`, then {"done": true} when the session finished.

        When the session moved, failed or was stopped here the stream breaks off (raises), as
        a dying instance's would, so the front end asks the PC where the session continues
        rather than taking a clean end for the end of the session.
        """
        index = start
        while True:
            changed = self._changed
            while index < self.released:
                yield {"index": index, "epoch": self.epoch, "token": self.generated[index]}
                index += 1
            if self.finished:
                if self.state == "finished":
                    yield {"done": True}
                    return
                raise StreamBroken(f"session {self.id} {self.state} here: {self.error or ''}")
            await changed.wait()

    def checkpoint(self, upto: int) -> SessionCheckpoint:
        return SessionCheckpoint(
            session=self.id, epoch=self.epoch, compat_id=self.compat_id, scope_id=self.scope_id,
            prompt_blocks=tuple(self.prompt_blocks), prompt_tail=tuple(self.prompt_tail),
            generated=tuple(self.generated[:upto]), output_offset=upto,
            sampler=self.sampler.record(self.step_base + upto, self.max_new_tokens))

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "session": self.id, "epoch": self.epoch, "state": self.state,
            "tokens": list(self.generated), "released": self.released,
            "cached_tokens": self.cached_tokens, "ttft_ms": self.ttft_ms,
            "sources": dict(self.sources),
        }
        if self.error:
            out["error"] = self.error
        if self.load is not None:
            out["load"] = self.load
        if self.load_choice is not None:
            out["load_choice"] = self.load_choice.to_json()
        out["timing"] = dict(self.timing)
        return out


# --------------------------------------------------------------------------- engine


@dataclass
class EngineOptions:
    """The engine's tunables (the agent's settings pick them)."""

    block_tokens: int = 16
    lease_ms: int = 10_000
    load_concurrency: int = 8
    layers_per_request: int | None = None
    #: non-deterministic samplers: tokens per checkpoint before they are released
    release_batch: int = 4
    #: non-deterministic samplers: how far decoding may run ahead of acknowledgements
    max_unacked: int = 64
    #: pause between output tokens (pacing for demos and failover tests); 0: none
    token_interval_s: float = 0.0
    max_new_tokens: int = 4096
    #: holders each new block is also stored at, so that it outlives this instance
    replicate_to: tuple[str, ...] = ()
    #: how long a finished session stays readable by streams ...
    keep_finished_s: float = 300.0
    #: ... and how many at most: the oldest go first, so that memory does not follow the
    #: request rate (each holds its prompt, output and block keys)
    keep_finished: int = 1024
    publish_wait_s: float = 5.0
    #: compute while loading (DESIGN §5); False loads the whole prefix first (a baseline)
    pipelined: bool = True
    #: keep each session's first logits (for checks against a recompute): a tensor the size
    #: of the vocabulary per kept session, 0.5 MiB for a 128k vocabulary
    keep_first_logits: bool = False
    #: choose between loading a cached prefix and recomputing it by the §6.4 estimates with
    #: this instance's measured rates (`agent.choice`); False always loads what it can
    choose_by_cost: bool = True
    #: after this many recomputes in a row, load anyway so that the link is measured again
    probe_every: int = 8


class Engine:
    """Generates for requests and sessions with the agent's model, store and index."""

    def __init__(self, adapter: ModelAdapter, *, store: BlockStore, announce: Callable[[Any], None],
                 is_published: Callable[[BlockId], bool], record_for: Callable[[Any], ReplicaRecord],
                 client: httpx.AsyncClient, index: IndexClient | None, leases: LeaseClient,
                 sources: Sequence[LayerSource], local: LocalLayerSource,
                 scope_keys: Mapping[str, bytes], default_scope: str | None,
                 self_url: Callable[[], str], pc_url: str | None = None, token: str | None = None,
                 options: EngineOptions | None = None, meters: "Meters | None" = None,
                 prefetching: Callable[[BlockId], "asyncio.Future[Any] | None"] | None = None) -> None:
        self.adapter = adapter
        #: a prefetch's load of a block in flight (`Prefetcher.adopt`): a request waits for it
        #: rather than loading the same block a second time beside it
        self.prefetching = prefetching
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
        self.pc_url = base_url(pc_url) if pc_url else pc_url
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.meters = meters
        self.model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvsp-model")
        self.sessions: dict[str, Session] = {}
        #: requests (generate and resume) admitted since start: the status record's "admitted"
        self.admitted = 0
        self.state = "active"
        self._tasks: set[asyncio.Task] = set()
        self._finished: deque[tuple[float, Session]] = deque()  # (forget at, session), in order
        self._sweeper: asyncio.Task | None = None
        self._loaders: set[PrefixLoader] = set()
        self._last_logits: dict[str, torch.Tensor] = {}

    # ---------------------------------------------------------------- bookkeeping

    @property
    def running(self) -> int:
        return sum(1 for s in self.sessions.values() if s.state == "running")

    @property
    def queued(self) -> int:
        return sum(1 for s in self.sessions.values() if s.state == "loading")

    def _spawn(self, coro: Any, name: str | None = None) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

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
        for t in list(self._tasks):
            t.cancel()
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

    async def _model(self, fn: Callable[..., Any], *args: Any) -> Any:
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

        prefill_s, decode_s = await self._model(run)
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
        session = Session(sid, epoch=1, tracked=req.session is not None and self.pc_url is not None,
                          scope_key=key, compat_id=self.compat_id,
                          sequence=Sequence_(chain, 0, list(req.tokens)),
                          prompt_blocks=[k.hex() for k in chain.keys[:full]],
                          prompt_tail=list(req.tokens[full * b:]), sampler=req.sampler,
                          max_new_tokens=req.max_new_tokens)
        self.sessions[sid] = session
        self.admitted += 1
        session.task = self._spawn(self._run(session, None, want_timeline=req.timeline),
                                   name=f"session-{sid}")
        return session

    async def resume(self, sid: str, body: Any) -> Session:
        """POST {ii}sessions/{id}/resume (§6.8): continue a session under a new epoch."""
        body = v.obj(body, "body")
        cp = SessionCheckpoint.from_json(v.required(body, "checkpoint"))
        epoch = v.integer(v.required(body, "epoch"), "epoch")
        if cp.session != sid:
            raise BadRecord("differs from the session in the path", member="checkpoint.session")
        if epoch < cp.epoch:
            raise StaleEpoch(f"epoch {epoch} is older than the checkpoint's {cp.epoch}", member="epoch")
        existing = self.sessions.get(sid)
        if existing is not None and existing.epoch >= epoch:
            raise StaleEpoch(f"session {sid} is already at epoch {existing.epoch} here", member="epoch")
        if self.state != "active":
            raise NotActive(f"this instance is {self.state}")
        if cp.compat_id != self.compat_id:
            raise BadRecord("is not this instance's compatibility ID", member="checkpoint.compat_id")
        key = self.scopes_by_id.get(cp.scope_id)
        if key is None:
            raise BadRecord("no key of this scope here", member="checkpoint.scope_id")
        spec = SamplerSpec.from_json(cp.sampler.to_json(), "checkpoint.sampler")
        max_new = cp.sampler.params.get("max_new_tokens", self.options.max_new_tokens)
        max_new = v.integer(max_new, "checkpoint.sampler.params.max_new_tokens", low=1,
                            high=self.options.max_new_tokens)
        b = self.block_tokens
        offset = cp.output_offset
        generated = list(cp.generated[:offset])
        chain = BlockKeyChain(key, self.descriptor.compat_id, b,
                              keys=[bytes.fromhex(k) for k in cp.prompt_blocks])
        known = list(cp.prompt_tail) + generated
        chain.extend(known)
        sequence = Sequence_(chain, len(cp.prompt_blocks), known)
        plan = await self._plan(cp.scope_id, [k.hex() for k in chain.keys], sequence)
        if len(plan) < len(cp.prompt_blocks):
            raise PrefixUnavailable(f"{len(cp.prompt_blocks) - len(plan)} of {len(cp.prompt_blocks)} "
                                    "prompt blocks have no replica here or in the index")
        if existing is not None and existing.task is not None and not existing.task.done():
            existing.task.cancel()
            existing.end("moved", f"resumed under epoch {epoch}")
        session = Session(sid, epoch=epoch, tracked=self.pc_url is not None, scope_key=key,
                          compat_id=self.compat_id, sequence=sequence,
                          prompt_blocks=list(cp.prompt_blocks), prompt_tail=list(cp.prompt_tail),
                          sampler=spec, max_new_tokens=max_new, generated=generated,
                          step_base=cp.sampler.step - offset)
        session.first_checkpoint_sent = True
        self.sessions[sid] = session
        self.admitted += 1
        session.task = self._spawn(self._run(session, plan, want_timeline=False),
                                   name=f"session-{sid}")
        return session

    # ---------------------------------------------------------------- planning

    async def _plan(self, scope_id: str, keys: list[str], sequence: Sequence_,
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
            if local[i] is not None:
                records.insert(0, local[i])  # type: ignore[arg-type]
            candidates = order_candidates(records, [self.local, *self.sources])
            if not candidates:
                break
            plan.append(candidates)
        return plan

    def _choose(self, session: Session, plan: list[list[Candidate]]) -> list[list[Candidate]]:
        """The plan, or only its leading resident blocks when recomputing the rest is cheaper
        than loading it (`agent.choice`); the choice is kept on the session."""
        resident = next((i for i, c in enumerate(plan) if c[0].source.kind != "local"), len(plan))
        remote = [c[0].record for c in plan if c[0].source.kind != "local"]
        meters = self.meters
        choice = choose(instance=self.self_url(),
                        prefill_tokens_per_s=meters.prefill.value if meters else None,
                        links=meters.links() if meters else (), matched_blocks=len(plan),
                        resident_blocks=resident, remote=remote, block_tokens=self.block_tokens,
                        total_tokens=session.sequence.length,
                        probe=self._recomputed_in_a_row + 1 >= self.options.probe_every)
        session.load_choice = choice
        if remote:
            self._recomputed_in_a_row = 0 if choice.load else self._recomputed_in_a_row + 1
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
            self._forget_later(session)

    async def _generate(self, session: Session, plan: list[list[Candidate]] | None,
                        want_timeline: bool) -> None:
        seq = session.sequence
        b = self.block_tokens
        if len(session.generated) >= session.max_new_tokens:
            await self._finish(session)
            return
        if plan is None:
            plan = await self._plan(session.scope_id, [k.hex() for k in seq.chain.keys], seq,
                                    session.prefetched)
            if self.options.choose_by_cost and seq.known_blocks == 0:
                plan = self._choose(session, plan)
        sampler = session.sampler.model_sampler()
        step = session.step_base + len(session.generated)
        state, token, report, timeline = await self._prefill(session, plan, sampler, step)
        session.first_logits = self._last_logits.pop(session.id, None)
        session.timeline = timeline if want_timeline else None
        session.state = "running"
        # Loaded blocks are stored here too (after the first token): the next request with
        # this prefix finds them local, and the index gets one more replica to place by.
        session.loaded = report.loaded if report else 0
        self._produced(session, token)
        await self._export(session, state)
        while len(session.generated) < session.max_new_tokens:
            if session.finished:
                return
            await self._backpressure(session)
            if self.options.token_interval_s > 0:
                await asyncio.sleep(self.options.token_interval_s)
            step = session.step_base + len(session.generated)
            started = time.perf_counter()
            token = await self._model(self._decode_sample, session.generated[-1], state, sampler, step)
            if self.meters is not None:
                self.meters.decoded(1, time.perf_counter() - started)
            self._produced(session, token)
            await self._export(session, state)
        if seq.length % b == 0 and state.length == seq.length - 1:
            # The last token completes a block: feed it so that the block can be stored too.
            await self._model(self.adapter.extend, state, [session.generated[-1]])
            await self._export(session, state)
        await self._finish(session)

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
            state, token = await self._model(self._prefill_sample, session.id, seq.tokens_from(0),
                                             None, sampler, step)
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
            run_forward = functools.partial(self._model, self._prefill_sample, session.id, suffix,
                                            prefix, sampler, step, timeline)
            forward = asyncio.ensure_future(run_forward()) if self.options.pipelined else None
            try:
                report = await loader.run()
            except BaseException:
                if forward is not None:
                    forward.cancel()
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
                state, token = await self._model(self._prefill_sample, session.id, rest, past,
                                                 sampler, step)
                self._note_prefill(session, len(rest), time.perf_counter() - started)
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
        session.cached_tokens = loaded * b
        session.sources["recompute"] = max(0, seq.length // b - loaded)
        session.ttft_ms = round((time.perf_counter() - session.started) * 1000, 3)
        return state, token, report, timeline

    def _note_prefill(self, session: Session, tokens: int, seconds: float) -> None:
        if self.meters is not None and tokens > 0:
            self.meters.prefilled(tokens, seconds)

    # model-thread functions ------------------------------------------------

    def _prefill_sample(self, sid: str, tokens: list[int], past: KVPrefix | None, sampler: TokenSampler,
                        step: int, timeline: Timeline | None = None) -> tuple[DecodeState, int]:
        if timeline is not None:
            timeline.forward_start = time.perf_counter()
        result = self.adapter.prefill(tokens, past=past, return_kv=False)
        if timeline is not None:
            timeline.forward_end = time.perf_counter()
        if self.options.keep_first_logits:
            self._last_logits[sid] = result.logits.detach().to("cpu")
        return result.state, sampler.sample(result.logits, step)

    def _decode_sample(self, token: int, state: DecodeState, sampler: TokenSampler, step: int) -> int:
        return sampler.sample(self.adapter.decode(token, state), step)

    def _block_octets(self, state: DecodeState, start: int, end: int) -> bytes:
        return block_container(self.adapter.kv_for_range(state, start, end))

    # ---------------------------------------------------------------- tokens, blocks

    def _produced(self, session: Session, token: int) -> None:
        session.generated.append(token)
        session.sequence.append(token)
        n = len(session.generated)
        b = self.block_tokens
        if not session.tracked:
            session.release(n)
            return
        if session.sampler.deterministic:
            session.release(n)
            due = (not session.first_checkpoint_sent or session.sequence.length % b == 0
                   or n - session.checkpointed >= min(CHECKPOINT_EVERY, b))
        else:
            due = n - session.acked >= self.options.release_batch or session.sequence.length % b == 0
        if due:
            self._request_checkpoint(session)

    async def _export(self, session: Session, state: DecodeState) -> None:
        """Store and publish every complete block whose KV is now cached and not held yet."""
        b = self.block_tokens
        ready = min(state.length // b, len(session.sequence.chain.keys))
        for i in range(session.exported, ready):
            key = session.sequence.chain.keys[i].hex()
            bid = BlockId(self.compat_id, session.scope_id, key)
            if bid in self.store:
                continue
            octets = await self._model(self._block_octets, state, i * b, (i + 1) * b)
            try:
                entry = await self.store.put(bid, octets)
            except KvspError as e:  # e.g. 412 from a concurrent put, or a full store
                log.info("block %s not stored: %s", key[:12], e.detail)
                continue
            self.announce(entry)
            if i >= session.loaded:  # a loaded block has its replicas already
                for holder in self.options.replicate_to:
                    self._spawn(self._replicate(holder, bid, octets))
        session.exported = max(session.exported, ready)

    async def _replicate(self, holder: str, bid: BlockId, octets: bytes) -> None:
        url = f"{holder.rstrip('/')}/blocks/{bid.path}"
        try:
            r = await self.client.put(url, content=octets, headers={
                **self.headers, "If-None-Match": "*", "Content-Type": "application/kvsp-block"})
            if r.status_code not in (201, 204, 412):
                log.info("replicating %s to %s: HTTP %d", bid.block_key[:12], holder, r.status_code)
        except httpx.HTTPError as e:
            log.info("replicating %s to %s failed: %s", bid.block_key[:12], holder, e)

    async def wait_published(self, session: Session) -> None:
        """Until the blocks this session stored are in the index (bounded): a client that got
        the answer can count on the next lookup finding them."""
        if self.index is None:
            return
        deadline = time.monotonic() + self.options.publish_wait_s
        keys = [k.hex() for k in session.sequence.chain.keys[:session.exported]]
        pending = [BlockId(self.compat_id, session.scope_id, k) for k in keys]
        pending = [bid for bid in pending if self.store.get(bid) is not None]
        for _ in range(int(self.options.publish_wait_s / 0.005) + 1):
            pending = [bid for bid in pending
                       if not self.is_published(bid) and self.store.get(bid) is not None]
            if not pending or time.monotonic() > deadline:
                return
            await asyncio.sleep(0.005)

    # ---------------------------------------------------------------- checkpoints

    def _request_checkpoint(self, session: Session) -> None:
        if session.checkpointer is None:
            session.checkpointer = self._spawn(self._checkpointer(session))
        session._ckpt_wake.set()

    async def _checkpointer(self, session: Session) -> None:
        """Sends checkpoints one at a time, each covering every token produced so far."""
        backoff = 0.05
        while True:
            await session._ckpt_wake.wait()
            session._ckpt_wake.clear()
            if session.state in ("moved", "cancelled", "failed"):
                return
            upto = len(session.generated)
            if session.closing and (session.sampler.deterministic or upto <= session.acked):
                return
            if upto <= session.acked:
                continue
            try:
                await self._put_checkpoint(session, upto)
            except StaleEpoch as e:
                log.warning("session %s moved on (%s); stopping here", session.id, e.detail)
                if session.task is not None and session.task is not asyncio.current_task():
                    session.task.cancel()
                session.end("moved", e.detail)
                return
            except KvspError as e:
                log.info("checkpoint of %s failed (%s); retrying", session.id, e.detail)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
                session._ckpt_wake.set()
                continue
            backoff = 0.05
            session.acked = max(session.acked, upto)
            session.checkpointed = max(session.checkpointed, upto)
            session.first_checkpoint_sent = True
            if not session.sampler.deterministic:
                session.release(upto)
            session._acked_event.set()
            session._acked_event = asyncio.Event()
            if len(session.generated) > session.acked:
                session._ckpt_wake.set()

    async def _put_checkpoint(self, session: Session, upto: int) -> None:
        body = session.checkpoint(upto).to_json()
        body["instance"] = self.self_url()
        try:
            r = await self.client.put(f"{self.pc_url}sessions/{session.id}/checkpoint", json=body,
                                      headers=self.headers)
        except httpx.HTTPError as e:
            raise TransportError(f"PC {self.pc_url}: {type(e).__name__} {e}") from None
        raise_for_problem(r)

    async def _backpressure(self, session: Session) -> None:
        """Non-deterministic sessions stop running ahead of the PC's acknowledgements."""
        if not session.tracked or session.sampler.deterministic:
            return
        for _ in range(600):
            if len(session.generated) - session.acked < self.options.max_unacked or session.finished:
                return
            waiter = session._acked_event
            try:
                await asyncio.wait_for(waiter.wait(), 0.1)
            except (asyncio.TimeoutError, TimeoutError):
                pass
        raise TransportError("the PC has not acknowledged checkpoints for a minute")

    async def _finish(self, session: Session) -> None:
        if session.tracked:
            if not session.sampler.deterministic:
                self._request_checkpoint(session)
                for _ in range(600):
                    if session.acked >= len(session.generated) or session.finished:
                        break
                    waiter = session._acked_event
                    try:
                        await asyncio.wait_for(waiter.wait(), 0.1)
                    except (asyncio.TimeoutError, TimeoutError):
                        pass
                if session.acked < len(session.generated):
                    raise TransportError("the final checkpoint was never acknowledged")
            session.release(len(session.generated))
            # No checkpoint may reach the PC after the session is ended there: it would
            # bring the session back to life.
            session.closing = True
            if session.checkpointer is not None:
                session._ckpt_wake.set()
                try:
                    await asyncio.wait_for(asyncio.shield(session.checkpointer), 10)
                except (asyncio.TimeoutError, TimeoutError):
                    session.checkpointer.cancel()
            try:
                r = await self.client.delete(f"{self.pc_url}sessions/{session.id}",
                                             headers=self.headers)
                if r.status_code not in (204, 404):
                    log.info("ending session %s at the PC: HTTP %d", session.id, r.status_code)
            except httpx.HTTPError as e:
                log.info("ending session %s at the PC failed: %s", session.id, e)
        session.release(len(session.generated))
        session.end("finished")


# --------------------------------------------------------------------------- resharding (§6.9)


Range = tuple[int, int]


@dataclass
class _Shards:
    version: int
    held: dict[Range, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    pending: dict[Range, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    pending_to: int | None = None
    plan: ReshardPlan | None = None
    last: dict[str, Any] = field(default_factory=dict)


class ShardKeeper:
    """Token ranges of sequence-sharded contexts held here, and their moves between versions.

    A plan's "fetch" ranges are read from the named instance with
    `GET {ii}kv?map=M&tokens=a-b` (a KVB1 container of every layer of tokens [a, b), with
    Repr-Digest) and kept aside until commit; "retain" ranges stay where they are and are never
    transferred; commit installs the fetched ranges and drops the "release" ones; abort drops
    what was fetched. `PUT {ii}shards/{map}` seeds the ranges of a context by computing it.
    """

    def __init__(self, adapter: ModelAdapter, model: Callable[..., Any], client: httpx.AsyncClient,
                 *, token: str | None = None) -> None:
        self.adapter = adapter
        self.model = model
        self.client = client
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.maps: dict[str, _Shards] = {}

    async def seed(self, name: str, body: Any) -> dict[str, Any]:
        body = v.obj(body, "body")
        version = v.integer(v.required(body, "version"), "version")
        tokens = v.tokens(v.required(body, "tokens"), "tokens")
        listed = v.array(v.required(body, "ranges"), "ranges", lambda x, m: x)
        ranges = [_range(r, f"ranges[{i}]") for i, r in enumerate(listed)]
        end = max((b for _, b in ranges), default=0)
        if not tokens or end > len(tokens):
            raise BadRecord("ranges must lie within the tokens", member="ranges")

        def compute() -> dict[Range, list]:
            if not ranges:
                return {}
            result = self.adapter.prefill(tokens[:end], return_kv=False)
            return {(a, b): self.adapter.kv_for_range(result.state, a, b) for a, b in ranges}

        held = await self.model(compute)
        self.maps[name] = _Shards(version, held)
        return self.status(name)

    def container(self, name: str, a: int, b: int) -> bytes:
        shards = self.maps.get(name)
        if shards is None:
            raise NotFound(f"no shards of map {name!r} here")
        for (x, y), kv in shards.held.items():
            if x <= a and b <= y:
                return block_container([(k[a - x:b - x], vv[a - x:b - x]) for k, vv in kv])
        raise NotFound(f"tokens {a}-{b} of map {name!r} are not held here")

    async def handle(self, body: Any) -> tuple[int, dict[str, Any]]:
        msg = parse_reshard(body)
        if isinstance(msg, ReshardDecision):
            return 200, self._decide(msg)
        return await self._plan(msg)

    async def _plan(self, plan: ReshardPlan) -> tuple[int, dict[str, Any]]:
        shards = self.maps.setdefault(plan.map, _Shards(plan.from_version))
        if shards.version != plan.from_version:
            raise StaleEpoch(f"map {plan.map!r} is at version {shards.version} here, "
                             f"not {plan.from_version}", member="from")
        missing = [r for r in plan.retain if not self._covered(shards, r)]
        fetched: list[dict[str, Any]] = []

        async def one(fetch: Any) -> None:
            a, b = fetch.tokens
            kv, octets = await self._fetch(fetch.source, plan.map, a, b)
            shards.pending[(a, b)] = kv
            fetched.append({"tokens": [a, b], "from": fetch.source, "bytes": octets})

        shards.pending = {}
        shards.pending_to = plan.to_version
        shards.plan = plan
        started = time.perf_counter()
        try:
            await asyncio.wait_for(asyncio.gather(*(one(f) for f in plan.fetch)),
                                   plan.deadline_ms / 1000)
            state, status = "acknowledged", 200
        except (asyncio.TimeoutError, TimeoutError):
            state, status = "timed-out", 504
        except KvspError as e:
            state, status = f"failed: {e.detail}", 502
        shards.last = {"from": plan.from_version, "to": plan.to_version, "state": state,
                       "fetched": sorted(fetched, key=lambda f: f["tokens"]),
                       "retained": [list(r) for r in plan.retain],
                       "retained_missing": [list(r) for r in missing],
                       "release": [list(r) for r in plan.release],
                       "transferred_bytes": sum(f["bytes"] for f in fetched),
                       "seconds": round(time.perf_counter() - started, 6)}
        return status, self.status(plan.map)

    def _covered(self, shards: _Shards, r: Range) -> bool:
        return any(x <= r[0] and r[1] <= y for x, y in shards.held)

    def _decide(self, d: ReshardDecision) -> dict[str, Any]:
        shards = self.maps.get(d.map)
        if shards is None:
            raise NotFound(f"no shards of map {d.map!r} here")
        if d.kind == "commit":
            if shards.version == d.version:
                return self.status(d.map)  # delivered twice
            if shards.pending_to != d.version or shards.plan is None:
                raise StaleEpoch(f"no plan towards version {d.version} here", member="commit")
            for r in shards.plan.release:
                _drop_range(shards.held, r)
            shards.held.update(shards.pending)
            shards.version = d.version
            shards.last["state"] = "committed"
        else:
            if shards.pending_to == d.version:
                shards.last["state"] = "aborted"
        shards.pending = {}
        shards.pending_to = None
        shards.plan = None
        return self.status(d.map)

    async def _fetch(self, source: str, name: str, a: int, b: int) -> tuple[list, int]:
        url = f"{source.rstrip('/')}/kv"
        try:
            r = await self.client.get(url, params={"map": name, "tokens": f"{a}-{b}"},
                                      headers=self.headers)
        except httpx.HTTPError as e:
            raise TransportError(f"{url}: {type(e).__name__} {e}") from None
        raise_for_problem(r)
        body = r.content
        expected = parse_repr_digest(r.headers.get("repr-digest"))
        if expected is None or hashlib.sha256(body).digest() != expected:
            raise DigestMismatch(f"tokens {a}-{b} from {source}: Repr-Digest missing or wrong")
        c = Container(body)
        ad = self.adapter
        if c.token_count != b - a or c.layer_count != ad.num_layers or c.first_layer != 0:
            raise BadRecord(f"tokens {a}-{b} from {source}: wrong geometry", member="body")
        shape = (b - a, ad.num_kv_heads, ad.head_dim)
        kv = []
        for layer in c.layers():
            k = tensor_from_octets(layer.k, ad.dtype).view(shape).clone()
            vv = tensor_from_octets(layer.v, ad.dtype).view(shape).clone()
            kv.append((k, vv))
        return kv, len(body)

    def status(self, name: str) -> dict[str, Any]:
        shards = self.maps.get(name)
        if shards is None:
            raise NotFound(f"no shards of map {name!r} here")
        return {"map": name, "version": shards.version,
                "ranges": sorted([list(r) for r in shards.held]),
                "pending": sorted([list(r) for r in shards.pending]),
                "pending_to": shards.pending_to, "last": shards.last}


def _range(value: Any, member: str) -> Range:
    a, b = v.pair(value, member)
    if a >= b:
        raise BadRecord("a half-open token range needs start < end", member=member)
    return a, b


def _drop_range(held: dict[Range, list], r: Range) -> None:
    """Remove tokens [r) from the held ranges, keeping what lies outside it."""
    for (x, y) in list(held):
        if y <= r[0] or x >= r[1]:
            continue
        kv = held.pop((x, y))
        if x < r[0]:
            held[(x, r[0])] = [(k[:r[0] - x].clone(), vv[:r[0] - x].clone()) for k, vv in kv]
        if r[1] < y:
            held[(r[1], y)] = [(k[r[1] - x:].clone(), vv[r[1] - x:].clone()) for k, vv in kv]


__all__ = ["Engine", "EngineOptions", "GenerateRequest", "NotActive", "PrefixUnavailable",
           "SamplerSpec", "Session", "ShardKeeper"]
