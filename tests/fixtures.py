"""Shared test inputs: a Compatibility Descriptor that the protocol, CLI, holder, tool and
Index Service tests all use."""

DESCRIPTOR = {
    "model": "llama-tiny",
    "model_digest": "sha-256:" + "ab" * 32,
    "tokenizer_digest": "sha-256:" + "cd" * 32,
    "layers": 4,
    "kv_heads": 2,
    "head_dim": 8,
    "kv_dtype": "float32",
    "positional": "rope;theta=500000",
    "block_tokens": 16,
    "layout": "kvsp-layout-1",
}
