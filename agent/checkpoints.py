"""Session Checkpoints (KVSP §6.8): building them, publishing them to the PC, resuming from them.

Building. `build_checkpoint` is the record of a session's first `upto` output tokens (what
`Session.checkpoint` returns): its epoch, compat and scope, the prompt as its complete blocks'
keys plus `prompt_tail` (the prompt tokens after the last complete block), the generated tokens,
`output_offset` and the sampler at its step. Two members travel beyond §4.4, both ignored by
other parties: "instance" (the serving instance's URL, which the PC needs for a session it has
not placed) and `sampler.params.max_new_tokens` (where the session stops; the sampler object is
the only part of the checkpoint the PC keeps verbatim).

Publishing. A session that named itself in its request is tracked: `Checkpointer` sends its
checkpoints with `PUT {pc}sessions/{id}/checkpoint`, one at a time, each covering every token
produced so far. `checkpoint_due` says when one is owed: at each completed block of generated
tokens and at least every 64 output tokens (every block, when blocks are shorter); the first
one, of the prompt alone, goes out at admission, beside the prefill, and no token is released
before the PC has acknowledged it: a token a client has seen belongs to a session the PC can
resume. Every output token is labelled with its index and the session epoch. With a non-deterministic sampler (top-p)
a token is released to the stream only once the PC has acknowledged a checkpoint covering it;
checkpoints then go out every `release_batch` tokens, and decoding runs ahead of the
acknowledgements by at most `max_unacked` tokens. A PC that answers kvsp-stale-epoch has moved
the session on: it stops here ("moved"). At its end the session is deleted at the PC, and no
checkpoint may follow (it would bring the session back to life).

Resuming. `read_resume` and `resume_point` check `POST {ii}sessions/{id}/resume` against this
instance: a new epoch older than the checkpoint's or than the session's epoch here is refused
(kvsp-stale-epoch); the result names the prompt blocks to load (their tokens are unknown here),
the tokens to recompute after them (prompt_tail and generated), the sampler restored at its step
and the session's limit. The engine loads what it can and continues from output_offset under the
new epoch.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

import httpx

from agent.options import EngineOptions
from agent.requests import SamplerSpec
from kvsp_moq.errors import BadRecord, KvspError, StaleEpoch, TransportError
from kvsp_moq.index_client import raise_for_problem
from kvsp_moq.pc_endpoints import PCEndpoints
from kvsp_moq.protocol import validate as v
from kvsp_moq.protocol.compat import CompatDescriptor
from kvsp_moq.protocol.keys import BlockKeyChain
from kvsp_moq.protocol.records import Sampler as SamplerRecord
from kvsp_moq.protocol.records import SessionCheckpoint

if TYPE_CHECKING:
    from agent.sessions import Session

log = logging.getLogger("kvsp.agent.checkpoints")

#: Checkpoints at least this often (§6.8), whatever the block size.
CHECKPOINT_EVERY = 64


# --------------------------------------------------------------------------- building


def sampler_record(spec: SamplerSpec, step: int, max_new_tokens: int) -> SamplerRecord:
    """The checkpoint's sampler: `spec` at `step`, with the session's `max_new_tokens` in its params."""
    params = {k: val for k, val in spec.params.items() if k != "max_new_tokens"}
    params["max_new_tokens"] = max_new_tokens
    return SamplerRecord(spec.method, params, spec.seed, step, spec.deterministic)


def build_checkpoint(session: "Session", upto: int) -> SessionCheckpoint:
    """The checkpoint of `session` covering its first `upto` output tokens."""
    return SessionCheckpoint(
        session=session.id, epoch=session.epoch, compat_id=session.compat_id,
        scope_id=session.scope_id, prompt_blocks=tuple(session.prompt_blocks),
        prompt_tail=tuple(session.prompt_tail), generated=tuple(session.generated[:upto]),
        output_offset=upto,
        sampler=sampler_record(session.sampler, session.step_base + upto, session.max_new_tokens))


def checkpoint_due(session: "Session", block_tokens: int, release_batch: int) -> bool:
    """Whether a tracked session owes the PC a checkpoint, its latest token just produced."""
    n = len(session.generated)
    block_complete = session.sequence.length % block_tokens == 0
    if session.sampler.deterministic:
        return (not session.first_checkpoint_sent or block_complete
                or n - session.checkpointed >= min(CHECKPOINT_EVERY, block_tokens))
    return n - session.acked >= release_batch or block_complete


# --------------------------------------------------------------------------- publishing


class Checkpointer:
    """Publishes the checkpoints of tracked sessions to the PC and ends them there."""

    def __init__(self, client: httpx.AsyncClient, pc_url: "str | PCEndpoints | None", *,
                 headers: Mapping[str, str],
                 instance_url: Callable[[], str], options: EngineOptions, block_tokens: int,
                 spawn: Callable[[Any], asyncio.Task]) -> None:
        self.client = client
        #: one PC URL, or several PC processes on one store (tried in turn when one fails)
        self.pc = PCEndpoints(pc_url) if pc_url else None
        self.headers = dict(headers)
        self.instance_url = instance_url
        self.options = options
        self.block_tokens = block_tokens
        self.spawn = spawn

    def after_token(self, session: "Session") -> None:
        """A token was produced: release it, or hold it back until a checkpoint covering it is
        acknowledged (non-deterministic samplers); ask for a checkpoint when one is due."""
        n = len(session.generated)
        if not session.tracked:
            session.release(n)
            return
        if session.sampler.deterministic and session.first_checkpoint_sent:
            session.release(n)
        if checkpoint_due(session, self.block_tokens, self.options.release_batch):
            self.request(session)

    def request(self, session: "Session") -> None:
        if session.checkpointer is None:
            session.checkpointer = self.spawn(self._publish(session))
        session.wake_checkpointer()

    async def _publish(self, session: "Session") -> None:
        """Sends checkpoints one at a time, each covering every token produced so far."""
        backoff = 0.05
        while True:
            await session.checkpoint_wanted()
            if session.state in ("moved", "cancelled", "failed"):
                return
            upto = len(session.generated)
            if session.closing and (session.sampler.deterministic or upto <= session.acked):
                return
            if upto <= session.acked and session.first_checkpoint_sent:
                continue
            try:
                await self._put(session, upto)
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
                session.wake_checkpointer()
                continue
            backoff = 0.05
            session.acknowledged(upto)
            if len(session.generated) > session.acked:
                session.wake_checkpointer()

    async def _put(self, session: "Session", upto: int) -> None:
        body = build_checkpoint(session, upto).to_json()
        body["instance"] = self.instance_url()
        assert self.pc is not None  # only tracked sessions are checkpointed
        pc = self.pc.url
        try:
            r = await self.client.put(f"{pc}sessions/{session.id}/checkpoint", json=body,
                                      headers=self.headers)
        except httpx.HTTPError as e:
            self.pc.failed(pc)
            raise TransportError(f"PC {pc}: {type(e).__name__} {e}") from None
        if r.status_code == 503:
            self.pc.failed(pc)
        raise_for_problem(r)

    async def backpressure(self, session: "Session") -> None:
        """Non-deterministic sessions stop running ahead of the PC's acknowledgements."""
        if not session.tracked or session.sampler.deterministic:
            return
        for _ in range(600):
            if len(session.generated) - session.acked < self.options.max_unacked or session.finished:
                return
            await session.wait_acknowledged(0.1)
        raise TransportError("the PC has not acknowledged checkpoints for a minute")

    async def _delete_at_pc(self, session: "Session") -> None:
        """DELETE {pc}sessions/{id}, best effort: the session is over and must not be resumed."""
        assert self.pc is not None
        for _ in self.pc.urls:  # each PC once: a dead one must not leave the session resumable
            pc = self.pc.url
            try:
                r = await self.client.delete(f"{pc}sessions/{session.id}", headers=self.headers)
            except httpx.HTTPError as e:
                self.pc.failed(pc)
                log.info("ending session %s at the PC %s failed: %s", session.id, pc, e)
                continue
            if r.status_code == 503:
                self.pc.failed(pc)
                continue
            if r.status_code not in (204, 404):
                log.info("ending session %s at the PC: HTTP %d", session.id, r.status_code)
            return

    async def drop(self, session: "Session") -> None:
        """A tracked session the client stopped: no further checkpoint, and the session deleted
        at the PC, so that it is not resumed elsewhere."""
        session.closing = True
        if session.checkpointer is not None:
            session.checkpointer.cancel()
        await self._delete_at_pc(session)

    async def end(self, session: "Session") -> None:
        """A tracked session has all its tokens: the last checkpoint of a non-deterministic one
        acknowledged, every token released, the publisher stopped and the session deleted at
        the PC."""
        if not session.sampler.deterministic:
            self.request(session)
            for _ in range(600):
                if session.acked >= len(session.generated) or session.finished:
                    break
                await session.wait_acknowledged(0.1)
            if session.acked < len(session.generated):
                raise TransportError("the final checkpoint was never acknowledged")
        session.release(len(session.generated))
        # No checkpoint may reach the PC after the session is ended there: it would
        # bring the session back to life.
        session.closing = True
        if session.checkpointer is not None:
            session.wake_checkpointer()
            try:
                await asyncio.wait_for(asyncio.shield(session.checkpointer), 10)
            except (asyncio.TimeoutError, TimeoutError):
                session.checkpointer.cancel()
        await self._delete_at_pc(session)


# --------------------------------------------------------------------------- resuming


@dataclass(frozen=True)
class ResumePoint:
    """A checkpoint checked against this instance: where its session continues from."""

    checkpoint: SessionCheckpoint
    epoch: int
    scope_key: bytes
    sampler: SamplerSpec
    max_new_tokens: int
    #: the keys of the prompt blocks, extended over `known`
    chain: BlockKeyChain
    #: the tokens after the prompt blocks: prompt_tail and the generated tokens
    known: list[int]

    @property
    def generated(self) -> list[int]:
        cp = self.checkpoint
        return list(cp.generated[:cp.output_offset])

    @property
    def step_base(self) -> int:
        """The sampler step of output token 0 (the checkpoint's step less output_offset)."""
        return self.checkpoint.sampler.step - self.checkpoint.output_offset


def read_resume(sid: str, body: Any, *, current_epoch: int | None) -> tuple[SessionCheckpoint, int]:
    """The checkpoint and new epoch of `POST {ii}sessions/{sid}/resume`; refused when the epoch
    is older than the checkpoint's or than `current_epoch`, the session's epoch here."""
    body = v.obj(body, "body")
    cp = SessionCheckpoint.from_json(v.required(body, "checkpoint"))
    epoch = v.integer(v.required(body, "epoch"), "epoch")
    if cp.session != sid:
        raise BadRecord("differs from the session in the path", member="checkpoint.session")
    if epoch < cp.epoch:
        raise StaleEpoch(f"epoch {epoch} is older than the checkpoint's {cp.epoch}", member="epoch")
    if current_epoch is not None and current_epoch >= epoch:
        raise StaleEpoch(f"session {sid} is already at epoch {current_epoch} here", member="epoch")
    return cp, epoch


def resume_point(cp: SessionCheckpoint, epoch: int, *, descriptor: CompatDescriptor,
                 scopes_by_id: Mapping[str, bytes], block_tokens: int,
                 max_new_tokens: int) -> ResumePoint:
    """Check a checkpoint against this instance (its compat, a key of its scope, its sampler,
    `max_new_tokens` at most) and rebuild its Block Key chain."""
    if cp.compat_id != descriptor.compat_hex:
        raise BadRecord("is not this instance's compatibility ID", member="checkpoint.compat_id")
    key = scopes_by_id.get(cp.scope_id)
    if key is None:
        raise BadRecord("no key of this scope here", member="checkpoint.scope_id")
    spec = SamplerSpec.from_json(cp.sampler.to_json(), "checkpoint.sampler")
    max_new = cp.sampler.params.get("max_new_tokens", max_new_tokens)
    max_new = v.integer(max_new, "checkpoint.sampler.params.max_new_tokens", low=1,
                        high=max_new_tokens)
    chain = BlockKeyChain(key, descriptor.compat_id, block_tokens,
                          keys=[bytes.fromhex(k) for k in cp.prompt_blocks])
    known = list(cp.prompt_tail) + list(cp.generated[:cp.output_offset])
    chain.extend(known)
    return ResumePoint(cp, epoch, key, spec, max_new, chain, known)


__all__ = ["CHECKPOINT_EVERY", "Checkpointer", "ResumePoint", "build_checkpoint", "checkpoint_due",
           "read_resume", "resume_point", "sampler_record"]
