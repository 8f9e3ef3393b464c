"""The scheduler side's per-step plans, step by step, with scheduler outputs written by hand:
chunked prefills, a rollback after a load error, a request resumed after preemption. (The
end-to-end tests run the same paths inside vLLM; here each step's plan is checked exactly.)"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvsp_moq.integrations.vllm.config import parse_extra_config
from kvsp_moq.integrations.vllm.metadata import KVSPMetadata
from kvsp_moq.integrations.vllm.scheduler import SchedulerSide
from kvsp_moq.model_descriptor import model_descriptor
from kvsp_moq.protocol.compat import CompatDescriptor
from tests_vllm.conftest import BLOCK, prompt


@pytest.fixture
def side(model_dir: Path) -> SchedulerSide:
    descriptor = CompatDescriptor.from_dict(model_descriptor(model_dir, dtype="float32",
                                                             block_tokens=BLOCK))
    s = SchedulerSide(parse_extra_config({"index": "http://127.0.0.1:9/"}), descriptor, load=False)
    yield s
    s.shutdown()


def request(req_id: str, tokens: list[int]) -> Any:
    return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens)


def new(req_id: str, blocks: list[int], computed: int) -> Any:
    return SimpleNamespace(req_id=req_id, block_ids=(blocks,), num_computed_tokens=computed)


def output(scheduled: dict[str, int], new_reqs: list[Any] = (), cached: list[tuple] = (),
           resumed: set[str] = frozenset()) -> Any:
    return SimpleNamespace(
        scheduled_new_reqs=list(new_reqs), num_scheduled_tokens=scheduled, finished_req_ids=set(),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[c[0] for c in cached], resumed_req_ids=set(resumed),
            new_block_ids=[c[1] for c in cached], num_computed_tokens=[c[2] for c in cached]))


def plan(meta: KVSPMetadata) -> tuple[list[int], list[int]]:
    """(paged ids loaded, paged ids saved) of the only request in a step."""
    if not meta.requests:
        return [], []
    [r] = meta.requests
    return [s.block_id for s in r.loads], [s.block_id for s in r.saves]


def found(side: SchedulerSide, req: Any, n: int) -> None:
    """As if the Index Service had answered with `n` leading blocks."""
    side._state(req).found = [('{"record": "of block %d"}' % i,) for i in range(n)]


def test_chunked_prefill_saves_each_block_in_the_step_that_completes_it(side: SchedulerSide) -> None:
    req = request("a", prompt(110, seed=1))
    assert side.matched_tokens(req, 0) == (0, False)
    side.after_alloc(req, 0)
    assert plan(side.build(output({"a": 48}, [new("a", [11, 12], 0)]))) == ([], [11])
    assert plan(side.build(output({"a": 48}, cached=[("a", ([13],), 48)]))) == ([], [12, 13])
    assert plan(side.build(output({"a": 14}, cached=[("a", ([14],), 96)]))) == ([], [])
    for step in range(3):  # decoding: nothing more to save, the tail is not a complete block
        assert plan(side.build(output({"a": 1}, cached=[("a", None, 110 + step)]))) == ([], [])


def test_a_rollback_after_a_load_error_saves_the_recomputed_blocks(side: SchedulerSide) -> None:
    req = request("b", prompt(96, seed=2) + prompt(100, seed=3))  # 6 complete blocks
    found(side, req, 3)
    assert side.matched_tokens(req, 0) == (96, False)
    side.after_alloc(req, 96)
    loads, saves = plan(side.build(output({"b": 100}, [new("b", [1, 2, 3, 4, 5, 6, 7], 96)])))
    assert (loads, saves) == ([1, 2, 3], [4, 5, 6])
    # The load failed: vLLM rolls back to the first bad block and recomputes from there. The
    # worker dropped this step's saves (they attended to holes), so they are planned again.
    loads, saves = plan(side.build(output({"b": 196}, cached=[("b", None, 0)])))
    assert (loads, saves) == ([], [1, 2, 3, 4, 5, 6])


def test_a_request_resumed_after_preemption_keeps_its_saves(side: SchedulerSide) -> None:
    req = request("c", prompt(140, seed=4))
    side.matched_tokens(req, 0)
    side.after_alloc(req, 0)
    assert plan(side.build(output({"c": 140}, [new("c", [1, 2, 3, 4, 5], 0)]))) == ([], [1, 2, 3, 4])
    # Preempted, then resumed in other paged blocks from scratch: the blocks are published
    # already, nothing is saved twice.
    side.after_alloc(req, 0)
    assert plan(side.build(output({"c": 140}, cached=[("c", ([9, 8, 7, 6, 5],), 0)],
                                  resumed={"c"}))) == ([], [])


def test_only_the_blocks_before_the_last_token_are_offered(side: SchedulerSide) -> None:
    exact = request("d", prompt(128, seed=5))  # 4 complete blocks; the 4th ends the prompt
    found(side, exact, 4)
    assert side.matched_tokens(exact, 0) == (96, False)
    assert side.matched_tokens(exact, 96) == (0, False)  # vLLM's own prefix cache had them
    short = request("e", prompt(20, seed=6))
    assert side.matched_tokens(short, 0) == (0, False)
    assert side.finished(exact) == (False, None)


class _Blocks:
    """vLLM's KVCacheBlocks as update_state_after_alloc sees it: one KV cache group."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


@pytest.fixture
def live_side(model_dir: Path) -> SchedulerSide:
    descriptor = CompatDescriptor.from_dict(model_descriptor(model_dir, dtype="float32",
                                                             block_tokens=BLOCK))
    config = parse_extra_config({"index": "http://127.0.0.1:9/", "relay": "moqt://127.0.0.1:9"})
    s = SchedulerSide(config, descriptor)
    yield s
    s.shutdown()


def live_request(req_id: str, tokens: list[int]) -> Any:
    return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens,
                           kv_transfer_params={"kvsp_prefill_at": "http://127.0.0.1:8801/"})


def test_blocks_being_computed_elsewhere_load_asynchronously(live_side: SchedulerSide) -> None:
    req = live_request("p", prompt(140, seed=7))  # 4 complete blocks before the last token
    assert live_side.matched_tokens(req, 0) == (128, True)
    live_side.after_alloc(req, 128, _Blocks([21, 22, 23, 24, 25]))
    # The request is not scheduled while it waits, but its load goes out in this pass.
    meta = live_side.build(output({}))
    [spec] = meta.requests
    assert spec.async_load and [s.block_id for s in spec.loads] == [21, 22, 23, 24]
    assert all(s.records for s in spec.loads) and spec.saves == ()
    assert live_side.build(output({})).requests == []  # planned once
    # Loaded: vLLM schedules it from token 128 on; nothing is loaded again.
    loads, saves = plan(live_side.build(output({"p": 12}, [new("p", [21, 22, 23, 24, 25], 128)])))
    assert loads == [] and saves == []
    assert live_side.stats["async_loads"] == 1


def test_a_failed_asynchronous_load_is_offered_short_then_synchronously(live_side: SchedulerSide) -> None:
    req = live_request("q", prompt(140, seed=8))
    assert live_side.matched_tokens(req, 0) == (128, True)
    live_side.after_alloc(req, 128, _Blocks([5, 6, 7, 8, 9]))
    live_side.build(output({}))
    # The third block could not be loaded: vLLM keeps the first two and recomputes the rest
    # (here, as after a preemption, it asks again from what it kept).
    live_side.connector_output(SimpleNamespace(invalid_block_ids={7}, finished_recving={"q"}))
    assert live_side.matched_tokens(req, 0) == (64, True)
    live_side.after_alloc(req, 64, _Blocks([1, 2, 3, 4, 5]))
    [spec] = live_side.build(output({})).requests
    assert spec.async_load and [s.block_id for s in spec.loads] == [1, 2]
    # Out of asynchronous tries: what remains loads inside a step.
    assert live_side.matched_tokens(req, 32) == (32, False)


def test_load_async_none_keeps_every_load_in_the_step(model_dir: Path) -> None:
    descriptor = CompatDescriptor.from_dict(model_descriptor(model_dir, dtype="float32",
                                                             block_tokens=BLOCK))
    config = parse_extra_config({"index": "http://127.0.0.1:9/", "relay": "moqt://127.0.0.1:9",
                                 "load_async": "none"})
    s = SchedulerSide(config, descriptor)
    try:
        req = live_request("r", prompt(140, seed=9))
        assert s.matched_tokens(req, 0) == (128, False)
        s.after_alloc(req, 128, _Blocks([1, 2, 3, 4, 5]))
        loads, _ = plan(s.build(output({"r": 12}, [new("r", [1, 2, 3, 4, 5], 128)])))
        assert loads == [1, 2, 3, 4]
    finally:
        s.shutdown()
