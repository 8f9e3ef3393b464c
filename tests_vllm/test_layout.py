"""The tripwire on vLLM's CPU cache writer: for fp32 blocks the layout derived from
`cpu_attn_reshape_and_cache` is the "vec" layout read from vLLM 0.32's kernel (per head, K as
[D, N], then V as [N, D]), which the connector copies into as a strided view."""

from __future__ import annotations

import torch

from kvsp_moq.integrations.vllm.layout import cpu_isa, cpu_writer_op, derive_cpu_layout, vec_reference


def test_fp32_blocks_are_the_vec_layout() -> None:
    kv_heads, head_dim, block = 4, 64, 32
    isa = cpu_isa(torch.float32, block, head_dim, "auto")
    layout = derive_cpu_layout(cpu_writer_op(), kv_heads=kv_heads, head_dim=head_dim,
                               block_size=block, dtype=torch.float32, isa=isa)
    k_ref, v_ref = vec_reference(kv_heads=kv_heads, head_dim=head_dim, block_size=block)
    assert isa in ("vec", "vec16")
    assert torch.equal(layout.k_index, k_ref) and torch.equal(layout.v_index, v_ref)
    assert layout.k_view is not None and layout.v_view is not None
