"""Writing a step's new keys and values into the paged cache, plain or quantized.

A plain cache takes them with one indexed store per tensor, or on CUDA one Triton launch for
both (``engine.attention.triton_kv_write``, where Triton is installed), which can rotate q and k
on the way (``rotate_and_write_kv``). A quantized cache (int8,
fp8) keeps per (block, KV head) scales that only grow: on a CPU ``csrc/kv_quant.cpp`` does it in
one pass; elsewhere the same rules run as torch ops, a block at a time (the Triton backend writes
it in one launch).
"""

from __future__ import annotations


import torch

from engine import fused_ops, native_kernels
from engine.device_caps import triton_module
from engine.rope import RopeTables


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
        triton_write = _triton_kv_write() if key_cache.is_cuda else None
        if triton_write is not None:
            triton_write.write_pair(k, v, key_cache, value_cache, slot_blocks, slot_offsets)
            return
        key_cache[slot_blocks, slot_offsets] = k
        value_cache[slot_blocks, slot_offsets] = v
    else:
        write_quantized(k, key_cache, key_scales, slot_blocks, slot_offsets)
        write_quantized(v, value_cache, value_scales, slot_blocks, slot_offsets)


def rotate_and_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
    rope: RopeTables,
) -> bool:
    """Rotate q and k in place by ``rope`` and write k/v into a plain cache, in one launch
    (``triton_kv_write.rotate_and_write_pair``). False: not done (not CUDA, q/k not for
    ``fused_ops.rotates_from_table``, or no Triton); the caller rotates, then writes. The
    rotation is FlashInfer's formula, which ``fused_ops.rotate_qk_`` applies otherwise."""
    if not (key_cache.is_cuda and fused_ops.rotates_from_table(q, k, rope)):
        return False
    if rope.cos_sin_cache.shape[1] != q.shape[-1]:
        return False  # a table narrower than a head: a partial rotation, which the kernel does not do
    triton_write = _triton_kv_write()
    if triton_write is None:
        return False
    triton_write.rotate_and_write_pair(q, k, v, key_cache, value_cache, slot_blocks, slot_offsets, rope.positions, rope.cos_sin_cache)
    return True


def _triton_kv_write():
    """The Triton write module, or None where Triton cannot be imported."""
    return triton_module("engine.attention.triton_kv_write")


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
    """``write_quantized`` in batched torch ops (devices without the CPU kernel): every touched
    block at once, one host synchronisation (the count of touched blocks) however many there are.

    Per touched block and head: the scale grows to cover the new rows (a block written from
    offset 0 this step starts afresh); where it grew, the block's earlier entries are requantized
    to it; then the new rows are quantized with it."""
    fp8 = cache.dtype == torch.float8_e4m3fn
    qmax = 448.0 if fp8 else 127.0

    def quantize(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        scaled = torch.where(scale > 0, values / torch.where(scale > 0, scale, 1.0), 0.0)
        return scaled.clamp(-qmax, qmax).to(cache.dtype) if fp8 else scaled.round().clamp(-qmax, qmax).to(cache.dtype)

    blocks, which = torch.unique(slot_blocks, return_inverse=True)  # which: each row's index among the touched blocks
    touched, heads = blocks.numel(), x.shape[1]
    rows = x.float()
    first = torch.full((touched,), cache.shape[1], dtype=slot_offsets.dtype, device=x.device).scatter_reduce(0, which, slot_offsets, "amin")
    row_max = rows.abs().amax(dim=2)  # [rows, heads]
    block_max = torch.zeros((touched, heads), dtype=torch.float32, device=x.device).scatter_reduce(
        0, which.unsqueeze(1).expand(-1, heads), row_max, "amax"
    )
    continuing = (first > 0).unsqueeze(1)  # [touched, 1]: the block already holds entries this step keeps
    old = torch.where(continuing, scales[blocks].float(), 0.0)
    new = torch.maximum(old, block_max / qmax)
    # Earlier entries (offsets before this step's first) of blocks whose scale grew: requantized.
    earlier = torch.arange(cache.shape[1], device=x.device).unsqueeze(0) < first.unsqueeze(1)  # [touched, block_size]
    redo = earlier.unsqueeze(2) & (continuing & (new > old)).unsqueeze(1)  # [touched, block_size, heads]
    held = cache[blocks].float() * old[:, None, :, None]
    requantized = quantize(held, new[:, None, :, None])
    cache[blocks] = torch.where(redo.unsqueeze(3), requantized, cache[blocks])
    scales[blocks] = new.to(scales.dtype)
    cache[slot_blocks, slot_offsets] = quantize(rows, new[which].unsqueeze(2))
