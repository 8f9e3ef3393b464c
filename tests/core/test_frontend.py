"""The front end delivers each output index exactly once across a failover (§6.8)."""

import asyncio
import json

import httpx
import pytest

from kvsp_moq.errors import TransportError
from kvsp_moq.frontend import FrontEnd, StreamCursor, Token
from tests.pc.fakes import checkpoint, fake_agents, ndjson, new_session, pc_server, status, status_path


def test_cursor_rules():
    c = StreamCursor()
    assert c.accept({"index": 0, "epoch": 1, "token": 5}) == Token(0, 1, 5)
    assert c.accept({"index": 0, "epoch": 1, "token": 5}) is None        # duplicate
    assert c.accept({"index": 1, "epoch": 2, "token": 6}) == Token(1, 2, 6)
    assert c.accept({"index": 2, "epoch": 1, "token": 9}) is None        # lower epoch
    assert (c.next_index, c.dropped_duplicates, c.dropped_stale) == (2, 1, 1)
    with pytest.raises(Exception):
        c.accept({"index": 7, "epoch": 2, "token": 1})                   # gap
    with pytest.raises(ValueError):
        c.accept({"index": "2", "epoch": 2, "token": 1})
    assert c.accept({"done": True}) is None and c.done


async def test_exactly_once_across_a_broken_stream_and_failover(tmp_path):
    s = new_session()
    total = 10
    with fake_agents(2) as (a, b), pc_server(str(tmp_path / "pc.db")) as pc:
        async def stream_a(request, start):
            for i in range(start, 5):
                yield ndjson(i, 1, 100 + i)
                if i == 3:
                    yield ndjson(3, 1, 100 + 3)          # a duplicate on the wire
            # Keep the connection until the PC has moved the session, then die mid-stream.
            for _ in range(500):
                if b.received("resume"):
                    break
                await asyncio.sleep(0.01)
            raise RuntimeError("instance A crashed")

        async def stream_b(request, start):
            for i in range(max(0, start - 2), total):   # regenerated duplicates first
                yield ndjson(i, 2, 100 + i)
                if i == start:
                    yield ndjson(i + 1, 1, 999)         # a late token of the old epoch
            # a clean end; the PC still places the session here

        a.stream, b.stream = stream_a, stream_b
        async with httpx.AsyncClient(timeout=10) as http:
            await http.put(pc.url + status_path(a.url), json=status(a.url, ttl_ms=300))
            await http.put(pc.url + status_path(b.url), json=status(b.url))
            await http.put(f"{pc.url}sessions/{s}/checkpoint",
                           json=checkpoint(s, epoch=1, offset=3, instance=a.url))
        got = []
        async with FrontEnd(pc.url, backoff_s=0.02, timeout_s=20) as fe:
            n = await fe.deliver(s, got.append, instance=a.url)
        assert n == total
        assert [t.index for t in got] == list(range(total))
        assert [t.token for t in got] == [100 + i for i in range(total)]
        assert [t.epoch for t in got] == [1] * 5 + [2] * 5
        assert b.received("stream") == [5]               # reconnected at the next index
        assert b.received("resume")[0]["epoch"] == 2


async def test_done_line_and_max_tokens(tmp_path):
    s = new_session()
    with fake_agents(1) as (a,), pc_server(str(tmp_path / "pc.db")) as pc:
        async def stream_a(request, start):
            for i in range(start, 4):
                yield ndjson(i, 1, i)
            yield (json.dumps({"done": True}) + "\n").encode()
            await asyncio.sleep(5)                        # never read: done ends it

        a.stream = stream_a
        async with FrontEnd(pc.url, timeout_s=10) as fe:
            assert [t.index async for t in fe.stream(s, instance=a.url)] == [0, 1, 2, 3]
            assert [t.index async for t in fe.stream(s, instance=a.url, start=1,
                                                     max_tokens=2)] == [1, 2]


async def test_gives_up_within_bounds(tmp_path):
    s = new_session()
    with pc_server(str(tmp_path / "pc.db")) as pc:
        async with FrontEnd(pc.url, retries=2, backoff_s=0.01, timeout_s=5) as fe:
            with pytest.raises(TransportError):
                await fe.deliver(s, lambda t: None, instance="http://127.0.0.1:9/")
