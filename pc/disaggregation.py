"""Prefill and decode apart (DESIGN §9): when the PC places a request's prefill on another
instance than its decode.

The route decision names the decode instance as today ("instance"); with a policy other than
"never" it may add `"prefill": {"instance": url, "reason": ...}` (an extension member), the
instance that computes the prompt's uncached blocks and publishes them live. The front end
then sends `POST {prefill}prefill` and `POST {instance}generate` with `"prefill_at"`; the
decode instance subscribes to the blocks as they are computed (`agent.live`).

Policies (`kvsp index --pd`):

* `never` (the default): one instance does the whole request.
* `length:N`: apart when the prompt has at least N tokens the decode instance would compute
  (not matched in the index), and another instance is active: a long prefill then never
  stalls the decoding sessions of the decode instance.
* `cost`: apart when the §6.4 estimates say it is sooner: the prefill instance's wait plus its
  recompute of the prompt, or the decode instance's own wait, whichever is later (the two run
  side by side), is below `margin` times the decode instance's own cost.

Sans I/O: `choose_prefill` reads the candidates the router ranked and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from kvsp_moq.errors import BadRecord
from pc.placement import Candidate

__all__ = ["PrefillChoice", "SplitPolicy", "choose_prefill"]

MODES = ("never", "length", "cost")


@dataclass(frozen=True)
class SplitPolicy:
    mode: str = "never"
    min_tokens: int = 0
    #: `cost`: apart only when that is sooner by this factor (a split costs a second instance)
    margin: float = 0.8

    @classmethod
    def parse(cls, text: str) -> "SplitPolicy":
        """`never`, `length:N` or `cost`."""
        mode, _, arg = text.partition(":")
        if mode == "never" and not arg:
            return cls("never")
        if mode == "cost" and not arg:
            return cls("cost")
        if mode == "length" and arg.isdigit() and int(arg) > 0:
            return cls("length", int(arg))
        raise BadRecord(f"{text!r} is not never, length:N (N > 0) or cost", member="pd")

    def __str__(self) -> str:
        return f"length:{self.min_tokens}" if self.mode == "length" else self.mode


@dataclass(frozen=True)
class PrefillChoice:
    instance: str
    reason: str

    def to_json(self) -> dict:
        return {"instance": self.instance, "reason": self.reason}


def _prefill_us(c: Candidate) -> float:
    """When a candidate would have computed the whole prompt: its wait, then the recompute."""
    return c.estimate.wait_us + c.estimate.recompute_all_us


def choose_prefill(policy: SplitPolicy, decode: str, candidates: Sequence[Candidate], *,
                   uncached_tokens: int, is_usable: Callable[[str], bool]) -> PrefillChoice | None:
    """The instance to prefill on apart from `decode`, or None for one instance alone.

    `candidates` are the router's, ranked; `is_usable` says whether an instance is active and
    serves the request's scope right now."""
    if policy.mode == "never" or uncached_tokens <= 0:
        return None
    others = [c for c in candidates if c.instance != decode and is_usable(c.instance)]
    if not others:
        return None
    best = min(others, key=_prefill_us)
    if policy.mode == "length":
        if uncached_tokens < policy.min_tokens:
            return None
        return PrefillChoice(best.instance, f"{uncached_tokens} uncached tokens >= {policy.min_tokens}")
    own = next((c for c in candidates if c.instance == decode), None)
    if own is None:
        return None
    apart = max(_prefill_us(best), own.estimate.wait_us)
    if apart < policy.margin * own.cost_us:
        return PrefillChoice(best.instance, f"apart {apart / 1000:.1f} ms < {own.cost_us / 1000:.1f} ms alone")
    return None
