"""`kvsp bench moqt` reports what each process spent per block; the accounting must be right."""

from __future__ import annotations

import asyncio
import mmap
import os
import subprocess
import sys

from kvsp_moq.bench.usage import ProcessUsage


def test_usage_counts_cpu_and_page_faults_of_each_process_per_variant() -> None:
    # A child that sleeps stands for an idle process beside the busy one (this one).
    idle = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); "
                             "time.sleep(30)"], stdout=subprocess.PIPE)
    try:
        assert idle.stdout is not None and idle.stdout.readline() == b"up\n"
        usage = ProcessUsage({"idle": idle.pid, "client": os.getpid()})
        assert usage.ok

        async def busy() -> int:
            x = 0
            for i in range(300_000):
                x += i
            # A fresh anonymous mapping, whatever malloc holds in reserve (an earlier test
            # may have tuned it in this process): every page faults in when first written.
            with mmap.mmap(-1, 40 << 20) as pages:
                for offset in range(0, 40 << 20, 4096):
                    pages[offset] = 1
            return x

        async def main() -> None:
            for _ in range(2):
                await usage.measure("busy", busy())
            await usage.measure("quiet", asyncio.sleep(0.05))

        asyncio.run(main())
        figures = usage.per_block("busy", 2)
        assert figures["cpu_ms_per_block"]["client"] > 1.0
        assert figures["cpu_ms_per_block"]["idle"] < 1.0
        assert figures["page_faults_per_block"]["idle"] == 0
        assert figures["page_faults_per_block"]["client"] > 5000  # 10,240 pages of 4 KiB
        quiet = usage.per_block("quiet", 1)
        assert quiet["cpu_ms_per_block"]["client"] < figures["cpu_ms_per_block"]["client"]
        assert usage.per_block("never ran", 1) == {}
    finally:
        idle.kill()
        idle.wait()
