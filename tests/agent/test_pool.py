"""The agent's KV pool on the CPU: a placed layer lands in its block's rows, and a block is cut
out of the pool as the same container the model's state would give."""

from __future__ import annotations

import pytest
import torch

from agent.pool import KVPool, block_container, tensor_octets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_placed_layers_are_the_blocks_container(dtype: torch.dtype) -> None:
    layers, heads, dim, b = 3, 2, 4, 4
    pool = KVPool(num_layers=layers, kv_heads=heads, head_dim=dim, dtype=dtype, device="cpu",
                  block_tokens=b, blocks=["a", "b"])
    gen = torch.Generator().manual_seed(5)
    kv = {(slot, layer): (torch.randn(b, heads, dim, generator=gen).to(dtype),
                          torch.randn(b, heads, dim, generator=gen).to(dtype))
          for slot in range(2) for layer in range(layers)}
    for (slot, layer), (k, v) in kv.items():
        pool.place(slot, layer, tensor_octets(k), bytes(tensor_octets(v)))
    for slot in range(2):
        expected = block_container([kv[slot, layer] for layer in range(layers)])
        assert pool.block_container(slot) == expected
        rows = pool.rows(slot)
        for layer in range(layers):
            assert torch.equal(pool.k[layer][rows], kv[slot, layer][0])
            assert torch.equal(pool.v[layer][rows], kv[slot, layer][1])


def test_a_layer_of_the_wrong_size_is_refused() -> None:
    pool = KVPool(num_layers=1, kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu",
                  block_tokens=2, blocks=["a"])
    with pytest.raises(ValueError, match="sections of 12 and 16 octets"):
        pool.place(0, 0, bytes(12), bytes(16))
