"""The block-GET benchmark, in its quick form: every variant moves the whole block (each one
asserts what it received), and the figures that separate the transfer from the verification
are all reported."""

from __future__ import annotations

from kvsp_moq.bench import http_blocks


def test_block_get_benchmark_reports_transfer_and_verification_apart() -> None:
    result = http_blocks.run_blocks(quick=True)
    assert [b["block_bytes"] for b in result["blocks"]] == [2097684, 16777748]
    for block in result["blocks"]:
        for rate in ("fetch_mb_per_s", "range_mb_per_s", "get_mb_per_s", "raw_tcp_mb_per_s",
                     "raw_tcp_range_mb_per_s", "httpx_fetch_mb_per_s"):
            assert block[rate] > 0, rate
        assert block["get_range_mb_per_s"] > 0
        assert block["ratio"] > 0 and block["get_ratio"] > 0 and block["range_ratio"] > 0
        assert block["get_range_ratio"] > 0
        assert block["two_sha256_passes_ms"] > 0
        cpu = block["cpu_ms_per_request"]
        for variant in ("fetch", "get", "raw", "range", "raw_range"):
            assert cpu[variant]["client"] > 0 and cpu[variant]["server"] > 0, variant
        # The verifying client hashes every octet twice; the bare transfer does not.
        assert cpu["fetch"]["client"] > cpu["get"]["client"]
