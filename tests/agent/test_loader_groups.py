"""How the loader cuts a prefix into requests: about 1 MiB each; a prefix of 8 MiB or more in
at least two layer groups (layer 0 must not wait for whole blocks), a smaller one whole blocks
(fewer requests cost less than the overlap would save)."""

from __future__ import annotations

import torch

from agent.pool import KVPool
from kvsp_moq.fetch.prefix import PrefixLoader


def loader(blocks: int, *, layers: int = 8, kv_heads: int = 2, head_dim: int = 32) -> PrefixLoader:
    pool = KVPool(num_layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype=torch.float32,
                  device="cpu", block_tokens=16, blocks=[f"{i:032x}" for i in range(blocks)])
    return PrefixLoader(pool, [[] for _ in range(blocks)], leases=None)  # type: ignore[arg-type]


def test_a_small_prefix_loads_whole_blocks() -> None:
    small = loader(32)  # 32 blocks of 64 KiB: 2 MiB
    assert small.pool.nbytes == 2 << 20
    assert small.group == 8


def test_a_large_prefix_is_split_into_layer_groups() -> None:
    large = loader(128)  # 8 MiB
    assert large.pool.nbytes == 8 << 20
    assert large.group == 4
    # Big blocks: requests of about 1 MiB (layers of 2 * 16 tokens * 8 heads * 128 * 4 octets
    # = 128 KiB: 8 layers a request, of 32).
    big = loader(16, layers=32, kv_heads=8, head_dim=128)
    assert big.pool.nbytes == 64 << 20
    assert big.group == 8
