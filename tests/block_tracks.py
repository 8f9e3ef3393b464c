"""The system the MOQT KV-track tests run on: a relay, a block store with a BlockPublisher
(kvsp_moq/holder/moqt_publisher.py) attached to it, and a MoqtBlockFetcher
(kvsp_moq/fetch/moqt.py), all on 127.0.0.1; shared by tests/holder, tests/fetch and
tests/core/test_naming.py."""

from __future__ import annotations

import asyncio
import hashlib
from contextlib import asynccontextmanager

import numpy as np

from kvsp_moq.fetch.moqt import MoqtBlockFetcher
from kvsp_moq.holder.moqt_publisher import BlockPublisher
from kvsp_moq.holder.store import BlockId, BlockStore
from kvsp_moq.moqt.certs import generate_self_signed
from kvsp_moq.protocol.container import Container, encode
from relay.relay import Relay, RelaySettings

CERT = generate_self_signed()
COMPAT, SCOPE, OTHER_SCOPE = "ab" * 32, "cd" * 16, "ef" * 16
HTTP_HOLDER = "http://127.0.0.1:8801/"
STEP = 10.0


def key(n: int) -> str:
    return hashlib.sha256(f"block {n}".encode()).hexdigest()

def container(n: int, layers: int = 8, section: int = 20_000, tokens: int = 16, k_extra: int = 0) -> bytes:
    rng = np.random.default_rng(n)
    parts = []
    for _ in range(layers):
        parts.append((rng.bytes(section + k_extra), rng.bytes(section)))
    return encode(0, tokens, parts)

@asynccontextmanager
async def system(**relay_settings):
    """A relay, a store with a publisher attached to it, and a fetcher."""
    relay = await Relay(RelaySettings(certificate=CERT, **relay_settings)).start()
    store = BlockStore(host_bytes=256 << 20)
    publisher = await BlockPublisher(store, relay.url, HTTP_HOLDER, cadata=CERT.certificate_pem,
                                     rescan_interval=0.1).start()
    fetcher = MoqtBlockFetcher(cadata=CERT.certificate_pem, timeout=STEP, layer_timeout=STEP)
    try:
        await publisher.wait_connected()
        yield relay, store, publisher, fetcher
    finally:
        await fetcher.aclose()
        await publisher.aclose()
        await relay.aclose()

async def stored(store: BlockStore, publisher: BlockPublisher, n: int, scope: str = SCOPE, **kw) -> tuple:
    bid = BlockId(COMPAT, scope, key(n))
    data = container(n, **kw)
    entry = await store.put(bid, data)
    publisher.announce(COMPAT, scope)
    for _ in range(100):
        if (COMPAT, scope) in publisher.announced:
            break
        await asyncio.sleep(0.02)
    return entry, Container(data), publisher.record(entry)

def same_layers(got, whole: Container, first: int, last: int) -> None:
    assert [layer.index for layer in got] == list(range(first, last + 1))
    for layer in got:
        ref = whole.layer(layer.index)
        assert bytes(layer.k) == bytes(ref.k) and bytes(layer.v) == bytes(ref.v)
