"""A holder killed (SIGKILL) in the middle of a transfer (issue #8, faults).

The client must go on from the next source at its first missing layer, and every layer it hands
out must be whole and match its layer digest: a cut response is never a layer. The block is
large (32 layers of 1 MiB) and the consumer pauses after the first layer, so the kill lands
while most of the block is still unsent, whatever the machine's speed.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from kvsp_moq.fetch import (
    HttpFetcher,
    HttpLayerSource,
    LeaseClient,
    LeaseKeeper,
    MoqtBlockFetcher,
    MoqtLayerSource,
    fetch_layers,
    order_candidates,
)
from kvsp_moq.naming import moqt_record
from kvsp_moq.protocol.container import Container
from tests.faults.conftest import Processes, block_key, make_container, small_window_client, stored_record

LAYERS = 32
LAYER_BYTES = 1 << 20


def expected_layers(body: bytes) -> dict[int, bytes]:
    return {layer.index: bytes(layer.k) + bytes(layer.v) for layer in Container(body).layers()}


async def test_http_holder_killed_mid_transfer_next_source(procs: Processes) -> None:
    a = procs.holder()
    b = procs.holder()
    body = make_container(1, layers=LAYERS, layer_bytes=LAYER_BYTES)
    bkey = block_key(1)
    record = stored_record(a.url, bkey, body)
    stored_record(b.url, bkey, body)
    want = expected_layers(body)

    got: dict[int, bytes] = {}
    order: list[int] = []
    async with small_window_client(timeout=5.0) as slow, HttpFetcher(client=slow) as fetcher:
        stream = fetcher.layers([a.url, b.url], record)
        started = time.monotonic()
        async for layer in stream:
            if not order:
                await asyncio.to_thread(a.kill)  # the holder dies with the body mostly unsent
                await asyncio.sleep(0.2)
            order.append(layer.index)
            got[layer.index] = bytes(layer.k) + bytes(layer.v)
        elapsed = time.monotonic() - started

    assert order == list(range(LAYERS)), "layers must come once each, in ascending order"
    assert got == want, "every layer handed out is the stored one"
    sources = [s for s, _, _ in stream.served_by]
    assert sources == [a.url, b.url], f"A served the start, B the rest: {stream.served_by}"
    assert stream.served_by[0][2] < LAYERS - 1, "the kill must land before A sent every layer"
    assert stream.served_by[1] == (b.url, stream.served_by[0][2] + 1, LAYERS - 1)
    assert [s for s, _ in stream.failures] == [a.url], stream.failures
    assert elapsed < 15, f"moving to the next source took {elapsed:.1f} s"


async def test_moqt_holder_killed_mid_transfer_falls_back(procs: Processes) -> None:
    """Through a relay: the MOQT source stalls or ends early; the library's fallback finishes the
    block over HTTP from B, from the first layer MOQT did not deliver."""
    relay = procs.relay()
    a = procs.holder(relay=relay.url)
    b = procs.holder()
    body = make_container(2, layers=LAYERS, layer_bytes=LAYER_BYTES)
    bkey = block_key(2)
    http_record = stored_record(a.url, bkey, body)
    b_record = stored_record(b.url, bkey, body)
    record = moqt_record(http_record, relay.url)
    want = expected_layers(body)

    got: dict[int, bytes] = {}
    order: list[int] = []
    started = time.monotonic()
    async with MoqtBlockFetcher(verify=False, timeout=5.0, layer_timeout=2.0) as moqt, \
            HttpFetcher(timeout=5.0) as http, httpx.AsyncClient(trust_env=False) as client:
        # The publisher announces once its session with the relay is up; wait for it, or the
        # fallback would rightly skip the MOQT candidate as a miss before the kill.
        deadline = time.monotonic() + 15
        while True:
            try:
                await moqt.fetch_block([relay.url], record, (0, 0))
                break
            except Exception:  # not announced yet
                assert time.monotonic() < deadline, "the holder never became reachable through the relay"
                await asyncio.sleep(0.2)
        candidates = order_candidates([record, b_record],
                                      [MoqtLayerSource(moqt, relay.url), HttpLayerSource(http)])
        assert [c.source.kind for c in candidates] == ["moqt", "http"]
        keeper = LeaseKeeper(LeaseClient(client, timeout=2.0), 10_000)
        try:
            async with fetch_layers(candidates, 0, LAYERS - 1, keeper=keeper) as stream:
                async for layer in stream:
                    if not order:
                        await asyncio.to_thread(a.kill)  # the holder dies with the block mostly unsent
                    order.append(layer.index)
                    got[layer.index] = bytes(layer.k) + bytes(layer.v)
        finally:
            await keeper.release()
    elapsed = time.monotonic() - started
    turns = [(t.candidate.source.kind, t.first, t.last, t.error) for t in stream.attempts]
    print(f"\nturns (kind, first, last, error): {turns}; {elapsed:.1f} s in all")

    assert order == list(range(LAYERS)), "layers once each, ascending, across both transports"
    assert got == want, "no partial or unverified layer was handed out"
    moqt_turn, http_turn = stream.attempts[0], stream.attempts[-1]
    assert moqt_turn.candidate.source.kind == "moqt" and moqt_turn.error is not None, (
        f"the relay path should have failed after the holder died ({turns})")
    assert http_turn.candidate.record.holder == b.url and http_turn.error is None, turns
    assert elapsed < 30, f"recovery took {elapsed:.1f} s"
