"""How the loader cuts a prefix into requests (`layer_ranges`): a prefix under 8 MiB in whole
blocks (fewer requests cost less than the overlap would save); a larger one starting with layer
0 alone and doubling the range up to about 1 MiB a request, so that the forward pass waits only
for the first layer of every block."""

from __future__ import annotations

import torch

from agent.pool import KVPool
from kvsp_moq.fetch.prefix import PrefixLoader, layer_ranges


def loader(blocks: int, *, layers: int = 8, kv_heads: int = 2, head_dim: int = 32,
           layers_per_request: int | None = None) -> PrefixLoader:
    pool = KVPool(num_layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype=torch.float32,
                  device="cpu", block_tokens=16, blocks=[f"{i:032x}" for i in range(blocks)])
    return PrefixLoader(pool, [[] for _ in range(blocks)], leases=None,  # type: ignore[arg-type]
                        layers_per_request=layers_per_request)


def test_a_small_prefix_loads_whole_blocks() -> None:
    small = loader(32)  # 32 blocks of 64 KiB: 2 MiB
    assert small.pool.nbytes == 2 << 20
    assert small.ranges == [(0, 7)]


def test_a_large_prefix_starts_with_layer_0_alone() -> None:
    large = loader(128)  # 8 MiB
    assert large.pool.nbytes == 8 << 20
    assert large.ranges == [(0, 0), (1, 1), (2, 3), (4, 7)]
    # Big blocks: ranges grow to about 1 MiB (layers of 2 * 16 tokens * 8 heads * 128 * 4
    # octets = 128 KiB: 8 layers a request, of 32).
    big = loader(16, layers=32, kv_heads=8, head_dim=128)
    assert big.pool.nbytes == 64 << 20
    assert big.ranges == [(0, 0), (1, 1), (2, 3), (4, 7), (8, 15), (16, 23), (24, 31)]


def test_ranges_cover_every_layer_once() -> None:
    for layers in range(1, 70):
        for layer_bytes in (1 << 10, 64 << 10, 1 << 20, 4 << 20):
            for per_request in (None, 1, 3):
                ranges = layer_ranges(layers, 200, layer_bytes, per_request, 1 << 20, 8 << 20)
                covered = [layer for a, b in ranges for layer in range(a, b + 1)]
                assert covered == list(range(layers)), (layers, layer_bytes, per_request)


def test_a_configured_range_size_is_kept() -> None:
    assert loader(128, layers_per_request=1).ranges == [(i, i) for i in range(8)]
    assert loader(128, layers_per_request=3).ranges == [(0, 2), (3, 5), (6, 7)]
