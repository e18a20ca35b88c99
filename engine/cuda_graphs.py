"""Decode steps replayed from CUDA graphs.

A decode step of a small model on a GPU is launch-bound: the 135M shape issues ~15 kernels per
layer and 30 layers, each a few microseconds of work behind tens of microseconds of Python and
launch overhead. A CUDA graph records the whole forward once per batch bucket and replays it
with one launch. The graph reads its inputs from persistent buffers (token ids, positions, KV
slots) and its attention from wrappers planned over fixed buffers before each replay
(``FlashInferBackend.graph_wrappers``), or, for a quantized cache's Triton kernels, from block
tables and lengths copied into fixed buffers (``TritonQuantizedBackend.graph_metadata``); a batch
is padded up to its bucket with rows that attend and write only the cache's scratch block, so no
sequence's KV is touched.

A step whose rows go through LoRA adapters replays a second graph per bucket, captured with
the adapters' deltas over a buffer of each row's slot (``engine.lora.RowSlots``): any mix of
adapters replays it. Those are captured on a bucket's first such step, and again after the
adapters' stacks change (a load or an unload makes new tensors: ``lora_version``).

Only whole-model, one-rank, decode-only steps are replayed (every row sampled); anything else
(prompt chunks, pipeline stages, tensor-parallel collectives) runs eagerly. Every bucket is
captured when the engine starts (``capture_all``, largest first, as vLLM does): captured on first
use instead, a serving decode actor stalled every request it held for a capture (two warm-up
forwards and the recording) each time the batch grew past a bucket it had not seen.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.attention.base import lay_out
from engine.attention.flashinfer_paged import FlashInferBackend, FlashInferMetadata, PagedTables

if TYPE_CHECKING:
    from engine.attention.triton_quantized import TritonQuantizedBackend
from engine.lora import RowSlots

logger = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, then every 16 (vLLM's spacing), up to ``max_batch``."""
    sizes = [size for size in (1, 2, 4, 8) if size < max_batch]
    sizes += list(range(16, max_batch, 16))
    return [*sizes, max_batch]


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    wrappers: dict  # window -> FlashInfer decode wrapper over this bucket's fixed buffers
    logits: torch.Tensor  # [bucket, vocab] float32, written by each replay (a view of DecodeGraphs.logits)
    metadata: object  # the captured step's attention metadata: what its kernels read stays allocated


class DecodeGraphs:
    """Captures and replays decode steps of ``model`` for batches up to ``max_batch`` rows."""

    def __init__(self, model, kv_cache, backend: "FlashInferBackend | TritonQuantizedBackend", max_batch: int, max_blocks_per_seq: int):
        if kv_cache.scratch_block is None:
            raise ValueError("CUDA graphs need the KV cache's scratch block for padding rows")
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.buckets = batch_buckets(max_batch)
        self.max_blocks_per_seq = max_blocks_per_seq
        device = backend.device
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slot_blocks = torch.full((max_batch,), kv_cache.scratch_block, dtype=torch.long, device=device)
        self.slot_offsets = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.rows = torch.arange(max_batch, device=device)
        # Backends whose decode kernels read block tables and lengths from tensors (the Triton
        # kernels of a quantized cache) replay over these buffers; FlashInfer's over its plans.
        self.tables_mode = not isinstance(backend, FlashInferBackend)
        if self.tables_mode:
            self.decode_tables = torch.full((max_batch, max_blocks_per_seq), kv_cache.scratch_block, dtype=torch.long, device=device)
            self.decode_lens = torch.ones(max_batch, dtype=torch.long, device=device)
            self.tables_staging = torch.zeros(max_batch * max_blocks_per_seq, dtype=torch.long).pin_memory()
        self.row_slots = torch.full((max_batch,), -1, dtype=torch.long, device=device)  # each row's adapter slot
        # One host-to-device copy per step: input ids, positions, slot blocks and offsets, and the
        # rows whose input the step in flight samples with their rows in its samples (engine.overlap).
        # Row-major, so a bucket's rows are one contiguous block of pinned memory.
        # The seventh column: each row's adapter slot (-1: none), for the adapter graphs; the
        # eighth: the tokens each row attends (tables mode).
        self.staging = torch.zeros((max_batch, 8), dtype=torch.long).pin_memory()
        # A step's block ids for FlashInfer's plan, handed over on the device: from the host its
        # plan copies them with a stream synchronization (the host would wait for the step in flight).
        self.indices_staging = torch.zeros(max_batch * max_blocks_per_seq, dtype=torch.int32).pin_memory()
        self.indices = torch.zeros(max_batch * max_blocks_per_seq, dtype=torch.int32, device=device)
        # Every graph writes its logits here: as each graph's own output they stayed allocated,
        # one [bucket, vocab] float32 tensor per bucket (1.3 GB for the buckets up to 256 rows of
        # a 152k vocabulary); the graphs replay one at a time, so one buffer serves them all.
        self.logits = torch.empty((max_batch, model.lm_head.out_features), dtype=torch.float32, device=device)
        self.graphs: dict[int, _Graph] = {}
        self.adapter_graphs: dict[int, _Graph] = {}  # through the adapters' stacks of ``adapter_graphs_version``
        self.adapter_graphs_version = None
        self.adapter_capture_failed: set[int] = set()  # buckets whose adapter graph failed to capture (this version)
        self.pool = None  # the graphs' shared memory pool

    def capture_all(self) -> None:
        """Capture every bucket now, the largest first: the smaller graphs then take their
        working memory from what the largest one's pool already holds."""
        started = time.perf_counter()
        for bucket in sorted(self.buckets, reverse=True):
            if bucket not in self.graphs:
                self._capture(bucket)
        logger.info("captured %d CUDA graphs (decode batches up to %d) in %.1f s", len(self.buckets), self.buckets[-1], time.perf_counter() - started)

    def bucket(self, rows: int) -> int | None:
        return next((size for size in self.buckets if size >= rows), None)

    def run(self, step, tables: np.ndarray, pending: torch.Tensor | None = None) -> torch.Tensor | None:
        """The logits of a decode-only step (an engine.model_runner.StepInput over the block
        ``tables``), replayed; None when the step is not one it replays. ``pending``: the step in
        flight's samples, where some rows read their input (``step.pending_rows``)."""
        input_ids, positions = step.input_ids, step.positions
        rows = len(input_ids)
        bucket = self.bucket(rows)
        if bucket is None or not all(s.decode for s in step.slices) or step.logits_indices != list(range(rows)):
            return None
        if rows != len(step.slices) and self.kv_cache.quantized is not None:
            # Draft rows (speculative decoding) write a sequence's block from several rows, and a
            # graph's quantized write takes every row for a block of its own: the rows would
            # rescale one block's entries unordered (run_starts, graph_metadata). Eager it is.
            return None
        layout = lay_out(step.slices, tables, self.kv_cache.block_size)
        decode_tables = layout.decode_tables()
        if decode_tables.shape[1] > self.max_blocks_per_seq:
            return None
        with_adapters = step.uses_adapters
        graph = self._adapter_graph(bucket) if with_adapters else (self.graphs.get(bucket) or self._capture(bucket))
        if graph is None:
            return None
        scratch = self.kv_cache.scratch_block
        # Padding rows attend the scratch block's first token (written by themselves).
        padded = np.full((bucket, decode_tables.shape[1]), scratch, dtype=np.int64)
        padded[:rows] = decode_tables
        lens = np.ones(bucket, dtype=np.int64)
        lens[:rows] = layout.decode_lens
        num_pending = len(step.pending_rows)
        with self.backend.planning():  # the pinned buffers below are free again once it returns
            staging = self.staging
            staging[:rows, 0] = torch.tensor(input_ids)
            staging[:rows, 1] = torch.tensor(positions)
            staging[:rows, 2] = torch.from_numpy(layout.slot_blocks)
            staging[:rows, 3] = torch.from_numpy(layout.slot_offsets)
            staging[rows:bucket, :4] = 0
            staging[rows:bucket, 2] = scratch
            if self.tables_mode:
                staging[:bucket, 7] = torch.from_numpy(lens)
            if num_pending:
                staging[:num_pending, 4] = torch.tensor(step.pending_rows)
                staging[:num_pending, 5] = torch.tensor(step.pending_sources)
            if with_adapters:  # a slot per slice; a slice with drafts has a row per token
                staging[:rows, 6] = torch.from_numpy(np.repeat(step.slice_adapters, [s.num_tokens for s in step.slices]))
                staging[rows:bucket, 6] = -1
            on_device = staging[:bucket].to(self.backend.device, non_blocking=True)
            if with_adapters:
                self.row_slots[:bucket].copy_(on_device[:, 6])
            self.input_ids[:bucket].copy_(on_device[:, 0])
            if num_pending:
                self.input_ids[on_device[:num_pending, 4]] = pending[on_device[:num_pending, 5]]
            self.positions[:bucket].copy_(on_device[:, 1])
            self.slot_blocks[:bucket].copy_(on_device[:, 2])
            self.slot_offsets[:bucket].copy_(on_device[:, 3])
            if self.tables_mode:
                width = padded.shape[1]
                staged = self.tables_staging[: bucket * width].view(bucket, width)
                staged.copy_(torch.from_numpy(padded))
                self.decode_tables[:bucket, :width].copy_(staged, non_blocking=True)
                self.decode_lens[:bucket].copy_(on_device[:, 7])
            else:
                paged = PagedTables.of(padded, lens, self.kv_cache.block_size)
                num_pages = paged.indices.numel()
                self.indices_staging[:num_pages].copy_(paged.indices)
                self.indices[:num_pages].copy_(self.indices_staging[:num_pages], non_blocking=True)
                on_device_tables = PagedTables(paged.indptr, self.indices[:num_pages], paged.last_page_len)
                for window, wrapper in graph.wrappers.items():
                    self.backend.plan_decode(wrapper, on_device_tables, window)
        graph.graph.replay()
        return graph.logits[:rows].clone()

    def _adapter_graph(self, bucket: int) -> _Graph | None:
        """The bucket's graph through the adapters' current stacks, captured now if need be;
        None where its capture failed (such steps run eagerly, computing the same: RowSlots
        either way)."""
        version = getattr(self.model, "lora_version", 0)
        if version != self.adapter_graphs_version:  # captured over stacks since replaced
            self.adapter_graphs.clear()
            self.adapter_capture_failed.clear()
            self.adapter_graphs_version = version
        if bucket in self.adapter_graphs or bucket in self.adapter_capture_failed:
            return self.adapter_graphs.get(bucket)
        try:
            return self._capture(bucket, with_adapters=True)
        except RuntimeError:
            logger.warning("capturing a CUDA graph for decode batches of %d through LoRA adapters failed; such steps run eagerly", bucket, exc_info=True)
            self.adapter_capture_failed.add(bucket)
            return None

    def _capture(self, bucket: int, with_adapters: bool = False) -> _Graph:
        started = time.perf_counter()
        scratch = self.kv_cache.scratch_block
        self.slot_blocks[:bucket].fill_(scratch)
        self.slot_offsets[:bucket].zero_()
        # Every row on the scratch block for the warm-up and capture, so they read valid pages.
        if self.tables_mode:
            wrappers = {}
            self.decode_tables[:bucket].fill_(scratch)
            self.decode_lens[:bucket].fill_(1)
            meta = self.backend.graph_metadata(self.slot_blocks[:bucket], self.slot_offsets[:bucket], self.decode_tables[:bucket], self.decode_lens[:bucket])
        else:
            wrappers = self.backend.graph_wrappers(bucket, bucket * self.max_blocks_per_seq)
            tables = PagedTables.of(np.full((bucket, 1), scratch, dtype=np.int64), np.ones(bucket, dtype=np.int64), self.kv_cache.block_size)
            for window, wrapper in wrappers.items():
                self.backend.plan_decode(wrapper, tables, window)
            meta = FlashInferMetadata(self.slot_blocks[:bucket], self.slot_offsets[:bucket], num_single=bucket, decode=wrappers)
        adapters = RowSlots(self.row_slots[:bucket]) if with_adapters else None
        if with_adapters:
            self.row_slots[:bucket].fill_(-1)  # the warm-up's rows: the base model (what replays read is copied in)

        def forward() -> torch.Tensor:
            return self.model.forward(self.input_ids[:bucket], self.positions[:bucket], self.kv_cache, meta, self.rows[:bucket],
                                      logits_out=self.logits[:bucket], adapters=adapters)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the graph: lazy initialisations, autotuning
                forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # An adapter graph is captured while serving, where other threads of the worker (KV
        # transfers) use the GPU: only this thread's calls may break its capture.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local" if with_adapters else "global"):
            logits = forward()
        self.pool = graph.pool()
        captured = _Graph(graph, wrappers, logits, meta)
        if with_adapters:
            self.adapter_graphs[bucket] = captured
            # Captured while serving (a bucket's first adapter step), not at start-up: say what it cost.
            logger.info("captured a CUDA graph for decode batches of %d through LoRA adapters in %.2f s", bucket, time.perf_counter() - started)
        else:
            self.graphs[bucket] = captured
            logger.debug("captured a CUDA graph for decode batches of %d", bucket)
        return captured

