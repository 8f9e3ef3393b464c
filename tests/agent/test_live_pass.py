"""The producer's side of pass tracks (DESIGN §9.6), without a model or a relay: the blocks a
forward pass computes are slots of pass tracks of bounded object size, and each layer handed
over on the model thread becomes every block's layer object and each track's one object, the
same octets."""

from __future__ import annotations

import asyncio
import hashlib

import torch

from agent.live import LiveProducer
from kvsp_moq.holder.moqt_publisher import BlockPublisher
from kvsp_moq.holder.store import BlockId, BlockStore
from tests.block_tracks import COMPAT, SCOPE, key

HEADS, DIM, B = 2, 4, 16
LAYER_OCTETS = 2 * B * HEADS * DIM * 4  # one block's layer: K and V, float32


async def test_a_pass_is_published_as_pass_tracks_of_bounded_size_whose_objects_are_its_blocks_layers():
    publisher = BlockPublisher(BlockStore(host_bytes=1 << 20), "moqt://127.0.0.1:1/", "http://127.0.0.1:2/")

    def produce(first: BlockId, layers: int, tokens: int):
        return publisher.open_pass(first, layer_count=layers, token_count=tokens)

    producer = LiveProducer(produce, num_layers=2, block_tokens=B, compat_id=COMPAT,
                            layer_octets=LAYER_OCTETS)
    producer.pass_blocks = 2  # as PASS_OBJECT_OCTETS would allow for larger blocks
    keys = [key(40 + i) for i in range(6)]
    live = producer.open(SCOPE, keys, 1, B, skip=lambda bid: bid.block_key == keys[-1])
    assert live is not None and [b.id.block_key for b in live.blocks] == keys[1:5]
    assert [[b.id.block_key for b in t.blocks] for t in live.tracks] == [keys[1:3], keys[3:5]]
    records = [publisher.live_record(b) for b in live.blocks]
    assert [r.live_pass for r in records] == [
        (live.tracks[0].moqt_namespace, 0), (live.tracks[0].moqt_namespace, 1),
        (live.tracks[1].moqt_namespace, 0), (live.tracks[1].moqt_namespace, 1)]
    assert live.tracks[0].moqt_namespace == records[0].moqt_namespace  # the first block's namespace

    rows = 5 * B  # the pass's tokens start at B; block 1 is rows 0..B-1 of what it computed
    for layer in range(2):
        k = torch.randn(rows, HEADS, DIM)
        v = torch.randn(rows, HEADS, DIM)
        live.on_layer(layer, k, v)
        await asyncio.sleep(0.01)  # the hand-over runs on the loop
        for j, block in enumerate(live.blocks):
            expected = (k[j * B:(j + 1) * B].numpy().tobytes() + v[j * B:(j + 1) * B].numpy().tobytes())
            assert bytes(block.payloads[layer]) == expected
            assert block.digests[layer] == hashlib.sha256(expected).digest()
        for t, track in enumerate(live.tracks):
            assert bytes(track.payloads[layer]) == b"".join(bytes(b.payloads[layer]) for b in track.blocks)
            assert track.digests[layer] == b"".join(b.digests[layer] for b in track.blocks)
    assert all(t.complete for t in live.tracks)
    # A track goes once its blocks are stored (a late reader takes their stored copies).
    for block in live.blocks[:2]:
        assert await block.finish() is not None
    assert list(publisher._passes) == [live.blocks[2].id]
    for block in live.blocks[2:]:
        await block.finish()
    assert not publisher._passes


async def test_an_abandoned_pass_ends_its_tracks():
    publisher = BlockPublisher(BlockStore(host_bytes=1 << 20), "moqt://127.0.0.1:1/", "http://127.0.0.1:2/")
    producer = LiveProducer(lambda first, layers, tokens: publisher.open_pass(first, layer_count=layers,
                                                                              token_count=tokens),
                            num_layers=2, block_tokens=B, compat_id=COMPAT, layer_octets=LAYER_OCTETS)
    keys = [key(50 + i) for i in range(3)]
    live = producer.open(SCOPE, keys, 0, 0, skip=lambda bid: False)
    assert live is not None and len(live.tracks) == 1 and len(live.tracks[0].blocks) == 3
    live.abort("outpaced")
    assert live.tracks[0].error == "outpaced" and all(b.error == "outpaced" for b in live.blocks)
    assert not publisher._passes and not publisher.live_blocks()
    # the first block is free to be produced again, as a pass's first block or a slot
    again = producer.open(SCOPE, keys, 0, 0, skip=lambda bid: False)
    assert again is not None and len(again.blocks) == 3
