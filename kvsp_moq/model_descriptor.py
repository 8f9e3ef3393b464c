"""The Compatibility Descriptor (KVSP §4.1) of a model directory, from its files and config alone.

Blocks cross between engines only when their descriptors are equal, so every party of this
project computes it here: the agent (`agent.model.ModelAdapter.descriptor`), `kvsp descriptor`
and the vLLM connector (`kvsp_moq.integrations.vllm`). Nothing here loads weights: the digests
are read from the files, the geometry and the positional encoding from the config, so an engine
that loads the model its own way (vLLM) names it exactly as the agent does.

    descriptor = model_descriptor("/models/llama", dtype="float32", block_tokens=32)

The model is named ``<model_type>-<directory name>``: the digests, not the name, identify the
weights, but the name is part of the ID, so engines that share blocks load the same directory
name. transformers is imported only when a config must be read from the directory.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterator, Mapping

from kvsp_moq.protocol import compat

__all__ = [
    "DEFAULT_ROPE_THETA", "KV_LAYOUT", "SUPPORTED_MODEL_TYPES", "file_chunks", "geometry", "partial_state",
    "load_config", "model_descriptor", "model_name", "positional_descriptor", "tokenizer_digest",
    "weight_digest", "weight_files",
]

KV_LAYOUT = "kvsp-layout-1"
#: Model families whose KV cache the agent exports in kvsp-layout-1 (post-RoPE K, per layer).
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})
DEFAULT_ROPE_THETA = 10000.0
TOKENIZER_FILE = "tokenizer.json"
#: The KV dtypes an agent computes in, by torch name.
DTYPES = ("float32", "float16", "bfloat16")
#: Tokens per block when nothing else is configured: the agent's and the PC's default.
DEFAULT_BLOCK_TOKENS = 16
_CHUNK = 1 << 20


def file_chunks(path: Path, chunk: int = _CHUNK) -> Iterator[bytes]:
    """A file's content in chunks, read as they are consumed (weights stay out of memory)."""
    with open(path, "rb") as f:
        while block := f.read(chunk):
            yield block


def weight_files(directory: Path | str) -> list[Path]:
    """The *.safetensors files of a model directory, in ascending byte order of their names."""
    directory = Path(directory)
    files = [p for p in directory.iterdir() if p.is_file() and p.name.endswith(".safetensors")]
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {directory}")
    return sorted(files, key=lambda p: p.name.encode("utf-8"))


def weight_digest(directory: Path | str) -> str:
    """§4.1 model_digest: SHA-256 over the weight files concatenated in name order."""
    return compat.model_digest((p.name, file_chunks(p)) for p in weight_files(directory))


def tokenizer_digest(directory: Path | str) -> str:
    """§4.1 tokenizer_digest: SHA-256 of the directory's tokenizer.json."""
    return compat.content_digest(file_chunks(Path(directory) / TOKENIZER_FILE))


def load_config(directory: Path | str) -> Any:
    """The directory's transformers config, read locally (the hub is never contacted)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(Path(directory), local_files_only=True)


def model_name(config: Any, directory: Path | str) -> str:
    """``<model_type>-<directory name>``, independent of where the directory is."""
    return f"{config.model_type}-{Path(directory).resolve().name}"


def geometry(config: Any) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of the KV cache the config describes."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return int(config.num_hidden_layers), kv_heads, head_dim


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"non-finite positional parameter {value!r}")
        if value.is_integer() and abs(value) < 1e16:
            return str(int(value))
        return repr(value)  # shortest round-trip form
    if isinstance(value, (list, tuple)):
        return ",".join(_format_value(v) for v in value)
    return str(value)


def positional_descriptor(config: Any) -> str:
    """KVSP "positional" member: ``rope`` plus non-default parameters in name order.

    ``theta`` appears only when it differs from 10000; any non-default rope
    type contributes ``type`` and all of its scaling parameters.
    """
    params = getattr(config, "rope_parameters", None)
    if params:
        params = dict(params)
    else:  # transformers 4.x style
        params = dict(getattr(config, "rope_scaling", None) or {})
        params["rope_theta"] = getattr(config, "rope_theta", DEFAULT_ROPE_THETA)
    theta = params.pop("rope_theta", DEFAULT_ROPE_THETA)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    out: dict[str, Any] = {}
    if float(theta) != DEFAULT_ROPE_THETA:
        out["theta"] = float(theta)
    if rope_type != "default":
        out["type"] = rope_type
        out.update({k: v for k, v in params.items() if v is not None})
    return "".join(["rope", *(f";{name}={_format_value(out[name])}" for name in sorted(out))])


def partial_state(config: Any) -> str | None:
    """Why a model's state is not all full-attention KV that a block can be keyed by exactly,
    or None when it is.

    A Block Key names a prompt prefix, and a loaded block must hand the attention exactly what
    computing it would have: that holds for full attention, whose KV of a position depends on
    the prefix only. A layer of linear attention or a state-space layer (hybrid models) keeps
    state that is not per-position KV; a sliding-window layer drops what lies outside its window
    (an engine such as vLLM frees those blocks). Caching either by prefix would hand a hit
    something else than a recompute: a silent wrong answer, so such models are refused."""
    kinds = getattr(config, "layer_types", None)
    if kinds:
        other = sorted({str(k) for k in kinds} - {"full_attention"})
        if other:
            return f"its layers are not all full attention ({', '.join(other)})"
    for name in ("attn_type_list", "hybrid_override_pattern", "layers_block_type"):
        if getattr(config, name, None):
            return f"it is a hybrid model ({name})"
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True):
        positions = getattr(config, "max_position_embeddings", None)
        if positions is None or int(window) < int(positions):
            return f"it uses sliding-window attention (a window of {int(window)} tokens)"
    return None


def check_model_type(config: Any) -> None:
    """ValueError for a family whose cache this project does not describe."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model type {config.model_type!r}; expected one of "
                         f"{sorted(SUPPORTED_MODEL_TYPES)}")


def model_descriptor(directory: Path | str, *, dtype: str, block_tokens: int,
                     config: Any = None, digests: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The descriptor of the model in `directory` with KV blocks of `dtype` (a KVSP element
    type such as "float32") and `block_tokens` tokens.

    `config` defaults to the directory's own; `digests` may carry "model_digest" and
    "tokenizer_digest" already computed from this directory (a caller that keeps them).
    Raises ValueError for an unsupported family or a bad block size, OSError for missing files.
    """
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens <= 0:
        raise ValueError(f"block_tokens must be a positive int, got {block_tokens!r}")
    if dtype not in compat.ELEMENT_SIZES:
        raise ValueError(f"unknown KV element type {dtype!r} (known: {', '.join(compat.ELEMENT_SIZES)})")
    directory = Path(directory)
    if config is None:
        config = load_config(directory)
    check_model_type(config)
    layers, kv_heads, head_dim = geometry(config)
    digests = digests or {}
    return {
        "model": model_name(config, directory),
        "model_digest": digests.get("model_digest") or weight_digest(directory),
        "tokenizer_digest": digests.get("tokenizer_digest") or tokenizer_digest(directory),
        "layers": layers,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "kv_dtype": dtype,
        "positional": positional_descriptor(config),
        "block_tokens": block_tokens,
        "layout": KV_LAYOUT,
    }
