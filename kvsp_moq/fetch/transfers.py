"""What a load tells about the links it used (KVSP §6.3): octets and the time they took, per
holder, over the whole load.

A placement estimate asks how long a prefix takes to arrive from a holder, which is what the
load's parallel requests reach together. One request's rate says something else: a 64 KiB
block's request lasts about a round trip whatever the link, so averaging per-request rates
would report a fast link as a slow one (and N parallel requests as 1/N of the link).
"""

from __future__ import annotations

import time
from typing import Callable

__all__ = ["TransferObserver", "TransferTally"]

#: Called with (holder URL, octets, seconds): one observation of a link's rate.
TransferObserver = Callable[[str, int, float], None]


class TransferTally:
    """Octets per holder and the span from the first request's start to the last one's end."""

    def __init__(self) -> None:
        self._by_holder: dict[str, list[float]] = {}  # holder -> [octets, first start, last end]

    def add(self, holder: str, octets: int, started: float, ended: float | None = None) -> None:
        """One finished transfer (times from `time.perf_counter`; `ended` default: now)."""
        ended = time.perf_counter() if ended is None else ended
        seen = self._by_holder.setdefault(holder, [0, started, ended])
        seen[0] += octets
        seen[1] = min(seen[1], started)
        seen[2] = max(seen[2], ended)

    def report(self, observer: TransferObserver | None) -> None:
        """One observation per holder of everything added since the last report."""
        tallied, self._by_holder = self._by_holder, {}
        if observer is None:
            return
        for holder, (octets, first, last) in tallied.items():
            observer(holder, int(octets), last - first)
