"""CPU sets and thread placement: which cores a process's loader threads run on, apart from its
model's.

A model computing on the CPU keeps every core it is given busy in parallel regions that wait
for their slowest thread; a loader (network, hashing, copies) that shares one of those cores
stalls every region for as long as it runs there. Both the vLLM connector
(`kvsp_moq.integrations.vllm.connector_cpus`) and `kvsp agent --loader-cpus` therefore put the
loader on cores of its own: by default the last usable core of each NUMA node, the one
`vllm serve` keeps out of its OpenMP binding for a KV connector.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

log = logging.getLogger("kvsp.cpus")

__all__ = ["format_cpu_list", "parse_cpu_list", "place_process", "place_thread", "reserved_cpus",
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
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"{part!r} is not a CPU number or range")
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


def place_process(pid: int, cpus: frozenset[int]) -> None:
    """Every thread of process `pid` onto `cpus` (a thread that ends meanwhile is skipped)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except (OSError, ValueError):
            pass
