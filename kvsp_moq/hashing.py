"""The worker threads that compute SHA-256 for the holder's store and the block fetchers.

hashlib releases the GIL on large updates, so digests of blocks run beside the event loop.
Holder and client share one pool: in an agent both run in one process, and two pools would
only compete for the same cores.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

_pool: ThreadPoolExecutor | None = None
#: CPUs the workers are kept on (None: wherever they were started)
_cpus: frozenset[int] | None = None
_PREFIX = "kvsp-hash"


def _start_worker() -> None:
    if _cpus is not None:
        try:
            os.sched_setaffinity(0, _cpus)
        except OSError:  # stays where it was started; place_workers said why
            pass


def hash_pool() -> ThreadPoolExecutor:
    """Worker threads for SHA-256, started on first use."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2)),
                                   thread_name_prefix=_PREFIX, initializer=_start_worker)
    return _pool


def place_workers(cpus: frozenset[int]) -> list[threading.Thread]:
    """Keep the hash workers on `cpus`, those running now and those started later (a vLLM
    worker keeps its loads off the model's cores); returns the running ones, to be moved."""
    global _cpus
    _cpus = cpus
    return [t for t in threading.enumerate() if t.name.startswith(_PREFIX + "_")]
