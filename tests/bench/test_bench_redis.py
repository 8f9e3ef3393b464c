"""The lookup benchmark's Redis part, in its smallest form."""

from __future__ import annotations

from kvsp_moq.bench import http_lookup
from tests.index_redis.redis_server import server_binary


def test_benchmark_runs_small_on_redis():
    server_binary()  # fails, rather than skips, where redis-server is missing
    result = http_lookup.run_lookup(quick=True, records=3_000, requests=10, keys_per_lookup=64,
                                    redis=True, load_requests=5)
    redis = result["redis"]
    assert redis["records"] == 3_000 and redis["index"]["lookups_per_s"] > 0
    assert redis["used_memory_bytes_per_record"] > redis["record_json_bytes"]
    assert redis["memory_usage"]["record_key"] > redis["record_json_bytes"]
    assert set(redis["under_load"]) == {"memory_one_is", "redis_one_is", "redis_two_is"}
    assert all(run["requests"] == 10 and run["lookups_per_s"] > 0
               for run in redis["under_load"].values())
