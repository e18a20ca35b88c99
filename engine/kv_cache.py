"""The paged KV cache: one tensor per engine, block-major so a block is one run of bytes.

Layout ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``: everything a
block holds, for every layer, keys then values, sits in ``bytes_per_block`` consecutive
bytes. The transfer layer moves whole blocks with one descriptor per run of adjacent block
ids; attention reads one layer's keys or values through a strided view.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineConfig, ModelConfig

LAYOUT_NAME = "block_major_v1"


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
    """Owns the KV tensor and its per-layer key/value views (and scale views, when quantized)."""

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, dtype: torch.dtype):
        self.block_size = engine_config.block_size
        self.num_layers = model_config.num_layers
        self.block_shape = (
            model_config.num_layers,
            2,
            engine_config.block_size,
            model_config.num_kv_heads,
            model_config.head_dim,
        )
        quantized = engine_config.kv_cache_dtype if engine_config.kv_cache_dtype in QUANTIZED_DTYPES else None
        self.quantized = quantized  # None: elements in the model's dtype, no scales
        self.dtype = QUANTIZED_DTYPES[quantized] if quantized else dtype
        self.bytes_per_block = self.bytes_per_block_of(model_config, engine_config.block_size, dtype, engine_config.kv_cache_dtype)
        if engine_config.num_kv_blocks is not None:
            self.num_blocks = engine_config.num_kv_blocks
        else:
            self.num_blocks = max(1, engine_config.kv_cache_bytes // self.bytes_per_block)
        self.key_scales: list[torch.Tensor | None] = [None] * self.num_layers
        self.value_scales: list[torch.Tensor | None] = [None] * self.num_layers
        if quantized is None:
            self.tensor = torch.zeros((self.num_blocks, *self.block_shape), dtype=dtype, device=engine_config.device)
            elements = self.tensor
        else:
            # One run of bytes per block: its elements, then its scales.
            self.tensor = torch.zeros((self.num_blocks, self.bytes_per_block), dtype=torch.uint8, device=engine_config.device)
            data_bytes = _numel(self.block_shape)
            elements = self.tensor[:, :data_bytes].view(self.num_blocks, *self.block_shape).view(self.dtype)
            scales = self.tensor[:, data_bytes:].view(torch.float32).view(self.num_blocks, self.num_layers, 2, model_config.num_kv_heads)
            # [num_blocks, kv_heads] per layer
            self.key_scales = [scales[:, layer, 0] for layer in range(self.num_layers)]
            self.value_scales = [scales[:, layer, 1] for layer in range(self.num_layers)]
        # Views [num_blocks, block_size, kv_heads, head_dim] per layer; no copies.
        self.key_views = [elements[:, layer, 0] for layer in range(self.num_layers)]
        self.value_views = [elements[:, layer, 1] for layer in range(self.num_layers)]

    @staticmethod
    def bytes_per_block_of(model_config: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
        """What one block of ``model_config``'s cache takes, every layer's keys and values (and
        their scales, for a quantized ``kv_cache_dtype``; "auto": elements in ``dtype``)."""
        shape = (model_config.num_layers, 2, block_size, model_config.num_kv_heads, model_config.head_dim)
        if kv_cache_dtype not in QUANTIZED_DTYPES:
            return _numel(shape) * torch.empty((), dtype=dtype).element_size()
        return _numel(shape) + model_config.num_layers * 2 * model_config.num_kv_heads * 4

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
