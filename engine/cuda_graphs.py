"""Decode steps replayed from CUDA graphs.

A decode step of a small model on a GPU is launch-bound: the 135M shape issues ~15 kernels per
layer and 30 layers, each a few microseconds of work behind tens of microseconds of Python and
launch overhead. A CUDA graph records the whole forward once per batch bucket and replays it
with one launch. The graph reads its inputs from persistent buffers (token ids, positions, KV
slots) and its attention from wrappers planned over fixed buffers before each replay
(``FlashInferBackend.graph_wrappers``); a batch is padded up to its bucket with rows that
attend and write only the cache's scratch block, so no sequence's KV is touched.

Only whole-model, one-rank, decode-only steps are replayed (every row sampled); anything else
(prompt chunks, pipeline stages, tensor-parallel collectives) runs eagerly. A bucket is
captured the first time a batch of its size runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.base import lay_out
from engine.attention.flashinfer_paged import FlashInferBackend, FlashInferMetadata, PagedTables

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
    logits: torch.Tensor  # [bucket, vocab] float32, written by each replay


class DecodeGraphs:
    """Captures and replays decode steps of ``model`` for batches up to ``max_batch`` rows."""

    def __init__(self, model, kv_cache, backend: FlashInferBackend, max_batch: int, max_blocks_per_seq: int):
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
        self.staging = torch.zeros((4, max_batch), dtype=torch.long).pin_memory()  # one host-to-device copy per step
        self.graphs: dict[int, _Graph] = {}
        self.pool = None  # the graphs' shared memory pool

    def bucket(self, rows: int) -> int | None:
        return next((size for size in self.buckets if size >= rows), None)

    def run(self, step, tables: np.ndarray) -> torch.Tensor | None:
        """The logits of a decode-only step (an engine.model_runner.StepInput over the block
        ``tables``), replayed; None when the step is not one it replays."""
        input_ids, positions = step.input_ids, step.positions
        rows = len(input_ids)
        bucket = self.bucket(rows)
        if bucket is None or not all(s.decode for s in step.slices) or step.logits_indices != list(range(rows)):
            return None
        layout = lay_out(step.slices, tables, self.kv_cache.block_size)
        decode_tables = layout.decode_tables()
        if decode_tables.shape[1] > self.max_blocks_per_seq:
            return None
        graph = self.graphs.get(bucket) or self._capture(bucket)
        pad = bucket - rows
        scratch = self.kv_cache.scratch_block
        staging = self.staging
        staging[0, :rows] = torch.tensor(input_ids)
        staging[1, :rows] = torch.tensor(positions)
        staging[2, :rows] = torch.from_numpy(layout.slot_blocks)
        staging[3, :rows] = torch.from_numpy(layout.slot_offsets)
        staging[:, rows:bucket] = 0
        staging[2, rows:bucket] = scratch
        on_device = staging[:, :bucket].to(self.backend.device, non_blocking=True)
        self.input_ids[:bucket].copy_(on_device[0])
        self.positions[:bucket].copy_(on_device[1])
        self.slot_blocks[:bucket].copy_(on_device[2])
        self.slot_offsets[:bucket].copy_(on_device[3])
        # Padding rows attend the scratch block's first token (written by themselves).
        padded = np.full((bucket, decode_tables.shape[1]), scratch, dtype=np.int64)
        padded[:rows] = decode_tables
        lens = np.ones(bucket, dtype=np.int64)
        lens[:rows] = layout.decode_lens
        paged = PagedTables.of(padded, lens, self.kv_cache.block_size)
        for window, wrapper in graph.wrappers.items():
            self.backend.plan_decode(wrapper, paged, window)
        graph.graph.replay()
        return graph.logits[:rows].clone()

    def _capture(self, bucket: int) -> _Graph:
        wrappers = self.backend.graph_wrappers(bucket, bucket * self.max_blocks_per_seq)
        scratch = self.kv_cache.scratch_block
        # Plan every padding row on the scratch block so the warm-up and capture read valid pages.
        tables = PagedTables.of(np.full((bucket, 1), scratch, dtype=np.int64), np.ones(bucket, dtype=np.int64), self.kv_cache.block_size)
        for window, wrapper in wrappers.items():
            self.backend.plan_decode(wrapper, tables, window)
        self.slot_blocks[:bucket].fill_(scratch)
        self.slot_offsets[:bucket].zero_()
        meta = FlashInferMetadata(self.slot_blocks[:bucket], self.slot_offsets[:bucket], num_single=bucket, decode=wrappers)

        def forward() -> torch.Tensor:
            return self.model.forward(self.input_ids[:bucket], self.positions[:bucket], self.kv_cache, meta, self.rows[:bucket])

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the graph: lazy initialisations, autotuning
                forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = forward()
        self.pool = graph.pool()
        captured = self.graphs[bucket] = _Graph(graph, wrappers, logits)
        logger.info("captured a CUDA graph for decode batches of %d", bucket)
        return captured

