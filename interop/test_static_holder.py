"""A plain static web server as an HTTP holder (KVSP §6.7): Python's own `http.server`, run as
a process, serving a directory laid out as `blocks/{compat}/{scope}/{key}`.

Such a server knows nothing of KVSP: it sends no Repr-Digest, ignores `layers=a-b`, labels a
block with a guessed media type and has no leases. The HTTP fetcher must still deliver the
block, verified by the Replica Record's digests alone, and must say what it could not rely on
instead of assuming it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import httpx
import pytest

from kvsp_moq.errors import DigestMismatch, KvspError, NotFound
from kvsp_moq.fetch.http import HttpFetcher
from kvsp_moq.fetch.leases import LeaseClient
from kvsp_moq.protocol.container import Container
from kvsp_moq.protocol.records import ReplicaRecord

from .helpers import STEP, Block, Service, eventually, make_block, services

LAYERS = 12


def record_for(block: Block, holder: str, *, layer_digests: bool = True) -> ReplicaRecord:
    """The HTTP Replica Record a publisher would write for a block kept on `holder`."""
    whole = Container(block.data)
    data = {"block_key": block.bid.block_key, "compat_id": block.bid.compat_id,
            "scope_id": block.bid.scope_id, "holder": holder, "codec": 1, "size": len(block.data),
            "digest": "sha-256:" + whole.digest().hex(), "ttl_ms": 60_000}
    if layer_digests:
        data["layer_digests"] = [d.hex() for d in whole.layer_digests()]
    return ReplicaRecord.from_json(data)


def lay_out(root: Path, block: Block, data: bytes | None = None) -> Path:
    path = root / block.path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(block.data if data is None else data)
    return path


async def serving(client: httpx.AsyncClient, server: Service) -> None:
    async def answers() -> bool:
        try:
            return (await client.get(server.url, timeout=1.0)).status_code == 200
        except httpx.HTTPError:
            return False

    await eventually(answers, "the static server to answer", service=server, interval=0.1)


async def test_a_static_web_server_serves_verified_whole_blocks(tmp_path: Path) -> None:
    root = tmp_path / "www"
    root.mkdir()
    block, other, corrupt = (make_block(n, layers=LAYERS) for n in (21, 22, 23))
    lay_out(root, block)
    lay_out(root, other)
    bad = bytearray(corrupt.data)
    bad[Container(corrupt.data).data_offset + 7 * 2 * 16_384 + 100] ^= 0x40  # inside layer 7
    lay_out(root, corrupt, bytes(bad))

    async with services(tmp_path) as run, httpx.AsyncClient(timeout=10, trust_env=False) as client:
        server = await run.static_server(root)
        await serving(client, server)
        url = server.url

        # What the server lacks, seen on the wire.
        r = await client.get(url + block.path + "?layers=3-5")
        assert r.status_code == 200 and r.content == block.data  # the whole block, not layers 3-5
        assert "repr-digest" not in r.headers
        assert r.headers.get("content-type", "").split(";")[0] != "application/kvsp-block"

        async with HttpFetcher(timeout=STEP) as fetcher:
            # Whole block: delivered, every layer checked against the record's layer digests.
            record = record_for(block, url)
            result = await fetcher.fetch_block([url], record)
            assert bytes(result.container.buffer) == block.data
            assert result.failures == [] and result.source == url
            assert any("sent no usable Repr-Digest" in note and "record's digests only" in note
                       for note in result.notes), result.notes
            assert any("labelled the block" in note for note in result.notes), result.notes

            # A layer range: the server ignores layers=, so the block is read from its first
            # octet (up to the last wanted layer), only the range is handed out, and a note says so.
            part = await fetcher.fetch_block([url], record, (3, 5))
            expected = Container(block.data).slice(3, 5)
            assert bytes(part.container.buffer) == expected
            assert part.layers == (3, 5)
            assert part.bytes_received > len(expected)
            assert any(f"ignored layers=3-5 and sent layers 0-{LAYERS - 1}" in note for note in part.notes), \
                part.notes

            # Streaming: layers are still handed out in order, each verified.
            async with fetcher.layers([url], record, (6, 9)) as stream:
                assert [layer.index async for layer in stream] == [6, 7, 8, 9]
            assert stream.failures == []

            # A record without layer digests: only the whole block is checked, by the replica digest.
            whole_only = await fetcher.fetch_block([url], record_for(other, url, layer_digests=False))
            assert bytes(whole_only.container.buffer) == other.data

            # Verification is the record's job here, and it catches a corrupted file.
            with pytest.raises(DigestMismatch) as caught:
                await fetcher.fetch_block([url], record_for(corrupt, url))
            assert caught.value.failures == [(url, "layer 7 does not match its layer digest")]
            wrong = dataclasses.replace(record_for(other, url, layer_digests=False),
                                        digest="sha-256:" + "00" * 32)
            with pytest.raises(DigestMismatch):
                await fetcher.fetch_block([url], wrong)

            # A block the server does not have is a miss, as a holder's 404 is.
            with pytest.raises(NotFound) as missing:
                await fetcher.fetch_block([url], record_for(make_block(24, layers=LAYERS), url))
            assert missing.value.failures == [(url, "HTTP 404")]

        # No leases (§6.6): the server answers 501 and the request fails, never taken as granted.
        with pytest.raises(KvspError) as refused:
            await LeaseClient(client).acquire(url, [block.bid.block_key], 5_000)
        assert "501" in refused.value.detail
