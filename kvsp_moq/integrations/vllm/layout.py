"""vLLM's paged KV cache <-> kvsp-layout-1 (KVSP §4.3), one block of one layer at a time.

kvsp-layout-1 holds a layer's K, then its V, each ``[B, kv_heads, head_dim]`` row-major, token
slowest. vLLM's paged cache stores a block of a layer differently on each backend, and on the
CPU backend differently per instruction set: with fp32 on x86 ("vec") the per-layer tensor is
``[num_blocks, H, N, 2D]`` and, inside one block and one head, K is stored transposed as
``[D, N]`` followed by V as ``[N, D]``; bf16 with AMX packs pairs (VNNI). The tensor's shape
says none of this.

So on the CPU the mapping is not written down here but derived from vLLM's own writer op,
`cpu_attn_reshape_and_cache`, for the dtype, block size and ISA the engine uses: position-coded
K and V are written through the op into a scratch block and read back, which gives, for every
element of the kvsp order, its offset inside the block (`derive_cpu_layout`). Extraction is then
one gather and injection one scatter per block and layer, whatever the kernel's tiling, and a
vLLM upgrade that changes the tiling changes the derived index with it. Where the derived
index is a strided view of the block (fp32's "vec": K transposed), injection is a strided copy
instead, which takes half the time of the scatter. A test pins the "vec"
result against the layout read from the kernel source, as the tripwire.

CUDA (flash-attention's ``[2, num_blocks, N, H, D]``) is written beside it: staging in pinned
host memory, non-blocking copies on a side stream, one event per layer that the forward pass's
stream waits for. It has not run on a GPU yet.
"""

from __future__ import annotations

import math
import re
import sys
import threading
import warnings
from typing import Any, Callable, Mapping, Sequence

import torch

from kvsp_moq.errors import SettingError
from kvsp_moq.protocol.container import Buffer

__all__ = [
    "CpuLayout", "CudaFlashLayout", "PagedBlocks", "derive_cpu_layout", "layer_order",
    "layout_for", "vec_reference",
]

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("kvsp-layout-1 is little-endian; this host is not")

#: The op's signature: (key, value, key_cache, value_cache, slot_mapping, isa).
WriterOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, str], None]
_LAYER_NUMBER = re.compile(r"\.(\d+)\.")


def layer_order(names: Sequence[str]) -> dict[str, int]:
    """vLLM layer name ("model.layers.7.self_attn.attn") -> KVSP layer index (0..L-1)."""
    out: dict[str, int] = {}
    for name in names:
        m = _LAYER_NUMBER.search(name)
        if m is None:
            raise SettingError(f"KV cache layer {name!r} carries no layer number")
        out[name] = int(m.group(1))
    if sorted(out.values()) != list(range(len(out))):
        raise SettingError(f"KV cache layers are not numbered 0..{len(out) - 1}: {sorted(out.values())}")
    return out


def _octets(tensor: torch.Tensor) -> memoryview:
    # numpy arrays export the buffer protocol, which their stubs do not declare
    return memoryview(tensor.contiguous().view(torch.uint8).reshape(-1).numpy())  # type: ignore[arg-type]


def _from_octets(octets: Buffer, dtype: torch.dtype) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffers: only read here
        return torch.frombuffer(octets, dtype=dtype)


# --------------------------------------------------------------------------- CPU


class CpuLayout:
    """A gather/scatter index per section: element i of the kvsp order (token, head, dim) of a
    block's K (V) sits at offset ``k_index[i]`` (``v_index[i]``) of the block's flat slab."""

    def __init__(self, k_index: torch.Tensor, v_index: torch.Tensor, *, kv_heads: int,
                 head_dim: int, block_size: int, dtype: torch.dtype, isa: str) -> None:
        self.k_index = k_index
        self.v_index = v_index
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.dtype = dtype
        self.isa = isa
        self.section_elements = block_size * kv_heads * head_dim
        self.section_bytes = self.section_elements * torch.empty((), dtype=dtype).element_size()
        shape = (block_size, kv_heads, head_dim)
        #: (strides, offset) of each section when its index is a strided view of the slab
        self.k_view = _strided(k_index, shape)
        self.v_view = _strided(v_index, shape)

    def _rows(self, kv_layer: torch.Tensor) -> torch.Tensor:
        return kv_layer.view(kv_layer.shape[0], -1)

    def extract(self, kv_layer: torch.Tensor, block_ids: Sequence[int]) -> list[tuple[memoryview, memoryview]]:
        """(K, V) octets in kvsp-layout-1 of each block, copied out of the paged cache."""
        rows = self._rows(kv_layer).index_select(0, torch.tensor(list(block_ids), dtype=torch.long))
        k = rows.index_select(1, self.k_index)
        v = rows.index_select(1, self.v_index)
        return [(_octets(k[i]), _octets(v[i])) for i in range(len(block_ids))]

    def inject(self, kv_layer: torch.Tensor, block_id: int, k: Buffer, v: Buffer) -> None:
        """Write one block's layer (K and V octets in kvsp-layout-1) into its paged slot."""
        if len(k) != self.section_bytes or len(v) != self.section_bytes:
            raise ValueError(f"sections of {len(k)} and {len(v)} octets, the paged cache "
                             f"expects {self.section_bytes}")
        row = self._rows(kv_layer)[block_id]
        for octets, view, index in ((k, self.k_view, self.k_index), (v, self.v_view, self.v_index)):
            values = _from_octets(octets, self.dtype)
            if view is None:
                row.index_copy_(0, index, values)
            else:  # a strided copy: half the time of the scatter, no index read
                strides, offset = view
                shape = (self.block_size, self.kv_heads, self.head_dim)
                row.as_strided(shape, strides, row.storage_offset() + offset).copy_(values.view(shape))

    def layer_written(self, layer: int) -> None:
        """Nothing to do on the CPU: a copy is done when `inject` returns."""

    def wait_layer(self, layer: int) -> None:
        """Nothing to do on the CPU."""


def _strided(index: torch.Tensor, shape: tuple[int, int, int]) -> tuple[tuple[int, int, int], int] | None:
    """The strides and offset that place element (token, head, dim) where `index` says, when one
    set does (every layout vLLM 0.32 writes for fp32 does); None for a packed one (VNNI)."""
    idx = index.view(shape)
    offset = int(idx[0, 0, 0])
    strides = tuple(int(idx[tuple(1 if i == axis else 0 for i in range(3))]) - offset
                    if shape[axis] > 1 else 0 for axis in range(3))
    grid = torch.meshgrid(*(torch.arange(n) for n in shape), indexing="ij")
    expected = grid[0] * strides[0] + grid[1] * strides[1] + grid[2] * strides[2] + offset
    if not torch.equal(expected, idx) or min(strides) < 0:
        return None
    return (strides[0], strides[1], strides[2]), offset


def derive_cpu_layout(op: WriterOp, *, kv_heads: int, head_dim: int, block_size: int,
                      dtype: torch.dtype, isa: str) -> CpuLayout:
    """The block layout that `op` writes for this geometry, dtype and ISA.

    Each pass writes, for every element, one base-256 digit of its kvsp index (plus one, so
    that zero means "not written"), positive for K and negative for V: small integers are exact
    in every float type, bf16 included. Every element must land exactly once, or the op's
    layout is not a permutation of the block and nothing can be mapped (SettingError).
    """
    h, n, d = kv_heads, block_size, head_dim
    count = n * h * d
    slab = h * n * 2 * d
    passes = max(1, math.ceil(math.log(count, 256))) if count > 1 else 1
    k_code = torch.zeros(slab, dtype=torch.long)
    v_code = torch.zeros(slab, dtype=torch.long)
    k_seen = torch.zeros(slab, dtype=torch.bool)
    v_seen = torch.zeros(slab, dtype=torch.bool)
    index = torch.arange(count, dtype=torch.long)
    for p in range(passes):
        digit = (index // (256 ** p)) % 256 + 1
        key = digit.to(torch.float32).view(n, h, d).to(dtype).contiguous()
        cache = torch.zeros((2, h, n, 2 * d), dtype=dtype)
        key_cache, value_cache = cache.view(2, h, 2 * n, d).chunk(2, dim=2)
        op(key, (-key).contiguous(), key_cache, value_cache,
           torch.arange(n, 2 * n, dtype=torch.long), isa)
        block = cache[1].reshape(-1).to(torch.float32).round().to(torch.long)
        if cache[0].any():
            raise SettingError(f"vLLM's cache writer ({isa}) wrote outside the block it was given")
        k_here, v_here = block > 0, block < 0
        if p == 0:
            k_seen, v_seen = k_here, v_here
        elif not (torch.equal(k_seen, k_here) and torch.equal(v_seen, v_here)):
            raise SettingError(f"vLLM's cache writer ({isa}) places elements inconsistently")
        k_code += torch.where(k_here, block - 1, 0) * (256 ** p)
        v_code += torch.where(v_here, -block - 1, 0) * (256 ** p)
    indices = []
    for seen, code in ((k_seen, k_code), (v_seen, v_code)):
        offsets = torch.nonzero(seen).flatten()
        if len(offsets) != count:
            raise SettingError(f"vLLM's cache writer ({isa}) does not store a block as a "
                               f"permutation of its elements ({len(offsets)} of {count} placed)")
        at = torch.full((count,), -1, dtype=torch.long)
        at[code[offsets]] = offsets
        if bool((at < 0).any()):
            raise SettingError(f"vLLM's cache writer ({isa}) stores some elements twice")
        indices.append(at)
    return CpuLayout(indices[0], indices[1], kv_heads=h, head_dim=d, block_size=n, dtype=dtype,
                     isa=isa)


def vec_reference(*, kv_heads: int, head_dim: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The "vec"/"vec16" layout as read from vLLM 0.32's kernel: per head, K as [D, N], then V
    as [N, D]. Tests compare the derived index with it."""
    h, n, d = kv_heads, block_size, head_dim
    tok = torch.arange(n).view(n, 1, 1)
    head = torch.arange(h).view(1, h, 1)
    dim = torch.arange(d).view(1, 1, d)
    base = head * (2 * n * d)
    k = (base + dim * n + tok).reshape(-1)
    v = (base + n * d + tok * d + dim).reshape(-1)
    return k, v


def cpu_writer_op() -> WriterOp:
    """vLLM's CPU cache writer (imported here: only the connector's worker needs vLLM)."""
    from vllm import _custom_ops as ops

    def write(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
              value_cache: torch.Tensor, slots: torch.Tensor, isa: str) -> None:
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)

    return write


def cpu_isa(dtype: torch.dtype, block_size: int, head_dim: int, cache_dtype: str) -> str:
    """The ISA vLLM's CPU attention backend picks for this cache (its own function)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_dim, cache_dtype)


# --------------------------------------------------------------------------- CUDA (untested)


class CudaFlashLayout:
    """flash-attention's paged layout, ``[2, num_blocks, N, H, D]`` per layer: a block's K is
    ``kv[0, b]`` and its V ``kv[1, b]``, each already ``[N, H, D]``, i.e. kvsp-layout-1.

    Injection stages the octets in pinned host memory and copies them with non_blocking on a
    side stream; `layer_written` records an event after a layer's copies, and `wait_layer` makes
    the current (forward) stream wait for exactly that event. Not yet run on a GPU.
    """

    def __init__(self, *, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, layers: int, staging: int = 16) -> None:
        self.kv_heads, self.head_dim, self.block_size, self.dtype = kv_heads, head_dim, block_size, dtype
        self.isa = "cuda-flash"
        self.section_bytes = block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        self.stream = torch.cuda.Stream(device=device)
        self.events: list[Any] = [None] * layers
        self._staging = [torch.empty(2 * self.section_bytes, dtype=torch.uint8, pin_memory=True)
                         for _ in range(staging)]
        self._staged: list[Any] = [None] * staging
        self._next = 0
        self._lock = threading.Lock()

    def extract(self, kv_layer: torch.Tensor, block_ids: Sequence[int]) -> list[tuple[memoryview, memoryview]]:
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=kv_layer.device)
        k = kv_layer[0].index_select(0, ids).to("cpu")
        v = kv_layer[1].index_select(0, ids).to("cpu")
        return [(_octets(k[i]), _octets(v[i])) for i in range(len(block_ids))]

    def inject(self, kv_layer: torch.Tensor, block_id: int, k: Buffer, v: Buffer) -> None:
        n = self.section_bytes
        if len(k) != n or len(v) != n:
            raise ValueError(f"sections of {len(k)} and {len(v)} octets, the paged cache expects {n}")
        with self._lock:
            i = self._next
            self._next = (i + 1) % len(self._staging)
            if self._staged[i] is not None:
                self._staged[i].synchronize()  # the buffer's previous copy has been read
            buf = self._staging[i]
            buf[:n].copy_(_from_octets(k, torch.uint8))
            buf[n:].copy_(_from_octets(v, torch.uint8))
            shape = (self.block_size, self.kv_heads, self.head_dim)
            with torch.cuda.stream(self.stream):
                kv_layer[0, block_id].copy_(buf[:n].view(self.dtype).view(shape), non_blocking=True)
                kv_layer[1, block_id].copy_(buf[n:].view(self.dtype).view(shape), non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            self._staged[i] = event

    def layer_written(self, layer: int) -> None:
        event = torch.cuda.Event()
        event.record(self.stream)
        self.events[layer] = event

    def wait_layer(self, layer: int) -> None:
        event = self.events[layer]
        if event is not None:
            torch.cuda.current_stream().wait_event(event)


# --------------------------------------------------------------------------- choosing


Layout = CpuLayout | CudaFlashLayout


def layout_for(kv_caches: Mapping[str, torch.Tensor], *, kv_heads: int, head_dim: int,
               block_size: int, cache_dtype: str) -> Layout:
    """The layout of the registered caches; SettingError for one this connector cannot map."""
    first = next(iter(kv_caches.values()))
    shape = tuple(first.shape)
    if first.device.type == "cpu":
        if len(shape) != 4 or shape[1:] != (kv_heads, block_size, 2 * head_dim):
            raise SettingError(f"unexpected CPU paged KV cache shape {shape}; expected "
                               f"[blocks, {kv_heads}, {block_size}, {2 * head_dim}]")
        isa = cpu_isa(first.dtype, block_size, head_dim, cache_dtype)
        return derive_cpu_layout(cpu_writer_op(), kv_heads=kv_heads, head_dim=head_dim,
                                 block_size=block_size, dtype=first.dtype, isa=isa)
    if first.device.type == "cuda" and len(shape) == 5 and shape[0] == 2 and shape[2:] == (
            block_size, kv_heads, head_dim):
        return CudaFlashLayout(kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
                               dtype=first.dtype, device=first.device, layers=len(kv_caches))
    raise SettingError(f"no KVSP mapping for a paged KV cache of shape {shape} on "
                       f"{first.device.type}")


class PagedBlocks:
    """The blocks of one request's load, as a loader sees them: slot i of the prefix is the
    paged block ``block_ids[i]``; `place` writes one verified layer of one block there.

    The loader marks layer l ready only once every block holds it, and calls `layer_complete`
    then; the forward pass calls `wait_layer` before reading the layer.
    """

    def __init__(self, layout: Layout, layers: Sequence[torch.Tensor], block_ids: Sequence[int],
                 block_keys: Sequence[str]) -> None:
        if len(block_ids) != len(block_keys):
            raise ValueError("one block id per block key")
        self.layout = layout
        self.layers = list(layers)
        self.block_ids = list(block_ids)
        self.block_keys = list(block_keys)
        self.num_layers = len(self.layers)
        self.section_bytes = layout.section_bytes
        #: refuses further writes once the engine has given up on this load
        self.closed = False
        self._placed = [0] * len(self.block_ids)
        self._lock = threading.Lock()

    def place(self, slot: int, layer: int, k: Buffer, v: Buffer) -> None:
        with self._lock:
            if self.closed:
                raise RuntimeError("the load was abandoned; its blocks are being recomputed")
            self.layout.inject(self.layers[layer], self.block_ids[slot], k, v)
            self._placed[slot] += 1  # the loader places each layer of a block once

    def complete(self) -> list[bool]:
        """Per slot, whether every layer of the block has been written."""
        with self._lock:
            return [n == self.num_layers for n in self._placed]

    def layer_complete(self, layer: int) -> None:
        self.layout.layer_written(layer)

    def wait_layer(self, layer: int) -> None:
        self.layout.wait_layer(layer)

    def close(self) -> None:
        """No write lands after this returns (one in progress finishes first)."""
        with self._lock:
            self.closed = True
