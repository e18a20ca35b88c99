"""Writing a step's new keys and values into the paged cache, plain or quantized.

A plain cache takes them with one indexed store per tensor. A quantized cache (int8, fp8) keeps
per (block, KV head) scales that only grow: on a CPU ``csrc/kv_quant.cpp`` does it in one pass;
elsewhere the same rules run as torch ops, a block at a time.
"""

from __future__ import annotations

import torch

from engine import native_kernels


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
) -> None:
    """k/v [T, KVH, D] into the layer's cache views at their slots (quantized where scales are given)."""
    if key_scales is None:
        key_cache[slot_blocks, slot_offsets] = k
        value_cache[slot_blocks, slot_offsets] = v
    else:
        write_quantized(k, key_cache, key_scales, slot_blocks, slot_offsets)
        write_quantized(v, value_cache, value_scales, slot_blocks, slot_offsets)


def write_quantized(x: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor) -> None:
    """Quantize x [T, KVH, D] into an int8/fp8 cache at its slots with per (block, head) scales that
    only grow (csrc/kv_quant.cpp on a CPU; the same rules in torch elsewhere)."""
    if not write_quantized_native(x, cache, scales, slot_blocks, slot_offsets):
        write_quantized_torch(x, cache, scales, slot_blocks, slot_offsets)


def write_quantized_native(
    x: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor
) -> bool:
    """``write_quantized`` through csrc/kv_quant.cpp. False: no kernel for these tensors here."""
    library = native_kernels.kernel()
    if library is None or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    x = x.contiguous()
    library.pdserve_kv_quant_write(
        x.data_ptr(), int(x.dtype == torch.bfloat16), x.shape[0], x.shape[1], x.shape[2],
        slot_blocks.data_ptr(), slot_offsets.data_ptr(), cache.data_ptr(),
        cache.stride(0), cache.stride(1), cache.stride(2), scales.data_ptr(), scales.stride(0), scales.stride(1),
        int(cache.dtype == torch.float8_e4m3fn),
    )
    return True


def write_quantized_torch(x: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor) -> None:
    """``write_quantized`` in torch ops, a block at a time (devices without the CPU kernel)."""
    fp8 = cache.dtype == torch.float8_e4m3fn
    qmax = 448.0 if fp8 else 127.0

    def quantize(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        scaled = torch.where(scale > 0, values / torch.where(scale > 0, scale, 1.0), 0.0)
        return scaled.clamp(-qmax, qmax).to(cache.dtype) if fp8 else scaled.round().clamp(-qmax, qmax).to(cache.dtype)

    for block in slot_blocks.unique().tolist():
        chosen = slot_blocks == block
        offsets, rows = slot_offsets[chosen], x[chosen].float()
        first = int(offsets.min())
        old = scales[block].clone() if first > 0 else torch.zeros_like(scales[block])
        new = torch.maximum(old, rows.abs().amax(dim=(0, 2)) / qmax)
        if first > 0 and bool((new > old).any()):
            earlier = cache[block, :first].float() * old[None, :, None]
            cache[block, :first] = quantize(earlier, new[None, :, None])
        scales[block] = new
        cache[block, offsets] = quantize(rows, new[None, :, None])
