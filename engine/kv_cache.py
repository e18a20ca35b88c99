"""The paged KV cache: one tensor per engine (per rank), block-major so a block is one run of bytes.

Layout ``[num_blocks, num_kv_heads, num_layers, 2, block_size, head_dim]``: everything a block
holds, for every layer, keys then values, sits in ``bytes_per_block`` consecutive bytes, and
inside a block each KV head's share is one run too (heads outermost). A transfer moves whole
blocks with one descriptor per run of adjacent block ids; between workers of different
tensor-parallel sizes a rank's heads of a block are still one run (``kvtransfer.sharding``).
Attention reads one layer's keys or values through a strided view
``[num_blocks, block_size, kv_heads, head_dim]``.

A quantized cache (int8, fp8) keeps, per block and KV head, that head's elements followed by
its float32 scales (one per layer, keys then values), so a head's run carries its scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineConfig, ModelConfig

LAYOUT_NAME = "heads_outer_v2"


@dataclass(slots=True, frozen=True)
class KVLayout:
    """What another process needs to address this cache's blocks."""

    base_address: int
    bytes_per_block: int
    num_blocks: int
    block_size: int
    device: str
    dtype: str
    layout: str = LAYOUT_NAME


# Quantized element types (EngineConfig.kv_cache_dtype): one byte per element, and per block one
# float32 scale per layer, key/value and KV head, stored after the block's elements.
QUANTIZED_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


class KVCache:
    """Owns the KV tensor and its per-layer key/value views (and scale views, when quantized).

    ``num_kv_heads``: the heads this cache holds (a tensor-parallel rank's); the model's by default.
    ``scratch_block``: one more block after the ``num_blocks`` the allocator hands out, never
    allocated or transferred, where CUDA graphs' padding rows write and attend.
    """

    def __init__(
        self, model_config: ModelConfig, engine_config: EngineConfig, dtype: torch.dtype, num_kv_heads: int | None = None, scratch_block: bool = False
    ):
        self.block_size = engine_config.block_size
        self.num_layers = model_config.num_layers
        self.num_kv_heads = num_kv_heads = num_kv_heads or model_config.num_kv_heads
        layers, block_size, head_dim = model_config.num_layers, engine_config.block_size, model_config.head_dim
        self.head_shape = (layers, 2, block_size, head_dim)  # one KV head's share of a block
        self.block_shape = (num_kv_heads, *self.head_shape)
        quantized = engine_config.kv_cache_dtype if engine_config.kv_cache_dtype in QUANTIZED_DTYPES else None
        self.quantized = quantized  # None: elements in the model's dtype, no scales
        self.dtype = QUANTIZED_DTYPES[quantized] if quantized else dtype
        self.bytes_per_block = self.bytes_per_block_of(model_config, block_size, dtype, engine_config.kv_cache_dtype, num_kv_heads)
        if engine_config.num_kv_blocks is not None:
            self.num_blocks = engine_config.num_kv_blocks
        else:
            self.num_blocks = max(1, engine_config.kv_cache_bytes // self.bytes_per_block)
        self.scratch_block = self.num_blocks if scratch_block else None
        rows = self.num_blocks + int(scratch_block)
        self.key_scales: list[torch.Tensor | None] = [None] * self.num_layers
        self.value_scales: list[torch.Tensor | None] = [None] * self.num_layers
        if quantized is None:
            self.tensor = torch.zeros((rows, *self.block_shape), dtype=dtype, device=engine_config.device)
            elements = self.tensor
        else:
            # Per block and head one run of bytes: the head's elements, then its scales.
            self.tensor = torch.zeros((rows, self.bytes_per_block), dtype=torch.uint8, device=engine_config.device)
            per_head = self.tensor.view(rows, num_kv_heads, self.bytes_per_block // num_kv_heads)
            data_bytes = _numel(self.head_shape)
            elements = per_head[..., :data_bytes].view(rows, num_kv_heads, *self.head_shape).view(self.dtype)
            scales = per_head[..., data_bytes:].view(torch.float32).view(rows, num_kv_heads, layers, 2)
            # [num_blocks, kv_heads] per layer (strided)
            self.key_scales = [scales[:, :, layer, 0] for layer in range(self.num_layers)]
            self.value_scales = [scales[:, :, layer, 1] for layer in range(self.num_layers)]
        # Views [num_blocks, block_size, kv_heads, head_dim] per layer; no copies.
        self.key_views = [elements[:, :, layer, 0].transpose(1, 2) for layer in range(self.num_layers)]
        self.value_views = [elements[:, :, layer, 1].transpose(1, 2) for layer in range(self.num_layers)]

    @staticmethod
    def bytes_per_block_of(
        model_config: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto", num_kv_heads: int | None = None
    ) -> int:
        """What one block of ``model_config``'s cache takes, every layer's keys and values (and
        their scales, for a quantized ``kv_cache_dtype``; "auto": elements in ``dtype``), for
        ``num_kv_heads`` heads (the model's by default)."""
        heads = num_kv_heads or model_config.num_kv_heads
        per_head = model_config.num_layers * 2 * block_size * model_config.head_dim
        if kv_cache_dtype not in QUANTIZED_DTYPES:
            return heads * per_head * torch.empty((), dtype=dtype).element_size()
        if per_head % 4:
            raise ValueError(f"block_size: layers x block_size x head_dim must be even for a quantized cache's float32 scales, got {block_size}")
        return heads * (per_head + model_config.num_layers * 2 * 4)

    def layer_runs(self, layers: range) -> list[tuple[int, int]]:
        """(byte offset, length) inside a block of layers ``layers``' keys and values: one run per
        KV head (heads are outermost, each head's layers in order), with its scales where the
        cache is quantized. What a pipeline stage computing those layers owns of each block."""
        per_layer = _numel(self.head_shape) // self.num_layers * self.key_views[0].element_size()
        per_head = self.bytes_per_block // self.num_kv_heads
        runs = []
        for head in range(self.num_kv_heads):
            start = head * per_head
            runs.append((start + layers.start * per_layer, len(layers) * per_layer))
            if self.quantized is not None:  # the head's scales follow its elements: 2 floats per layer
                scales = start + self.num_layers * per_layer
                runs.append((scales + layers.start * 8, len(layers) * 8))
        return runs

    def layout(self) -> KVLayout:
        return KVLayout(
            base_address=self.tensor.data_ptr(),
            bytes_per_block=self.bytes_per_block,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            device=str(self.tensor.device),
            dtype=str(self.dtype).removeprefix("torch."),
        )

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total
