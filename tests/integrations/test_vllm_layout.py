"""The CPU paged layout derived from a cache writer (`integrations.vllm.layout`), without vLLM:
a writer that stores blocks as vLLM 0.32's fp32 "vec" kernel does (per head, K as [D, N], then V
as [N, D]) gives that layout, and injection by strided copy and by scatter write the same
octets where the writer would."""

from __future__ import annotations

import torch

from kvsp_moq.integrations.vllm.layout import CpuLayout, derive_cpu_layout, vec_reference

H, N, D = 4, 32, 64


def vec_writer(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
               value_cache: torch.Tensor, slots: torch.Tensor, isa: str) -> None:
    """What vLLM's cpu_attn_reshape_and_cache does for fp32 ("vec"): token t of slot s goes to
    block s // N, position s % N; per head K is stored [D, N] and V [N, D] (key_cache and
    value_cache are the halves of a [blocks, H, N, 2D] slab, each viewed as [blocks, H, N, D])."""
    blocks = key_cache.shape[0]
    whole = torch.as_strided(key_cache, (blocks, H, 2 * N * D), (H * 2 * N * D, 2 * N * D, 1),
                             key_cache.storage_offset())
    for t, slot in enumerate(slots.tolist()):
        b, pos = divmod(slot, N)
        for h in range(H):
            whole[b, h, torch.arange(D) * N + pos] = key[t, h]
            whole[b, h, N * D + pos * D + torch.arange(D)] = value[t, h]


def test_the_vec_layout_is_derived_and_copied_strided() -> None:
    layout = derive_cpu_layout(vec_writer, kv_heads=H, head_dim=D, block_size=N,
                               dtype=torch.float32, isa="vec")
    k_ref, v_ref = vec_reference(kv_heads=H, head_dim=D, block_size=N)
    assert torch.equal(layout.k_index, k_ref) and torch.equal(layout.v_index, v_ref)
    assert layout.k_view == ((1, 2 * N * D, N), 0)
    assert layout.v_view == ((D, 2 * N * D, 1), N * D)


def test_strided_and_scattered_injection_agree() -> None:
    layout = derive_cpu_layout(vec_writer, kv_heads=H, head_dim=D, block_size=N,
                               dtype=torch.float32, isa="vec")
    scatter = CpuLayout(layout.k_index, layout.v_index, kv_heads=H, head_dim=D, block_size=N,
                        dtype=torch.float32, isa="vec")
    scatter.k_view = scatter.v_view = None
    k = torch.randn(N * H * D)
    v = torch.randn(N * H * D)
    kb = k.numpy().tobytes()
    vb = v.numpy().tobytes()
    a = torch.zeros(5, H, N, 2 * D)
    b = torch.zeros(5, H, N, 2 * D)
    layout.inject(a, 3, kb, vb)
    scatter.inject(b, 3, kb, vb)
    assert torch.equal(a, b) and a[3].abs().sum() > 0 and a[:3].abs().sum() == 0
    # and what the writer itself stores for the same block
    c = torch.zeros(5, H, N, 2 * D)
    key_cache, value_cache = c.view(5, H, 2 * N, D).chunk(2, dim=2)
    vec_writer(k.view(N, H, D), v.view(N, H, D), key_cache, value_cache,
               torch.arange(3 * N, 4 * N), "vec")
    assert torch.equal(a, c)
    # extraction reads back the kvsp order
    [(k_out, v_out)] = layout.extract(a, [3])
    assert bytes(k_out) == kb and bytes(v_out) == vb


def test_a_packed_layout_keeps_the_scatter() -> None:
    perm = torch.randperm(N * H * D, generator=torch.Generator().manual_seed(1))
    layout = CpuLayout(perm, perm + N * H * D, kv_heads=H, head_dim=D, block_size=N,
                       dtype=torch.float32, isa="packed")
    assert layout.k_view is None and layout.v_view is None
