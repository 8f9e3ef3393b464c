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
