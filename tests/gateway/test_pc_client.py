"""The gateway's client of the PC's route (`kvsp_moq.gateway.pc_client`), against a PC of a few
lines that answers as told and counts its connections: connections kept and reused, one closed
while idle or closed by the answer, a chunked answer, problems, a 503 or a PC that cannot be
reached left for the next one, an answer that never comes."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Callable

import pytest

from kvsp_moq.errors import BadRecord, KvspError, NoActiveInstance, ProtocolViolation, TransportError
from kvsp_moq.gateway.pc_client import PCClient
from kvsp_moq.protocol.problems import Problem
from kvsp_moq.web import BackgroundServer
from pc.app import PCSettings, create_pc_app


def ok(body: dict[str, Any], *, close: bool = False, chunked: bool = False) -> bytes:
    data = json.dumps(body).encode()
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/kvsp+json\r\n"
    if close:
        head += b"Connection: close\r\n"
    if chunked:
        return (head + b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n" % (5, data[:5])
                + b"%x\r\n%s\r\n0\r\n\r\n" % (len(data) - 5, data[5:]))
    return head + b"Content-Length: %d\r\n\r\n%s" % (len(data), data)


def problem(err: KvspError) -> bytes:
    data = json.dumps(Problem.from_error(err).to_json()).encode()
    return (b"HTTP/1.1 %d X\r\nContent-Type: application/problem+json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (err.status, len(data), data))


class FakePC:
    """An HTTP/1.1 server on 127.0.0.1 that answers each request with `answer(head, body)`
    (None: never answers) and records the connections and requests."""

    def __init__(self, answer: Callable[[bytes, bytes], bytes | None]) -> None:
        self.answer = answer
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []
        self.writers: list[asyncio.StreamWriter] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.url = ""

    async def __aenter__(self) -> "FakePC":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks)
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        task = asyncio.current_task()
        assert task is not None
        self.tasks.append(task)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                self.requests.append((head, body))
                out = self.answer(head, body)
                if out is None:
                    await asyncio.sleep(3600)
                    return
                writer.write(out)
                await writer.drain()
                if b"Connection: close" in out:
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    def close_idle(self) -> None:
        """Close every connection from this side, as a PC's keep-alive timeout does."""
        for w in self.writers:
            w.close()


@pytest.fixture
async def decision_pc() -> AsyncIterator[FakePC]:
    async with FakePC(lambda head, body: ok({"instance": "http://i/", "got": json.loads(body)})) as pc:
        yield pc


async def test_calls_share_one_kept_connection(decision_pc: FakePC) -> None:
    client = PCClient(decision_pc.url, token="T0k")
    try:
        for n in range(5):
            decision, ms = await client.route({"n": n})
            assert decision == {"instance": "http://i/", "got": {"n": n}} and ms > 0
    finally:
        await client.aclose()
    assert decision_pc.connections == 1
    head, body = decision_pc.requests[0]
    assert head.startswith(b"POST /route HTTP/1.1\r\n")
    assert b"Authorization: Bearer T0k\r\n" in head and b"Content-Type: application/json" in head
    assert json.loads(body) == {"n": 0}


async def test_a_connection_closed_while_idle_is_replaced(decision_pc: FakePC) -> None:
    client = PCClient(decision_pc.url)
    try:
        await client.route({"n": 1})
        decision_pc.close_idle()
        await asyncio.sleep(0.05)
        assert (await client.route({"n": 2}))[0]["got"] == {"n": 2}
        decision_pc.close_idle()  # no time for the client to see it: the send finds it closed
        assert (await client.route({"n": 3}))[0]["got"] == {"n": 3}
    finally:
        await client.aclose()
    assert decision_pc.connections == 3
    assert [json.loads(b) for _, b in decision_pc.requests] == [{"n": 1}, {"n": 2}, {"n": 3}]


@pytest.mark.parametrize("close, chunked", [(True, False), (False, True)])
async def test_connection_close_and_chunked_answers(close: bool, chunked: bool) -> None:
    async with FakePC(lambda head, body: ok({"instance": "x"}, close=close, chunked=chunked)) as pc:
        client = PCClient(pc.url)
        try:
            for _ in range(3):
                assert (await client.route({}))[0] == {"instance": "x"}
        finally:
            await client.aclose()
    assert pc.connections == (3 if close else 1)


async def test_a_problem_is_raised_as_its_error_and_not_retried() -> None:
    async with FakePC(lambda head, body: problem(BadRecord("no block_keys"))) as bad, \
            FakePC(lambda head, body: ok({"instance": "x"})) as other:
        client = PCClient(f"{bad.url},{other.url}")
        try:
            with pytest.raises(ProtocolViolation, match="no block_keys"):
                await client.route({})
        finally:
            await client.aclose()
    assert len(bad.requests) == 1 and other.requests == []
    assert client.pcs.url == bad.url


async def test_a_503_or_an_unreachable_pc_is_left_for_the_next() -> None:
    async with FakePC(lambda head, body: problem(NoActiveInstance("none active"))) as busy, \
            FakePC(lambda head, body: ok({"instance": "x"})) as good:
        stopped = BackgroundServer(create_pc_app(PCSettings(database=":memory:")))
        stopped.start()
        stopped.stop()
        client = PCClient(f"{stopped.url},{busy.url},{good.url}")
        try:
            assert (await client.route({"n": 1}))[0] == {"instance": "x"}
            assert client.pcs.url == good.url  # where the next call starts
            assert (await client.route({"n": 2}))[0] == {"instance": "x"}
        finally:
            await client.aclose()
        assert len(busy.requests) == 1 and len(good.requests) == 2
        alone = PCClient(busy.url)
        try:
            with pytest.raises(NoActiveInstance, match="none active"):  # the last PC's answer
                await alone.route({})
        finally:
            await alone.aclose()


async def test_no_answer_in_time_is_a_transport_error_and_the_connection_is_dropped() -> None:
    answers = iter([None, ok({"instance": "x"})])
    async with FakePC(lambda head, body: next(answers)) as pc:
        client = PCClient(pc.url, timeout_s=0.3)
        try:
            with pytest.raises(TransportError, match="no answer within 0.3 s"):
                await client.route({})
            assert (await client.route({}))[0] == {"instance": "x"}
        finally:
            await client.aclose()
    assert pc.connections == 2


async def test_httpx_path_answers_alike(decision_pc: FakePC) -> None:
    lean, old = PCClient(decision_pc.url), PCClient(decision_pc.url, lean=False)
    try:
        assert (await lean.route({"a": 1}))[0] == (await old.route({"a": 1}))[0]
    finally:
        await lean.aclose()
        await old.aclose()


async def test_an_answer_that_is_not_a_decision_is_a_transport_error() -> None:
    text = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 4\r\n\r\nnope"
    async with FakePC(lambda head, body: text) as pc:
        client = PCClient(pc.url)
        try:
            with pytest.raises(TransportError, match="not a JSON object"):
                await client.route({})
        finally:
            await client.aclose()


def test_a_token_that_would_break_the_head_is_refused() -> None:
    with pytest.raises(ValueError, match="printable"):
        PCClient("http://127.0.0.1:1/", token="t0k\r\nX-Other: 1")
