"""The split policy of prefill and decode apart (`pc.disaggregation`, `kvsp index --pd`)."""

from __future__ import annotations

import pytest

from kvsp_moq.errors import BadRecord
from kvsp_moq.protocol.cost import Estimate
from kvsp_moq.protocol.records import InstanceStatus
from pc.disaggregation import SplitPolicy, choose_prefill
from pc.placement import Candidate


def cand(url: str, *, wait_ms: float, fetch_ms: float, recompute_ms: float, all_ms: float) -> Candidate:
    status = InstanceStatus.from_json({
        "instance": url, "compat_ids": ["00" * 32], "state": "active", "epoch": 1,
        "running": 0, "queued": 0, "kv_utilization": 0.0, "prefill_tokens_per_s": 1000.0,
        "ttl_ms": 5000})
    return Candidate(status, Estimate(url, fetch_ms * 1000, recompute_ms * 1000, wait_ms * 1000, 0, 1000,
                                      all_ms * 1000), 0)


A, B, C = "http://a.test/", "http://b.test/", "http://c.test/"


def test_policies_parse_and_print() -> None:
    assert str(SplitPolicy.parse("never")) == "never"
    assert SplitPolicy.parse("length:512") == SplitPolicy("length", 512)
    assert str(SplitPolicy.parse("length:512")) == "length:512"
    assert SplitPolicy.parse("cost").mode == "cost"
    for bad in ("", "always", "length", "length:0", "length:-3", "cost:2", "never:1"):
        with pytest.raises(BadRecord):
            SplitPolicy.parse(bad)


def test_never_keeps_the_request_on_one_instance() -> None:
    cands = [cand(A, wait_ms=0, fetch_ms=0, recompute_ms=10, all_ms=10),
             cand(B, wait_ms=0, fetch_ms=0, recompute_ms=10, all_ms=10)]
    assert choose_prefill(SplitPolicy(), A, cands, uncached_tokens=5000, is_usable=lambda i: True) is None


def test_length_splits_long_uncached_prompts_to_the_soonest_other_instance() -> None:
    cands = [cand(A, wait_ms=0, fetch_ms=0, recompute_ms=100, all_ms=100),
             cand(B, wait_ms=50, fetch_ms=0, recompute_ms=100, all_ms=100),
             cand(C, wait_ms=10, fetch_ms=0, recompute_ms=100, all_ms=100)]
    policy = SplitPolicy.parse("length:256")
    choice = choose_prefill(policy, A, cands, uncached_tokens=300, is_usable=lambda i: True)
    assert choice is not None and choice.instance == C
    assert choose_prefill(policy, A, cands, uncached_tokens=255, is_usable=lambda i: True) is None
    # Only instances that are usable now (active, serving the scope).
    choice = choose_prefill(policy, A, cands, uncached_tokens=300, is_usable=lambda i: i != C)
    assert choice is not None and choice.instance == B
    assert choose_prefill(policy, A, cands[:1], uncached_tokens=300, is_usable=lambda i: True) is None


def test_cost_splits_only_when_apart_is_sooner() -> None:
    policy = SplitPolicy.parse("cost")
    # The decode instance is busy (a long wait); another one is idle: apart is sooner.
    busy = [cand(A, wait_ms=200, fetch_ms=0, recompute_ms=100, all_ms=100),
            cand(B, wait_ms=0, fetch_ms=0, recompute_ms=100, all_ms=100)]
    choice = choose_prefill(policy, A, busy, uncached_tokens=1000, is_usable=lambda i: True)
    assert choice is not None and choice.instance == B
    # Both idle: apart saves nothing, so one instance does it all.
    idle = [cand(A, wait_ms=0, fetch_ms=0, recompute_ms=100, all_ms=100),
            cand(B, wait_ms=0, fetch_ms=0, recompute_ms=100, all_ms=100)]
    assert choose_prefill(policy, A, idle, uncached_tokens=1000, is_usable=lambda i: True) is None
    # Nothing to compute: nothing to split.
    assert choose_prefill(policy, A, busy, uncached_tokens=0, is_usable=lambda i: True) is None


def test_in_flight_blocks_name_the_instance_computing_them() -> None:
    from pc.disaggregation import InFlight

    table = InFlight(ttl_s=5.0)
    table.note("s", "c", ["k0", "k1", "k2"], A, now=0.0)
    assert table.computing("s", "c", ["k0", "k1", "x2"], 0, now=1.0) == (A, 2)
    assert table.computing("s", "c", ["k0", "k1", "k2", "k3"], 0, now=1.0) == (A, 3)
    assert table.computing("s", "c", ["x0", "k1"], 0, now=1.0) is None
    assert table.computing("other-scope", "c", ["k0"], 0, now=1.0) is None
    # A later route of the same blocks to another instance: the run stops where owners change.
    table.note("s", "c", ["k1"], B, now=2.0)
    assert table.computing("s", "c", ["k0", "k1"], 0, now=2.5) == (A, 1)
    # Forgotten after the TTL (by then the index lists in-production records).
    assert table.computing("s", "c", ["k0"], 0, now=5.5) is None
    assert table.computing("s", "c", ["k1"], 0, now=6.5) == (B, 1)
    assert table.computing("s", "c", ["k1"], 0, now=7.5) is None


def test_in_flight_is_bounded() -> None:
    from pc.disaggregation import InFlight

    table = InFlight(ttl_s=60.0, max_entries=4)
    table.note("s", "c", [f"k{i}" for i in range(10)], A, now=0.0)
    assert table.computing("s", "c", ["k0"], 0, now=0.0) is None  # the oldest went first
    assert table.computing("s", "c", ["k9"], 0, now=0.0) == (A, 1)
