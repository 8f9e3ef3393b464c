"""What a client asks the inference instance for: `POST {ii}generate` and its sampler (DESIGN §6).

`GenerateRequest` is the checked body of a generate request; `SamplerSpec` is the sampler of a
request or of a §6.8 checkpoint (method, parameters, seed) and makes the `TokenSampler` that
draws the tokens. How a sampler travels in a checkpoint is in `agent.checkpoints`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from agent.model import TokenSampler
from kvsp_moq.errors import BadRecord
from kvsp_moq.protocol import validate as v

METHODS = ("greedy", "top-p")


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
    #: the session's epoch (§6.8): a front end that starts a session again from its prompt,
    #: because its instance was lost before the PC acknowledged a checkpoint, starts it above
    #: the epoch it has seen, so that the lost instance's tokens and checkpoints are stale
    epoch: int = 1
    #: prefill and decode apart (DESIGN §9): the instance (its base URL) that computes the
    #: prompt's blocks and publishes them live; this one subscribes to them and decodes
    prefill_at: str | None = None
    #: with prefill_at: how many leading prompt blocks that instance computes (the rest are
    #: computed here); None: every prompt block it can
    prefill_blocks: int | None = None
    #: with prefill_at: its pass tracks as its prefill answer laid them out ("passes"), each
    #: (first block, block count): the blocks of one are one subscription (DESIGN §9.4)
    prefill_passes: tuple[tuple[int, int], ...] = ()

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
        epoch = v.integer(data.get("epoch", 1), "epoch", low=1, high=(1 << 53) - 1)
        prefill_at = data.get("prefill_at")
        if prefill_at is not None:
            prefill_at = v.url(prefill_at, "prefill_at", schemes=("http", "https"))
        prefill_blocks = data.get("prefill_blocks")
        if prefill_blocks is not None:
            if prefill_at is None:
                raise BadRecord("needs prefill_at", member="prefill_blocks")
            prefill_blocks = v.integer(prefill_blocks, "prefill_blocks", low=1, high=1 << 20)
        passes = data.get("prefill_passes")
        if passes is not None and prefill_at is None:
            raise BadRecord("needs prefill_at", member="prefill_passes")
        return cls(tuple(tokens), n, SamplerSpec.from_json(data.get("sampler", {})), session,
                   v.boolean(data.get("stream", False), "stream"), scope,
                   v.boolean(data.get("timeline", False), "timeline"), epoch, prefill_at, prefill_blocks,
                   _passes(passes) if passes is not None else ())


def _passes(value: Any) -> tuple[tuple[int, int], ...]:
    """`prefill_passes`: [[first block, block count], ...], in order, none overlapping."""
    out = v.array(value, "prefill_passes", v.pair, max_len=1 << 16)
    end = 0
    for i, (first, count) in enumerate(out):
        if count < 1 or first < end:
            raise BadRecord("each pass is [first block, block count > 0], in order, none overlapping",
                            member=f"prefill_passes[{i}]")
        end = first + count
    return tuple(out)


@dataclass(frozen=True)
class PrefillRequest:
    """POST {ii}prefill (DESIGN §9): compute a prompt's complete blocks and publish them live,
    for the instance that decodes it."""

    tokens: tuple[int, ...]
    scope: str | None = None

    @classmethod
    def from_json(cls, data: Any) -> "PrefillRequest":
        data = v.obj(data, "body")
        tokens = v.tokens(v.required(data, "tokens"), "tokens")
        if not tokens:
            raise BadRecord("needs at least one token", member="tokens")
        scope = data.get("scope")
        if scope is not None:
            scope = v.string(scope, "scope", max_len=256)
        return cls(tuple(tokens), scope)


__all__ = ["METHODS", "GenerateRequest", "PrefillRequest", "SamplerSpec"]
