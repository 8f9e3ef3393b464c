"""A small, randomly initialised Llama created locally for tests and benchmarks.

Nothing is downloaded: the weights come from a fixed seed and the tokenizer is a
synthetic word-level vocabulary, so every machine derives the same bytes and
therefore the same KVSP model and tokenizer digests.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

SPEC_FILE = "kvsp-tiny.json"
"""Written last inside the staging directory: its presence marks a complete model."""

UNK_TOKEN = "<unk>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
_SPECIAL_TOKENS = (UNK_TOKEN, BOS_TOKEN, EOS_TOKEN)

_DEFAULTS: dict[str, Any] = {
    "layers": 8,
    "hidden": 256,
    "heads": 8,
    "kv_heads": 2,
    "intermediate": 512,
    "vocab": 4096,
    "max_positions": 4096,
    "rope_theta": 10000.0,
    "seed": 0,
    # Wider than the usual 0.02 so that the random model's outputs depend on the context:
    # with 0.02 greedy decoding repeats one token, which would make equivalence checks vacuous.
    "init_std": 0.1,
}


def synthetic_vocabulary(size: int) -> list[str]:
    """Deterministic vocabulary of exactly `size` entries, special tokens first."""
    if size < len(_SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocabulary size must be at least {len(_SPECIAL_TOKENS) + 1}, got {size}")
    words = list(_SPECIAL_TOKENS)
    words.extend(f"w{i}" for i in range(len(_SPECIAL_TOKENS), size))
    return words


def ensure_tiny_model(
    directory: Path | str,
    *,
    layers: int = _DEFAULTS["layers"],
    hidden: int = _DEFAULTS["hidden"],
    heads: int = _DEFAULTS["heads"],
    kv_heads: int = _DEFAULTS["kv_heads"],
    intermediate: int = _DEFAULTS["intermediate"],
    vocab: int = _DEFAULTS["vocab"],
    max_positions: int = _DEFAULTS["max_positions"],
    rope_theta: float = _DEFAULTS["rope_theta"],
    seed: int = _DEFAULTS["seed"],
    init_std: float = _DEFAULTS["init_std"],
) -> Path:
    """Create the tiny model in `directory` once and return the directory.

    Reuses an existing complete model made with the same parameters, refuses to
    overwrite anything else, and stages the files in a sibling directory that is
    renamed into place so an interrupted run never leaves a partial model.
    """
    directory = Path(directory)
    spec = {
        "family": "llama",
        "layers": int(layers),
        "hidden": int(hidden),
        "heads": int(heads),
        "kv_heads": int(kv_heads),
        "intermediate": int(intermediate),
        "vocab": int(vocab),
        "max_positions": int(max_positions),
        "rope_theta": float(rope_theta),
        "seed": int(seed),
        "init_std": float(init_std),
    }
    if hidden % heads or heads % kv_heads:
        raise ValueError("hidden must be a multiple of heads and heads a multiple of kv_heads")

    existing = _existing_spec(directory)
    if existing is not None:
        return _reuse(directory, existing, spec)
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise FileExistsError(f"{directory} exists and does not hold a tiny model; refusing to overwrite it")

    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".tmp", dir=directory.parent))
    try:
        os.chmod(staging, 0o755)  # mkdtemp makes it private; the model is meant to be shared
        _write_model(staging, spec)
        _write_tokenizer(staging, spec)
        _write_json(staging / SPEC_FILE, spec)
        _fsync_tree(staging)
        try:
            # rename(2) replaces an empty directory atomically and fails on a non-empty one.
            os.rename(staging, directory)
        except OSError:
            existing = _existing_spec(directory)
            if existing is None:
                raise
            # Another process finished first; its model is as good as ours.
            return _reuse(directory, existing, spec)
        _fsync_dir(directory.parent)
        return directory
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _existing_spec(directory: Path) -> dict[str, Any] | None:
    path = directory / SPEC_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def _reuse(directory: Path, existing: dict[str, Any], wanted: dict[str, Any]) -> Path:
    if existing != wanted:
        raise ValueError(f"{directory} holds a tiny model made with {existing}, not {wanted}")
    return directory


def _write_model(target: Path, spec: dict[str, Any]) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec["vocab"],
        hidden_size=spec["hidden"],
        intermediate_size=spec["intermediate"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["kv_heads"],
        max_position_embeddings=spec["max_positions"],
        rope_parameters={"rope_type": "default", "rope_theta": spec["rope_theta"]},
        bos_token_id=_SPECIAL_TOKENS.index(BOS_TOKEN),
        eos_token_id=_SPECIAL_TOKENS.index(EOS_TOKEN),
        initializer_range=spec["init_std"],
        tie_word_embeddings=False,
        dtype="float32",
    )
    # Fork the RNG so that creating a model does not disturb the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec["seed"])
        # .float(), not .to(torch.float32): the same cast, but `to` is wrapped by functools.wraps
        # in transformers and loses its signature for type checkers.
        model = LlamaForCausalLM(config).float()
    model.eval()
    # safetensors metadata written by save_pretrained is {"format": "pt"}: no timestamps.
    model.save_pretrained(target, safe_serialization=True)


def _write_tokenizer(target: Path, spec: dict[str, Any]) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    words = synthetic_vocabulary(spec["vocab"])
    tokenizer = Tokenizer(WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(str(target / "tokenizer.json"), pretty=False)
    _write_json(
        target / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "unk_token": UNK_TOKEN,
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "model_max_length": spec["max_positions"],
        },
    )


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _fsync_tree(root: Path) -> None:
    for path in root.iterdir():
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
