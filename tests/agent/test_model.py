"""Model adapter: tiny model creation, descriptor, prefix injection, decoding, sampling."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from agent.model import (
    KVPrefix,
    LayerReadiness,
    ModelAdapter,
    TokenSampler,
    positional_descriptor,
)
from agent.tiny import ensure_tiny_model

PROMPT_LEN = 96
SPLIT = 64


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _prompt(adapter: ModelAdapter, n: int = PROMPT_LEN, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, adapter.vocab_size, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def adapter(tiny_dir: Path) -> ModelAdapter:
    return ModelAdapter.load(tiny_dir)


# ------------------------------------------------------------------ tiny model


def test_tiny_model_is_deterministic(tiny_dir: Path, tmp_path: Path) -> None:
    empty = tmp_path / "other"
    empty.mkdir()  # an existing empty directory is filled, not rejected
    other = ensure_tiny_model(empty)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _sha256(tiny_dir / name) == _sha256(other / name), name
    from safetensors import safe_open

    with safe_open(str(other / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_tiny_model_is_idempotent(tiny_dir: Path, tmp_path: Path) -> None:
    weights = tiny_dir / "model.safetensors"
    before = (weights.stat().st_mtime_ns, _sha256(weights))
    assert ensure_tiny_model(tiny_dir) == tiny_dir
    assert (weights.stat().st_mtime_ns, _sha256(weights)) == before
    with pytest.raises(ValueError):
        ensure_tiny_model(tiny_dir, layers=4)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        ensure_tiny_model(foreign)
    assert (foreign / "keep.txt").read_text() == "mine"


def test_tiny_model_overrides(tmp_path: Path) -> None:
    d = ensure_tiny_model(tmp_path / "small", layers=2, hidden=64, heads=4, kv_heads=1, intermediate=128, vocab=300)
    config = json.loads((d / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]) == (2, 64, 4)
    assert (config["num_key_value_heads"], config["intermediate_size"], config["vocab_size"]) == (1, 128, 300)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert tok.get_vocab_size() == 300
    assert tok.encode("w5 nope w299").ids == [5, 0, 299]


# ------------------------------------------------------------------ descriptor


def test_descriptor(adapter: ModelAdapter, tiny_dir: Path) -> None:
    desc = adapter.descriptor(16)
    assert set(desc) == {
        "model", "model_digest", "tokenizer_digest", "layers", "kv_heads", "head_dim",
        "kv_dtype", "positional", "block_tokens", "layout",
    }
    assert desc["model"] == "llama-tiny"
    assert (desc["layers"], desc["kv_heads"], desc["head_dim"]) == (8, 2, 32)
    assert all(type(desc[k]) is int for k in ("layers", "kv_heads", "head_dim", "block_tokens"))
    assert desc["kv_dtype"] == "float32"
    assert desc["positional"] == "rope"
    assert desc["block_tokens"] == 16
    assert desc["layout"] == "kvsp-layout-1"

    h = hashlib.sha256()
    for path in sorted(tiny_dir.glob("*.safetensors"), key=lambda p: p.name.encode()):
        h.update(path.read_bytes())
    assert desc["model_digest"] == "sha-256:" + h.hexdigest()
    assert desc["tokenizer_digest"] == "sha-256:" + _sha256(tiny_dir / "tokenizer.json")
    with pytest.raises(ValueError):
        adapter.descriptor(0)


def test_descriptor_dtype(tiny_dir: Path) -> None:
    bf16 = ModelAdapter.load(tiny_dir, dtype=torch.bfloat16)
    assert bf16.descriptor(32)["kv_dtype"] == "bfloat16"
    assert bf16.prefill([5, 6, 7]).kv[0][0].dtype == torch.bfloat16


def test_positional_descriptor() -> None:
    assert positional_descriptor(LlamaConfig()) == "rope"
    assert positional_descriptor(LlamaConfig(rope_theta=500000.0)) == "rope;theta=500000"
    assert positional_descriptor(LlamaConfig(rope_theta=10000.5)) == "rope;theta=10000.5"
    llama3 = LlamaConfig(
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        },
    )
    assert positional_descriptor(llama3) == (
        "rope;factor=8;high_freq_factor=4;low_freq_factor=1;original_max_position_embeddings=8192;"
        "theta=500000;type=llama3"
    )
    assert positional_descriptor(LlamaConfig(rope_scaling={"rope_type": "linear", "factor": 2.5})) == (
        "rope;factor=2.5;type=linear"
    )


# ------------------------------------------------------------------ prefill / prefix injection


def test_split_prefill_matches_full(adapter: ModelAdapter) -> None:
    tokens = _prompt(adapter)
    full = adapter.prefill(tokens)
    head = adapter.prefill(tokens[:SPLIT])
    assert len(head.kv) == adapter.num_layers
    k, v = head.kv[0]
    assert k.shape == (SPLIT, adapter.num_kv_heads, adapter.head_dim) and k.is_contiguous() and v.is_contiguous()
    assert k.dtype == adapter.dtype

    tail = adapter.prefill(tokens[SPLIT:], past=KVPrefix.from_kv(head.kv))
    assert tail.state.length == PROMPT_LEN
    assert (full.logits - tail.logits).abs().max().item() <= 1e-5
    for layer in range(adapter.num_layers):
        torch.testing.assert_close(full.kv[layer][0][SPLIT:], tail.kv[layer][0], atol=1e-5, rtol=0)
        torch.testing.assert_close(full.kv[layer][1][:SPLIT], head.kv[layer][1], atol=1e-5, rtol=0)

    # The adapter's logits are those of the plain model without any prefix machinery.
    with torch.no_grad():
        reference = adapter.model(torch.tensor([tokens])).logits[0, -1]
    assert (reference - full.logits).abs().max().item() <= 1e-5

    greedy_full = adapter.generate_greedy(tokens, 16)
    greedy_split = adapter.generate_greedy(tokens[SPLIT:], 16, past=KVPrefix.from_kv(head.kv))
    assert greedy_full == greedy_split
    assert len(set(greedy_full)) > 1  # the check means something only if the output varies


def test_wait_hook_gates_each_layer(adapter: ModelAdapter) -> None:
    tokens = _prompt(adapter, seed=2)
    full = adapter.prefill(tokens)
    source = adapter.prefill(tokens[:SPLIT]).kv
    events: list[tuple[str, int]] = []

    def on_attention(index: int):
        def hook(module, args, kwargs):
            events.append(("attn", index))
        return hook

    handles = [
        layer.self_attn.register_forward_pre_hook(on_attention(i), with_kwargs=True)
        for i, layer in enumerate(adapter.model.model.layers)
    ]
    pool = KVPrefix.allocate(adapter, SPLIT)  # NaN until each layer is waited for

    def wait_for_layer(layer: int) -> None:
        events.append(("wait", layer))
        # Nothing beyond this layer has been filled yet: reading early would poison the logits.
        for later in range(layer, adapter.num_layers):
            assert torch.isnan(pool.layers[later][0]).all()
        pool.layers[layer][0].copy_(source[layer][0])
        pool.layers[layer][1].copy_(source[layer][1])

    pool.wait_for_layer = wait_for_layer
    try:
        tail = adapter.prefill(tokens[SPLIT:], past=pool)
    finally:
        for handle in handles:
            handle.remove()
    expected = [e for i in range(adapter.num_layers) for e in (("wait", i), ("attn", i))]
    assert events == expected
    assert (full.logits - tail.logits).abs().max().item() <= 1e-5

    # The pool is only read: reusing it for another sequence is safe.
    pool.layers[0][0].fill_(float("nan"))
    assert torch.isfinite(adapter.decode(tokens[0], tail.state)).all()


def test_on_layer_hands_each_layer_over_before_the_next_runs(adapter: ModelAdapter) -> None:
    """Live KV: layer l's K/V of the new tokens is handed over right after layer l ran (before
    layer l+1's attention), and equals what the finished pass exports."""
    tokens = _prompt(adapter, seed=5)
    head = adapter.prefill(tokens[:SPLIT])
    events: list[tuple[str, int]] = []
    got: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def on_attention(index: int):
        def hook(module, args, kwargs):
            events.append(("attn", index))
        return hook

    def on_layer(index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        events.append(("layer", index))
        got[index] = (k.clone(), v.clone())

    handles = [layer.self_attn.register_forward_pre_hook(on_attention(i), with_kwargs=True)
               for i, layer in enumerate(adapter.model.model.layers)]
    try:
        tail = adapter.prefill(tokens[SPLIT:], past=KVPrefix.from_kv(head.kv), on_layer=on_layer)
    finally:
        for handle in handles:
            handle.remove()
    assert events == [e for i in range(adapter.num_layers) for e in (("attn", i), ("layer", i))]
    for index in range(adapter.num_layers):
        assert got[index][0].shape == (PROMPT_LEN - SPLIT, adapter.num_kv_heads, adapter.head_dim)
        torch.testing.assert_close(got[index][0], tail.kv[index][0], atol=0, rtol=0)
        torch.testing.assert_close(got[index][1], tail.kv[index][1], atol=0, rtol=0)
    # Only the pass that asked for it hands layers over.
    events.clear()
    adapter.decode(tokens[0], tail.state)
    assert ("layer", 0) not in events


def test_prefix_loaded_by_another_thread(adapter: ModelAdapter) -> None:
    tokens = _prompt(adapter, seed=3)
    full = adapter.prefill(tokens)
    source = adapter.prefill(tokens[:SPLIT]).kv
    ready = LayerReadiness(adapter.num_layers, timeout=30)
    pool = KVPrefix.allocate(adapter, SPLIT, wait_for_layer=ready.wait_for_layer)

    def load() -> None:
        for layer in range(adapter.num_layers):
            time.sleep(0.002)
            for dst, src in zip(pool.layers[layer], source[layer]):
                for start in range(0, SPLIT, 16):  # block by block, as they arrive
                    dst[start:start + 16].copy_(src[start:start + 16])
            ready.mark_ready(layer)

    loader = threading.Thread(target=load)
    loader.start()
    tail = adapter.prefill(tokens[SPLIT:], past=pool)
    loader.join()
    assert (full.logits - tail.logits).abs().max().item() <= 1e-5


def test_loader_failure_propagates(adapter: ModelAdapter) -> None:
    ready = LayerReadiness(adapter.num_layers)
    ready.mark_ready(0)
    pool = KVPrefix.allocate(adapter, 8, wait_for_layer=ready.wait_for_layer)
    # The loader fails while the forward pass is blocked on layer 1: the pass must not hang.
    threading.Timer(0.05, ready.fail, args=(OSError("relay went away"),)).start()
    with pytest.raises(RuntimeError, match="layer 1") as info:
        adapter.prefill([5, 6], past=pool)
    assert isinstance(info.value.__cause__, OSError)
    # A failure reported before a wait aborts it at once, ready or not.
    with pytest.raises(RuntimeError, match="layer 0"):
        adapter.prefill([5, 6], past=pool)
    with pytest.raises(TimeoutError):
        LayerReadiness(2, timeout=0.01).wait_for_layer(1)


def test_prefix_shape_is_checked(adapter: ModelAdapter) -> None:
    bad = [(torch.zeros(4, adapter.num_kv_heads, adapter.head_dim + 1),) * 2] * adapter.num_layers
    with pytest.raises(ValueError, match="shape"):
        adapter.prefill([5], past=KVPrefix(length=4, layers=bad))


# ------------------------------------------------------------------ decode / export


def test_decode_matches_prefill_and_exports_kv(adapter: ModelAdapter) -> None:
    prompt = _prompt(adapter, n=40, seed=4)
    result = adapter.generate(prompt, 12)
    generated = result.tokens
    state = result.state
    assert state.length == len(prompt) + len(generated) - 1

    # Logits after feeding the last token equal those of one prefill over everything
    # (up to the rounding of one-row versus many-row matrix products over 12 steps).
    logits = adapter.decode(generated[-1], state)
    full = adapter.prefill(prompt + generated)
    assert (logits - full.logits).abs().max().item() <= 1e-4

    published = adapter.kv_for_range(state, len(prompt), state.length)
    for layer in range(adapter.num_layers):
        k, v = published[layer]
        assert k.shape == (len(generated), adapter.num_kv_heads, adapter.head_dim) and k.is_contiguous()
        torch.testing.assert_close(k, full.kv[layer][0][len(prompt):], atol=5e-5, rtol=1e-5)
        torch.testing.assert_close(v, full.kv[layer][1][len(prompt):], atol=5e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        adapter.kv_for_range(state, 0, state.length + 1)


# ------------------------------------------------------------------ sampling


def test_sampler_reproducible_from_seed_and_step(adapter: ModelAdapter) -> None:
    prompt = _prompt(adapter, n=24, seed=5)
    sampler = TokenSampler(temperature=1.0, top_p=0.9, seed=1234)
    run = adapter.generate(prompt, 12, sampler=sampler)
    again = adapter.generate(prompt, 12, sampler=sampler)
    assert run.tokens == again.tokens
    assert run.next_step == 12

    k = 5
    resumed = adapter.generate(prompt + run.tokens[:k], 12 - k, sampler=sampler, start_step=k)
    assert resumed.tokens == run.tokens[k:]

    other = adapter.generate(prompt, 12, sampler=TokenSampler(temperature=1.0, top_p=0.9, seed=99))
    assert other.tokens != run.tokens
    greedy = adapter.generate(prompt, 12)
    assert run.tokens != greedy.tokens


def test_sampler_top_p() -> None:
    logits = torch.tensor([5.0, 4.0, 0.0, -1.0])
    # The top two carry ~0.97 of the mass: top_p=0.9 never draws beyond them.
    picks = {TokenSampler(temperature=1.0, top_p=0.9, seed=s).sample(logits, 0) for s in range(200)}
    assert picks == {0, 1}
    assert {TokenSampler(temperature=1.0, top_p=1e-6, seed=s).sample(logits, s) for s in range(50)} == {0}
    assert TokenSampler().sample(logits, 7) == 0
    assert TokenSampler(temperature=1.0, top_p=0.5, seed=3).sample(logits, 9) == TokenSampler(
        temperature=1.0, top_p=0.5, seed=3
    ).sample(logits.clone(), 9)


# ------------------------------------------------------------------ other families


def _save_family(tmp_path: Path, model_cls, config) -> Path:
    torch.manual_seed(0)
    model = model_cls(config).eval()
    directory = tmp_path / config.model_type
    model.save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_other_families_split_prefill(family: str, tmp_path: Path) -> None:
    common = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False,
    )
    if family == "qwen2":  # q/k/v biases and a non-default theta
        directory = _save_family(tmp_path, Qwen2ForCausalLM, Qwen2Config(rope_theta=1000000.0, **common))
    else:  # a sliding window shorter than the prefix
        directory = _save_family(tmp_path, MistralForCausalLM, MistralConfig(sliding_window=24, **common))
    adapter = ModelAdapter.load(directory)
    tokens = _prompt(adapter, n=72, seed=6)
    with torch.no_grad():
        reference = adapter.model(torch.tensor([tokens])).logits[0, -1]
    full = adapter.prefill(tokens)
    head = adapter.prefill(tokens[:48])
    tail = adapter.prefill(tokens[48:], past=KVPrefix.from_kv(head.kv))
    assert (reference - full.logits).abs().max().item() <= 1e-5
    assert (full.logits - tail.logits).abs().max().item() <= 1e-5
    expected = "rope;theta=1000000" if family == "qwen2" else "rope"
    assert positional_descriptor(adapter.config) == expected
