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

One prefill for many (whatever the policy): a route whose prompt begins with blocks the PC
routed to another instance moments ago, not in the index yet, gets `"prefill": {"instance":
that one, "reason", "running": true, "blocks": n}`: that instance is computing the first n
blocks already, and publishes them live; the front end sends only the generate, with
"prefill_at" and "prefill_blocks", and its instance subscribes to those n blocks and computes
the rest. `InFlight` remembers, for `ttl_s`, the uncached blocks each route sent somewhere:
longer than an instance takes to put its in-production records in the index, from which on a
lookup finds them anyway.

Sans I/O: `choose_prefill` reads the candidates the router ranked and nothing else; `InFlight`
takes the time as an argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from kvsp_moq.errors import BadRecord
from pc.placement import Candidate

__all__ = ["InFlight", "PrefillChoice", "SplitPolicy", "choose_prefill"]

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
    #: the instance computes these blocks already (for another request): nothing to ask it
    running: bool = False
    blocks: int | None = None
    #: the holder whose tracks carry its live blocks, when not the instance itself (a vLLM
    #: engine's embedded holder)
    holder: str | None = None

    def to_json(self) -> dict:
        out: dict = {"instance": self.instance, "reason": self.reason}
        if self.holder is not None:
            out["holder"] = self.holder
        if self.running:
            out["running"] = True
            out["blocks"] = self.blocks
        return out


class InFlight:
    """The uncached prompt blocks recent routes sent to each instance, by scope and key."""

    def __init__(self, ttl_s: float = 5.0, max_entries: int = 65_536) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        #: (scope, compat, key) -> (instance, expires); in insertion (so expiry) order
        self._keys: dict[tuple[str, str, str], tuple[str, float]] = {}

    def _expire(self, now: float) -> None:
        while self._keys:
            first = next(iter(self._keys))
            if self._keys[first][1] > now and len(self._keys) <= self.max_entries:
                break
            del self._keys[first]

    def note(self, scope_id: str, compat_id: str, keys: Sequence[str], instance: str, now: float) -> None:
        """`keys` (uncached, in prompt order) were routed to `instance`, which computes them."""
        self._expire(now)
        for key in keys:
            ident = (scope_id, compat_id, key)
            self._keys.pop(ident, None)
            self._keys[ident] = (instance, now + self.ttl_s)
        self._expire(now)

    def computing(self, scope_id: str, compat_id: str, keys: Sequence[str], first: int,
                  now: float) -> tuple[str, int] | None:
        """(instance, n) when blocks first..n-1 of `keys` are being computed at one instance,
        from `first` (the blocks before it are cached); None when block `first` is not."""
        self._expire(now)
        instance: str | None = None
        n = first
        for key in keys[first:]:
            held = self._keys.get((scope_id, compat_id, key))
            if held is None or (instance is not None and held[0] != instance):
                break
            instance = held[0]
            n += 1
        return (instance, n) if instance is not None else None


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
