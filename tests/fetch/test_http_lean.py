"""The lean HTTP/1.1 path of the fetcher: body framings, kept-alive connections, broken
responses, and verification when the digests are computed on the hash workers."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import random
import socket
import threading
from typing import Callable, Iterator

import httpx
import pytest

import kvsp_moq.fetch.http as fetch_http
from kvsp_moq.errors import BadContainer
from kvsp_moq.fetch.http import HttpFetcher
from kvsp_moq.protocol.container import Container
from kvsp_moq.protocol.container_parser import ContainerParser
from kvsp_moq.protocol.records import ReplicaRecord
from kvsp_moq.web import BackgroundServer
from tests.fetch.test_http import corrupting_proxy, stored
from tests.holder.conftest import make_block

#: (connection number, request number on it, request head) -> (response octets, keep open)
Respond = Callable[[int, int, bytes], tuple[bytes, bool]]


class CannedServer:
    """A socket server answering each request with whatever `respond` returns."""

    def __init__(self, respond: Respond) -> None:
        self.respond = respond
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/"
        self.connections = 0
        self.requests: list[bytes] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn, self.connections),
                             daemon=True).start()

    def _serve(self, conn: socket.socket, number: int) -> None:
        buf = b""
        served = 0
        with conn:
            while True:
                while b"\r\n\r\n" not in buf:
                    try:
                        data = conn.recv(65536)
                    except OSError:
                        return
                    if not data:
                        return
                    buf += data
                head, buf = buf.split(b"\r\n\r\n", 1)
                self.requests.append(head)
                served += 1
                out, keep = self.respond(number, served, head)
                try:
                    conn.sendall(out)
                except OSError:
                    return
                if not keep:
                    return

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def canned() -> Iterator[Callable[[Respond], CannedServer]]:
    servers: list[CannedServer] = []

    def start(respond: Respond) -> CannedServer:
        servers.append(CannedServer(respond))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def static_record(block, holder: str) -> ReplicaRecord:
    return ReplicaRecord.from_json({
        "block_key": block.bid.block_key, "compat_id": block.bid.compat_id,
        "scope_id": block.bid.scope_id, "holder": holder, "codec": 1,
        "size": len(block.data),
        "digest": "sha-256:" + hashlib.sha256(
            b"".join(bytes.fromhex(d) for d in block.layer_digests)).hexdigest(),
        "layer_digests": block.layer_digests, "ttl_ms": 1000})


def head(status: str, fields: dict[str, str | int]) -> bytes:
    lines = [status] + [f"{k}: {v}" for k, v in fields.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def repr_field(data: bytes) -> str:
    return "sha-256=:" + base64.b64encode(hashlib.sha256(data).digest()).decode() + ":"


def chunked(data: bytes, seed: int) -> bytes:
    rng = random.Random(seed)
    out, pos = [], 0
    while pos < len(data):
        n = rng.randint(1, 50_000)
        piece = data[pos:pos + n]
        out.append(b"%x;ext=1\r\n" % len(piece) + piece + b"\r\n")
        pos += n
    return b"".join(out) + b"0\r\nTrailer: x\r\n\r\n"


async def test_chunked_and_close_delimited_bodies(canned) -> None:
    block = make_block(21, layers=6, section=40_000)
    data = block.data
    fields = {"Content-Type": "application/kvsp-block", "Repr-Digest": repr_field(data)}
    as_chunks = canned(lambda n, i, req: (
        head("HTTP/1.1 200 OK", fields | {"Transfer-Encoding": "chunked"})
        + chunked(data, n * 100 + i), True))
    until_close = canned(lambda n, i, req: (head("HTTP/1.0 200 OK", fields) + data, False))
    async with HttpFetcher(timeout=2.0) as f:
        for server in (as_chunks, until_close):
            record = static_record(block, server.url)
            for _ in range(2):
                result = await f.fetch_block([server.url], record)
                assert bytes(result.container.buffer) == data and not result.failures
            result = await f.fetch_block([server.url], record, (2, 4))
            assert bytes(result.container.buffer) == Container(data).slice(2, 4)
            assert any("ignored layers=2-4" in n for n in result.notes)
    assert as_chunks.connections == 1  # kept alive across the three GETs
    assert until_close.connections == 3
    assert all(b"Accept-Encoding: identity" in r for r in as_chunks.requests)


async def test_interim_responses_and_the_connection_limit(canned) -> None:
    block = make_block(28, layers=4, section=50_000)
    data = block.data
    fields = {"Content-Type": "application/kvsp-block", "Content-Length": len(data),
              "Repr-Digest": repr_field(data)}
    server = canned(lambda n, i, req: (
        head("HTTP/1.1 103 Early Hints", {"Link": "</x>; rel=preload"})
        + head("HTTP/1.1 200 OK", fields) + data, True))
    async with HttpFetcher(timeout=2.0) as f:
        f.pool.max_connections = 1  # type: ignore[union-attr]
        record = static_record(block, server.url)
        results = await asyncio.gather(*(f.fetch_block([server.url], record)
                                         for _ in range(4)))
    assert all(bytes(r.container.buffer) == data and not r.failures for r in results)
    assert server.connections == 1


async def test_a_kept_alive_connection_closed_by_the_server_is_replaced(canned) -> None:
    block = make_block(22, layers=4)
    data = block.data
    fields = {"Content-Type": "application/kvsp-block", "Content-Length": len(data),
              "Repr-Digest": repr_field(data)}
    # HTTP/1.1 without "Connection: close", then the connection is dropped: the next GET
    # finds it closed and is sent again on a new one.
    server = canned(lambda n, i, req: (head("HTTP/1.1 200 OK", fields) + data, False))
    async with HttpFetcher(timeout=2.0) as f:
        record = static_record(block, server.url)
        for _ in range(3):
            result = await f.fetch_block([server.url], record)
            assert bytes(result.container.buffer) == data and not result.failures
    assert server.connections == 3


async def test_broken_responses_fall_through_to_the_next_source(canned, start_holder) -> None:
    holder = start_holder()
    block = make_block(23, layers=6, section=30_000)
    data = block.data
    record = stored(holder, block)
    ok = {"Content-Type": "application/kvsp-block", "Repr-Digest": repr_field(data)}
    cut = canned(lambda n, i, req: (
        head("HTTP/1.1 200 OK", ok | {"Content-Length": len(data)}) + data[:len(data) // 2],
        False))
    shorter = canned(lambda n, i, req: (
        head("HTTP/1.1 200 OK", ok | {"Content-Length": len(data) - 10}) + data[:-10], True))
    garbage = canned(lambda n, i, req: (b"SSH-2.0-OpenSSH\r\n\r\n", False))
    problem = b'{"type": "urn:kvsp:problem:kvsp-not-found", "status": 404}'
    refused = canned(lambda n, i, req: (
        head("HTTP/1.1 404 Not Found", {"Content-Type": "application/problem+json",
                                        "Content-Length": len(problem)}) + problem, True))
    async with HttpFetcher(timeout=2.0) as f:
        sources = [cut.url, shorter.url, garbage.url, refused.url, holder.url]
        result = await f.fetch_block(sources, record)
    assert bytes(result.container.buffer) == data
    reasons = dict(result.failures)
    assert "closed" in reasons[cut.url]
    assert "header announced" in reasons[shorter.url]
    assert "RemoteProtocolError" in reasons[garbage.url]
    assert reasons[refused.url] == "HTTP 404 kvsp-not-found"
    # The cut response delivered its complete, verified layers; the rest came from the holder.
    assert result.served_by[-1][0] == holder.url
    assert all(src == cut.url for src, _, _ in result.served_by[:-1])


async def test_a_body_that_stalls_times_out(canned, start_holder) -> None:
    holder = start_holder()
    block = make_block(29, layers=4, section=30_000)
    data = block.data
    record = stored(holder, block)
    fields = {"Content-Type": "application/kvsp-block", "Content-Length": len(data),
              "Repr-Digest": repr_field(data)}
    stalled = canned(lambda n, i, req: (head("HTTP/1.1 200 OK", fields) + data[:50_000], True))
    async with HttpFetcher(timeout=0.3) as f:
        result = await f.fetch_block([stalled.url, holder.url], record)
    assert bytes(result.container.buffer) == data
    assert dict(result.failures)[stalled.url] == "timed out (ReadTimeout)"


@pytest.fixture(params=["inline", "workers"])
def hashing(request, monkeypatch) -> str:
    """Hash every body on the event loop, or every one on the hash workers."""
    monkeypatch.setattr(fetch_http, "INLINE_BODY_BELOW", 1 << 40 if request.param == "inline"
                        else 0)
    return request.param


@pytest.mark.parametrize("corrupt_layer", [0, 3, 7])
async def test_a_corrupted_layer_is_never_handed_out(start_holder, hashing,
                                                     corrupt_layer) -> None:
    bad, good = start_holder(), start_holder()
    block = make_block(24, layers=8, section=50_000)
    record = stored(bad, block)
    stored(good, block)
    offset = Container(block.data).data_offset + corrupt_layer * 100_000 + 77_777
    bad.store.get(block.bid).host.buffer[offset] ^= 0x10
    expected = Container(block.data)
    async with HttpFetcher(timeout=2.0) as f:
        stream = f.layers([bad.url, good.url], record)
        seen = []
        async for layer in stream:
            assert bytes(layer.k) == bytes(expected.layer(layer.index).k)
            assert bytes(layer.v) == bytes(expected.layer(layer.index).v)
            seen.append(layer.index)
    assert seen == list(range(8))
    assert stream.failures[0][0] == bad.url
    assert stream.failures[0][1] in (f"layer {corrupt_layer} does not match its layer digest",
                                     "Repr-Digest does not match the body")
    assert all(src == bad.url and last < corrupt_layer for src, _, last in stream.served_by[:-1])
    assert stream.served_by[-1][0] == good.url


async def test_repr_digest_holds_the_last_layer_on_the_workers(start_holder, hashing) -> None:
    holder, other = start_holder(), start_holder()
    block = make_block(25, layers=4, section=20_000)
    record = stored(holder, block)
    stored(other, block)
    with BackgroundServer(corrupting_proxy(holder.url, 16)) as proxy:  # the Token Count
        async with HttpFetcher(timeout=2.0) as f:
            stream = f.layers([proxy.url, other.url], record)
            seen = [layer.index async for layer in stream]
    assert seen == [0, 1, 2, 3]
    assert stream.failures == [(proxy.url, "Repr-Digest does not match the body")]
    assert stream.served_by[-1][0] == other.url and stream.served_by[-1][2] == 3
    assert all(last < 3 for _, _, last in stream.served_by[:-1])


async def test_the_httpx_path_still_serves(start_holder) -> None:
    holder = start_holder()
    block = make_block(26, layers=8, section=30_000)
    record = stored(holder, block)
    async with HttpFetcher(timeout=2.0, lean=False) as f:
        assert f.pool is None
        result = await f.fetch_block([holder.url], record)
        assert bytes(result.container.buffer) == block.data and not result.failures
        result = await f.fetch_block([holder.url], record, (2, 5))
        assert bytes(result.container.buffer) == Container(block.data).slice(2, 5)


async def test_lean_sources() -> None:
    client = httpx.AsyncClient(trust_env=False)
    assert HttpFetcher(client=client).pool is None  # the caller's client is used as given
    assert HttpFetcher(client=client, lean=True).pool is not None
    await client.aclose()
    f = HttpFetcher()
    assert f.lean_for("http://127.0.0.1:8080/")
    assert f.lean_for("HTTP://holder.example/base/")
    assert not f.lean_for("https://holder.example/")
    assert not f.lean_for("http://user:secret@holder.example/")


def test_parser_in_place() -> None:
    block = make_block(27, layers=3, section=100)
    data = block.data
    buf = bytearray(len(data))
    asm = ContainerParser(max_size=len(data))
    asm.attach(buf)
    done = []
    for end in range(7, len(data) + 7, 7):
        end = min(end, len(data))
        buf[:end] = data[:end]
        done += [layer.index for layer in asm.advance(end)]
    assert done == [0, 1, 2] and asm.complete
    assert bytes(asm.close().buffer) == data
    for size in (len(data) - 1, len(data) + 1):
        asm = ContainerParser(max_size=len(data) + 1)
        given = bytearray(size)
        asm.attach(given)
        given[:100] = data[:100]
        with pytest.raises(BadContainer):
            asm.advance(100)
