"""Check what one saved vLLM CPU KV block holds, against transformers' KV for the same prompt.

usage: .venv-vllm/bin/python check_layout.py STORE_DIR
The store is the probe connector's (files KEY.LAYER.pt holding kv_cache[block_id], shape [H, N, 2*D]).
"""
import hashlib, json, os, sys
import torch
from transformers import AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
store = sys.argv[1]
bs = 32
prefix = [3 + (i * 7) % 4000 for i in range(100)]
p1 = prefix + [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
m = AutoModelForCausalLM.from_pretrained(os.path.join(HERE, "tiny-model"), dtype=torch.float32).eval()
with torch.no_grad():
    out = m(torch.tensor([p1]), use_cache=True)
pkv = out.past_key_values
h = hashlib.sha256()
for blk in range(3):
    h.update(json.dumps(p1[blk * bs:(blk + 1) * bs]).encode())
    key = h.copy().hexdigest()[:24]
    for layer in (0, 7):
        t = torch.load(os.path.join(store, f"{key}.model.layers.{layer}.self_attn.attn.pt"))
        H, N, C = t.shape
        D = C // 2
        lay = pkv.layers[layer]
        K = lay.keys[0, :, blk * bs:(blk + 1) * bs]     # [H, N, D] post-RoPE
        V = lay.values[0, :, blk * bs:(blk + 1) * bs]
        a = t.reshape(H, 2 * N, D)                    # how cpu_attn.py views it
        ka, va = a[:, :N], a[:, N:]
        c = t.reshape(H, 2, N * D)                     # ISA "vec"/"vec16" (fp32): K as [H, D, N], V as [H, N, D]
        kb, vb = c[:, 0].reshape(H, D, N).transpose(1, 2), c[:, 1].reshape(H, N, D)
        print(f"block {blk} layer {layer} shape {tuple(t.shape)}: "
              f"A(view [H,2N,D], K=first N rows, V=last N): K {torch.allclose(ka, K, atol=1e-4)} V {torch.allclose(va, V, atol=1e-4)} "
              f"maxerr {max((ka-K).abs().max().item(), (va-V).abs().max().item()):.2e} | "
              f"C(K^T [H,D,N] then V [H,N,D]): K {torch.allclose(kb, K, atol=1e-4)} V {torch.allclose(vb, V, atol=1e-4)} "
              f"maxerr {max((kb-K).abs().max().item(), (vb-V).abs().max().item()):.2e}")
