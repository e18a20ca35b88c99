"""Attention on CUDA through FlashInfer's paged kernels, reading the cache in place.

The cache's per-layer view is FlashInfer's "HND" paged layout with our strides: a page is a
block (page size = block size), the page stride is the whole block's (every layer's keys and
values sit in it, engine.kv_cache), then KV heads, then tokens; FlashInfer takes the strides as
they are, so nothing is copied or gathered. A step plans once (block tables as indptr/indices/
last-page lengths, on the host) and every layer runs the planned kernels: decode rows through
the batched decode kernel, prompt chunks through the batched prefill kernel (FA2: causal,
bottom-right aligned, so a chunk attends its cached context and itself). A sliding window is
a plan parameter, so each window the model uses has its own planned wrappers.

FlashInfer compiles its kernels on first use (JIT, cached under ~/.cache/flashinfer): measured
on an H100, about 13 s for the decode kernel and 23 s for the FA2 prefill kernel per head size;
FA3's sm90 prefill took 80 s, so the prefill wrapper asks for FA2.

Not served here: float32 (FlashInfer has no float32 kernels) and the quantized caches (their
scales are per block and head; FlashInfer's fp8 path takes one scale per tensor): the registry
keeps the SDPA backend for those.

CUDA graphs (engine.cuda_graphs) replay decode steps: ``graph_wrappers`` gives a batch bucket
its own wrappers over fixed buffers, planned before each replay.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.attention.base import AttentionBackend, AttentionMetadata, StepLayout

WORKSPACE_BYTES = 256 * 1024 * 1024  # FlashInfer's split-KV scratch, shared by its wrappers (they run one after another)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (64, 128, 256)  # the head sizes FlashInfer instantiates its kernels for
# From this many query heads per KV head, decode runs FlashInfer's tensor-core kernel (its FA2
# prefill kernel, one query row per request) instead of the CUDA-core decode kernel, which
# multiplies each query head by the keys on its own: on an H200, the 1.5B shape (12 query heads,
# 2 KV heads) at batch 64, context 600 spent 37 us a layer there, reading 39 MB (1.1 TB/s), 36% of
# the step. vLLM switches at the same group sizes.
TENSOR_CORE_MIN_GROUP = 4
# Whether a decode plan may split a row's KV over several thread blocks (FlashInfer's choice,
# then a kernel merging their partial results: 0.10 ms of a 2.58 ms 1.5B batch-64 step on an
# H200). tools/gpu_check.py's decode variant ``no_split_kv`` turns it off to time a step each way.
DECODE_SPLIT_KV = True


def available() -> bool:
    """Whether FlashInfer can be imported (the ``pdserve[cuda]`` extra)."""
    try:
        import flashinfer  # noqa: F401
    except Exception:
        return False
    return True


@dataclass(slots=True)
class PagedTables:
    """Block tables in FlashInfer's CSR form (what ``plan`` reads): on the host, but for the
    block ids of a graph's plan, which ``DecodeGraphs`` hands over on the device."""

    indptr: torch.Tensor  # [n + 1] int32: entry i's pages are indices[indptr[i]:indptr[i + 1]]
    indices: torch.Tensor  # [pages] int32 block ids
    last_page_len: torch.Tensor  # [n] int32: tokens in each entry's last page

    @classmethod
    def of(cls, tables: np.ndarray, lengths: np.ndarray, block_size: int) -> "PagedTables":
        """From padded tables [n, width] and the tokens each entry covers [n] (numpy, int64)."""
        counts = -(-lengths // block_size)
        indptr = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(counts, out=indptr[1:])
        # Row-major: each entry's first ``counts[i]`` columns, entry after entry.
        indices = tables[np.arange(tables.shape[1]) < counts[:, None]]
        return cls(
            torch.from_numpy(indptr),
            torch.from_numpy(indices.astype(np.int32)),
            torch.from_numpy((lengths - (counts - 1) * block_size).astype(np.int32)),
        )


@dataclass(slots=True)
class FlashInferMetadata(AttentionMetadata):
    """A planned step: per window, the decode wrapper (rows [0, num_single)) and the prefill
    wrapper (the rest)."""

    decode: dict[int | None, object] = field(default_factory=dict)
    prefill: dict[int | None, object] = field(default_factory=dict)

    def attend(self, q, k, v, key_cache, value_cache, window, key_scales, value_scales) -> torch.Tensor:
        # The layer's views are [blocks, block_size, KVH, D]; FlashInfer's HND is [blocks, KVH, block_size, D].
        paged = (key_cache.transpose(1, 2), value_cache.transpose(1, 2))
        out = torch.empty_like(q)
        if self.num_single:
            self.decode[window].run(q[: self.num_single], paged, out=out[: self.num_single])
        if self.num_single < q.shape[0]:
            self.prefill[window].run(q[self.num_single :], paged, out=out[self.num_single :])
        return out


class FlashInferBackend(AttentionBackend):
    """Decode and prefill through FlashInfer's paged kernels (CUDA, float16/bfloat16, plain cache)."""

    name = "flashinfer"
    supports_cuda_graphs = True

    def __init__(self, device: str, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, windows: set[int | None]):
        super().__init__(device, block_size)
        import flashinfer

        self.flashinfer = flashinfer
        self.num_heads, self.num_kv_heads, self.head_dim, self.dtype = num_heads, num_kv_heads, head_dim, dtype
        self.windows = windows or {None}
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.decode_tensor_cores = num_heads // num_kv_heads >= TENSOR_CORE_MIN_GROUP
        self.decode = {w: flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "HND", use_tensor_cores=self.decode_tensor_cores) for w in self.windows}
        self.prefill = {w: flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "HND", backend="fa2") for w in self.windows}

    def build_layout(self, layout: StepLayout) -> FlashInferMetadata:
        meta = FlashInferMetadata(*self.slot_tensors(layout), num_single=layout.num_single)
        with self.planning():
            if layout.num_single:
                tables = PagedTables.of(layout.decode_tables(), layout.decode_lens, self.block_size)
                for window, wrapper in self.decode.items():
                    self.plan_decode(wrapper, tables, window)
                meta.decode = self.decode
            if layout.num_chunks:
                self._plan_prefill(layout)
                meta.prefill = self.prefill
        return meta

    def plan_decode(self, wrapper, tables: PagedTables, window: int | None) -> None:
        wrapper.plan(
            tables.indptr, tables.indices, tables.last_page_len, self.num_heads, self.num_kv_heads, self.head_dim, self.block_size,
            window_left=_window_left(window), q_data_type=self.dtype, kv_data_type=self.dtype, disable_split_kv=not DECODE_SPLIT_KV,
        )

    def _plan_prefill(self, layout: StepLayout) -> None:
        query_indptr = np.zeros(layout.num_chunks + 1, dtype=np.int32)
        np.cumsum(layout.chunk_num_tokens, out=query_indptr[1:])
        paged = PagedTables.of(layout.chunk_tables(), layout.chunk_context_lens + layout.chunk_num_tokens, self.block_size)
        for window, wrapper in self.prefill.items():
            wrapper.plan(
                torch.from_numpy(query_indptr), paged.indptr, paged.indices, paged.last_page_len,
                self.num_heads, self.num_kv_heads, self.head_dim, self.block_size, causal=True,
                window_left=_window_left(window), q_data_type=self.dtype, kv_data_type=self.dtype,
            )

    def graph_wrappers(self, batch: int, max_pages: int) -> dict[int | None, object]:
        """Decode wrappers for a CUDA graph of ``batch`` rows over fixed buffers (at most
        ``max_pages`` pages in all), one per window."""
        wrappers = {}
        for window in self.windows:
            wrappers[window] = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "HND", use_cuda_graph=True, use_tensor_cores=self.decode_tensor_cores,
                paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32, device=self.device),
                paged_kv_indices_buffer=torch.zeros(max_pages, dtype=torch.int32, device=self.device),
                paged_kv_last_page_len_buffer=torch.zeros(batch, dtype=torch.int32, device=self.device),
            )
        return wrappers


def _window_left(window: int | None) -> int:
    """Our window (a query sees itself and window - 1 keys before it) as FlashInfer's window_left."""
    return -1 if window is None else window - 1
