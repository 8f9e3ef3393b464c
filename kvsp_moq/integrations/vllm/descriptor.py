"""The Compatibility Descriptor of a vLLM engine: the agent's, for the same model directory.

`kvsp_moq.model_descriptor` computes it from the directory's files and config, as `kvsp agent`
and `kvsp descriptor` do; vLLM contributes the element type of its cache and its block size
(KVSP block_tokens = vLLM's block size). vLLM's own view of the cache geometry (layers, KV
heads, head size) must agree with the descriptor's, or blocks would be cut and read wrongly:
a disagreement, a sharded cache (tensor or pipeline parallel), a quantized cache, or a model
whose state is not all full-attention KV (hybrid, sliding-window: `partial_state`) stops the
engine at start with one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsp_moq.errors import SettingError
from kvsp_moq.model_descriptor import model_descriptor, partial_state
from kvsp_moq.protocol.compat import ELEMENT_SIZES, CompatDescriptor

__all__ = ["EngineFacts", "engine_descriptor", "engine_facts"]


@dataclass(frozen=True)
class EngineFacts:
    """What the connector needs to know of the engine's cache."""

    model_dir: Path
    kv_dtype: str
    block_size: int
    layers: int
    kv_heads: int
    head_dim: int
    cache_dtype: str
    prefix_caching: bool


def engine_facts(vllm_config: Any) -> EngineFacts:
    """The engine's cache as vLLM configured it; SettingError for what KVSP cannot share."""
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    cc = vllm_config.cache_config
    model_dir = Path(str(mc.model)).expanduser()
    if not model_dir.is_dir():
        raise SettingError(f"KVSPConnector: the model must be a local directory (its name is part "
                           f"of the Compatibility ID), not {mc.model!r}")
    if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
        raise SettingError("KVSPConnector: tensor and pipeline parallel caches are not supported "
                           "yet (each worker would hold a shard of every block)")
    reason = partial_state(mc.hf_config)
    if reason is not None:
        raise SettingError(f"KVSPConnector: {mc.model} cannot be cached by KVSP: {reason}; a cache "
                           "hit would not equal a recompute (KVSP keys full-attention KV only)")
    kv_dtype = str(mc.dtype).removeprefix("torch.")
    if kv_dtype not in ELEMENT_SIZES:
        raise SettingError(f"KVSPConnector: no KVSP element type for the model dtype {kv_dtype}")
    cache_dtype = str(cc.cache_dtype)
    if cache_dtype not in ("auto", kv_dtype):
        raise SettingError(f"KVSPConnector: kv_cache_dtype {cache_dtype!r} is not supported; the "
                           f"cache must hold the model's dtype ({kv_dtype})")
    return EngineFacts(model_dir=model_dir, kv_dtype=kv_dtype, block_size=int(cc.block_size),
                       layers=int(mc.get_num_layers(pc)), kv_heads=int(mc.get_num_kv_heads(pc)),
                       head_dim=int(mc.get_head_size()), cache_dtype=cache_dtype,
                       prefix_caching=bool(cc.enable_prefix_caching))


def engine_descriptor(facts: EngineFacts) -> CompatDescriptor:
    """The descriptor `kvsp agent --model DIR --dtype D --block-tokens B` computes."""
    try:
        data = model_descriptor(facts.model_dir, dtype=facts.kv_dtype, block_tokens=facts.block_size)
    except (OSError, ValueError) as e:
        raise SettingError(f"KVSPConnector: cannot describe the model in {facts.model_dir}: "
                           f"{' '.join(str(e).split())}") from None
    descriptor = CompatDescriptor.from_dict(data)
    mine = (descriptor.layers, descriptor.kv_heads, descriptor.head_dim)
    theirs = (facts.layers, facts.kv_heads, facts.head_dim)
    if mine != theirs:
        raise SettingError(f"KVSPConnector: the model's config gives (layers, kv_heads, head_dim) "
                           f"= {mine}, vLLM's cache {theirs}")
    return descriptor
