"""`kvsp bench core`: Block Key derivation and container parsing against their primitives."""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from typing import Any, Callable

import numpy as np

from kvsp_moq.protocol.container import Container, encode
from kvsp_moq.protocol.keys import BLOCK_LABEL, block_keys, tokens_to_bytes


def _best(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def bench_keys(tokens: int, block_tokens: int, repeat: int) -> dict[str, Any]:
    rng = np.random.default_rng(7)
    arr = rng.integers(0, 2**32, size=tokens, dtype=np.uint64).astype(np.uint32)
    toks = arr.tolist()
    scope_key, compat = os.urandom(32), os.urandom(32)
    # Tokens as an array (as a tokenizer hands them over) and as a JSON-decoded list.
    ours = _best(lambda: block_keys(scope_key, compat, arr, block_tokens), repeat)
    ours_list = _best(lambda: block_keys(scope_key, compat, toks, block_tokens), repeat)
    # Baseline: a plain HMAC per block over the same messages, built before timing.
    keys = block_keys(scope_key, compat, toks, block_tokens)
    raw = tokens_to_bytes(toks)
    step = 4 * block_tokens
    prevs = [bytes(32)] + keys[:-1]
    msgs = [BLOCK_LABEL + compat + prevs[i] + raw[i * step:(i + 1) * step] for i in range(len(keys))]

    def plain() -> None:
        for m in msgs:
            hmac.new(scope_key, m, hashlib.sha256).digest()

    base = _best(plain, repeat)
    return {
        "tokens": tokens,
        "block_tokens": block_tokens,
        "blocks": len(keys),
        "tokens_per_s": round(tokens / ours),
        "tokens_per_s_from_list": round(tokens / ours_list),
        "baseline_hmac_tokens_per_s": round(tokens / base),
        "ratio": round(base / ours, 3),
        "ratio_from_list": round(base / ours_list, 3),
    }


def bench_container(size: int, layers: int, repeat: int) -> dict[str, Any]:
    section = size // layers // 2
    blob = np.random.default_rng(1).integers(0, 256, size=section * 2 * layers, dtype=np.uint8)
    mv = memoryview(blob.tobytes())
    data = encode(0, 1, [(mv[(2 * i) * section:(2 * i + 1) * section],
                          mv[(2 * i + 1) * section:(2 * i + 2) * section]) for i in range(layers)])

    def ours() -> None:
        c = Container(data)
        c.digest()

    t_ours = _best(ours, repeat)
    t_base = _best(lambda: hashlib.sha256(data).digest(), repeat)
    return {
        "block_bytes": len(data),
        "layers": layers,
        "parse_and_digest_gb_per_s": round(len(data) / t_ours / 1e9, 3),
        "baseline_sha256_gb_per_s": round(len(data) / t_base / 1e9, 3),
        "ratio": round(t_base / t_ours, 3),
    }


def run(*, quick: bool = False) -> dict[str, Any]:
    repeat = 3 if quick else 7
    tokens = 16_384 if quick else 131_072
    return {
        "benchmark": "core",
        "block_keys": [bench_keys(tokens, b, repeat) for b in (16, 256)],
        "container": [bench_container(s, 32, repeat)
                      for s in ((2 << 20,) if quick else (2 << 20, 64 << 20))],
        "targets": {"block_keys_ratio": ">= 1.0", "container_ratio": ">= 0.9"},
    }
