"""CPU time and minor page faults of the processes taking part in a benchmark's transfers."""

from __future__ import annotations

import os
from typing import Any


class ProcessUsage:
    """CPU time and minor page faults of the processes in a transfer, summed per variant.

    CPU time is read from each thread's schedstat (nanoseconds; utime/stime tick at 10 ms,
    too coarse for one block), faults from /proc/PID/stat. Where /proc does not have them
    (not Linux), nothing is reported.
    """

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.totals: dict[str, dict[str, list[int]]] = {}
        self.ok = all(os.path.exists(f"/proc/{pid}/task") for pid in pids.values())

    def _read(self) -> dict[str, tuple[int, int]]:
        out = {}
        for name, pid in self.pids.items():
            cpu = 0
            try:
                for task in os.listdir(f"/proc/{pid}/task"):
                    try:
                        with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                            cpu += int(f.read().split()[0])
                    except (OSError, ValueError, IndexError):
                        pass  # a thread that ended meanwhile
                with open(f"/proc/{pid}/stat") as f:
                    faults = int(f.read().rsplit(")", 1)[1].split()[7])
            except (OSError, ValueError, IndexError):
                self.ok = False
                return {}
            out[name] = (cpu, faults)
        return out

    async def measure(self, variant: str, transfer: Any) -> Any:
        """Await `transfer`, adding what each process spent meanwhile to `variant`."""
        if not self.ok:
            return await transfer
        before = self._read()
        result = await transfer
        after = self._read()
        if self.ok:
            acc = self.totals.setdefault(variant, {name: [0, 0] for name in self.pids})
            for name in self.pids:
                acc[name][0] += after[name][0] - before[name][0]
                acc[name][1] += after[name][1] - before[name][1]
        return result

    def per_block(self, variant: str, blocks: int) -> dict[str, Any]:
        acc = self.totals.get(variant)
        if not acc or not blocks:
            return {}
        return {"cpu_ms_per_block": {n: round(v[0] / blocks / 1e6, 1) for n, v in acc.items()},
                "page_faults_per_block": {n: v[1] // blocks for n, v in acc.items()}}
