"""A quantized KV cache (int8, fp8) on CUDA: the KV write and decode attention in Triton.

The cache keeps one float32 scale per (block, KV head) that only grows (engine.kv_cache,
engine.attention.kv_write). FlashInfer's fp8 path takes one scale per tensor, so the portable
backend served these caches on CUDA: decode gathered every row's blocks, padded to the longest,
dequantized them in float32 and ran SDPA, reading about three times the bytes the cache holds,
and the write ran as a dozen torch ops per layer with a host synchronisation.

Here decode attention reads each row's blocks in place (one program per decode row and KV
head: the group's query heads against the block's keys, dequantized in registers, online
softmax), and the write is one kernel per layer for keys and values together
(``engine.attention.triton_kv_write``), the same rules as the CPU kernel and the torch path.
Prompt chunks keep the portable backend's gather + SDPA (compute-bound there).

The kernels run on a CPU too under Triton's interpreter (``TRITON_INTERPRET=1``): the tests
check them against the portable backend that way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from engine.attention.base import StepLayout
from engine.attention.sdpa import SdpaBackend, SdpaMetadata
from engine.attention.triton_kv_write import write_quantized_pair

QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn)


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
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    length = tl.load(lens_ptr + row)
    start = tl.where(window > 0, tl.maximum(length - window, 0), 0)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    t = tl.arange(0, BLOCK_SIZE)
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + row * q_stride_t + heads[:, None] * q_stride_h + d[None, :], mask=(g < GROUP)[:, None], other=0.0).to(tl.float32)
    best = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    total = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    for b in range(start // BLOCK_SIZE, tl.cdiv(length, BLOCK_SIZE)):
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
    out = acc / total[:, None]
    tl.store(out_ptr + row * out_stride_t + heads[:, None] * out_stride_h + d[None, :], out, mask=(g < GROUP)[:, None])


def attend_decode(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, key_scales: torch.Tensor, value_scales: torch.Tensor,
    tables: torch.Tensor, lens: torch.Tensor, window: int | None,
) -> torch.Tensor:
    """Decode rows q [n, H, D] over their quantized blocks -> [n, H, D] in q's dtype."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty((n, num_heads, head_dim), dtype=torch.float32, device=q.device)
    _decode_kernel[(n, num_kv_heads)](
        q, q.stride(0), q.stride(1),
        key_cache, key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache, value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        key_scales, value_scales, key_scales.stride(0), key_scales.stride(1),
        tables, tables.stride(0), lens,
        out, out.stride(0), out.stride(1),
        head_dim**-0.5, window or 0,
        GROUP=group, GROUP_PAD=max(2, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_SIZE=key_cache.shape[1],
    )
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
