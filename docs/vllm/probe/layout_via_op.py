"""Derive the CPU paged-KV block layout from vLLM's own writer op (layout-agnostic).

vLLM's CPU attention writes K/V with torch.ops._C.cpu_attn_reshape_and_cache(key, value,
key_cache, value_cache, slot_mapping, isa, ...), where the per-layer cache
[num_blocks, H, N, 2*D] is viewed as [num_blocks, H, 2N, D] and chunked on dim 2.
The placement inside a block depends on the ISA ("vec", "vec16", "amx", "neon", ...).
Writing position-coded values through the op and reading them back gives, for every
(head, token, dim), its flat offset inside the block: a gather index for extraction
and a scatter index for injection, without hard-coding a kernel's tiling.

usage: .venv-vllm/bin/python layout_via_op.py [ISA] [BLOCK_SIZE] [HEADS] [HEAD_DIM]
"""
import sys
import torch
import vllm._custom_ops as ops  # noqa: F401  (registers torch.ops._C)
from vllm import _custom_ops

isa = sys.argv[1] if len(sys.argv) > 1 else None
N = int(sys.argv[2]) if len(sys.argv) > 2 else 32
H = int(sys.argv[3]) if len(sys.argv) > 3 else 2
D = int(sys.argv[4]) if len(sys.argv) > 4 else 32
if isa is None:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    isa = _get_attn_isa(torch.float32, N, D)
print("isa", isa, "avx512", torch.cpu._is_avx512_supported(), "amx", torch.cpu._is_amx_tile_supported())

def layout(isa, N, H, D, dtype=torch.float32):
    nb = 2
    cache = torch.full((nb, H, N, 2 * D), float('nan'), dtype=dtype)
    view = cache.view(nb, H, 2 * N, D)
    kc, vc = view.chunk(2, dim=2)
    # code = 1 + h*N*D + n*D + d  for K, negative for V (exact in fp32 for small sizes)
    code = (torch.arange(H * N * D, dtype=torch.float32) + 1).reshape(H, N, D).permute(1, 0, 2)  # [N,H,D]
    key = code.to(dtype).contiguous()
    value = (-code).to(dtype).contiguous()
    slots = torch.arange(N, dtype=torch.long) + N  # block 1
    _custom_ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa)
    blk = cache[1].reshape(-1).to(torch.float32)
    k_pos = torch.full((H * N * D,), -1, dtype=torch.long)
    v_pos = torch.full((H * N * D,), -1, dtype=torch.long)
    for off, val in enumerate(blk.tolist()):
        if val > 0: k_pos[int(val) - 1] = off
        elif val < 0: v_pos[int(-val) - 1] = off
    return k_pos.reshape(H, N, D), v_pos.reshape(H, N, D), blk

dtype = torch.bfloat16 if isa == 'amx' else torch.float32
k_pos, v_pos, blk = layout(isa, N, H, D, dtype)
print('dtype', dtype, 'unfilled', int(blk.isnan().sum()))
print("K offsets h0 n0 d0..7:", k_pos[0, 0, :8].tolist())
print("K offsets h0 n0..7 d0:", k_pos[0, :8, 0].tolist())
print("V offsets h0 n0 d0..7:", v_pos[0, 0, :8].tolist())
print("V offsets h0 n1 d0:", v_pos[0, 1, 0].item(), " h1 n0 d1:", v_pos[1, 0, 1].item(), " K h1 n0 d0:", k_pos[1, 0, 0].item())
