"""The HTTP fetcher against real holders, a corrupting proxy, a stalled server and a static
web server (§6.7: clients verify Repr-Digest, layer digests and the replica digest)."""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import http.server
import threading
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvsp_moq.errors import (
    BadContainer,
    DigestMismatch,
    LayersUnavailable,
    NotFound,
    TransportError,
)
from kvsp_moq.fetch.http import (
    HttpFetcher,
    fetch_block,
    parse_repr_digest,
)
from kvsp_moq.protocol.container import Container
from kvsp_moq.protocol.container_parser import ContainerParser
from kvsp_moq.protocol.records import ReplicaRecord
from kvsp_moq.web import BackgroundServer
from tests.holder.conftest import make_block

PUT = {"If-None-Match": "*"}


def stored(holder, block) -> ReplicaRecord:
    r = httpx.put(holder.url + block.path, content=block.data, headers=PUT, trust_env=False)
    assert r.status_code == 201, r.text
    return ReplicaRecord.from_json(r.json())


@pytest.fixture
def two_holders(start_holder):
    return start_holder(), start_holder()


@pytest.fixture
async def fetcher() -> Iterator[HttpFetcher]:
    f = HttpFetcher(timeout=2.0)
    yield f
    await f.aclose()


async def test_whole_block_and_ranges(two_holders, fetcher) -> None:
    holder, _ = two_holders
    block = make_block(1, layers=8, section=300_000)
    record = stored(holder, block)
    result = await fetcher.fetch_block([holder.url], record)
    assert bytes(result.container.buffer) == block.data
    assert result.failures == [] and result.notes == [] and result.source == holder.url
    assert result.first_layer_seconds is not None and result.first_layer_seconds <= result.seconds
    result = await fetcher.fetch_block([holder.url], record, (3, 6))
    assert bytes(result.container.buffer) == Container(block.data).slice(3, 6)
    with pytest.raises(LayersUnavailable):
        fetcher.layers([holder.url], record, (6, 8))


async def test_layers_arrive_verified_in_ascending_order(two_holders, fetcher) -> None:
    holder, _ = two_holders
    block = make_block(2, layers=8, section=200_000)
    record = stored(holder, block)
    expected = Container(block.data)
    seen = []
    async with fetcher.layers([holder.url], record, (2, 7)) as stream:
        async for layer in stream:
            assert bytes(layer.k) == bytes(expected.layer(layer.index).k)
            assert bytes(layer.v) == bytes(expected.layer(layer.index).v)
            seen.append(layer.index)
    assert seen == [2, 3, 4, 5, 6, 7] and stream.failures == []


async def test_a_corrupted_stored_byte_is_caught_and_the_next_source_used(two_holders,
                                                                         fetcher) -> None:
    bad, good = two_holders
    block = make_block(3, layers=6)
    record = stored(bad, block)
    stored(good, block)
    offset = Container(block.data).data_offset + 3 * 2 * 1024 + 5  # inside layer 3
    bad.store.get(block.bid).host.buffer[offset] ^= 0xFF
    result = await fetcher.fetch_block([bad.url, good.url], record)
    assert bytes(result.container.buffer) == block.data
    # Whichever check fires first (layer 3's digest, or Repr-Digest at the end of the body
    # while layers are still being hashed), layer 3 never comes from the bad source.
    assert result.failures in ([(bad.url, "layer 3 does not match its layer digest")],
                               [(bad.url, "Repr-Digest does not match the body")])
    *from_bad, from_good = result.served_by
    assert from_good[0] == good.url and from_good[2] == 5
    assert all(src == bad.url and last < 3 for src, _, last in from_bad)
    with pytest.raises(DigestMismatch) as info:
        await fetcher.fetch_block([bad.url], record)
    assert info.value.failures[0][0] == bad.url


def corrupting_proxy(upstream: str, flip_at: int) -> Starlette:
    """Forwards GETs, flipping one octet of the body and keeping the upstream's headers."""
    async def forward(request: Request) -> Response:
        async with httpx.AsyncClient(trust_env=False) as c:
            r = await c.get(upstream + request.url.path.lstrip("/"),
                            params=dict(request.query_params))
        body = bytearray(r.content)
        if r.status_code == 200:
            body[flip_at] ^= 0x01
        headers = {k: v for k, v in r.headers.items()
                   if k in ("content-type", "repr-digest", "cache-control")}
        return Response(bytes(body), status_code=r.status_code, headers=headers)

    return Starlette(routes=[Route("/{path:path}", forward)])


async def test_repr_digest_is_verified_before_the_last_layer(two_holders, fetcher) -> None:
    holder, other = two_holders
    block = make_block(4, layers=4)
    record = stored(holder, block)
    stored(other, block)
    # Octet 16 is inside the Token Count: no layer digest covers it, only Repr-Digest does.
    with BackgroundServer(corrupting_proxy(holder.url, 16)) as proxy:
        seen = []
        stream = fetcher.layers([proxy.url, other.url], record)
        async for layer in stream:
            seen.append(layer.index)
        assert seen == [0, 1, 2, 3]
        assert stream.failures == [(proxy.url, "Repr-Digest does not match the body")]
        # The response's last layer waits for the Repr-Digest check, so it comes from `other`.
        *from_proxy, from_other = stream.served_by
        assert from_other[0] == other.url and from_other[2] == 3
        assert all(src == proxy.url and last < 3 for src, _, last in from_proxy)


async def test_timeouts_and_refusals_fall_through_to_the_next_source(two_holders) -> None:
    holder, _ = two_holders
    block = make_block(5)
    record = stored(holder, block)

    async def stall(request: Request) -> Response:
        await asyncio.sleep(1.0)  # well past the fetcher's 0.3 s
        return Response(b"")

    stalled = Starlette(routes=[Route("/{path:path}", stall)])
    with BackgroundServer(stalled) as slow:
        async with HttpFetcher(timeout=0.3) as f:
            result = await f.fetch_block(
                ["moqt://relay.example/", slow.url, "http://127.0.0.1:1/", holder.url], record)
    assert bytes(result.container.buffer) == block.data
    reasons = dict(result.failures)
    assert reasons["moqt://relay.example/"] == "not an HTTP source"
    assert reasons[slow.url].startswith("timed out")
    assert "ConnectError" in reasons["http://127.0.0.1:1/"]


async def test_all_sources_failing_raises_with_the_reasons(two_holders, fetcher) -> None:
    holder, other = two_holders
    block = make_block(6)
    record = stored(holder, block)
    with pytest.raises(NotFound) as info:
        await fetcher.fetch_block([other.url], record)
    assert info.value.failures == [(other.url, "HTTP 404 kvsp-not-found")]
    with pytest.raises(TransportError):
        await fetcher.fetch_block(["http://127.0.0.1:1/"], record)
    with pytest.raises(NotFound):
        await fetcher.fetch_block([], record)


@pytest.fixture
def static_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    handler = functools.partial(QuietHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/", tmp_path
    server.shutdown()
    server.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


async def test_a_static_web_server_is_a_usable_source(static_server, fetcher) -> None:
    url, root = static_server
    block = make_block(7, layers=6)
    path = root / block.path
    path.parent.mkdir(parents=True)
    path.write_bytes(block.data)
    record = ReplicaRecord.from_json({
        "block_key": block.bid.block_key, "compat_id": block.bid.compat_id,
        "scope_id": block.bid.scope_id, "holder": url, "codec": 1, "size": len(block.data),
        "digest": "sha-256:" + hashlib.sha256(
            b"".join(bytes.fromhex(d) for d in block.layer_digests)).hexdigest(),
        "layer_digests": block.layer_digests, "ttl_ms": 1000})
    result = await fetcher.fetch_block([url], record)
    assert bytes(result.container.buffer) == block.data
    assert any("Repr-Digest" in n for n in result.notes)
    result = await fetcher.fetch_block([url], record, (1, 3))
    assert bytes(result.container.buffer) == Container(block.data).slice(1, 3)
    assert any("ignored layers=1-3" in n for n in result.notes)
    # A corrupted file is caught by the record's layer digests.
    corrupted = bytearray(block.data)
    corrupted[-10] ^= 0xFF
    path.write_bytes(bytes(corrupted))
    with pytest.raises(DigestMismatch):
        await fetcher.fetch_block([url], record)


async def test_a_record_without_layer_digests_is_checked_whole(two_holders) -> None:
    holder, _ = two_holders
    block = make_block(8)
    full = stored(holder, block).to_json()
    del full["layer_digests"], full["residency"]
    record = ReplicaRecord.from_json(full)
    result = await fetch_block([holder.url], record)
    assert bytes(result.container.buffer) == block.data
    wrong = ReplicaRecord.from_json(full | {"digest": "sha-256:" + "00" * 32})
    with pytest.raises(DigestMismatch):
        await fetch_block([holder.url], wrong)


def test_parser_reports_layers_as_they_complete() -> None:
    block = make_block(9, layers=3, section=10)
    data = block.data
    asm = ContainerParser(max_size=len(data))
    done = []
    for i in range(len(data)):
        done += [layer.index for layer in asm.feed(data[i:i + 1])]
        if i < 20 + 3 * 16 + 19:
            assert done == []
    assert done == [0, 1, 2] and asm.complete
    assert bytes(asm.close().buffer) == data
    for bad in (b"XVB1", data[:4] + b"\x09" + data[5:], data + b"\x00"):
        with pytest.raises(BadContainer):
            a = ContainerParser(max_size=len(data))
            a.feed(bad)
    with pytest.raises(BadContainer):
        ContainerParser(max_size=50).feed(data)


def test_repr_digest_field_parsing() -> None:
    digest = bytes(range(32))
    field = "sha-256=:" + base64.b64encode(digest).decode() + ":"
    assert parse_repr_digest(field) == digest
    assert parse_repr_digest("sha-512=:AAAA:, " + field) == digest
    assert parse_repr_digest("sha-256=:AAAA:") is None
    assert parse_repr_digest(None) is None


def _past_layer_space(block_data: bytes) -> bytes:
    """The block with First Layer set so that First Layer + Layer Count exceeds 2^32 (§4.3
    refuses that; the header is otherwise consistent, so only that rule can catch it)."""
    data = bytearray(block_data)
    data[8:12] = (0xFFFFFFFF).to_bytes(4, "big")
    return bytes(data)


def test_parser_refuses_layers_past_2_to_the_32_in_the_header() -> None:
    block = make_block(10, layers=3, section=10)
    bad = _past_layer_space(block.data)
    with pytest.raises(BadContainer, match="2\\^32"):
        Container(bad)  # the whole-container parser's rule
    asm = ContainerParser(max_size=len(bad))
    with pytest.raises(BadContainer, match="2\\^32"):
        asm.feed(bad)  # the streaming parser refuses it too, before any layer is handed out


async def test_a_source_announcing_layers_past_2_to_the_32_is_malformed_and_skipped(
        two_holders) -> None:
    holder, _ = two_holders
    block = make_block(11)
    full = stored(holder, block).to_json()
    del full["layer_digests"], full["residency"]  # the path that checks the container whole
    record = ReplicaRecord.from_json(full)
    bad = _past_layer_space(block.data)

    async def serve(request: Request) -> Response:
        return Response(bad, media_type="application/kvsp-block")

    with BackgroundServer(Starlette(routes=[Route("/{path:path}", serve)])) as liar:
        result = await fetch_block([liar.url, holder.url], record)
    assert bytes(result.container.buffer) == block.data
    assert result.failures[0][0] == liar.url and "2^32" in result.failures[0][1]
