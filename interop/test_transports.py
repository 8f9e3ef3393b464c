"""One holder, both transports (DESIGN §4, §6): `kvsp holder --relay` publishes every block it
stores as an HTTP replica and, through a `kvsp relay`, as a MOQT replica, each with its own
record in a `kvsp index`. Whatever the transport, a client must get the same octets and the
two records must describe the same replica."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

import httpx

from kvsp_moq.errors import KvspError
from kvsp_moq.fetch.http import HttpFetcher
from kvsp_moq.fetch.moqt import MoqtBlockFetcher
from kvsp_moq.fetch.stream import FetchedBlock
from kvsp_moq.naming import decode_namespace, publisher_id
from kvsp_moq.protocol.container import Container
from kvsp_moq.protocol.records import ReplicaRecord, replica_id

from .helpers import (
    COMPAT,
    SCOPE,
    STEP,
    by_kind,
    eventually,
    healthy,
    lookup,
    make_block,
    put_block,
    relay_cert,
    relay_up,
    services,
)

RANGES = [(0, 0), (3, 8), (11, 11), (5, 11)]


def namespace_fields(text: str) -> list[bytes]:
    """`moqt_namespace` decoded by hand: base64url without padding of length-prefixed fields."""
    assert "=" not in text, text
    raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    fields, pos = [], 0
    while pos < len(raw):
        fields.append(raw[pos + 1:pos + 1 + raw[pos]])
        pos += 1 + raw[pos]
    assert pos == len(raw), "a field runs past the end of the namespace"
    return fields


async def first_moqt_fetch(fetcher: MoqtBlockFetcher, record: ReplicaRecord) -> FetchedBlock:
    """The first MOQT fetch of a block, retried until the holder's announcement reached the relay."""
    async def attempt() -> FetchedBlock | None:
        try:
            return await fetcher.fetch_block([], record)
        except KvspError:
            return None

    return await eventually(attempt, "the block to be served through the relay", interval=0.2)


async def test_http_and_moqt_deliver_the_same_blocks(tmp_path: Path) -> None:
    blocks = [make_block(n, layers=12, section=16_384 + 512 * n, tokens=16 + n) for n in range(3)]
    async with services(tmp_path) as run, httpx.AsyncClient(timeout=10, trust_env=False) as client:
        relay, index = await run.relay(), await run.index()
        await relay_up(relay)
        await healthy(client, index)
        holder = await healthy(client, await run.holder("holder", "--index", index.url, "--relay", relay.url))

        answered = {b.bid.block_key: await put_block(client, holder, b) for b in blocks}
        keys = [b.bid.block_key for b in blocks]

        async def both_published() -> dict[str, dict[str, list[ReplicaRecord]]] | None:
            found = await lookup(client, index, COMPAT, SCOPE, keys)
            kinds = {k: by_kind(v) for k, v in found.items()}
            if len(kinds) == len(keys) and all(len(r["http"]) == len(r["moqt"]) == 1 for r in kinds.values()):
                return kinds
            return None

        records = await eventually(both_published, "an HTTP and a MOQT record of every block in the index")

        for block in blocks:
            key = block.bid.block_key
            http, moqt = records[key]["http"][0], records[key]["moqt"][0]
            # The two records describe one replica, reachable two ways.
            assert http.holder == holder.url and http.moqt_namespace is None and http.http_holder is None
            assert moqt.holder == relay.url and moqt.http_holder == holder.url
            for member in ("block_key", "compat_id", "scope_id", "codec", "size", "digest", "layer_digests"):
                assert getattr(moqt, member) == getattr(http, member), member
            whole = Container(block.data)
            assert http.size == len(block.data)
            assert http.digest == "sha-256:" + whole.digest().hex()
            assert list(http.layer_digests) == [d.hex() for d in whole.layer_digests()]
            assert http.to_json() | {"ttl_ms": 0} == answered[key].to_json() | {"ttl_ms": 0}
            assert replica_id(http.holder, http.moqt_namespace) != replica_id(moqt.holder, moqt.moqt_namespace)
            # moqt_namespace: ("kvsp", compat_id, scope_id, publisher_id, block_key), DESIGN §4.
            fields = namespace_fields(moqt.moqt_namespace)
            assert fields == [b"kvsp", COMPAT.encode(), SCOPE.encode(),
                              hashlib.sha256(holder.url.encode()).digest()[:16].hex().encode(), key.encode()]
            assert [len(f) for f in fields] == [4, 64, 32, 32, 64]
            assert tuple(fields) == decode_namespace(moqt.moqt_namespace)
            assert fields[3] == publisher_id(holder.url).hex().encode()

        async with HttpFetcher(timeout=STEP) as over_http, MoqtBlockFetcher(
                cafile=str(relay_cert(relay)), timeout=STEP, layer_timeout=STEP) as over_moqt:
            for i, block in enumerate(blocks):
                key = block.bid.block_key
                http, moqt = records[key]["http"][0], records[key]["moqt"][0]
                got_http = await over_http.fetch_block([http.holder], http)
                got_moqt = (await first_moqt_fetch(over_moqt, moqt) if i == 0
                            else await over_moqt.fetch_block([], moqt))
                assert bytes(got_http.container.buffer) == bytes(got_moqt.container.buffer) == block.data
                assert got_http.source == holder.url and got_moqt.source == relay.url
                assert got_http.failures == [] and got_moqt.failures == []
                for first, last in RANGES:
                    part_http = await over_http.fetch_block([http.holder], http, (first, last))
                    part_moqt = await over_moqt.fetch_block([], moqt, (first, last))
                    expected = Container(block.data).slice(first, last)
                    assert bytes(part_http.container.buffer) == bytes(part_moqt.container.buffer) == expected, \
                        (key, first, last)
                    assert part_http.layers == part_moqt.layers == (first, last)
                    # A real holder honours layers=a-b: only the range crossed the wire.
                    assert part_http.notes == [] and part_http.bytes_received == len(expected)
