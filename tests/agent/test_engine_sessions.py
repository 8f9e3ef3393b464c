"""The parts of the engine that need no model: the checked generate request and its sampler
(agent/requests.py), a session's tokens, releases and streams (agent/sessions.py), and when §6.8
checkpoints are owed, what they carry and how a resume is read back (agent/checkpoints.py)."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import httpx
import pytest

from agent.checkpoints import CHECKPOINT_EVERY, checkpoint_due, read_resume, resume_point
from agent.model import TokenSampler
from agent.requests import GenerateRequest, SamplerSpec
from agent.sessions import Session, StreamBroken, TokenSequence
from kvsp_moq.errors import BadRecord, StaleEpoch
from kvsp_moq.protocol.compat import CompatDescriptor
from kvsp_moq.protocol.keys import BlockKeyChain
from kvsp_moq.protocol.keys import scope_id as scope_id_of
from kvsp_moq.protocol.records import SessionCheckpoint
from tests.fixtures import DESCRIPTOR

KEY = bytes(range(32))
COMPAT = CompatDescriptor.from_dict(DESCRIPTOR)
TOP_P = SamplerSpec("top-p", {"p": 0.9, "temperature": 0.7}, seed=3)


def session(prompt: list[int], *, block_tokens: int = 4, sampler: SamplerSpec = SamplerSpec(),
            max_new_tokens: int = 100) -> Session:
    """A session as `Engine.generate` makes one, for a prompt of `prompt`."""
    chain = BlockKeyChain(KEY, COMPAT.compat_id, block_tokens)
    chain.extend(prompt)
    full = len(prompt) // block_tokens
    return Session(str(uuid.uuid4()), epoch=1, tracked=True, scope_key=KEY, compat_id=COMPAT.compat_hex,
                   sequence=TokenSequence(chain, 0, list(prompt)),
                   prompt_blocks=[k.hex() for k in chain.keys[:full]],
                   prompt_tail=list(prompt[full * block_tokens:]), sampler=sampler,
                   max_new_tokens=max_new_tokens)


# --------------------------------------------------------------------------- requests


def test_a_generate_request_is_read_with_its_defaults() -> None:
    req = GenerateRequest.from_json({"tokens": [5, 6], "max_new_tokens": 3}, max_tokens=8)
    assert req == GenerateRequest((5, 6), 3)
    sid = str(uuid.uuid4())
    req = GenerateRequest.from_json({"tokens": [5], "max_new_tokens": 8, "session": sid, "scope": "t",
                                     "stream": True, "timeline": True,
                                     "sampler": {"method": "top-p", "params": {"p": 0.5}, "seed": 9}},
                                    max_tokens=8)
    assert (req.session, req.scope, req.stream, req.timeline) == (sid, "t", True, True)
    assert req.sampler == SamplerSpec("top-p", {"p": 0.5}, 9) and not req.sampler.deterministic


@pytest.mark.parametrize("body, member", [
    ({"max_new_tokens": 1}, "tokens"),
    ({"tokens": [], "max_new_tokens": 1}, "tokens"),
    ({"tokens": [-1], "max_new_tokens": 1}, "tokens[0]"),
    ({"tokens": [1]}, "max_new_tokens"),
    ({"tokens": [1], "max_new_tokens": 0}, "max_new_tokens"),
    ({"tokens": [1], "max_new_tokens": 9}, "max_new_tokens"),  # above the instance's limit
    ({"tokens": [1], "max_new_tokens": 1, "session": "s-1"}, "session"),
    ({"tokens": [1], "max_new_tokens": 1, "scope": 5}, "scope"),
    ({"tokens": [1], "max_new_tokens": 1, "stream": "yes"}, "stream"),
    ({"tokens": [1], "max_new_tokens": 1, "timeline": 1}, "timeline"),
    ({"tokens": [1], "max_new_tokens": 1, "sampler": {"method": "beam"}}, "sampler.method"),
    ({"tokens": [1], "max_new_tokens": 1, "sampler": {"method": "top-p", "params": {"p": 0}}},
     "sampler.params.p"),
    ({"tokens": [1], "max_new_tokens": 1, "sampler": {"method": "top-p", "params": {"p": 1.5}}},
     "sampler.params.p"),
    ({"tokens": [1], "max_new_tokens": 1, "sampler": {"method": "top-p", "params": {"temperature": 0}}},
     "sampler.params.temperature"),
    ({"tokens": [1], "max_new_tokens": 1, "sampler": {"seed": "s"}}, "sampler.seed"),
    ([1], "body"),
])
def test_a_bad_generate_request_is_refused_naming_its_member(body: Any, member: str) -> None:
    with pytest.raises(BadRecord) as e:
        GenerateRequest.from_json(body, max_tokens=8)
    assert e.value.member == member


def test_a_sampler_spec_makes_the_model_sampler() -> None:
    assert SamplerSpec(seed=4).model_sampler() == TokenSampler(seed=4)
    assert TOP_P.model_sampler() == TokenSampler(temperature=0.7, top_p=0.9, seed=3)
    assert SamplerSpec().deterministic and not TOP_P.deterministic


# --------------------------------------------------------------------------- sessions


def test_a_token_sequence_knows_tokens_only_after_its_known_blocks() -> None:
    chain = BlockKeyChain(KEY, COMPAT.compat_id, 4, keys=[b"\x01" * 32, b"\x02" * 32])
    chain.extend([7, 8, 9])  # as a resume point's chain is
    seq = TokenSequence(chain, 2, [7, 8, 9])
    assert seq.length == 11 and seq.tokens_from(9) == [8, 9] and seq.tokens_from(8) == [7, 8, 9]
    with pytest.raises(ValueError):
        seq.tokens_from(7)
    seq.append(10)  # completes the third block
    assert seq.length == 12 and len(chain.keys) == 3


async def test_a_stream_gives_released_tokens_then_the_end() -> None:
    s = session([5, 6, 7, 8, 9])
    for t in (11, 12, 13):
        s.add_token(t)
    assert s.sequence.length == 8 and len(s.sequence.chain.keys) == 2
    s.release(2)
    seen: list[dict] = []

    async def read() -> None:
        async for item in s.stream():
            seen.append(item)

    reader = asyncio.ensure_future(read())
    await asyncio.sleep(0.01)
    assert seen == [{"index": 0, "epoch": 1, "token": 11}, {"index": 1, "epoch": 1, "token": 12}]
    s.release(10)  # never past what was produced
    assert s.released == 3
    s.end("finished")
    await asyncio.wait_for(reader, 5)
    assert seen[2:] == [{"index": 2, "epoch": 1, "token": 13}, {"done": True}]
    s.end("failed", "too late")  # an ended session stays as it ended
    assert (s.state, s.error, s.done.is_set()) == ("finished", None, True)
    assert s.summary()["tokens"] == [11, 12, 13] and "error" not in s.summary()


@pytest.mark.parametrize("state", ["moved", "failed", "cancelled"])
async def test_a_session_that_does_not_finish_here_breaks_its_streams(state: str) -> None:
    s = session([5, 6])
    s.add_token(1)
    s.release(1)
    stream = s.stream()
    assert await stream.__anext__() == {"index": 0, "epoch": 1, "token": 1}
    s.end(state, "elsewhere")
    with pytest.raises(StreamBroken):
        await stream.__anext__()
    assert s.summary()["error"] == "elsewhere"


def test_an_acknowledgement_releases_the_tokens_of_a_non_deterministic_session() -> None:
    greedy, top_p = session([5, 6]), session([5, 6], sampler=TOP_P)
    for s in (greedy, top_p):
        for t in (1, 2, 3):
            s.add_token(t)
        s.acknowledged(2)
        assert (s.acked, s.checkpointed, s.first_checkpoint_sent) == (2, 2, True)
    assert greedy.released == 3  # all of them: a greedy session replays from its prompt
    assert top_p.released == 2


async def test_no_token_of_a_tracked_session_is_released_before_the_pc_knows_it() -> None:
    """An instance that dies after a client saw a token must leave a session the PC can
    resume: the first checkpoint (the prompt alone) is acknowledged before any release."""
    from agent.checkpoints import Checkpointer
    from agent.options import EngineOptions

    put = asyncio.Event()
    answer = asyncio.Event()
    bodies: list[dict[str, Any]] = []

    async def pc(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        put.set()
        await answer.wait()
        return httpx.Response(204)

    async with httpx.AsyncClient(transport=httpx.MockTransport(pc)) as client:
        tasks: set[asyncio.Task] = set()

        def spawn(coro: Any) -> asyncio.Task:
            t = asyncio.ensure_future(coro)
            tasks.add(t)
            return t

        ckpt = Checkpointer(client, "http://pc/", headers={}, instance_url=lambda: "http://i/",
                            options=EngineOptions(), block_tokens=4, spawn=spawn)
        s = session([5, 6, 7])
        ckpt.request(s)  # at admission
        await asyncio.wait_for(put.wait(), 5)
        assert bodies[0]["output_offset"] == 0 and bodies[0]["generated"] == []
        for t in (1, 2):
            s.add_token(t)
            ckpt.after_token(s)
        assert s.released == 0  # the PC has not answered yet
        answer.set()
        for _ in range(100):
            if s.released == 2:
                break
            await asyncio.sleep(0.01)
        assert s.released == 2 and s.first_checkpoint_sent
        s.end("cancelled")
        await asyncio.gather(*tasks, return_exceptions=True)


# --------------------------------------------------------------------------- checkpoints


def test_a_checkpoint_carries_the_prompt_as_blocks_and_the_sampler_at_its_step() -> None:
    s = session(list(range(10, 20)), sampler=TOP_P, max_new_tokens=50)  # two blocks and two tokens
    s.step_base = 5
    for t in (1, 2, 3):
        s.add_token(t)
    cp = s.checkpoint(2)
    assert (cp.session, cp.epoch, cp.compat_id, cp.scope_id) == (s.id, 1, COMPAT.compat_hex,
                                                                 scope_id_of(KEY).hex())
    assert cp.prompt_blocks == tuple(s.prompt_blocks) and len(cp.prompt_blocks) == 2
    assert cp.prompt_tail == (18, 19) and cp.generated == (1, 2) and cp.output_offset == 2
    assert (cp.sampler.method, cp.sampler.seed, cp.sampler.step) == ("top-p", 3, 7)
    assert dict(cp.sampler.params) == {"p": 0.9, "temperature": 0.7, "max_new_tokens": 50}
    assert SessionCheckpoint.from_json(cp.to_json()) == cp


def test_a_greedy_session_owes_a_checkpoint_first_then_per_block() -> None:
    s = session([5, 6, 7], block_tokens=4)
    s.add_token(1)  # completes block 1
    assert checkpoint_due(s, 4, release_batch=4)  # the first one, whatever the position
    s.acknowledged(1)
    due = []
    for t in range(2, 11):
        s.add_token(t)
        due.append(checkpoint_due(s, 4, release_batch=4))
        if due[-1]:
            s.acknowledged(len(s.generated))
    # sequence lengths 5..13: blocks complete at 8 and 12
    assert [n for n, d in zip(range(5, 14), due) if d] == [8, 12]


def test_long_blocks_still_give_a_checkpoint_every_64_tokens() -> None:
    s = session([5], block_tokens=256)
    s.add_token(1)
    s.acknowledged(1)
    due = []
    for t in range(2 * CHECKPOINT_EVERY + 1):
        s.add_token(t)
        due.append(checkpoint_due(s, 256, release_batch=4))
        if due[-1]:
            s.acknowledged(len(s.generated))
    assert [i + 2 for i, d in enumerate(due) if d] == [1 + CHECKPOINT_EVERY, 1 + 2 * CHECKPOINT_EVERY]


def test_a_non_deterministic_session_owes_one_per_release_batch_or_block() -> None:
    s = session([5], block_tokens=16, sampler=TOP_P)
    due = []
    for t in range(20):
        s.add_token(t)
        due.append(checkpoint_due(s, 16, release_batch=4))
        if due[-1]:
            s.acknowledged(len(s.generated))
    # every 4 tokens past the last acknowledgement, and at 15, where prompt and output fill a block
    assert [i + 1 for i, d in enumerate(due) if d] == [4, 8, 12, 15, 19]


def test_a_resume_restores_chain_tokens_sampler_and_limit() -> None:
    prompt = list(range(10, 20))
    s = session(prompt, sampler=TOP_P, max_new_tokens=50)
    s.step_base = 5
    for t in (1, 2, 3, 4):
        s.add_token(t)
    body = {"checkpoint": s.checkpoint(3).to_json(), "epoch": 4}
    cp, epoch = read_resume(s.id, body, current_epoch=None)
    point = resume_point(cp, epoch, descriptor=COMPAT, scopes_by_id={scope_id_of(KEY).hex(): KEY},
                         block_tokens=4, max_new_tokens=64)
    assert (point.epoch, point.scope_key, point.max_new_tokens) == (4, KEY, 50)
    assert point.sampler.model_sampler() == TOP_P.model_sampler()  # the same draws from its step on
    assert point.step_base == 5 and point.generated == [1, 2, 3]
    assert point.known == [18, 19, 1, 2, 3]
    whole = BlockKeyChain(KEY, COMPAT.compat_id, 4)
    whole.extend(prompt + [1, 2, 3])
    assert point.chain.keys == whole.keys  # the same Block Keys, without the prompt's tokens


def test_a_resume_is_refused_when_stale_or_not_for_this_instance() -> None:
    s = session(list(range(10, 20)), max_new_tokens=50)
    s.epoch = 3
    s.add_token(1)
    cp = s.checkpoint(1).to_json()
    with pytest.raises(StaleEpoch):
        read_resume(s.id, {"checkpoint": cp, "epoch": 2}, current_epoch=None)  # older than the checkpoint
    with pytest.raises(StaleEpoch):
        read_resume(s.id, {"checkpoint": cp, "epoch": 4}, current_epoch=4)  # not newer than here
    for body, member in [({"checkpoint": cp}, "epoch"), ({"epoch": 4}, "checkpoint"),
                         ({"checkpoint": {**cp, "session": str(uuid.uuid4())}, "epoch": 4},
                          "checkpoint.session")]:
        with pytest.raises(BadRecord) as e:
            read_resume(s.id, body, current_epoch=None)
        assert e.value.member == member
    parsed, epoch = read_resume(s.id, {"checkpoint": cp, "epoch": 4}, current_epoch=3)
    scopes = {scope_id_of(KEY).hex(): KEY}
    with pytest.raises(BadRecord) as e:  # no key of its scope here
        resume_point(parsed, epoch, descriptor=COMPAT, scopes_by_id={}, block_tokens=4, max_new_tokens=64)
    assert e.value.member == "checkpoint.scope_id"
    with pytest.raises(BadRecord) as e:  # it would run past this instance's limit
        resume_point(parsed, epoch, descriptor=COMPAT, scopes_by_id=scopes, block_tokens=4, max_new_tokens=49)
    assert e.value.member == "checkpoint.sampler.params.max_new_tokens"
    other = CompatDescriptor.from_dict({**DESCRIPTOR, "layers": 5})
    with pytest.raises(BadRecord) as e:
        resume_point(parsed, epoch, descriptor=other, scopes_by_id=scopes, block_tokens=4, max_new_tokens=64)
    assert e.value.member == "checkpoint.compat_id"
