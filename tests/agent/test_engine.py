"""The engine (agent/engine.py) driven directly: a request's tokens are the model's own, its
complete blocks are stored and loaded again, a §6.8 checkpoint resumes to the same
continuation, and what the engine refuses it refuses with the project's errors."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from transformers import AutoModelForCausalLM

from agent.model import ModelAdapter
from agent.pool import tensor_from_octets
from agent.requests import GenerateRequest
from agent.sessions import StreamBroken
from kvsp_moq.errors import BadRecord, ForbiddenScope, NotActive, PrefixUnavailable, SessionConflict, StaleEpoch
from kvsp_moq.holder.store import BlockId, BlockStore
from kvsp_moq.protocol.compat import CompatDescriptor
from kvsp_moq.protocol.container import Container
from kvsp_moq.protocol.keys import BlockKeyChain
from kvsp_moq.protocol.records import SessionCheckpoint
from tests.agent.bare_engine import SCOPE_KEY, SELF, B, FakePC, finished, running_engine
from tests.agent.conftest import tokens
from tests.polling import eventually

PROMPT = 40  # two complete blocks and a tail of 8
NEW = 8  # the last one completes the third block
TOP_P = {"method": "top-p", "params": {"p": 0.9, "temperature": 1.0}, "seed": 7}


@pytest.fixture(scope="module")
def adapter(model_dir: Path) -> ModelAdapter:
    return ModelAdapter.load(model_dir)


@pytest.fixture(scope="module")
def greedy_reference(model_dir: Path) -> Callable[[list[int], int], list[int]]:
    """Greedy tokens from transformers itself: the whole sequence through the model at each step,
    no cache, none of the agent's code."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    model.eval()

    def greedy(prompt: list[int], n: int) -> list[int]:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(torch.argmax(model(torch.tensor([ids])).logits[0, -1])))
        return ids[len(prompt):]

    return greedy


def request(prompt: list[int], n: int = NEW, **body: Any) -> GenerateRequest:
    return GenerateRequest.from_json({"tokens": prompt, "max_new_tokens": n, **body}, max_tokens=4096)


def block_keys(adapter: ModelAdapter, sequence: list[int]) -> list[str]:
    """The Block Keys of the complete blocks of `sequence` in the engine's scope."""
    chain = BlockKeyChain(SCOPE_KEY, CompatDescriptor.from_dict(adapter.descriptor(B)).compat_id, B)
    chain.extend(sequence)
    return [k.hex() for k in chain.keys]


# --------------------------------------------------------------------------- generation


async def test_prefill_then_greedy_decoding_gives_the_models_own_tokens(adapter, greedy_reference) -> None:
    prompt = tokens(PROMPT, 1)
    async with running_engine(adapter) as run:
        s = await finished(await run.engine.generate(request(prompt)))
        assert (s.state, s.error) == ("finished", None)
        assert s.generated == greedy_reference(prompt, NEW)
        assert s.released == NEW and s.epoch == 1 and not s.tracked
        assert s.cached_tokens == 0 and s.sources["recompute"] == PROMPT // B
        assert [x async for x in s.stream()] == (
            [{"index": i, "epoch": 1, "token": t} for i, t in enumerate(s.generated)] + [{"done": True}])


async def test_every_complete_block_is_stored_with_the_kv_of_its_tokens(adapter) -> None:
    prompt = tokens(PROMPT, 2)
    async with running_engine(adapter) as run:
        s = await finished(await run.engine.generate(request(prompt)))
        sequence = prompt + s.generated
        keys = block_keys(adapter, sequence)
        assert len(keys) == (PROMPT + NEW) // B == 3
        assert [e.id.block_key for e in run.announced] == keys  # in order, each once
        assert s.exported == 3
        state = adapter.prefill(sequence, return_kv=False).state
        for i, key in enumerate(keys):
            entry = run.store.get(BlockId(run.engine.compat_id, s.scope_id, key))
            assert entry is not None and entry.host is not None
            block = Container(bytes(entry.host.buffer))
            assert (block.token_count, block.layer_count) == (B, adapter.num_layers)
            for layer, (k, v) in zip(block.layers(), adapter.kv_for_range(state, i * B, (i + 1) * B)):
                assert torch.allclose(tensor_from_octets(layer.k, adapter.dtype).view(k.shape), k, atol=1e-4)
                assert torch.allclose(tensor_from_octets(layer.v, adapter.dtype).view(v.shape), v, atol=1e-4)


@pytest.mark.parametrize("pipelined", [True, False])
async def test_a_stored_prefix_is_loaded_and_gives_the_same_tokens(adapter, pipelined: bool) -> None:
    prompt = tokens(PROMPT, 3)
    async with running_engine(adapter, pipelined=pipelined) as run:
        first = await finished(await run.engine.generate(request(prompt)))
        second = await finished(await run.engine.generate(request(prompt)))
    assert second.generated == first.generated
    assert second.cached_tokens == 2 * B  # all but the last token's block: (40 - 1) // 16
    assert second.sources == {"moqt": 0, "http": 0, "local": 2, "recompute": 0}
    assert second.load is not None and (second.load["planned"], second.load["loaded"]) == (2, 2)
    assert second.load_choice is not None and second.load_choice.load


async def test_blocks_computed_here_are_replicated(adapter) -> None:
    pc = FakePC()
    prompt = tokens(PROMPT, 4)
    async with running_engine(adapter, pc=pc, replicate_to=("http://keeper.test/",)) as run:
        s = await finished(await run.engine.generate(request(prompt)))
        await eventually(lambda: len(pc.replicated) == 3, timeout=5.0, what="three replicated blocks")
        keys = block_keys(adapter, prompt + s.generated)
        assert sorted(pc.replicated) == sorted(
            f"keeper.test/blocks/{run.engine.compat_id}/{s.scope_id}/{k}" for k in keys)


# --------------------------------------------------------------------------- §6.8 checkpoints


@pytest.mark.parametrize("sampler", [{"method": "greedy"}, TOP_P], ids=["greedy", "top-p"])
async def test_a_checkpoint_resumes_to_the_same_continuation(adapter, sampler: dict) -> None:
    """A tracked session's checkpoints go to the PC; another engine with the blocks resumes from
    the first of them under a new epoch and produces the tokens the first one produced."""
    pc, pc2 = FakePC(), FakePC()
    store = BlockStore(host_bytes=64 << 20)
    sid = str(uuid.uuid4())
    prompt = tokens(PROMPT, 5)
    async with running_engine(adapter, store=store, pc=pc, token_interval_s=0.01) as a:
        original = await finished(await a.engine.generate(request(prompt, 12, session=sid, sampler=sampler)))
    assert original.state == "finished" and original.tracked and len(original.generated) == 12
    assert pc.deleted == [f"/sessions/{sid}"]
    for body in pc.checkpoints:
        cp = SessionCheckpoint.from_json(body)
        assert (cp.session, cp.epoch, body["instance"]) == (sid, 1, SELF)
        assert list(cp.generated) == original.generated[:cp.output_offset]
        assert cp.prompt_blocks == tuple(block_keys(adapter, prompt)) and list(cp.prompt_tail) == prompt[32:]
    assert pc.checkpoints[0]["output_offset"] == 0  # the prompt alone, at admission
    first = next(c for c in pc.checkpoints if c["output_offset"] > 0)
    offset = first["output_offset"]
    assert 0 < offset < 12

    async with running_engine(adapter, store=store, pc=pc2) as b:
        resumed = await finished(await b.engine.resume(sid, {"checkpoint": first, "epoch": 2}))
        assert (resumed.state, resumed.epoch) == ("finished", 2)
        assert resumed.generated == original.generated
        assert resumed.cached_tokens >= 2 * B  # the prompt blocks, whose tokens it never saw
        assert [x async for x in resumed.stream(offset)] == (
            [{"index": i, "epoch": 2, "token": original.generated[i]} for i in range(offset, 12)]
            + [{"done": True}])
    assert all(c["epoch"] == 2 for c in pc2.checkpoints)
    if sampler is TOP_P:  # its tokens are released once a checkpoint covering them is acknowledged
        assert pc2.checkpoints[-1]["output_offset"] == 12
    assert pc2.deleted == [f"/sessions/{sid}"]


async def test_a_resume_is_checked_against_the_instance(adapter) -> None:
    pc = FakePC()
    store = BlockStore(host_bytes=64 << 20)
    sid = str(uuid.uuid4())
    async with running_engine(adapter, store=store, pc=pc, max_new_tokens=64) as run:
        s = await finished(await run.engine.generate(request(tokens(PROMPT, 6), 4, session=sid)))
        cp = s.checkpoint(2).to_json()
        with pytest.raises(StaleEpoch):  # the session is at epoch 1 here already
            await run.engine.resume(sid, {"checkpoint": cp, "epoch": 1})
        with pytest.raises(BadRecord) as e:
            await run.engine.resume(str(uuid.uuid4()), {"checkpoint": cp, "epoch": 2})
        assert e.value.member == "checkpoint.session"
        with pytest.raises(BadRecord) as e:
            await run.engine.resume(sid, {"checkpoint": {**cp, "compat_id": "ab" * 32}, "epoch": 2})
        assert e.value.member == "checkpoint.compat_id"
        with pytest.raises(ForbiddenScope):  # the session here belongs to the checkpoint's scope
            await run.engine.resume(sid, {"checkpoint": {**cp, "scope_id": "cd" * 16}, "epoch": 2})
        other = str(uuid.uuid4())
        with pytest.raises(BadRecord) as e:  # a scope this instance does not serve
            await run.engine.resume(other, {"checkpoint": {**cp, "session": other, "scope_id": "cd" * 16},
                                            "epoch": 2})
        assert e.value.member == "checkpoint.scope_id"
        too_long = {**cp, "sampler": {**cp["sampler"], "params": {"max_new_tokens": 65}}}
        with pytest.raises(BadRecord) as e:
            await run.engine.resume(sid, {"checkpoint": too_long, "epoch": 2})
        assert e.value.member == "checkpoint.sampler.params.max_new_tokens"
    async with running_engine(adapter, pc=pc) as empty:  # no replica of the prompt blocks here
        with pytest.raises(PrefixUnavailable):
            await empty.engine.resume(sid, {"checkpoint": cp, "epoch": 2})
        assert sid not in empty.engine.sessions


async def test_a_pc_that_moved_the_session_on_stops_it_here(adapter) -> None:
    pc = FakePC(stale=True)
    async with running_engine(adapter, pc=pc, token_interval_s=0.01) as run:
        s = await finished(await run.engine.generate(request(tokens(PROMPT, 7), 200,
                                                             session=str(uuid.uuid4()))))
        assert s.state == "moved" and len(s.generated) < 200
        with pytest.raises(StreamBroken):
            async for _ in s.stream():
                pass


# --------------------------------------------------------------------------- admission


async def test_requests_the_engine_cannot_serve_are_refused(adapter) -> None:
    async with running_engine(adapter) as run:
        engine = run.engine
        cases = [
            (request([1, 2, adapter.vocab_size]), "tokens"),
            (request(tokens(PROMPT, 8), adapter.config.max_position_embeddings), "max_new_tokens"),
            (request([5, 6, 7], scope="nobody"), "scope"),
        ]
        for req, member in cases:
            with pytest.raises(BadRecord) as e:
                await engine.generate(req)
            assert e.value.member == member
        assert engine.sessions == {} and engine.admitted == 0
        engine.state = "draining"
        with pytest.raises(NotActive):
            await engine.generate(request([5, 6, 7]))


async def test_a_named_session_is_admitted_once(adapter) -> None:
    sid = str(uuid.uuid4())
    async with running_engine(adapter) as run:
        s = await finished(await run.engine.generate(request([5, 6, 7], 2, session=sid)))
        assert run.engine.sessions[sid] is s
        with pytest.raises(SessionConflict):
            await run.engine.generate(request([5, 6, 7], 2, session=sid))
        assert run.engine.sessions[sid] is s and run.engine.admitted == 1


async def test_finished_sessions_are_forgotten_oldest_first_and_after_a_while(adapter) -> None:
    async with running_engine(adapter, keep_finished=2) as run:
        engine = run.engine
        done = [await finished(await engine.generate(request([5, 6, 7], 1))) for _ in range(3)]
        assert list(engine.sessions) == [s.id for s in done[1:]]
        assert (engine.running, engine.queued, engine.admitted) == (0, 0, 3)
    async with running_engine(adapter, keep_finished_s=0.05) as run:
        await finished(await run.engine.generate(request([5, 6, 7], 1)))
        await eventually(lambda: not run.engine.sessions, timeout=5.0, what="the session forgotten")


async def test_a_session_is_tracked_only_when_it_names_itself_and_there_is_a_pc(adapter) -> None:
    pc = FakePC()
    async with running_engine(adapter, pc=pc) as run:
        anonymous = await finished(await run.engine.generate(request([5, 6, 7], 2)))
        named = await finished(await run.engine.generate(request([5, 6, 7], 2, session=str(uuid.uuid4()))))
    assert not anonymous.tracked and named.tracked
    assert {c["session"] for c in pc.checkpoints} == {named.id}
    async with running_engine(adapter) as run:  # no PC
        alone = await finished(await run.engine.generate(request([5, 6, 7], 2, session=str(uuid.uuid4()))))
    assert not alone.tracked
