"""Where the agent's threads run: with `--loader-cpus`, its loader on cores of its own and the
model on the rest.

The forward pass keeps every core torch gives it busy, in parallel regions that wait for their
slowest thread; the loader (the event loop that fetches, verifies and copies blocks, and the
hash workers) sharing one of those cores stalls every region while it runs there. On a host
with cores to spare, a core kept for the loader makes loading overlap computing instead of
slowing it; on a small one it takes a core from every recompute, hence an option, off by
default. It is the placement the vLLM connector takes beside `vllm serve` (`kvsp_moq.cpus`).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from kvsp_moq.cpus import format_cpu_list, parse_cpu_list, reserved_cpus
from kvsp_moq.errors import SettingError
from kvsp_moq.hashing import place_workers

log = logging.getLogger("kvsp.agent.cores")

__all__ = ["CoreSplit", "loader_cpus"]


def loader_cpus(spec: str | None) -> frozenset[int] | None:
    """`--loader-cpus`: None or "none" (every thread everywhere), "auto" (the last core of each
    NUMA node this process may use) or a CPU list, which must leave the model a core."""
    if spec is None or spec == "none":
        return None
    allowed = frozenset(os.sched_getaffinity(0))
    if spec == "auto":
        cpus = reserved_cpus(allowed)
    else:
        try:
            cpus = parse_cpu_list(spec)
        except ValueError as e:
            raise SettingError(f"--loader-cpus: {e} (auto, none, or a list such as 6,7 or 6-7)",
                               member="loader_cpus")
        if not cpus <= allowed:
            raise SettingError(f"--loader-cpus: CPU {min(cpus - allowed)} is not one this process "
                               f"may use ({format_cpu_list(allowed)})", member="loader_cpus")
    if not allowed - cpus:
        raise SettingError(f"--loader-cpus: {format_cpu_list(cpus)} leaves the model no core "
                           f"(this process may use {format_cpu_list(allowed)})",
                           member="loader_cpus")
    return cpus


class CoreSplit:
    """Every thread of this process on the model's cores but the loader's, which go to the
    `loader` cores; torch computes with one thread per model core. `restore` undoes the
    placement (the model's thread ends with the agent)."""

    def __init__(self, loader: frozenset[int]) -> None:
        self.loader = loader
        self.everywhere = frozenset(os.sched_getaffinity(0))
        self.model = self.everywhere - loader
        self._applied = False

    def apply(self, loader_threads: list[threading.Thread]) -> None:
        """From now on: `loader_threads` (the event loop's) and the hash workers on the loader's
        cores, every other thread (the model's, torch's own) on the model's. Called from the
        loop; `on_model_thread` is to be run on the model's thread."""
        own = {t.native_id for t in [*loader_threads, *place_workers(self.loader)]}
        for tid in _tasks():
            self._place(tid, self.loader if tid in own else self.model)
        self._applied = True
        log.info("model on CPUs %s, loader on CPUs %s", format_cpu_list(self.model),
                 format_cpu_list(self.loader))

    def on_model_thread(self) -> None:
        """torch computes with one thread per model core (its thread count belongs to the
        thread that runs the model)."""
        import torch

        torch.set_num_threads(len(self.model))

    def restore(self) -> None:
        """Every thread back on every core."""
        if not self._applied:
            return
        self._applied = False
        place_workers(self.everywhere)
        for tid in _tasks():
            self._place(tid, self.everywhere)

    @staticmethod
    def _place(tid: int, cpus: frozenset[int]) -> None:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # a thread that ended meanwhile
            pass


def _tasks() -> list[int]:
    return [int(t.name) for t in Path("/proc/self/task").iterdir()]
