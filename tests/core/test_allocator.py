"""The allocator settings keep freed block buffers for reuse instead of faulting in new pages."""

from __future__ import annotations

import json
import os
import subprocess
import sys

_PROBE = r"""
import json, resource, sys
from kvsp_moq.allocator import tune_allocator
tuned = tune_allocator() if sys.argv[1] == "tune" else False
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
size = 16 << 20
counts = []
for _ in range(4):  # three blocks in flight at a time, then all freed
    before = faults()
    bufs = [bytearray(size) for _ in range(3)]  # zero-filled: every page is written
    counts.append(faults() - before)
    del bufs
print(json.dumps({"tuned": tuned, "faults": counts}))
"""


def _probe(mode: str, **env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True,
                         timeout=60, env={**os.environ, **env}, check=True)
    return json.loads(out.stdout)


def test_a_freed_block_buffer_is_reused_without_new_page_faults() -> None:
    pages = 3 * (16 << 20) // 4096
    untuned = _probe("plain")
    tuned = _probe("tune")
    assert tuned["tuned"] is True
    # With glibc's defaults the freed buffers go back to the system (unmapped, or trimmed
    # from the top of the heap), so every round faults all of their pages in again.
    assert min(untuned["faults"][1:]) > pages // 2, untuned
    # Tuned, the first round faults the pages in once; the next rounds reuse them.
    assert max(tuned["faults"][1:]) < pages // 16, tuned


def test_the_operators_own_malloc_settings_win() -> None:
    result = _probe("tune", MALLOC_TRIM_THRESHOLD_="131072")
    assert result["tuned"] is False
    result = _probe("tune", GLIBC_TUNABLES="glibc.malloc.trim_threshold=131072")
    assert result["tuned"] is False


def test_the_environment_form_gives_a_child_the_same_settings() -> None:
    from kvsp_moq.allocator import MMAP_THRESHOLD, TRIM_THRESHOLD

    env = subprocess.run([sys.executable, "-c", "import json; from kvsp_moq.allocator import "
                          "allocator_environment as e; print(json.dumps(e()))"],
                         capture_output=True, text=True, timeout=60, check=True)
    settings = json.loads(env.stdout)
    assert settings == {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD),
                        "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}
    result = _probe("plain", **settings)  # untuned by us, tuned by glibc from the environment
    assert result["tuned"] is False
    assert max(result["faults"][1:]) < 3 * (16 << 20) // 4096 // 16, result


_UNTOUCHED_PROBE = r"""
import json, resource, sys
from kvsp_moq.allocator import receive_buffer
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
size = 64 << 20  # above glibc's mmap threshold: fresh pages, each faulted in when first written
before = faults()
buf = bytearray(size) if sys.argv[1] == "bytearray" else receive_buffer(size)
allocated = faults() - before
buf[size // 2:size // 2 + 4] = b"kvsp"
print(json.dumps({"faults": allocated, "len": len(buf), "readonly": memoryview(buf).readonly,
                  "written": bytes(buf[size // 2:size // 2 + 4]).decode()}))
"""


def _untouched(kind: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _UNTOUCHED_PROBE, kind], capture_output=True,
                         text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def test_a_receive_buffer_is_not_written_before_the_receiver_fills_it() -> None:
    pages = (64 << 20) // 4096
    zeroed = _untouched("bytearray")
    lazy = _untouched("receive_buffer")
    assert zeroed["faults"] > pages // 2, zeroed  # zero-filled: every page touched
    assert lazy["faults"] < pages // 16, lazy
    assert lazy["len"] == 64 << 20 and lazy["readonly"] is False and lazy["written"] == "kvsp"
