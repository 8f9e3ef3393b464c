"""The worker threads that compute SHA-256 for the holder's store and the block fetchers.

hashlib releases the GIL on large updates, so digests of blocks run beside the event loop.
Holder and client share one pool: in an agent both run in one process, and two pools would
only compete for the same cores.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

_pool: ThreadPoolExecutor | None = None


def hash_pool() -> ThreadPoolExecutor:
    """Worker threads for SHA-256, started on first use."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2)),
                                   thread_name_prefix="kvsp-hash")
    return _pool
