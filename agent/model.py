"""Model adapter: runs a Hugging Face causal LM with KVSP-shaped KV cache import and export.

KV tensors cross this boundary in the KVSP wire layout "kvsp-layout-1": per layer,
K and V shaped ``[tokens, kv_heads, head_dim]``, row-major (token slowest, dim
fastest), in the model dtype. K is post-RoPE, exactly as the attention reads it
from the cache, so a prefix loaded back gives the attention the very inputs it
would have computed itself.

Prefix injection (transformers 5.x): a :class:`DynamicCache` subclass whose layers
announce the prefix length ``P`` up front (so the causal mask and position ids
are sized for ``P`` cached positions) but hold no tensors yet. A forward pre-hook
on every decoder layer calls the caller's ``wait_for_layer(l)`` and only then
reads that layer's prefix K/V into cache layer ``l``. The caller can therefore
keep loading later layers while earlier layers compute.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch.utils.hooks import RemovableHandle
from transformers import AutoModelForCausalLM
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from agent.settings import AgentSettings, model_directory
from kvsp_moq import model_descriptor as md
from kvsp_moq.errors import BadRecord
from kvsp_moq.fetch.prefix import LayerReadiness  # re-exported: what the forward pass waits on
from kvsp_moq.model_descriptor import (  # re-exported: the agent's names for them
    KV_LAYOUT,
    SUPPORTED_MODEL_TYPES,
    file_chunks,
    positional_descriptor,
)

__all__ = [
    "load_model",
    "KV_LAYOUT",
    "SUPPORTED_MODEL_TYPES",
    "DecodeState",
    "GenerateResult",
    "KVPrefix",
    "LayerReadiness",
    "ModelAdapter",
    "OnLayer",
    "PrefillResult",
    "TokenSampler",
    "positional_descriptor",
    "file_chunks",
]


KV = tuple[torch.Tensor, torch.Tensor]
WaitForLayer = Callable[[int], None]
#: called on the model thread right after decoder layer l ran, with layer l's K and V of the
#: pass's new tokens (``[tokens, kv_heads, head_dim]`` views, valid only during the call)
OnLayer = Callable[[int, torch.Tensor, torch.Tensor], None]
LayerSource = Sequence[KV] | Callable[[int], KV]


# --------------------------------------------------------------------------- prefix


@dataclass
class KVPrefix:
    """The cached K/V of positions ``[0, length)``, handed over layer by layer.

    ``layers`` is either a sequence with one ``(K, V)`` pair per layer or a
    callable returning layer ``l``'s pair; each tensor is ``[length, kv_heads,
    head_dim]``. Layer ``l`` is read only after ``wait_for_layer(l)`` returned,
    so the tensors may be filled in place (or produced lazily) while earlier
    layers already compute.

    On an accelerator the read is a kernel on the current stream: a loader that
    copies on its own stream must make the current stream wait for that copy
    inside ``wait_for_layer`` (e.g. ``current_stream().wait_event(done[l])``),
    and may overwrite the tensors only after the forward pass has completed.
    Tensors on another device or in another dtype are converted synchronously.
    """

    length: int
    layers: LayerSource
    wait_for_layer: WaitForLayer | None = None

    @classmethod
    def allocate(
        cls,
        adapter: ModelAdapter,
        length: int,
        *,
        wait_for_layer: WaitForLayer | None = None,
        fill: float = math.nan,
    ) -> KVPrefix:
        """A pool of per-layer tensors on the model device for the caller to fill.

        Filled with NaN by default so that a layer read before it was loaded
        poisons the logits instead of passing silently.
        """
        shape = (length, adapter.num_kv_heads, adapter.head_dim)
        layers = [
            (
                torch.full(shape, fill, dtype=adapter.dtype, device=adapter.device),
                torch.full(shape, fill, dtype=adapter.dtype, device=adapter.device),
            )
            for _ in range(adapter.num_layers)
        ]
        return cls(length=length, layers=layers, wait_for_layer=wait_for_layer)

    @classmethod
    def from_kv(cls, kv: Sequence[KV], *, wait_for_layer: WaitForLayer | None = None) -> KVPrefix:
        """Prefix from already available per-layer K/V (e.g. a previous prefill)."""
        if not kv:
            raise ValueError("a prefix needs at least one layer")
        return cls(length=int(kv[0][0].shape[0]), layers=list(kv), wait_for_layer=wait_for_layer)

    def layer(self, index: int) -> KV:
        """Layer ``index``'s ``(K, V)``; only valid once that layer has been waited for."""
        if callable(self.layers):
            return self.layers(index)
        return self.layers[index]


# --------------------------------------------------------------------------- cache


class _PrefixCacheLayer(DynamicLayer):
    """A DynamicLayer that reports ``P`` cached positions before holding them.

    Reporting the length early lets the model size the mask and positions for
    the whole forward pass before any prefix data has arrived.
    """

    def __init__(self, pending_length: int | None) -> None:
        super().__init__()
        self.pending_length = pending_length

    def get_seq_length(self) -> int:
        if self.pending_length is not None:
            return self.pending_length
        return super().get_seq_length()

    def load_prefix(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        # [P, H, D] -> [1, H, P, D] view; the first update() concatenates into fresh storage,
        # so the caller's buffers are never written and can be reused after the forward pass.
        self.device = keys.device
        self.keys = keys.permute(1, 0, 2).unsqueeze(0)
        self.values = values.permute(1, 0, 2).unsqueeze(0)
        self.is_initialized = True
        self.pending_length = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> KV:
        if self.pending_length is not None:
            raise RuntimeError("attention ran before the prefix of its layer was loaded")
        return super().update(key_states, value_states, *args, **kwargs)


class _KVSPCache(DynamicCache):
    """DynamicCache with one full-attention layer per decoder layer and a lazily loaded prefix.

    Every layer keeps all positions (no sliding-window truncation), so that any
    range can be exported; sliding-window models still attend correctly because
    their masks are built from the positions, not from the stored length.
    """

    def __init__(self, num_layers: int, prefix: KVPrefix | None, shape: tuple[int, int], dtype: torch.dtype,
                 device: torch.device) -> None:
        pending = prefix.length if prefix is not None else None
        Cache.__init__(self, layers=[_PrefixCacheLayer(pending) for _ in range(num_layers)])
        self._prefix = prefix
        #: (first new position, callback) while a pass publishes its layers as they are computed
        self.produce: tuple[int, OnLayer] | None = None
        self._shape = shape
        self._dtype = dtype
        self._device = device

    def before_layer(self, index: int) -> None:
        layer = self.layers[index]
        if not isinstance(layer, _PrefixCacheLayer) or layer.pending_length is None:
            return
        prefix = self._prefix
        assert prefix is not None
        if prefix.wait_for_layer is not None:
            prefix.wait_for_layer(index)
        keys, values = prefix.layer(index)
        expected = (prefix.length, *self._shape)
        for name, tensor in (("K", keys), ("V", values)):
            if tuple(tensor.shape) != expected:
                raise ValueError(f"prefix {name} of layer {index} has shape {tuple(tensor.shape)}, expected {expected}")
        layer.load_prefix(
            keys.to(device=self._device, dtype=self._dtype),
            values.to(device=self._device, dtype=self._dtype),
        )

    def after_layer(self, index: int) -> None:
        """Hand layer ``index``'s K/V of this pass's new positions to the producer, if any."""
        produce = self.produce
        if produce is None:
            return
        start, on_layer = produce
        layer = self.layers[index]
        if not isinstance(layer, DynamicLayer):
            return
        keys, values = layer.keys, layer.values
        if keys is None or values is None:
            return
        on_layer(index, keys[0, :, start:, :].permute(1, 0, 2), values[0, :, start:, :].permute(1, 0, 2))

    def drop_prefix(self) -> None:
        """Release the caller's prefix tensors so its pool can be reused or freed."""
        self._prefix = None

    def finish_prefix(self) -> None:
        """Release the prefix after the pass that consumed it, and check that every layer read it."""
        self.drop_prefix()
        missing = [i for i, layer in enumerate(self.layers) if getattr(layer, "pending_length", None) is not None]
        if missing:
            raise RuntimeError(f"decoder layers {missing} never ran; their prefix was not loaded")


def _decoder_pre_hook(index: int) -> Callable[..., None]:
    def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, _KVSPCache):
            cache.before_layer(index)
        return None

    return hook


def _decoder_post_hook(index: int) -> Callable[..., None]:
    def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, _KVSPCache):
            cache.after_layer(index)
        return None

    return hook


# --------------------------------------------------------------------------- results


@dataclass
class DecodeState:
    """The live KV cache of one sequence; ``length`` positions are cached."""

    cache: DynamicCache
    length: int


@dataclass
class PrefillResult:
    logits: torch.Tensor
    """Float32 logits of the last input position, shape ``[vocab]``."""
    kv: list[KV]
    """Per layer, K and V of the new tokens only, ``[tokens, kv_heads, head_dim]``."""
    state: DecodeState


@dataclass
class GenerateResult:
    tokens: list[int]
    """Generated tokens. The cache holds every one but the last, which has not been fed back yet."""
    state: DecodeState
    next_step: int
    """Sampler step of the next token, for resuming."""


# --------------------------------------------------------------------------- sampling


@dataclass(frozen=True)
class TokenSampler:
    """Greedy (``temperature == 0``) or temperature + top-p sampling.

    Randomness is derived from ``(seed, step)`` alone, so a session resumed at
    step ``k`` draws exactly the tokens the original session would have drawn.
    Sampling runs on the CPU in float64 to be independent of the model device.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @staticmethod
    def step_seed(seed: int, step: int) -> int:
        """Generator seed of one step; a hash, so nearby (seed, step) pairs give unrelated streams."""
        digest = hashlib.blake2b(f"kvsp-sampler/{seed}/{step}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") & ((1 << 63) - 1)

    def sample(self, logits: torch.Tensor, step: int) -> int:
        logits = logits.detach().reshape(-1)
        if self.greedy:
            return int(torch.argmax(logits).item())
        scores = logits.to(device="cpu", dtype=torch.float64) / self.temperature
        probs = torch.softmax(scores, dim=-1)
        sorted_probs, order = torch.sort(probs, descending=True, stable=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest head whose mass reaches top_p (always at least one token).
        keep = int(torch.searchsorted(cumulative, torch.tensor([self.top_p], dtype=torch.float64)).item()) + 1
        keep = min(keep, sorted_probs.numel())
        head = sorted_probs[:keep]
        head_cdf = torch.cumsum(head, dim=-1) / head.sum()
        generator = torch.Generator(device="cpu")
        generator.manual_seed(self.step_seed(self.seed, step))
        u = torch.rand((1,), generator=generator, dtype=torch.float64)
        index = min(int(torch.searchsorted(head_cdf, u, right=True).item()), keep - 1)
        return int(order[index].item())


# --------------------------------------------------------------------------- adapter


class ModelAdapter:
    """A loaded causal LM exposing prefill/decode with KVSP KV import and export.

    One forward pass runs at a time per adapter; the model is shared state.
    """

    def __init__(self, model: torch.nn.Module, directory: Path) -> None:
        # transformers' configs and decoder stacks: attributes that torch.nn.Module cannot type
        config: Any = model.config
        decoder: Any = model.model
        md.check_model_type(config)
        self.model = model
        self.config = config
        self.directory = Path(directory)
        self._lock = threading.RLock()
        self._model_digest: str | None = None
        self._tokenizer_digest: str | None = None
        self._tokenizer: Any = None
        self._hooks: list[RemovableHandle] = []
        #: transformers 5.20 renamed the forward's `past_key_values` to `cache`
        params = inspect.signature(model.forward).parameters
        self._cache_argument = "cache" if "cache" in params else "past_key_values"
        for index, layer in enumerate(decoder.layers):
            layer_idx = getattr(layer.self_attn, "layer_idx", index)
            if layer_idx != index:
                raise ValueError(f"decoder layer {index} caches as layer {layer_idx}")
            self._hooks.append(layer.register_forward_pre_hook(_decoder_pre_hook(index), with_kwargs=True))
            self._hooks.append(layer.register_forward_hook(_decoder_post_hook(index), with_kwargs=True))

    @classmethod
    def load(
        cls,
        directory: Path | str,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        attn_implementation: str | None = None,
    ) -> ModelAdapter:
        """Load from a local directory; the hub is never contacted."""
        directory = Path(directory)
        md.check_model_type(md.load_config(directory))
        kwargs: dict[str, Any] = {"local_files_only": True, "dtype": dtype}
        if attn_implementation is not None:
            kwargs["attn_implementation"] = attn_implementation
        model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(directory, **kwargs)
        model.to(device=torch.device(device))
        model.eval()
        return cls(model, directory)

    def close(self) -> None:
        """Detach the decoder-layer hooks, e.g. before handing the model to other code."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    # ---------------------------------------------------------------- properties

    @property
    def num_layers(self) -> int:
        return md.geometry(self.config)[0]

    @property
    def num_kv_heads(self) -> int:
        return md.geometry(self.config)[1]

    @property
    def head_dim(self) -> int:
        return md.geometry(self.config)[2]

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def name(self) -> str:
        """``<model_type>-<directory name>``.

        Independent of ``_name_or_path`` (which records wherever the model was
        loaded from); the digests, not the name, identify the weights.
        """
        return md.model_name(self.config, self.directory)

    @property
    def tokenizer(self) -> Any:
        """The ``tokenizers.Tokenizer`` from tokenizer.json, loaded on first use."""
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(self.directory / "tokenizer.json"))
        return self._tokenizer

    # ---------------------------------------------------------------- descriptor

    def weight_files(self) -> list[Path]:
        return md.weight_files(self.directory)

    @property
    def model_digest(self) -> str:
        """Computed once: the weight files are assumed immutable while loaded."""
        if self._model_digest is None:
            self._model_digest = md.weight_digest(self.directory)
        return self._model_digest

    @property
    def tokenizer_digest(self) -> str:
        if self._tokenizer_digest is None:
            self._tokenizer_digest = md.tokenizer_digest(self.directory)
        return self._tokenizer_digest

    def descriptor(self, block_tokens: int) -> dict[str, Any]:
        """The KVSP Compatibility Descriptor: equal descriptors mean interchangeable KV blocks.

        `kvsp_moq.model_descriptor` computes it, from the directory and the config, as
        `kvsp descriptor` and the vLLM connector do."""
        return md.model_descriptor(
            self.directory, config=self.config, block_tokens=block_tokens,
            dtype=str(self.dtype).removeprefix("torch."),
            digests={"model_digest": self.model_digest, "tokenizer_digest": self.tokenizer_digest})

    # ---------------------------------------------------------------- inference

    def prefill(self, tokens: Sequence[int], *, past: KVPrefix | None = None, return_kv: bool = True,
                on_layer: OnLayer | None = None) -> PrefillResult:
        """Run ``tokens`` (which follow ``past``, if given) and start a decode state.

        With ``past``, layer ``l``'s prefix is read right after
        ``past.wait_for_layer(l)`` returns, immediately before layer ``l`` runs. With
        ``on_layer``, layer ``l``'s K/V of ``tokens`` is handed over as soon as layer ``l`` ran,
        while the later layers still compute (live KV).
        """
        if len(tokens) == 0:
            raise ValueError("prefill needs at least one token")
        start = 0
        if past is not None:
            if past.length < 0:
                raise ValueError("prefix length must be >= 0")
            start = past.length
        cache = _KVSPCache(self.num_layers, past, (self.num_kv_heads, self.head_dim), self.dtype, self.device)
        state = DecodeState(cache=cache, length=start)
        cache.produce = (start, on_layer) if on_layer is not None else None
        try:
            logits = self._forward(state, tokens)
        except BaseException:
            cache.drop_prefix()
            raise
        finally:
            cache.produce = None
        cache.finish_prefix()
        kv = self.kv_for_range(state, start, state.length) if return_kv else []
        return PrefillResult(logits=logits, kv=kv, state=state)

    def extend(self, state: DecodeState, tokens: Sequence[int]) -> torch.Tensor:
        """Append ``tokens`` to a live state; returns the float32 logits of the last one."""
        if len(tokens) == 0:
            raise ValueError("extend needs at least one token")
        return self._forward(state, tokens)

    def decode(self, token: int, state: DecodeState) -> torch.Tensor:
        """One decode step: cache ``token`` and return the next-token logits."""
        return self._forward(state, [token])

    def _forward(self, state: DecodeState, tokens: Sequence[int]) -> torch.Tensor:
        tokens = [int(t) for t in tokens]
        # Checked on the host: an out-of-range id would otherwise fail asynchronously on an accelerator.
        if min(tokens) < 0 or max(tokens) >= self.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size})")
        device = self.device
        input_ids = torch.tensor([tokens], dtype=torch.long, device=device)
        positions = torch.arange(state.length, state.length + len(tokens), dtype=torch.long, device=device)
        with self._lock, torch.no_grad():
            out = self.model(
                input_ids=input_ids,
                position_ids=positions.unsqueeze(0),
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_argument: state.cache},
            )
            state.length += len(tokens)
        return out.logits[0, -1].float()

    def kv_for_range(self, state: DecodeState, start: int, end: int) -> list[KV]:
        """Per layer, contiguous ``[end - start, kv_heads, head_dim]`` copies of cached K and V."""
        if not 0 <= start <= end <= state.length:
            raise ValueError(f"range [{start}, {end}) is outside the cached [0, {state.length})")
        result: list[KV] = []
        layers = cast("list[DynamicLayer]", state.cache.layers)  # a _KVSPCache: DynamicLayers only
        for layer in layers:
            if layer.keys is None or layer.values is None or layer.get_seq_length() != state.length:
                raise RuntimeError("cache does not hold every position of the state")
            keys = layer.keys[0, :, start:end, :].permute(1, 0, 2).contiguous()
            values = layer.values[0, :, start:end, :].permute(1, 0, 2).contiguous()
            result.append((keys, values))
        return result

    def generate(
        self,
        prompt: Sequence[int],
        n: int,
        *,
        sampler: TokenSampler | None = None,
        past: KVPrefix | None = None,
        start_step: int = 0,
    ) -> GenerateResult:
        """Generate ``n`` tokens; ``start_step`` numbers the first one for the sampler."""
        if n <= 0:
            raise ValueError("n must be positive")
        sampler = sampler or TokenSampler()
        result = self.prefill(prompt, past=past, return_kv=False)
        state, logits = result.state, result.logits
        tokens: list[int] = []
        step = start_step
        while True:
            token = sampler.sample(logits, step)
            tokens.append(token)
            step += 1
            if len(tokens) == n:
                break
            logits = self.decode(token, state)
        return GenerateResult(tokens=tokens, state=state, next_step=step)

    def generate_greedy(self, prompt: Sequence[int], n: int, *, past: KVPrefix | None = None) -> list[int]:
        return self.generate(prompt, n, past=past).tokens


def load_model(settings: AgentSettings) -> ModelAdapter:
    """The model the settings name, on their device; the tiny model is created once."""
    directory = model_directory(settings)
    if settings.device.startswith("cuda") and not torch.cuda.is_available():
        raise BadRecord("CUDA is not available on this machine", member="device")
    return ModelAdapter.load(directory, device=settings.device, dtype=getattr(torch, settings.dtype))
