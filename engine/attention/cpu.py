"""Attention on a CPU straight from the paged cache: small C++ kernels, built per machine.

Decode (``csrc/paged_decode_attention.cpp``): SDPA needs each decode sequence's keys and
values contiguous, so the portable path copies every sequence's blocks out of the cache, pads
a gather group to its longest member, and only then attends. On the SmolLM2-135M shape
(float32, 2 threads, batch 32 of 64-1024 tokens) that copy plus SDPA took ~150 ms of a ~280 ms
decode step; the kernel reads each key and value once, in place, with no padding, and the step
takes ~150 ms.

Prefill (``csrc/paged_prefill_attention.cpp``): a chunk with cached context needs an explicit
causal mask in SDPA, so torch's CPU flash kernel computes the masked half too, after the
context is gathered out of the blocks; attention was 28% of a prefill step. The kernel is
flash attention in tiles that skips every tile after a query's position: 512 queries over
512 + 512 keys in ~6.5 ms against SDPA's ~11 ms, 512 causal queries in ~3 ms against ~5. On a
bfloat16 cache with avx512_bf16 the tiles stay bfloat16 and the products run on vdpbf16ps:
~3.5 ms for the first case, and the engine's bfloat16 prefill went from 943 to 1,117 tok/s.

The kernels live in ``engine.native_kernels``' library. Where it cannot be built or the kernels
do not apply (another device or dtype, a head size or group they were not built for), the
registry picks the portable SDPA backend instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import native_kernels
from engine.attention.base import AttentionBackend, AttentionMetadata, StepLayout

_MAX_GROUP = 8  # query heads per KV head the kernel was instantiated for
_HEAD_VECTORS = (1, 2, 4, 8, 16)  # head_dim as this many vectors of the machine's width
# The cache element types the kernels read, as their ``kind`` argument; the last two are
# quantized (engine.kv_cache), with a float32 scale per block and KV head.
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.float8_e4m3fn: 3}
_DTYPES = tuple(_KINDS)


def applies(device: torch.device | str, dtype: torch.dtype, head_dim: int, group: int) -> bool:
    """Whether the kernels can serve this cache (without building them)."""
    return (
        torch.device(device).type == "cpu"
        and dtype in _DTYPES
        and head_dim in tuple(v * native_kernels.vector_width() for v in _HEAD_VECTORS)
        and 1 <= group <= _MAX_GROUP
    )


def prepare(device: torch.device | str, dtype: torch.dtype, head_dim: int, group: int) -> bool:
    """Build the kernels now if they apply: an engine calls this at start, not on its first step."""
    return applies(device, dtype, head_dim, group) and native_kernels.kernel() is not None


def _check_layout(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    for cache in (key_cache, value_cache):
        if cache.stride(3) != 1 or cache.dtype not in _DTYPES:
            raise ValueError(f"KV cache layout {tuple(cache.shape)}/{cache.stride()} {cache.dtype} not supported")


def _cache_geometry(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[int, ...]:
    """Block size, then the block, token and head strides of keys and values, as the kernels take them."""
    return (
        key_cache.shape[1],
        key_cache.stride(0),
        value_cache.stride(0),
        key_cache.stride(1),
        value_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(2),
    )


def _scale_args(key_cache: torch.Tensor, key_scales: torch.Tensor | None, value_scales: torch.Tensor | None) -> tuple:
    """The kernels' scale arguments: pointers, block strides and the head stride, or nulls for an
    unquantized cache."""
    if key_cache.dtype not in (torch.int8, torch.float8_e4m3fn):
        return (None, None, 0, 0, 1)
    if key_scales is None or value_scales is None or key_scales.stride(1) != value_scales.stride(1):
        raise ValueError("a quantized KV cache needs its per-block key and value scales [num_blocks, kv_heads]")
    return (key_scales.data_ptr(), value_scales.data_ptr(), key_scales.stride(0), value_scales.stride(0), key_scales.stride(1))


def attend_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lens: torch.Tensor,
    window: int | None = None,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of n single-token queries q [n, H, D] over their blocks -> [n, H, D] in q's dtype.

    key/value caches [num_blocks, block_size, kv_heads, head_dim] (any block, token and head
    strides; each row dense); block_tables [n, width] and lens [n] int64 (tokens attended, the new one included);
    ``window``: a sliding window's size (each query attends its latest ``window`` keys).
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    _check_layout(q, key_cache, value_cache)
    queries = q.float().contiguous()
    tables = block_tables.contiguous()
    lengths = lens.contiguous()
    out = torch.empty_like(queries)
    status = native_kernels.kernel().pdserve_paged_decode(
        queries.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        _KINDS[key_cache.dtype],
        n,
        num_kv_heads,
        num_heads // num_kv_heads,
        head_dim,
        *_cache_geometry(key_cache, value_cache),
        *_scale_args(key_cache, key_scales, value_scales),
        tables.data_ptr(),
        tables.shape[1],
        lengths.data_ptr(),
        out.data_ptr(),
        head_dim**-0.5,
        torch.get_num_threads(),
        window or 0,
    )
    if status != 0:
        raise ValueError(f"no kernel built for head_dim {head_dim} with {num_heads // num_kv_heads} query heads per KV head")
    return out.to(q.dtype)


@dataclass(slots=True)
class PrefillChunks:
    """A step's multi-token chunks as the prefill kernel reads them, built once per step.

    Each chunk's query rows are consecutive in the step's packed tokens; its own keys and
    values are in the cache (written before attention), after its ``context_len`` cached ones.
    """

    first_rows: torch.Tensor  # [chunks] int64: the chunk's first row among the rows passed
    num_tokens: torch.Tensor  # [chunks] int64
    context_lens: torch.Tensor  # [chunks] int64
    tables: torch.Tensor  # [chunks, width] int64: blocks covering context + chunk


def attend_prefill(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    chunks: PrefillChunks,
    window: int | None = None,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed chunks q [T, H, D] over their context and themselves -> [T, H, D];
    under a sliding ``window`` each query attends its latest ``window`` keys only."""
    _, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    _check_layout(q, key_cache, value_cache)
    queries = q.float().contiguous()
    out = torch.empty_like(queries)
    status = native_kernels.kernel().pdserve_paged_prefill(
        queries.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        _KINDS[key_cache.dtype],
        chunks.first_rows.numel(),
        chunks.first_rows.data_ptr(),
        chunks.num_tokens.data_ptr(),
        chunks.context_lens.data_ptr(),
        chunks.tables.data_ptr(),
        chunks.tables.shape[1],
        num_kv_heads,
        num_heads // num_kv_heads,
        head_dim,
        *_cache_geometry(key_cache, value_cache),
        *_scale_args(key_cache, key_scales, value_scales),
        out.data_ptr(),
        head_dim**-0.5,
        torch.get_num_threads(),
        window or 0,
        int(q.dtype == torch.bfloat16),
    )
    if status != 0:
        raise ValueError(f"no kernel built for head_dim {head_dim}")
    return out.to(q.dtype)


@dataclass(slots=True)
class CpuKernelMetadata(AttentionMetadata):
    """A step for the CPU kernels: they read block tables and lengths, no masks."""

    single_block_tables: torch.Tensor | None = None  # [num_single, width] int64, padded with each row's first block
    single_lens: torch.Tensor | None = None  # [num_single] tokens each decode row attends, its own included
    prefill: PrefillChunks | None = None

    def attend(self, q, k, v, key_cache, value_cache, window, key_scales, value_scales) -> torch.Tensor:
        if self.prefill is None:
            return attend_decode(q, key_cache, value_cache, self.single_block_tables, self.single_lens, window, key_scales, value_scales)
        out = torch.empty_like(q)
        if self.num_single:
            out[: self.num_single] = attend_decode(
                q[: self.num_single], key_cache, value_cache, self.single_block_tables, self.single_lens, window, key_scales, value_scales
            )
        out[self.num_single :] = attend_prefill(q[self.num_single :], key_cache, value_cache, self.prefill, window, key_scales, value_scales)
        return out


class CpuKernelBackend(AttentionBackend):
    """Decode and prefill attention through the native kernels, reading the cache in place."""

    name = "cpu"

    def build_layout(self, layout: StepLayout) -> CpuKernelMetadata:
        meta = CpuKernelMetadata(*self.slot_tensors(layout), num_single=layout.num_single)
        if layout.num_single:
            meta.single_block_tables = torch.from_numpy(layout.decode_tables())
            meta.single_lens = torch.from_numpy(layout.decode_lens)
        if layout.num_chunks:
            meta.prefill = PrefillChunks(
                first_rows=torch.from_numpy(layout.chunk_first_rows - layout.num_single),
                num_tokens=torch.from_numpy(layout.chunk_num_tokens),
                context_lens=torch.from_numpy(layout.chunk_context_lens),
                tables=torch.from_numpy(layout.chunk_tables()),
            )
        return meta
