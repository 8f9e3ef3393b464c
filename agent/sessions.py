"""A generation session on this instance: its tokens, epoch, sampler state and output stream.

A `Session` is one generation (named by its request, or given an id here). Its
`TokenSequence` is the sequence as far as this instance knows it: a resumed session knows its
prompt blocks by key only. Output tokens are labelled with their index and the session epoch and
go to readers of `stream` once released (`agent.checkpoints` says when a token may be released);
a session that moved, failed or was stopped here breaks its streams off (`StreamBroken`).

The engine drives a session through a small interface: `add_token`, `release`, `end`; the
checkpoint publisher's `wake_checkpointer`, `checkpoint_wanted`, `acknowledged` and
`wait_acknowledged`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Sequence

import torch

from agent.checkpoints import build_checkpoint
from agent.choice import LoadChoice
from agent.requests import SamplerSpec
from kvsp_moq.fetch.prefix import Timeline
from kvsp_moq.protocol.keys import BlockKeyChain
from kvsp_moq.protocol.keys import scope_id as scope_id_of
from kvsp_moq.protocol.records import SessionCheckpoint

if TYPE_CHECKING:
    from agent.pool import KVPool
    from kvsp_moq.holder.moqt_publisher import LiveBlock


class StreamBroken(Exception):
    """Ends an output stream abnormally: the session no longer continues on this instance."""


@dataclass
class TokenSequence:
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
                 sequence: TokenSequence, prompt_blocks: list[str], prompt_tail: list[int],
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
        #: the pool the loaded blocks are in, until they are stored
        self.loaded_pool: KVPool | None = None
        #: the layer digests each loaded block was checked against, where all are known
        self.loaded_digests: list[list[bytes] | None] = []
        #: blocks this session's prefill publishes live (`agent.live`), by key, until stored
        self.live: dict[str, LiveBlock] = {}
        #: the instance computing this session's prompt blocks live for it (prefill and decode
        #: apart), None when this instance loads or computes them itself
        self.prefill_at: str | None = None
        #: how many leading prompt blocks `prefill_at` computes (None: all it can)
        self.prefill_blocks: int | None = None
        #: its pass tracks, each (first block, block count) (DESIGN §9.4)
        self.prefill_passes: tuple[tuple[int, int], ...] = ()
        #: the instance this one stopped computing the prompt for, because it computes it too
        #: and wins (`agent.live.Outpaced`); a session gives way at most once
        self.outpaced_by: str | None = None
        #: prompt blocks loaded from live tracks: key -> their producer's HTTP base
        self.live_loaded: dict[str, str] = {}
        #: the client stopped the session (DELETE {ii}sessions/{id}): over for good
        self.stopped_by_client = False
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

    def add_token(self, token: int) -> None:
        """The next output token, produced (not yet released)."""
        self.generated.append(token)
        self.sequence.append(token)

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

    # checkpoints (agent.checkpoints) ----------------------------------------

    def wake_checkpointer(self) -> None:
        """Ask the session's checkpoint publisher for a checkpoint of everything produced."""
        self._ckpt_wake.set()

    async def checkpoint_wanted(self) -> None:
        """Until a checkpoint is asked for (or the session ended); takes the request."""
        await self._ckpt_wake.wait()
        self._ckpt_wake.clear()

    def acknowledged(self, upto: int) -> None:
        """The PC acknowledged the checkpoint of the first `upto` tokens: a non-deterministic
        session releases them, a deterministic one everything (it can be replayed from the
        prompt), and whoever waits for an acknowledgement wakes up."""
        self.acked = max(self.acked, upto)
        self.checkpointed = max(self.checkpointed, upto)
        self.first_checkpoint_sent = True
        # Deterministic tokens were held back only until the PC knew the session at all.
        self.release(len(self.generated) if self.sampler.deterministic else upto)
        self._acked_event.set()
        self._acked_event = asyncio.Event()

    async def wait_acknowledged(self, timeout: float) -> None:
        """Until the next acknowledgement, the session's end or `timeout` seconds."""
        waiter = self._acked_event
        try:
            await asyncio.wait_for(waiter.wait(), timeout)
        except (asyncio.TimeoutError, TimeoutError):
            pass

    # reading ------------------------------------------------------------------

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
        """The §6.8 checkpoint of the first `upto` output tokens (`agent.checkpoints`)."""
        return build_checkpoint(self, upto)

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


__all__ = ["Session", "StreamBroken", "TokenSequence"]
