"""64 concurrent clients through the relay and over HTTP for a bounded time (issue #8, load).

KVSP_LOAD_SECONDS sets the duration (10 s by default here, 60 s for the figures of the issue).
Nothing may fail, no object may be lost, and the relay's RSS must stay below its cache budget
plus the margin stated in kvsp_moq.bench.load.RSS_MARGIN.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvsp_moq.bench.load import MiB, run_load


def test_load_64_clients_relay_and_http(tmp_path: Path) -> None:
    seconds = float(os.environ.get("KVSP_LOAD_SECONDS") or 10)
    result = run_load(seconds=seconds, clients=64, workdir=tmp_path)
    print("\n" + json.dumps(result, indent=1))
    relay = result["relay"]
    print(f"load: {result['clients']} clients, {result['seconds']} s, {result['total_mb_per_s']} MB/s "
          f"(MOQT {result['moqt']['mb_per_s']}, HTTP {result['http']['mb_per_s']}), "
          f"TTFL p99 {result['ttfl_p99_ms']} ms; relay RSS peak {relay['rss_peak_bytes'] / MiB:.0f} MiB "
          f"<= {relay['rss_limit_bytes'] / MiB:.0f} MiB (cache {relay['cache_bytes'] / MiB:.0f} MiB "
          f"+ margin {relay['rss_margin_bytes'] / MiB:.0f} MiB)")
    assert result["errors"] == 0, result["error_samples"]
    assert result["moqt"]["fetches"] > 0 and result["http"]["fetches"] > 0
    assert relay["alive"] and result["holder_alive"]
    assert relay["samples"] > 0
    assert relay["rss_within_limit"], (
        f"relay RSS peaked at {relay['rss_peak_bytes']} octets, above {relay['rss_limit_bytes']}")
