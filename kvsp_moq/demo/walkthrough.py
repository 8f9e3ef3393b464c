"""`kvsp demo`: show the protocol at work on this machine, measuring everything it prints."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np

from kvsp_moq.protocol.compat import CompatDescriptor
from kvsp_moq.protocol.container import Container, encode, format_digest
from kvsp_moq.protocol.keys import BlockKeyChain, scope_id

DEMO_DESCRIPTOR = {
    "model": "llama-tiny",
    "model_digest": "sha-256:" + "00" * 32,
    "tokenizer_digest": "sha-256:" + "00" * 32,
    "layers": 8, "kv_heads": 2, "head_dim": 32, "kv_dtype": "float32",
    "positional": "rope", "block_tokens": 16, "layout": "kvsp-layout-1",
}


def run_core_walkthrough(*, as_json: bool = False) -> dict[str, Any]:
    """Compatibility ID, Block Keys of two prompts sharing a prefix, and a verified container."""
    d = CompatDescriptor.from_dict(DEMO_DESCRIPTOR)
    key_a, key_b = os.urandom(32), os.urandom(32)
    rng = np.random.default_rng(0)
    system = rng.integers(0, 4096, 512).tolist()
    prompts = [system + rng.integers(0, 4096, 40).tolist() for _ in range(2)]
    t = time.perf_counter()
    keys = [BlockKeyChain(key_a, d.compat_id, d.block_tokens) for _ in prompts]
    for chain, prompt in zip(keys, prompts):
        chain.extend(prompt)
    shared = sum(1 for a, b in zip(keys[0].keys, keys[1].keys) if a == b)
    other_tenant = BlockKeyChain(key_b, d.compat_id, d.block_tokens)
    other_tenant.extend(prompts[0])
    cross = len(set(other_tenant.keys) & set(keys[0].keys))
    elapsed = time.perf_counter() - t
    section = d.section_bytes(d.block_tokens)
    layers = [(os.urandom(section), os.urandom(section)) for _ in range(d.layers)]
    block = encode(0, d.block_tokens, layers)
    c = Container(block)
    report = {
        "compat_id": d.compat_hex,
        "scope_ids": [scope_id(key_a).hex(), scope_id(key_b).hex()],
        "blocks_per_prompt": len(keys[0].keys),
        "shared_prefix_blocks": shared,
        "blocks_shared_across_tenants": cross,
        "key_derivation_ms": round(elapsed * 1000, 3),
        "container_bytes": len(block),
        "container_digest": format_digest(c.digest()),
    }
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        print(f"Compatibility ID   {report['compat_id']}")
        print(f"Two prompts share  {shared} of {len(keys[0].keys)} blocks "
              f"(a 512-token system prompt at B={d.block_tokens})")
        print(f"Second tenant      {cross} blocks in common with the first (keys are scoped)")
        print(f"A block container  {len(block)} octets, digest {report['container_digest']}")
    return report
