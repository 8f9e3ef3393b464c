"""A holder with a relay (DESIGN §4, §6): its store served over MOQT by a BlockPublisher on
the holder's own event loop, and a MOQT record in the index beside each HTTP record."""

from __future__ import annotations

import asyncio
import base64
import hashlib
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvsp_moq.auth import Authenticator
from kvsp_moq.errors import SettingError
from kvsp_moq.fetch.moqt import MoqtBlockFetcher
from kvsp_moq.holder.service import Holder, HolderSettings
from kvsp_moq.moqt.certs import client_tls, generate_self_signed
from kvsp_moq.naming import BlockTrack, decode_namespace, publisher_id
from kvsp_moq.protocol.container import Container
from kvsp_moq.protocol.records import ReplicaRecord, replica_id
from kvsp_moq.web import BackgroundServer
from relay.relay import Relay, RelaySettings
from tests.holder.conftest import COMPAT, OTHER_SCOPE, SCOPE, FakeIndex, make_block
from tests.polling import eventually

CERT = generate_self_signed()
PUT = {"If-None-Match": "*"}
STEP = 10.0


class ReplicaIndex(FakeIndex):
    """The recording Index Service, keeping every record under its full replica ID (holder and
    moqt_namespace, DESIGN §3) in batches too, as the real one does."""

    def app(self) -> Starlette:
        single = super().app()

        async def batch(request: Request) -> Response:
            records = [ReplicaRecord.from_json(r) for r in (await request.json())["records"]]
            with self.lock:
                for r in records:
                    path = f"{r.compat_id}/{r.scope_id}/{r.block_key}/{replica_id(r.holder, r.moqt_namespace)}"
                    self.records[path] = r.to_json()
                    self.events.append(("BATCH", r.block_key))
                self.batches.append(len(records))
            return JSONResponse({"stored": len(records)})

        return Starlette(routes=[Route("/replicas:batch", batch, methods=["POST"]), *single.routes])


@pytest.fixture
def fake_index():
    index = ReplicaIndex()
    with BackgroundServer(index.app()) as server:
        yield index, server.url


def records_of(index: FakeIndex, key: str) -> dict[str, ReplicaRecord]:
    """The records of one block in the index, by kind ("http" / "moqt")."""
    with index.lock:
        found = [ReplicaRecord.from_json(r) for r in index.records.values() if r["block_key"] == key]
    return {("moqt" if r.is_moqt else "http"): r for r in found}


async def put(client: httpx.AsyncClient, holder: Holder, block) -> ReplicaRecord:
    r = await client.put(holder.url + block.path, content=block.data, headers=PUT)
    assert r.status_code == 201, r.text
    return ReplicaRecord.from_json(r.json())


@pytest.fixture
async def relay():
    relay = await Relay(RelaySettings(certificate=CERT)).start()
    try:
        yield relay
    finally:
        await relay.aclose()


@pytest.fixture
def cert_file(tmp_path):
    path = tmp_path / "relay-cert.pem"
    path.write_bytes(CERT.certificate_pem)
    return str(path)


@pytest.fixture
def holders():
    started: list[Holder] = []

    def start(**settings: Any) -> Holder:
        settings.setdefault("listen", "127.0.0.1:0")
        holder = Holder(HolderSettings(**settings)).start()
        started.append(holder)
        return holder

    yield start
    for holder in started:
        holder.stop()


@pytest.fixture
async def client():
    async with httpx.AsyncClient(trust_env=False) as c:
        yield c


async def announced(holder: Holder, *pairs: tuple[str, str]) -> None:
    await eventually(lambda: holder.moqt_publisher is not None
                     and set(pairs) <= holder.moqt_publisher.announced,
                     timeout=STEP, what="the namespaces announced")


# --------------------------------------------------------------------------- records


async def test_a_holder_with_a_relay_publishes_both_records(relay, fake_index, holders, client, cert_file):
    index, index_url = fake_index
    holder = holders(index_url=index_url, relay=relay.url, relay_ca=cert_file, record_ttl_ms=30_000)
    block = make_block(1, layers=5)
    answered = await put(client, holder, block)
    assert not answered.is_moqt and answered.holder == holder.url  # the PUT answers with the HTTP one

    key = block.bid.block_key
    records = await eventually(lambda: len(r := records_of(index, key)) == 2 and r, timeout=STEP,
                               what="both records")
    http, moqt = records["http"], records["moqt"]
    assert http.holder == holder.url and http.moqt_namespace is None and http.http_holder is None
    assert moqt.holder == relay.url and moqt.http_holder == holder.url
    for member in ("block_key", "compat_id", "scope_id", "codec", "size", "digest", "ttl_ms",
                   "layer_digests", "residency"):
        assert getattr(moqt, member) == getattr(http, member), member
    assert replica_id(moqt.holder, moqt.moqt_namespace) != replica_id(http.holder)

    # moqt_namespace: base64url without padding of the five fields, each after its length octet.
    raw = base64.urlsafe_b64decode(moqt.moqt_namespace + "=" * (-len(moqt.moqt_namespace) % 4))
    assert "=" not in moqt.moqt_namespace
    fields, pos = [], 0
    while pos < len(raw):
        fields.append(raw[pos + 1:pos + 1 + raw[pos]])
        pos += 1 + raw[pos]
    assert pos == len(raw)
    # Each ID as lowercase hex text (DESIGN §4, with IDs as text: see kvsp_moq/naming.py).
    assert fields == [b"kvsp", COMPAT.encode(), block.bid.scope_id.encode(),
                      hashlib.sha256(holder.url.encode()).digest()[:16].hex().encode(), key.encode()]
    assert [len(f) for f in fields] == [4, 64, 32, 32, 64]
    assert tuple(fields) == decode_namespace(moqt.moqt_namespace)
    assert bytes.fromhex(fields[3].decode()) == publisher_id(holder.url) == holder.moqt_publisher.publisher_id
    await announced(holder, (COMPAT, SCOPE))


async def test_both_records_are_refreshed_and_withdrawn_together(relay, fake_index, holders, client):
    index, index_url = fake_index
    size = len(make_block(0).data)
    holder = holders(index_url=index_url, relay=relay.url, host_bytes=2 * size, record_ttl_ms=900)
    a, b, c = (make_block(i) for i in range(3))
    await put(client, holder, a)
    await put(client, holder, b)
    # Refreshed in one batch every 0.3 s: two blocks, two records each.
    await eventually(lambda: 4 in index.batches, timeout=STEP, what="a refresh of four records")
    await put(client, holder, c)  # evicts a, the least recently used
    assert index.deleted() == [a.bid.block_key, a.bid.block_key]  # DELETE of both, before the data went
    assert records_of(index, a.bid.block_key) == {}
    await eventually(lambda: all(len(records_of(index, x.bid.block_key)) == 2 for x in (b, c)),
                     timeout=STEP, what="the records of b and c")
    await eventually(lambda: index.batches[-1] == 4, timeout=STEP, what="a refresh without a")


async def test_every_compat_and_scope_held_is_announced(relay, holders, client):
    holder = holders(relay=relay.url)
    await put(client, holder, make_block(1))
    await put(client, holder, make_block(2, scope=OTHER_SCOPE))
    await announced(holder, (COMPAT, SCOPE), (COMPAT, OTHER_SCOPE))
    namespaces = [BlockTrack.for_holder(COMPAT, s, "00" * 32, holder.url).announce_prefix for s in (SCOPE, OTHER_SCOPE)]
    await eventually(lambda: all(relay.routes.lookup(ns) for ns in namespaces), timeout=STEP,
                     what="routes at the relay")


# --------------------------------------------------------------------------- data


async def test_layers_through_the_relay_equal_an_http_get(relay, fake_index, holders, client, cert_file):
    index, index_url = fake_index
    holder = holders(index_url=index_url, relay=relay.url, relay_ca=cert_file)
    block = make_block(7, layers=8, section=40_000)
    await put(client, holder, block)
    moqt = (await eventually(lambda: records_of(index, block.bid.block_key).get("moqt"), timeout=STEP,
                             what="the MOQT record"))
    await announced(holder, (COMPAT, SCOPE))

    r = await client.get(holder.url + block.path)
    assert r.status_code == 200
    via_http = Container(r.content)
    async with MoqtBlockFetcher(cadata=CERT.certificate_pem, timeout=STEP, layer_timeout=STEP) as fetcher:
        whole = [layer async for layer in fetcher.layers([], moqt)]
        part = [layer async for layer in fetcher.layers([], moqt, (2, 5))]
    assert [layer.index for layer in whole] == list(range(8))
    for layer in whole + part:
        ref = via_http.layer(layer.index)
        assert bytes(layer.k) == bytes(ref.k) and bytes(layer.v) == bytes(ref.v)
    assert [layer.index for layer in part] == [2, 3, 4, 5]
    assert holder.moqt_publisher.stats.fetches >= 1


async def test_the_holder_token_is_presented_to_a_protected_relay(fake_index, holders, client):
    auth = Authenticator.from_mapping({"principal": [
        {"name": "holder", "token": "holder-token", "scopes": [SCOPE], "holders": ["*"],
         "roles": ["holder"]},
    ]})
    relay = await Relay(RelaySettings(certificate=CERT, authenticator=auth)).start()
    try:
        holder = holders(relay=relay.url, index_token="holder-token")
        await put(client, holder, make_block(1))
        await announced(holder, (COMPAT, SCOPE))
        assert relay.stats.unauthorized == 0
    finally:
        await relay.aclose()


async def test_a_relay_with_another_certificate_is_not_trusted(relay, holders, client, tmp_path):
    other = tmp_path / "other.pem"
    other.write_bytes(generate_self_signed().certificate_pem)
    holder = holders(relay=relay.url, relay_ca=str(other))
    await put(client, holder, make_block(1))
    await asyncio.sleep(1.0)
    assert holder.moqt_publisher.stats.connections == 0 and not holder.moqt_publisher.announced


async def test_without_a_relay_there_is_no_moqt_side(fake_index, holders, client):
    index, index_url = fake_index
    holder = holders(index_url=index_url)
    block = make_block(1)
    await put(client, holder, block)
    await eventually(lambda: records_of(index, block.bid.block_key), timeout=STEP, what="the HTTP record")
    assert holder.moqt_publisher is None
    assert list(records_of(index, block.bid.block_key)) == ["http"]


# --------------------------------------------------------------------------- the relay's certificate


def test_relay_certificate_checks(tmp_path):
    """The holder checks its relay's certificate by the rule every MOQT client shares."""
    ca = tmp_path / "ca.pem"
    ca.write_bytes(CERT.certificate_pem)

    def decided(url, cafile=None, insecure=False):
        return client_tls(url, cafile=cafile, insecure=insecure).connect_options()

    assert decided("moqt://127.0.0.1:4443") == {"verify": False}  # loopback default
    assert decided("moqt://localhost:4443") == {"verify": False}
    assert decided("moqt://127.0.0.1:4443", ca) == {"verify": True, "cafile": str(ca)}
    assert decided("moqt://relay.example:4443") == {"verify": True}  # system CAs
    assert decided("moqt://10.0.0.5:4443", insecure=True) == {"verify": False}  # anywhere, warned
    with pytest.raises(SettingError, match="not both"):
        client_tls("moqt://127.0.0.1:4443", cafile=ca, insecure=True)
    with pytest.raises(SettingError):
        client_tls("https://127.0.0.1:4443")


def test_the_command_line_carries_the_relay_options():
    import argparse

    from kvsp_moq.holder.service import configure_parser, settings_from_args

    parser = argparse.ArgumentParser()
    configure_parser(parser)
    args = parser.parse_args(["--relay", "moqt://127.0.0.1:4443", "--relay-ca", "ca.pem"])
    settings = settings_from_args(args)
    assert (settings.relay, settings.relay_ca, settings.relay_insecure) == ("moqt://127.0.0.1:4443", "ca.pem", False)
    assert settings_from_args(parser.parse_args(["--relay", "moqt://127.0.0.1:1", "--relay-insecure"])).relay_insecure
    with pytest.raises(SystemExit):
        parser.parse_args(["--relay-ca", "ca.pem", "--relay-insecure"])
