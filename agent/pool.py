"""The agent's KV pool: where loaded prefix blocks land before the model reads them.

A pool is sized for one prefix of ``n`` blocks: per layer one K and one V tensor of
``[n * B, kv_heads, head_dim]`` on the model device, and block ``i`` of the prefix occupies
token rows ``[i * B, (i + 1) * B)``. So the first ``k`` blocks are one contiguous view that the
model takes as its cached prefix, whichever order the blocks arrive in.

On CUDA a layer's octets go through pinned host staging and a non-blocking copy on a side
stream; an event recorded after the copies of a layer lets the forward pass's stream wait for
exactly that layer (``wait_layer``), never for the whole prefix. On the CPU the copy is a plain
memcpy on the caller's thread.

Blocks leave the agent as KVB1 containers in layout "kvsp-layout-1": per layer, K then V as
``[B, kv_heads, head_dim]`` elements in little-endian order (``block_container``).
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, Sequence

import numpy as np
import torch

from kvsp_moq.protocol.container import Buffer, encode

KV = tuple[torch.Tensor, torch.Tensor]

__all__ = ["KVPool", "block_container", "tensor_octets", "tensor_from_octets"]

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("kvsp-layout-1 is little-endian; this host is not")


def tensor_octets(tensor: torch.Tensor) -> memoryview:
    """A tensor's elements as little-endian octets on the host, without a copy when it is
    already a contiguous CPU tensor (bfloat16 and float8 included: viewed as bytes first)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous()
    return t.view(torch.uint8).reshape(-1).numpy().data


def tensor_from_octets(octets: Buffer, dtype: torch.dtype) -> torch.Tensor:
    """A flat CPU tensor viewing ``octets`` (read-only buffers included; nothing writes it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": we only read
        return torch.frombuffer(octets, dtype=dtype)


def _octets(t: torch.Tensor) -> np.ndarray:
    """The memory of contiguous CPU tensor `t` as a flat, writable uint8 array."""
    return t.view(torch.uint8).reshape(-1).numpy()


def block_container(layers: Sequence[KV], *, codec: int = 1) -> bytes:
    """One block as a KVB1 container: layer ``l`` holds ``layers[l]`` (each ``[B, H, D]``)."""
    if not layers:
        raise ValueError("a block needs at least one layer")
    tokens = int(layers[0][0].shape[0])
    sections = [(tensor_octets(k), tensor_octets(v)) for k, v in layers]
    return encode(0, tokens, sections, codec=codec)


class _PinnedRing:
    """Pinned host buffers reused round-robin; a buffer is refilled only after the device copy
    that read it has completed (its event), so staging never races the side stream."""

    def __init__(self, nbytes: int, count: int) -> None:
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(count)]
        self.events: list[torch.cuda.Event | None] = [None] * count
        self.next = 0

    def acquire(self) -> tuple[int, torch.Tensor]:
        i = self.next
        self.next = (i + 1) % len(self.buffers)
        event = self.events[i]
        if event is not None:
            event.synchronize()
        return i, self.buffers[i]

    def release_after(self, i: int, event: torch.cuda.Event) -> None:
        self.events[i] = event


class KVPool:
    """Per-layer K/V tensors for a prefix of blocks, filled layer by layer."""

    def __init__(self, *, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, block_tokens: int, blocks: Sequence[str],
                 staging_buffers: int = 8) -> None:
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.block_tokens = block_tokens
        self.block_keys = list(blocks)
        self.slots = {key: i for i, key in enumerate(self.block_keys)}
        rows = len(self.block_keys) * block_tokens
        shape = (rows, kv_heads, head_dim)
        # Uninitialised: a layer is read only after every block's copy of it is in place.
        self.k = [torch.empty(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        element = torch.empty((), dtype=dtype).element_size()
        self.section_bytes = block_tokens * kv_heads * head_dim * element
        self.cuda = self.device.type == "cuda"
        if not self.cuda:
            # Each layer's K and V as flat octets sharing the tensors' memory: placing a layer
            # is then one memcpy, with no tensor made or dispatched per section.
            self._k_octets = [_octets(t) for t in self.k]
            self._v_octets = [_octets(t) for t in self.v]
        if self.cuda:
            self.stream = torch.cuda.Stream(device=self.device)
            self.layer_events: list[torch.cuda.Event | None] = [None] * num_layers
            self._ring = _PinnedRing(2 * self.section_bytes, staging_buffers)

    @classmethod
    def for_adapter(cls, adapter: Any, block_tokens: int, blocks: Sequence[str]) -> "KVPool":
        """A pool with the geometry, dtype and device of a ModelAdapter."""
        return cls(num_layers=adapter.num_layers, kv_heads=adapter.num_kv_heads,
                   head_dim=adapter.head_dim, dtype=adapter.dtype, device=adapter.device,
                   block_tokens=block_tokens, blocks=blocks)

    @property
    def nbytes(self) -> int:
        return 2 * self.num_layers * len(self.block_keys) * self.section_bytes

    def rows(self, slot: int) -> slice:
        b = self.block_tokens
        return slice(slot * b, (slot + 1) * b)

    def place(self, slot: int, layer: int, k: Buffer, v: Buffer) -> None:
        """Copy one verified layer of block ``slot`` into its rows (K and V sections)."""
        if len(k) != self.section_bytes or len(v) != self.section_bytes:
            raise ValueError(f"layer {layer}: sections of {len(k)} and {len(v)} octets, the pool "
                             f"expects {self.section_bytes}")
        if not self.cuda:
            n = self.section_bytes
            at = slot * n
            self._k_octets[layer][at:at + n] = np.frombuffer(k, np.uint8)
            self._v_octets[layer][at:at + n] = np.frombuffer(v, np.uint8)
            return
        shape = (self.block_tokens, self.kv_heads, self.head_dim)
        rows = self.rows(slot)
        n = self.section_bytes
        i, staging = self._ring.acquire()
        staging[:n].copy_(tensor_from_octets(k, torch.uint8))
        staging[n:2 * n].copy_(tensor_from_octets(v, torch.uint8))
        with torch.cuda.stream(self.stream):
            self.k[layer][rows].copy_(staging[:n].view(self.dtype).view(shape), non_blocking=True)
            self.v[layer][rows].copy_(staging[n:2 * n].view(self.dtype).view(shape), non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._ring.release_after(i, event)

    def block_container(self, slot: int, *, codec: int = 1) -> bytes | None:
        """Block `slot` as a KVB1 container, straight from the pool's memory (CPU pools; None
        on a device): a loaded block is stored without a pass through the model's state."""
        if self.cuda:
            return None
        n = self.section_bytes
        at = slot * n
        sections = [(self._k_octets[layer][at:at + n].data, self._v_octets[layer][at:at + n].data)
                    for layer in range(self.num_layers)]
        return encode(0, self.block_tokens, sections, codec=codec)

    def layer_complete(self, layer: int) -> None:
        """Every block's copy of ``layer`` has been issued: mark the point the model waits for."""
        if self.cuda:
            event = torch.cuda.Event()
            event.record(self.stream)  # after all copies issued so far, this layer's included
            self.layer_events[layer] = event

    def wait_layer(self, layer: int) -> None:
        """Make the current stream wait for ``layer``'s copies (called on the model's thread)."""
        if self.cuda:
            event = self.layer_events[layer]
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self) -> None:
        """Wait for every copy issued; needed before the pool is reused or read elsewhere."""
        if self.cuda:
            self.stream.synchronize()

    def prefix(self, blocks: int) -> list[KV]:
        """The first ``blocks`` blocks as per-layer ``[blocks * B, H, D]`` views (no copy)."""
        if not 0 <= blocks <= len(self.block_keys):
            raise ValueError(f"the pool holds {len(self.block_keys)} blocks, not {blocks}")
        end = blocks * self.block_tokens
        return [(self.k[layer][:end], self.v[layer][:end]) for layer in range(self.num_layers)]

    def block(self, slot: int) -> list[KV]:
        rows = self.rows(slot)
        return [(self.k[layer][rows], self.v[layer][rows]) for layer in range(self.num_layers)]

    def export_block(self, slot: int, *, codec: int = 1) -> bytes:
        """Block ``slot`` as a KVB1 container (e.g. to store a loaded block as a replica)."""
        self.synchronize()
        return block_container(self.block(slot), codec=codec)
