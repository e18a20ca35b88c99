"""A layer's KV write on CUDA as one Triton launch: keys and values together, plain or quantized,
and for a plain cache with the rotary embedding of q and k in the same launch.

On CUDA a plain cache took the step's keys and values as two indexed stores (two kernels a layer,
56 a step of a 28-layer model: at a few microseconds each, most of a small decode step's cost
beside its matmuls), and a quantized cache as one kernel each for keys and values. Here one
program per (new row, keys|values) copies its row's heads into its slot; for a quantized cache one
program per (run of rows landing in one block, KV head, keys|values) grows the block's scale,
requantizes the block's earlier rows where it grew and quantizes the new ones (the rules of
``engine.attention.kv_write``, which the tests hold the kernel to).

``rotate_and_write_pair`` also rotates q and k in place (NeoX halves, from FlashInfer's float32
cos|sin table, in float32, rounded once: FlashInfer's own formula) on their way into the cache:
the rotation was a launch of its own per layer (FlashInfer's, 28 a step of a 28-layer model),
and FlashInfer's fused rotate-and-append kernel takes two head layouts only (8/1 and 64/8 query/KV
heads of 128).

The kernels run on a CPU too under Triton's interpreter (``TRITON_INTERPRET=1``): the tests check
them against the indexed stores and the torch rules that way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_kernel(
    k_ptr, k_stride_t, k_stride_h,
    v_ptr, v_stride_t, v_stride_h,
    slot_blocks_ptr, slot_offsets_ptr,
    key_cache_ptr, value_cache_ptr, cache_stride_block, cache_stride_token, cache_stride_head,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
):
    row = tl.program_id(0)
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, DIM_PAD)
    inside = (h < NUM_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    block = tl.load(slot_blocks_ptr + row)
    offset = tl.load(slot_offsets_ptr + row)
    slot = block * cache_stride_block + offset * cache_stride_token + h[:, None] * cache_stride_head + d[None, :]
    if tl.program_id(1) == 0:
        keys = tl.load(k_ptr + row * k_stride_t + h[:, None] * k_stride_h + d[None, :], mask=inside)
        tl.store(key_cache_ptr + slot, keys.to(key_cache_ptr.dtype.element_ty), mask=inside)
    else:
        values = tl.load(v_ptr + row * v_stride_t + h[:, None] * v_stride_h + d[None, :], mask=inside)
        tl.store(value_cache_ptr + slot, values.to(value_cache_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _rotate_heads(
    x_ptr, row_base, stride_h, cos, sin, j,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):
    """A row's heads rotated in place (first half pairs with second); returns both halves."""
    h = tl.arange(0, HEADS_PAD)
    inside = (h < NUM_HEADS)[:, None] & (j < HALF)[None, :]
    first_ptrs = x_ptr + row_base + h[:, None] * stride_h + j[None, :]
    x1 = tl.load(first_ptrs, mask=inside, other=0.0).to(tl.float32)
    x2 = tl.load(first_ptrs + HALF, mask=inside, other=0.0).to(tl.float32)
    r1 = x1 * cos[None, :] - x2 * sin[None, :]
    r2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(first_ptrs, r1.to(x_ptr.dtype.element_ty), mask=inside)
    tl.store(first_ptrs + HALF, r2.to(x_ptr.dtype.element_ty), mask=inside)
    return r1, r2, h, inside


@triton.jit
def _rotate_write_kernel(
    q_ptr, q_stride_t, q_stride_h,
    k_ptr, k_stride_t, k_stride_h,
    v_ptr, v_stride_t, v_stride_h,
    positions_ptr, cos_sin_ptr, cos_sin_stride,
    slot_blocks_ptr, slot_offsets_ptr,
    key_cache_ptr, value_cache_ptr, cache_stride_block, cache_stride_token, cache_stride_head,
    NUM_Q_HEADS: tl.constexpr, Q_HEADS_PAD: tl.constexpr, NUM_KV_HEADS: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):
    """Program (row, part): part 0 rotates the row's query heads, 1 its key heads (then into the
    key cache), 2 copies its values into the value cache."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    j = tl.arange(0, HALF_PAD)
    block = tl.load(slot_blocks_ptr + row)
    offset = tl.load(slot_offsets_ptr + row)
    slot_base = block * cache_stride_block + offset * cache_stride_token
    if part == 2:
        h = tl.arange(0, KV_HEADS_PAD)
        inside = (h < NUM_KV_HEADS)[:, None] & (j < HALF)[None, :]
        source = v_ptr + row * v_stride_t + h[:, None] * v_stride_h + j[None, :]
        target = value_cache_ptr + slot_base + h[:, None] * cache_stride_head + j[None, :]
        tl.store(target, tl.load(source, mask=inside).to(value_cache_ptr.dtype.element_ty), mask=inside)
        tl.store(target + HALF, tl.load(source + HALF, mask=inside).to(value_cache_ptr.dtype.element_ty), mask=inside)
    else:
        position = tl.load(positions_ptr + row)
        cos = tl.load(cos_sin_ptr + position * cos_sin_stride + j, mask=j < HALF, other=0.0)
        sin = tl.load(cos_sin_ptr + position * cos_sin_stride + HALF + j, mask=j < HALF, other=0.0)
        if part == 0:
            _rotate_heads(q_ptr, row * q_stride_t, q_stride_h, cos, sin, j, NUM_Q_HEADS, Q_HEADS_PAD, HALF, HALF_PAD)
        else:
            r1, r2, h, inside = _rotate_heads(k_ptr, row * k_stride_t, k_stride_h, cos, sin, j, NUM_KV_HEADS, KV_HEADS_PAD, HALF, HALF_PAD)
            # The cache holds what the rotated k holds: rounded to k's type, then to the cache's.
            target = key_cache_ptr + slot_base + h[:, None] * cache_stride_head + j[None, :]
            tl.store(target, r1.to(k_ptr.dtype.element_ty).to(key_cache_ptr.dtype.element_ty), mask=inside)
            tl.store(target + HALF, r2.to(k_ptr.dtype.element_ty).to(key_cache_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _round_half_even(x):
    rounded = tl.floor(x + 0.5)
    odd = (rounded - 2.0 * tl.floor(rounded * 0.5)) != 0.0
    return tl.where((rounded - x) == 0.5, tl.where(odd, rounded - 1.0, rounded), rounded)  # a tie goes to the even one


@triton.jit
def _quantize(values, scale, QMAX: tl.constexpr, IS_FP8: tl.constexpr):
    scaled = tl.where(scale > 0.0, values / tl.where(scale > 0.0, scale, 1.0), 0.0)
    if not IS_FP8:
        scaled = _round_half_even(scaled)
    return tl.minimum(tl.maximum(scaled, -QMAX), QMAX)


@triton.jit
def _quantized_run(
    x_ptr, x_stride_t, x_stride_h, cache_ptr, scales_ptr,
    first_row, end_row, head, slot_blocks_ptr, slot_offsets_ptr,
    cache_stride_block, cache_stride_token, cache_stride_head, scales_stride_block, scales_stride_head,
    QMAX: tl.constexpr, IS_FP8: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """One run's rows of one head of keys or values into its block."""
    t = tl.arange(0, BLOCK_SIZE)
    d = tl.arange(0, HEAD_DIM)
    rows = first_row + t
    in_run = rows < end_row
    block = tl.load(slot_blocks_ptr + first_row)
    first = tl.load(slot_offsets_ptr + first_row)  # a run's offsets rise: its first is its smallest
    offsets = tl.load(slot_offsets_ptr + rows, mask=in_run, other=0)
    x = tl.load(x_ptr + rows[:, None] * x_stride_t + head * x_stride_h + d[None, :], mask=in_run[:, None], other=0.0).to(tl.float32)
    scale_ptr = scales_ptr + block * scales_stride_block + head * scales_stride_head
    old = tl.where(first > 0, tl.load(scale_ptr), 0.0)  # a block written from offset 0 starts afresh
    new = tl.maximum(old, tl.max(tl.max(tl.abs(x), axis=1), axis=0) / QMAX)
    head_base = cache_ptr + block * cache_stride_block + head * cache_stride_head
    earlier = t < tl.where(new > old, first, 0)  # entries before this step's, where the scale grew
    held_ptrs = head_base + t[:, None] * cache_stride_token + d[None, :]
    # other=0.0, not 0: Triton casts an int32 fill to the cache's type, and has no int32 -> fp8 cast.
    held = tl.load(held_ptrs, mask=earlier[:, None], other=0.0).to(tl.float32) * old
    tl.store(held_ptrs, _quantize(held, new, QMAX, IS_FP8).to(cache_ptr.dtype.element_ty), mask=earlier[:, None])
    tl.store(scale_ptr, new)
    new_ptrs = head_base + offsets[:, None] * cache_stride_token + d[None, :]
    tl.store(new_ptrs, _quantize(x, new, QMAX, IS_FP8).to(cache_ptr.dtype.element_ty), mask=in_run[:, None])


@triton.jit
def _quantized_kernel(
    k_ptr, k_stride_t, k_stride_h,
    v_ptr, v_stride_t, v_stride_h,
    run_starts_ptr, run_ends_ptr, slot_blocks_ptr, slot_offsets_ptr,
    key_cache_ptr, value_cache_ptr, cache_stride_block, cache_stride_token, cache_stride_head,
    key_scales_ptr, value_scales_ptr, scales_stride_block, scales_stride_head,
    QMAX: tl.constexpr, IS_FP8: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    run = tl.program_id(0)
    head = tl.program_id(1)
    first_row = tl.load(run_starts_ptr + run)
    end_row = tl.load(run_ends_ptr + run)
    if tl.program_id(2) == 0:
        _quantized_run(
            k_ptr, k_stride_t, k_stride_h, key_cache_ptr, key_scales_ptr, first_row, end_row, head, slot_blocks_ptr, slot_offsets_ptr,
            cache_stride_block, cache_stride_token, cache_stride_head, scales_stride_block, scales_stride_head,
            QMAX, IS_FP8, HEAD_DIM, BLOCK_SIZE,
        )
    else:
        _quantized_run(
            v_ptr, v_stride_t, v_stride_h, value_cache_ptr, value_scales_ptr, first_row, end_row, head, slot_blocks_ptr, slot_offsets_ptr,
            cache_stride_block, cache_stride_token, cache_stride_head, scales_stride_block, scales_stride_head,
            QMAX, IS_FP8, HEAD_DIM, BLOCK_SIZE,
        )


def _check_views(k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    # The kernels step both caches with one set of strides and a head's elements with stride 1.
    if key_cache.stride() != value_cache.stride() or k.stride(2) != 1 or v.stride(2) != 1 or key_cache.stride(3) != 1:
        raise ValueError(f"KV write: unsupported strides: k {k.stride()}, v {v.stride()}, caches {key_cache.stride()} / {value_cache.stride()}")


def write_pair(
    k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    slot_blocks: torch.Tensor, slot_offsets: torch.Tensor,
) -> None:
    """k/v [T, KVH, D] into the layer's views [blocks, block_size, KVH, D] at their slots, one launch."""
    rows, heads, dim = k.shape
    if rows == 0:
        return
    _check_views(k, v, key_cache, value_cache)
    _copy_kernel[(rows, 2)](
        k, k.stride(0), k.stride(1),
        v, v.stride(0), v.stride(1),
        slot_blocks, slot_offsets,
        key_cache, value_cache, key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        NUM_HEADS=heads, HEADS_PAD=triton.next_power_of_2(heads), HEAD_DIM=dim, DIM_PAD=triton.next_power_of_2(dim),
    )


def rotate_and_write_pair(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    slot_blocks: torch.Tensor, slot_offsets: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
) -> None:
    """q [T, H, D] and k [T, KVH, D] rotated in place by ``positions`` [T] (NeoX halves, from
    ``cos_sin_cache`` [max_positions, D] float32, cos | sin), then k and v [T, KVH, D] into the
    layer's views [blocks, block_size, KVH, D] at their slots: one launch."""
    rows, heads, dim = q.shape
    if rows == 0:
        return
    _check_views(k, v, key_cache, value_cache)
    if q.stride(2) != 1 or dim % 2 or cos_sin_cache.shape[1] != dim or cos_sin_cache.stride(1) != 1:
        raise ValueError(f"rotate and write: unsupported q {tuple(q.shape)}/{q.stride()} or table {tuple(cos_sin_cache.shape)}/{cos_sin_cache.stride()}")
    kv_heads = k.shape[1]
    _rotate_write_kernel[(rows, 3)](
        q, q.stride(0), q.stride(1),
        k, k.stride(0), k.stride(1),
        v, v.stride(0), v.stride(1),
        positions, cos_sin_cache, cos_sin_cache.stride(0),
        slot_blocks, slot_offsets,
        key_cache, value_cache, key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        NUM_Q_HEADS=heads, Q_HEADS_PAD=triton.next_power_of_2(heads), NUM_KV_HEADS=kv_heads, KV_HEADS_PAD=triton.next_power_of_2(kv_heads),
        HALF=dim // 2, HALF_PAD=triton.next_power_of_2(dim // 2),
    )


def write_quantized_pair(
    k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    key_scales: torch.Tensor, value_scales: torch.Tensor,
    slot_blocks: torch.Tensor, slot_offsets: torch.Tensor, run_starts: torch.Tensor, run_ends: torch.Tensor,
) -> None:
    """k/v [T, KVH, D] into a quantized layer's views with their ``scales`` [blocks, KVH], one
    launch; ``run_starts``/``run_ends``: the step's runs of rows that land in one block (each
    run's rows consecutive, its offsets rising). Head size and block size: powers of two."""
    if run_starts.numel() == 0:
        return
    _check_views(k, v, key_cache, value_cache)
    if key_scales.stride() != value_scales.stride():
        raise ValueError(f"KV write: key and value scales differ in strides ({key_scales.stride()} / {value_scales.stride()})")
    fp8 = key_cache.dtype == torch.float8_e4m3fn
    _quantized_kernel[(run_starts.numel(), k.shape[1], 2)](
        k, k.stride(0), k.stride(1),
        v, v.stride(0), v.stride(1),
        run_starts, run_ends, slot_blocks, slot_offsets,
        key_cache, value_cache, key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        key_scales, value_scales, key_scales.stride(0), key_scales.stride(1),
        QMAX=448.0 if fp8 else 127.0, IS_FP8=fp8, HEAD_DIM=k.shape[2], BLOCK_SIZE=key_cache.shape[1],
    )
