"""Models whose state is not all full-attention KV are refused for caching (`partial_state`):
a prefix hit must hand the attention exactly what a recompute would."""

from __future__ import annotations

from types import SimpleNamespace

from transformers import LlamaConfig, MistralConfig, Qwen2Config

from kvsp_moq.model_descriptor import partial_state


def test_full_attention_models_are_cacheable() -> None:
    assert partial_state(LlamaConfig()) is None
    assert partial_state(MistralConfig(sliding_window=None)) is None  # Mistral v0.3 and later
    assert partial_state(Qwen2Config()) is None  # use_sliding_window is off by default
    # A window as long as the context drops nothing.
    assert partial_state(MistralConfig(sliding_window=4096, max_position_embeddings=4096)) is None


def test_sliding_windows_are_refused() -> None:
    reason = partial_state(MistralConfig(sliding_window=4096, max_position_embeddings=32768))
    assert reason is not None and "sliding-window" in reason and "4096" in reason
    mixed = Qwen2Config(use_sliding_window=True, sliding_window=1024, max_window_layers=2,
                        num_hidden_layers=4)
    reason = partial_state(mixed)
    assert reason is not None and "sliding_attention" in reason


def test_hybrid_models_are_refused() -> None:
    assert "linear_attention" in (partial_state(SimpleNamespace(
        layer_types=["full_attention", "linear_attention"])) or "")
    assert "hybrid" in (partial_state(SimpleNamespace(layers_block_type=["attention", "mamba"])) or "")
    assert "hybrid" in (partial_state(SimpleNamespace(hybrid_override_pattern="M-M*")) or "")
