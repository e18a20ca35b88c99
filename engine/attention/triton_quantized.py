"""A quantized KV cache (int8, fp8) on CUDA: the KV write and decode attention in Triton.

The cache keeps one float32 scale per (block, KV head) that only grows (engine.kv_cache,
engine.attention.kv_write). FlashInfer's fp8 path takes one scale per tensor, so the portable
backend served these caches on CUDA: decode gathered every row's blocks, padded to the longest,
dequantized them in float32 and ran SDPA, reading about three times the bytes the cache holds,
and the write ran as a dozen torch ops per layer with a host synchronisation.

Here decode attention reads each row's blocks in place (programs per decode row, KV head and
split of the row's context: the group's query heads against a block's keys, dequantized in
registers, online softmax; the splits then merged, as flash-decoding does), and the write is one kernel per layer for keys and values together
(``engine.attention.triton_kv_write``), the same rules as the CPU kernel and the torch path.
Prompt chunks keep the portable backend's gather + SDPA (compute-bound there).

The kernels run on a CPU too under Triton's interpreter (``TRITON_INTERPRET=1``): the tests
check them against the portable backend that way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from engine.attention.base import StepLayout
from engine.attention.sdpa import SdpaBackend, SdpaMetadata
from engine.attention.triton_kv_write import write_quantized_pair

logger = logging.getLogger(__name__)

QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn)


@triton.jit
def _window_start(length, window):
    """A decode row's first visible position (``window`` 0: no sliding window)."""
    return tl.where(window > 0, tl.maximum(length - window, 0), 0)


@triton.jit
def _attend_blocks(
    q_ptr, q_stride_t, q_stride_h,
    k_ptr, k_stride_block, k_stride_token, k_stride_head,
    v_ptr, v_stride_block, v_stride_token, v_stride_head,
    k_scales_ptr, v_scales_ptr, scales_stride_block, scales_stride_head,
    tables_ptr, tables_stride, row, kv_head, length, start, first, last, softmax_scale,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """The group's query heads of decode row ``row`` against its blocks [first, last) (positions
    [start, length) visible), keys and values dequantized in registers, online softmax: the
    running maximum, sum and unnormalized output per query head."""
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    t = tl.arange(0, BLOCK_SIZE)
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + row * q_stride_t + heads[:, None] * q_stride_h + d[None, :], mask=(g < GROUP)[:, None], other=0.0).to(tl.float32)
    best = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    total = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    for b in range(first, last):
        block = tl.load(tables_ptr + row * tables_stride + b)
        positions = b * BLOCK_SIZE + t
        visible = (positions < length) & (positions >= start)
        k_scale = tl.load(k_scales_ptr + block * scales_stride_block + kv_head * scales_stride_head)
        v_scale = tl.load(v_scales_ptr + block * scales_stride_block + kv_head * scales_stride_head)
        keys = tl.load(k_ptr + block * k_stride_block + t[:, None] * k_stride_token + kv_head * k_stride_head + d[None, :]).to(tl.float32)
        scores = tl.sum(q[:, None, :] * keys[None, :, :], axis=2) * (softmax_scale * k_scale)  # [group, block]
        scores = tl.where(visible[None, :], scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        weights = tl.exp(scores - new_best[:, None])
        rescale = tl.exp(best - new_best)
        total = total * rescale + tl.sum(weights, axis=1)
        values = tl.load(v_ptr + block * v_stride_block + t[:, None] * v_stride_token + kv_head * v_stride_head + d[None, :]).to(tl.float32)
        acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * values[None, :, :], axis=1) * v_scale
        best = new_best
    return best, total, acc


@triton.jit
def _decode_kernel(
    q_ptr, q_stride_t, q_stride_h,
    k_ptr, k_stride_block, k_stride_token, k_stride_head,
    v_ptr, v_stride_block, v_stride_token, v_stride_head,
    k_scales_ptr, v_scales_ptr, scales_stride_block, scales_stride_head,
    tables_ptr, tables_stride, lens_ptr,
    out_ptr, out_stride_t, out_stride_h,
    softmax_scale, window,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """One program per decode row and KV head, over all its blocks."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    length = tl.load(lens_ptr + row)
    start = _window_start(length, window)
    _, total, acc = _attend_blocks(
        q_ptr, q_stride_t, q_stride_h, k_ptr, k_stride_block, k_stride_token, k_stride_head,
        v_ptr, v_stride_block, v_stride_token, v_stride_head, k_scales_ptr, v_scales_ptr, scales_stride_block, scales_stride_head,
        tables_ptr, tables_stride, row, kv_head, length, start, start // BLOCK_SIZE, tl.cdiv(length, BLOCK_SIZE), softmax_scale,
        GROUP, GROUP_PAD, HEAD_DIM, BLOCK_SIZE,
    )
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g
    tl.store(out_ptr + row * out_stride_t + heads[:, None] * out_stride_h + d[None, :], acc / total[:, None], mask=(g < GROUP)[:, None])


@triton.jit
def _split_blocks(length, start, split, BLOCK_SIZE: tl.constexpr, MIN_SPLIT_BLOCKS: tl.constexpr, MAX_SPLITS: tl.constexpr):
    """A row's blocks split ``split`` attends (``start``: its first visible position): [first,
    last), empty past the row's last split; and how many splits it has. Splits of at least
    MIN_SPLIT_BLOCKS blocks, at most MAX_SPLITS of them: a function of the row alone, so a row
    attends alike in any batch and any table width (a CUDA graph's padded ones)."""
    row_blocks = tl.cdiv(length, BLOCK_SIZE)
    per_split = tl.maximum(MIN_SPLIT_BLOCKS, tl.cdiv(row_blocks, MAX_SPLITS))
    return tl.maximum(start // BLOCK_SIZE, split * per_split), tl.minimum(row_blocks, (split + 1) * per_split), tl.cdiv(row_blocks, per_split)


@triton.jit
def _decode_split_kernel(
    q_ptr, q_stride_t, q_stride_h,
    k_ptr, k_stride_block, k_stride_token, k_stride_head,
    v_ptr, v_stride_block, v_stride_token, v_stride_head,
    k_scales_ptr, v_scales_ptr, scales_stride_block, scales_stride_head,
    tables_ptr, tables_stride, lens_ptr,
    best_ptr, total_ptr, acc_ptr, num_kv_heads, num_splits,
    softmax_scale, window,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    MIN_SPLIT_BLOCKS: tl.constexpr, MAX_SPLITS: tl.constexpr,
):
    """``_decode_kernel``'s walk over one split of a row's blocks, leaving its running maximum,
    sum and unnormalized output per query head for ``_merge_splits_kernel``."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(lens_ptr + row)
    start = _window_start(length, window)
    first, last, _ = _split_blocks(length, start, split, BLOCK_SIZE, MIN_SPLIT_BLOCKS, MAX_SPLITS)
    best, total, acc = _attend_blocks(
        q_ptr, q_stride_t, q_stride_h, k_ptr, k_stride_block, k_stride_token, k_stride_head,
        v_ptr, v_stride_block, v_stride_token, v_stride_head, k_scales_ptr, v_scales_ptr, scales_stride_block, scales_stride_head,
        tables_ptr, tables_stride, row, kv_head, length, start, first, last, softmax_scale,
        GROUP, GROUP_PAD, HEAD_DIM, BLOCK_SIZE,
    )
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    partial = (row * num_kv_heads + kv_head) * num_splits + split
    tl.store(best_ptr + partial * GROUP_PAD + g, best)
    tl.store(total_ptr + partial * GROUP_PAD + g, total)
    tl.store(acc_ptr + (partial * GROUP_PAD + g[:, None]) * HEAD_DIM + d[None, :], acc)


@triton.jit
def _merge_splits_kernel(
    best_ptr, total_ptr, acc_ptr, num_kv_heads, num_splits, lens_ptr,
    out_ptr, out_stride_t, out_stride_h,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    MIN_SPLIT_BLOCKS: tl.constexpr, MAX_SPLITS: tl.constexpr,
):
    """A row's splits joined: each split's sum and output rescaled to the largest maximum. A row
    of one split comes out exactly as ``_decode_kernel`` gives it (its factor is exp(0) = 1)."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    length = tl.load(lens_ptr + row)
    _, _, used = _split_blocks(length, 0, 0, BLOCK_SIZE, MIN_SPLIT_BLOCKS, MAX_SPLITS)  # (how many splits: the window does not change it)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    first = (row * num_kv_heads + kv_head) * num_splits
    peak = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    for s in range(0, used):
        peak = tl.maximum(peak, tl.load(best_ptr + (first + s) * GROUP_PAD + g))
    total = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    for s in range(0, used):
        factor = tl.exp(tl.load(best_ptr + (first + s) * GROUP_PAD + g) - peak)  # 0 for a split before a window's start
        total += tl.load(total_ptr + (first + s) * GROUP_PAD + g) * factor
        acc += tl.load(acc_ptr + ((first + s) * GROUP_PAD + g[:, None]) * HEAD_DIM + d[None, :]) * factor[:, None]
    heads = kv_head * GROUP + g
    tl.store(out_ptr + row * out_stride_t + heads[:, None] * out_stride_h + d[None, :], acc / total[:, None], mask=(g < GROUP)[:, None])


# Decode attention splits a row's context into runs of at least this many tokens, attended by
# programs of their own and then merged (flash-decoding): one program per row and KV head
# walking its blocks one after another left most of a GPU idle. On an H200 (session 46) the 1.5B
# shape's batch-64 step at context 600 with an fp8 cache took 9.17 ms in CUDA graphs against 2.89
# ms with a bfloat16 cache through FlashInfer: 128 programs for 132 SMs, 38 blocks each in turn.
SPLIT_TOKENS = 128
MAX_SPLITS = 32  # at most this many a row (longer splits past 4k tokens): bounds the partials' memory
_splits_build = True  # False once the split kernels failed to build or launch here


def attend_decode(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, key_scales: torch.Tensor, value_scales: torch.Tensor,
    tables: torch.Tensor, lens: torch.Tensor, window: int | None, split_tokens: int | None = None,
) -> torch.Tensor:
    """Decode rows q [n, H, D] over their quantized blocks -> [n, H, D] in q's dtype. Rows whose
    blocks span several splits of ``split_tokens`` (SPLIT_TOKENS) are attended split by split, then
    merged; the split of a row depends on the row alone, never on ``tables``' width."""
    n, num_heads, head_dim = q.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    group = num_heads // num_kv_heads
    group_pad = max(2, triton.next_power_of_2(group))
    out = torch.empty((n, num_heads, head_dim), dtype=torch.float32, device=q.device)
    cache_args = (
        q, q.stride(0), q.stride(1),
        key_cache, key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache, value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        key_scales, value_scales, key_scales.stride(0), key_scales.stride(1),
        tables, tables.stride(0), lens,
    )
    shape = dict(GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK_SIZE=block_size)
    min_split_blocks = max(1, (split_tokens or SPLIT_TOKENS) // block_size)
    num_splits = min(MAX_SPLITS, triton.cdiv(tables.shape[1], min_split_blocks))  # the most any row of ``tables`` takes
    global _splits_build
    if num_splits > 1 and _splits_build:
        splits = dict(MIN_SPLIT_BLOCKS=min_split_blocks, MAX_SPLITS=MAX_SPLITS)
        best = torch.empty((n, num_kv_heads, num_splits, group_pad), dtype=torch.float32, device=q.device)
        total = torch.empty_like(best)
        acc = torch.empty((n, num_kv_heads, num_splits, group_pad, head_dim), dtype=torch.float32, device=q.device)
        try:
            _decode_split_kernel[(n, num_kv_heads, num_splits)](*cache_args, best, total, acc, num_kv_heads, num_splits, head_dim**-0.5, window or 0, **shape, **splits)
            _merge_splits_kernel[(n, num_kv_heads)](best, total, acc, num_kv_heads, num_splits, lens, out, out.stride(0), out.stride(1), **shape, **splits)
            return out.to(q.dtype)
        except Exception:
            # Kernels that do not build here (a Triton or driver they were never run on): the
            # one-pass kernel from now on (the engine's warm-up step meets this before a graph does).
            logger.exception("the split decode kernels failed to run; quantized decode attends in one pass from now on")
            _splits_build = False
    _decode_kernel[(n, num_kv_heads)](*cache_args, out, out.stride(0), out.stride(1), head_dim**-0.5, window or 0, **shape)
    return out.to(q.dtype)


def applies(head_dim: int, block_size: int) -> bool:
    """Triton's block shapes are powers of two."""
    return head_dim == triton.next_power_of_2(head_dim) and block_size == triton.next_power_of_2(block_size)


@dataclass(slots=True)
class TritonQuantizedMetadata(SdpaMetadata):
    """The portable backend's step (prompt chunks), with the write's runs for the Triton kernels."""

    run_starts: torch.Tensor | None = None  # [runs] first row of each run of rows landing in one block
    run_ends: torch.Tensor | None = None

    def write(self, k, v, key_cache, value_cache, key_scales, value_scales) -> None:
        write_quantized_pair(
            k, v, key_cache, value_cache, key_scales, value_scales, self.slot_blocks, self.slot_offsets, self.run_starts, self.run_ends
        )

    def attend_single(self, q, key_cache, value_cache, out, window, key_scales, value_scales) -> None:
        out[: self.num_single] = attend_decode(
            q[: self.num_single], key_cache, value_cache, key_scales, value_scales, self.single_block_tables, self.single_lens, window
        )


class TritonQuantizedBackend(SdpaBackend):
    """int8/fp8 caches on CUDA: decode attention and the KV write in Triton, chunks through SDPA."""

    name = "triton"
    metadata_class = TritonQuantizedMetadata
    # Decode attention reads each row's block table and length from tensors: from fixed buffers,
    # a CUDA graph replays it (engine.cuda_graphs, graph_metadata).
    supports_cuda_graphs = True

    def graph_metadata(self, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor) -> TritonQuantizedMetadata:
        """A decode-only step of ``len(lens)`` rows over fixed buffers: each row's new KV slot,
        its block table (padded) and the tokens it attends. Each row writes a block of its own
        (padding rows all write the scratch block, whatever lands there), so every row is a run
        of the write."""
        rows = torch.arange(len(lens) + 1, device=lens.device)
        return TritonQuantizedMetadata(slot_blocks, slot_offsets, num_single=len(lens), single_block_tables=tables, single_lens=lens,
                                       run_starts=rows[:-1], run_ends=rows[1:])

    def build_layout(self, layout: StepLayout) -> TritonQuantizedMetadata:
        meta = super().build_layout(layout)
        # Runs of consecutive rows whose KV lands in one block (a sequence's rows in a block are
        # consecutive in the packed step, and no two sequences write one block).
        change = np.flatnonzero(np.diff(layout.slot_blocks)) + 1
        meta.run_starts = self.to_device(np.concatenate([[0], change]).astype(np.int64))
        meta.run_ends = self.to_device(np.concatenate([change, [len(layout.slot_blocks)]]).astype(np.int64))
        return meta
