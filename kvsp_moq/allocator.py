"""Process-wide settings of the C allocator (glibc malloc) for processes that move KV blocks.

Why: with glibc's defaults, a buffer of a few MiB that is freed at the top of the heap is
handed back to the kernel (the trim threshold follows the mmap threshold, at most 64 MiB,
and usually sits far lower), and buffers above the mmap threshold are mapped and unmapped
one by one. Either way the next block lands on fresh pages, and every 4 KiB page costs a
page fault when it is first written. On the virtual machines measured here a fault costs
3-4 µs, about 1 ms per MiB: a relay forwarding a 16 MiB block took 8,800 faults (about a
third of its CPU time for that block), the fetcher 1,400. With the settings below the relay
takes 4,100 (the pages of the copy its cache keeps) and the fetcher almost none; a cold
16 MiB FETCH through the relay went from about 155 to about 200-225 MB/s.

The cost is memory: up to TRIM_THRESHOLD octets freed at the top of the heap stay with the
process instead of going back to the system, and buffers up to MMAP_THRESHOLD come from the
heap (a freed one in the middle of the heap is reused, not returned). Processes whose work
is holding and moving gigabytes of KV cache are sized for that.

Settings the operator gave glibc (MALLOC_*_ environment variables or GLIBC_TUNABLES) win:
then nothing is changed. Elsewhere than glibc on Linux this does nothing.
"""

from __future__ import annotations

import ctypes
import os
import sys

import numpy as np

#: Allocations at or above this size are mapped on their own (glibc's largest allowed value).
MMAP_THRESHOLD = 32 << 20
#: Free memory at the top of the heap kept for reuse before any is returned to the system.
TRIM_THRESHOLD = 256 << 20

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_OPERATOR_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")

_tuned: bool | None = None


def allocator_environment() -> dict[str, str]:
    """The same settings as environment variables, for a process this code does not start
    itself (a peer measured beside ours); empty where tune_allocator() would do nothing."""
    if not tune_allocator():
        return {}
    return {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}


def tune_allocator() -> bool:
    """Apply the settings once per process; True when they are in effect."""
    global _tuned
    if _tuned is not None:
        return _tuned
    _tuned = False
    if not sys.platform.startswith("linux"):
        return False
    if any(name in os.environ for name in _OPERATOR_SETTINGS) or \
            "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # only glibc has it; musl's mallopt does nothing
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _tuned = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and \
        bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _tuned


def receive_buffer(size: int) -> memoryview:
    """A writable buffer of `size` octets whose contents are not initialized.

    Why: `bytearray(size)` zero-fills, which for a block about to be overwritten by the
    socket or the disk is a wasted pass over memory on the receiving thread (0.3 ms of the
    ~5 ms of CPU a verified 2 MiB GET takes here) and, where the pages are new, faults every
    one of them in before the first octet arrives. Callers must write every octet before
    reading it (the receive paths hand out only octets they received).
    """
    return np.empty(size, dtype=np.uint8).data
