"""Load or recompute: the instance's own §6.4 choice for one request.

The PC ranks instances with the §6.4 cost, but by the time a request arrives the instance
knows more than the PC did: which blocks it holds now, and the rates its own loads and
prefills have just reached. A cached prefix is only worth loading when fetching it and
computing the rest costs less than computing everything; on a fast model and a slow or
loaded link it does not (a tiny model recomputes 512 tokens faster than two hosts move
its 2 MB). The same estimate functions as the PC's (`kvsp_moq.protocol.cost`) decide here.

A link the instance stopped using would never be measured again, so after `probe_every`
recomputes in a row it is measured again: the agent loads about 4 MiB of the blocks in the
background while that request still recomputes (`Engine.measure_link`); with `probe=True`
(an engine without that) the request itself loads them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from kvsp_moq.protocol.cost import estimate
from kvsp_moq.protocol.records import InstanceStatus, Link, ReplicaRecord


@dataclass(frozen=True)
class LoadChoice:
    """What the instance chose for a request's cached prefix, and the estimates behind it."""

    load: bool
    reason: str
    #: blocks the instance already holds (they are used either way)
    resident_blocks: int = 0
    #: blocks to fetch from other holders, had it loaded
    remote_blocks: int = 0
    fetch_ms: float | None = None
    recompute_rest_ms: float | None = None
    recompute_all_ms: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"chose": "load" if self.load else "recompute", "reason": self.reason,
                "resident_blocks": self.resident_blocks, "remote_blocks": self.remote_blocks,
                "fetch_ms": self.fetch_ms, "recompute_rest_ms": self.recompute_rest_ms,
                "recompute_all_ms": self.recompute_all_ms}


def _ms(us: float) -> float | None:
    return round(us / 1000, 3) if math.isfinite(us) else None


def choose(*, instance: str, prefill_tokens_per_s: float | None, links: Sequence[Link],
           matched_blocks: int, resident_blocks: int, remote: Sequence[ReplicaRecord],
           block_tokens: int, total_tokens: int, probe: bool = False) -> LoadChoice:
    """Load the `matched_blocks` leading blocks of a `total_tokens` prompt (the first
    `resident_blocks` held here; `remote`: the replica each block held elsewhere would come
    from) or recompute from the end of the resident prefix, whichever the §6.4 estimates
    say is cheaper. With no measured prefill rate there is nothing to compare against, and
    the cache is used."""
    if not matched_blocks:
        return LoadChoice(False, "nothing matched: recompute")
    if not remote:
        return LoadChoice(True, "every matched block is resident here", resident_blocks)
    if not prefill_tokens_per_s:
        return LoadChoice(True, "no prefill rate measured yet: using the cache",
                          resident_blocks, len(remote))
    after = resident_blocks * block_tokens
    status = InstanceStatus(instance=instance, epoch=0, state="active", ttl_ms=1,
                            prefill_tokens_per_s=prefill_tokens_per_s, links=tuple(links))
    est = estimate(status, matched_tokens=(matched_blocks - resident_blocks) * block_tokens,
                   total_tokens=total_tokens - after, plan=remote)

    def decided(load: bool, reason: str) -> LoadChoice:
        return LoadChoice(load, reason, resident_blocks=resident_blocks, remote_blocks=len(remote),
                          fetch_ms=_ms(est.fetch_us), recompute_rest_ms=_ms(est.recompute_us),
                          recompute_all_ms=_ms(est.recompute_all_us))

    load_ms = (est.fetch_us + est.recompute_us) / 1000
    all_ms = est.recompute_all_us / 1000
    if est.uses_cache:
        return decided(True, f"loading {len(remote)} blocks and computing the rest "
                             f"(~{load_ms:.1f} ms) beats recomputing them (~{all_ms:.1f} ms)")
    if probe:
        return decided(True, f"recomputing (~{all_ms:.1f} ms) beats loading (~{load_ms:.1f} ms), "
                             "but the link's rate is due to be measured again")
    return decided(False, f"recomputing (~{all_ms:.1f} ms) beats loading {len(remote)} blocks "
                          f"and computing the rest (~{load_ms:.1f} ms)")
