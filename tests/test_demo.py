"""`kvsp demo` end to end: real processes on 127.0.0.1, the report it prints checked."""

import json
import subprocess
import sys

from kvsp_moq.demo.cluster import Cluster
from kvsp_moq.demo.run import SYSTEM_TOKENS

BLOCKS = SYSTEM_TOKENS // Cluster.block_tokens


def test_demo_runs_the_whole_system_and_reports_measured_results(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvsp_moq.cli", "demo", "--json",
                          "--report-dir", str(tmp_path / "report")],
                         capture_output=True, text=True, timeout=540)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    rows = report["shared_prompt"]
    assert rows[0]["cached_tokens"] == 0 and rows[0]["matched_blocks"] == 0
    for row in rows[1:]:
        assert row["matched_blocks"] == BLOCKS and row["cached_tokens"] == SYSTEM_TOKENS, row
    # The PC sends the next request that shares the system prompt where it was computed (the
    # instance reports as each request ends, so it is free again for the next one) ...
    first = rows[0]["instance"]
    assert rows[1]["instance"] == first and rows[1]["sources"].get("local") == BLOCKS, rows
    # ... the one that excludes it to the other instance, which loads the prefix and keeps it ...
    assert rows[2]["instance"] != first and "excluded" in rows[2]["why"], rows[2]
    moved = rows[2]["sources"]
    assert moved.get("http", 0) + moved.get("moqt", 0) == BLOCKS, moved
    # ... so that the last one finds it local wherever it goes.
    assert rows[3]["sources"].get("local") == BLOCKS, rows[3]
    pd = report["prefill_apart"]
    assert pd["equals_one_instance"] is True, pd
    assert pd["live_blocks"] == pd["prompt_tokens"] // Cluster.block_tokens
    assert pd["sources"]["moqt"] == pd["live_blocks"] and pd["sources"]["recompute"] == 0, pd
    assert pd["streamed_vs_single"] == round(pd["ttft_ms"]["streamed"] / pd["ttft_ms"]["single"], 3)
    fo = report["failover"]
    assert fo["every_index_once"] and fo["equals_uninterrupted_run"] and fo["epochs"][-1] > fo["epochs"][0]
    rs = report["reshard"]
    assert rs["committed"] is True and rs["agent1_ranges"] == [[512, 1024]]
    assert rs["agent2_ranges"] == [[0, 512]]
    assert rs["bytes_moved_for_retained_range"] == 0 and rs["bytes_moved_to_agent1"] > 0
    assert report["other_tenant"]["matched_blocks"] == 0
    assert report["other_tenant"]["cached_tokens"] == 0
    saved = json.loads((tmp_path / "report" / "report.json").read_text())
    assert saved["failover"] == fo
    # Nothing is left running.
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "report")], capture_output=True, text=True)
    assert left.stdout.strip() == ""
