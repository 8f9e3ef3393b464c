"""Which CPUs the connector's loader threads run on, beside vLLM's model on the CPU backend.

`vllm serve` on a CPU binds the model's OpenMP threads one per core (OMP_PLACES with
OMP_PROC_BIND), and when a KV connector is configured it leaves the last core of each NUMA node
out of that binding, for the connector (its NIXL connector moves its transfer threads there).
The binding also narrows the worker's main thread to the first OpenMP core, and every thread
started from it inherits that one core: left alone, the connector's event loop and hash workers
would all run on the core of the model's busiest thread, each OpenMP region waiting for them,
while the core kept for them stays idle.

So on a CPU worker the connector moves its threads to those reserved cores ("cpus": "auto",
the default), to CPUs the user names ("cpus": "6,7" or "6-7"), or leaves them alone ("none").
On other devices the model does not run on the host's cores and "auto" changes nothing.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

log = logging.getLogger("kvsp.vllm.cpus")

__all__ = ["connector_cpus", "format_cpu_list", "parse_cpu_list", "place_thread", "reserved_cpus",
           "usable_cpus"]

_SYS_NODE = Path("/sys/devices/system/node")
_SYS_CPU = Path("/sys/devices/system/cpu")


def parse_cpu_list(text: str) -> frozenset[int]:
    """A Linux CPU list ("0-3,8,10-11") as a set; ValueError for anything else."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        first, dash, last = part.partition("-")
        a = int(first)
        b = int(last) if dash else a
        if a < 0 or b < a:
            raise ValueError(f"bad CPU range {part!r}")
        cpus.update(range(a, b + 1))
    if not cpus:
        raise ValueError("no CPUs listed")
    return frozenset(cpus)


def format_cpu_list(cpus: frozenset[int]) -> str:
    """A set of CPUs as a Linux CPU list ("0-3,8")."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _read_list(path: Path) -> frozenset[int] | None:
    try:
        return parse_cpu_list(path.read_text())
    except (OSError, ValueError):
        return None


def usable_cpus() -> frozenset[int]:
    """The CPUs this process may run on: its cgroup's cpuset, else every online CPU. (Not the
    calling thread's affinity, which vLLM's OpenMP binding has narrowed to one core.)"""
    for path in (Path("/sys/fs/cgroup/cpuset.cpus.effective"),
                 Path("/sys/fs/cgroup/cpuset/cpuset.effective_cpus")):
        cpus = _read_list(path)
        if cpus:
            return cpus
    return _read_list(_SYS_CPU / "online") or frozenset(range(os.cpu_count() or 1))


def reserved_cpus(usable: frozenset[int] | None = None, nodes: list[frozenset[int]] | None = None
                  ) -> frozenset[int]:
    """The last usable CPU of each NUMA node: where vLLM's CPU backend leaves room for a KV
    connector (the cores its OpenMP binding keeps out when a connector is configured)."""
    usable = usable_cpus() if usable is None else usable
    if nodes is None:
        nodes = []
        if _SYS_NODE.is_dir():
            for node in sorted(_SYS_NODE.glob("node[0-9]*")):
                cpus = _read_list(node / "cpulist")
                if cpus:
                    nodes.append(cpus)
    picked = {max(node & usable) for node in nodes if node & usable}
    return frozenset(picked) if picked else frozenset({max(usable)})


def connector_cpus(setting: str, device_type: str) -> frozenset[int] | None:
    """The CPUs for the connector's threads under `setting` ("auto", "none" or a CPU list) on a
    worker whose cache lives on `device_type`; None leaves the threads where they are."""
    if setting == "none":
        return None
    if setting == "auto":
        return reserved_cpus() if device_type == "cpu" else None
    return parse_cpu_list(setting)  # checked when the settings were parsed


def place_thread(thread: threading.Thread, cpus: frozenset[int]) -> bool:
    """Move a running thread onto `cpus` (threads it starts later inherit them); False when
    the system refuses, which is logged and otherwise harmless."""
    tid = thread.native_id
    if tid is None or not hasattr(os, "sched_setaffinity"):
        return False
    try:
        os.sched_setaffinity(tid, cpus)
        return True
    except OSError as e:
        log.warning("could not move thread %s to CPUs %s: %s", thread.name, sorted(cpus), e)
        return False
