"""What a worker's KV cache looks like to the transfer layer.

The engine keeps one KV tensor per worker (per tensor-parallel rank), block-major with heads
outermost inside a block: ``[num_blocks, num_kv_heads, num_layers, 2, block_size, head_dim]``.
Block ``b`` is the single contiguous byte run ``[base + b * bytes_per_block, base + (b + 1) *
bytes_per_block)``, and each KV head's share of it is one run of ``bytes_per_head`` too, which
is what lets ranks of different tensor-parallel sizes write each other's heads directly
(``kvtransfer.sharding``). ``KVRegion`` is that memory (no model knowledge); ``KVCompat`` is
what two workers must agree on before one writes into the other, hashed for the handshake.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING

from kvtransfer.errors import LayoutError

if TYPE_CHECKING:
    import torch

HEADS_OUTER = "heads_outer_v2"

# Element sizes by dtype name; torch is not needed to describe a layout.
DTYPE_SIZES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


def dtype_name(dtype: object) -> str:
    """'torch.bfloat16' -> 'bfloat16'; plain strings pass through."""
    return str(dtype).removeprefix("torch.")


@dataclass(slots=True, frozen=True)
class KVCompat:
    """Everything two workers must share for a block of one to mean the same in the other."""

    model_id: str
    dtype: str
    num_layers: int
    num_kv_heads: int  # the model's; a tensor-parallel rank holds some of them
    head_dim: int
    block_size: int
    layout: str = HEADS_OUTER
    # A quantized cache (int8, fp8): after each head's elements in a block, its float32 scales
    # (per layer, key/value); the tensor is then raw bytes, [num_blocks, bytes_per_block].
    block_scales: bool = False
    # What the blocks' values depend on beyond the shapes: the weights (engine.loader's
    # weights_digest) and the rotary schedule keys are rotated by (engine.rope). Empty: not said.
    weights: str = ""
    rope: str = ""

    def __post_init__(self) -> None:
        if dtype_name(self.dtype) not in DTYPE_SIZES:
            raise LayoutError(f"dtype: unsupported {self.dtype!r}; known: {sorted(DTYPE_SIZES)}")
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name}: must be a positive integer, got {value!r}")
        if self.layout != HEADS_OUTER:
            raise LayoutError(f"layout: only {HEADS_OUTER!r} is supported, got {self.layout!r}")

    @property
    def bytes_per_head(self) -> int:
        """One KV head's share of a block: its elements for every layer (and its scales)."""
        elements = self.num_layers * 2 * self.block_size * self.head_dim * DTYPE_SIZES[self.dtype]
        return elements + (self.num_layers * 2 * 4 if self.block_scales else 0)

    def layer_runs_in_head(self, layers: range) -> list[tuple[int, int]]:
        """(byte offset, length) inside one head's share of a block holding layers ``layers``:
        its elements, then its scales where the cache has them. What a pipeline stage computing
        those layers writes of each head of each block."""
        if not (0 <= layers.start < layers.stop <= self.num_layers and layers.step == 1):
            raise LayoutError(f"layers: {layers} is not a contiguous range inside the model's {self.num_layers} layers")
        per_layer = 2 * self.block_size * self.head_dim * DTYPE_SIZES[self.dtype]
        runs = [(layers.start * per_layer, len(layers) * per_layer)]
        if self.block_scales:  # two float32 scales (key, value) per layer, after every layer's elements
            scales = self.num_layers * per_layer
            runs.append((scales + layers.start * 8, len(layers) * 8))
        return runs

    @property
    def bytes_per_block(self) -> int:
        """A block holding every KV head of the model (a rank's holds its heads only)."""
        return self.num_kv_heads * self.bytes_per_head

    def block_shape(self, num_kv_heads: int | None = None) -> tuple[int, ...]:
        """Shape of one block inside the KV tensor (of a rank holding ``num_kv_heads`` heads)."""
        return (num_kv_heads or self.num_kv_heads, self.num_layers, 2, self.block_size, self.head_dim)

    def compat_hash(self) -> str:
        """A short stable digest of every field; equal hashes mean compatible caches."""
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def differences(self, other: KVCompat) -> list[str]:
        """Human-readable 'field: ours != theirs' for every field that differs."""
        return [
            f"{f.name}: {getattr(self, f.name)!r} != {getattr(other, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]

    def check_tensor(self, kv_cache: torch.Tensor, num_kv_heads: int | None = None) -> None:
        """Raise LayoutError unless ``kv_cache`` is a contiguous tensor of this layout (holding
        ``num_kv_heads`` heads: a rank's; all of them by default)."""
        if self.block_scales:
            expected_bytes = (num_kv_heads or self.num_kv_heads) * self.bytes_per_head
            if kv_cache.dim() != 2 or kv_cache.shape[1] != expected_bytes or dtype_name(kv_cache.dtype) != "uint8":
                raise LayoutError(
                    f"kv_cache: {tuple(kv_cache.shape)} {dtype_name(kv_cache.dtype)} is not [num_blocks, {expected_bytes}] uint8 "
                    f"(a {self.dtype} cache with block scales)"
                )
            if not kv_cache.is_contiguous():
                raise LayoutError("kv_cache: must be contiguous so that a block is one run of bytes")
            return
        expected = self.block_shape(num_kv_heads)
        if kv_cache.dim() != 1 + len(expected) or tuple(kv_cache.shape[1:]) != expected:
            raise LayoutError(
                f"kv_cache: shape {tuple(kv_cache.shape)} is not [num_blocks, {', '.join(map(str, expected))}]"
            )
        if dtype_name(kv_cache.dtype) != self.dtype:
            raise LayoutError(f"kv_cache: dtype {dtype_name(kv_cache.dtype)} != {self.dtype}")
        if not kv_cache.is_contiguous():
            raise LayoutError("kv_cache: must be contiguous so that a block is one run of bytes")


@dataclass(slots=True, frozen=True)
class KVRegion:
    """The registered KV memory of one worker: where it is and how it splits into blocks."""

    base_addr: int
    bytes_per_block: int
    num_blocks: int
    device_kind: str = "cpu"  # "cpu" or "cuda"
    device_id: int = 0

    @property
    def nbytes(self) -> int:
        return self.bytes_per_block * self.num_blocks

    @property
    def nixl_mem_type(self) -> str:
        return "VRAM" if self.device_kind == "cuda" else "DRAM"

    def block_addr(self, block_id: int) -> int:
        return self.base_addr + block_id * self.bytes_per_block

    @classmethod
    def from_tensor(cls, kv_cache: torch.Tensor) -> KVRegion:
        """Describe a contiguous block-major tensor (CPU or CUDA) whose dim 0 is the block id."""
        if not kv_cache.is_contiguous():
            raise LayoutError("kv_cache: must be contiguous so that a block is one run of bytes")
        if kv_cache.dim() < 1 or kv_cache.shape[0] < 1:
            raise LayoutError(f"kv_cache: needs at least one block, got shape {tuple(kv_cache.shape)}")
        num_blocks = int(kv_cache.shape[0])
        bytes_per_block = kv_cache.numel() // num_blocks * kv_cache.element_size()
        device_kind = kv_cache.device.type
        if device_kind not in ("cpu", "cuda"):
            raise LayoutError(f"kv_cache: device {kv_cache.device} is neither cpu nor cuda")
        return cls(
            base_addr=int(kv_cache.data_ptr()),
            bytes_per_block=int(bytes_per_block),
            num_blocks=num_blocks,
            device_kind=device_kind,
            device_id=kv_cache.device.index or 0,
        )
