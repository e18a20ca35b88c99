"""Turn a scheduled batch into packed step inputs, run the model, return next-token logits.

``prepare`` (on the worker, where the scheduler is) reduces a batch to a ``StepInput``: plain
lists a tensor-parallel worker broadcasts to its other ranks, with only the changes to the
sequences' block tables (engine.attention.block_tables); ``run`` (on every rank) applies those
to its copy of the tables, packs the step into tensors and runs that rank's shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionBackend, SeqSlice
from engine.attention.block_tables import BlockTables, TableUpdate
from engine.cuda_graphs import DecodeGraphs
from engine.kv_cache import KVCache
from engine.model import CausalLM, StageActivations
from engine.scheduler import ScheduledBatch


@dataclass(slots=True)
class StepInput:
    """One step's tokens and where they go, as every rank of a worker computes it."""

    input_ids: list[int]
    positions: list[int]
    logits_indices: list[int]  # rows that get logits: one per completing sequence, one per draft
    slices: list[SeqSlice]
    table_updates: list[TableUpdate]  # what changed in the slices' block tables since the last step


class ModelRunner:
    """``attention``: the backend that builds each step's attention metadata (engine.attention);
    ``graphs``: decode steps replayed from CUDA graphs (None: every step eager)."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, device: str, attention: AttentionBackend, graphs: DecodeGraphs | None = None):
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.attention = attention
        self.graphs = graphs
        self.block_tables = BlockTables()

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Forward the batch; logits [rows sampled this step, vocab] in slice order: one row per
        sequence completing this step, plus one per draft token."""
        return self.run(self.prepare(batch))

    def prepare(self, batch: ScheduledBatch) -> StepInput:
        """The step's inputs (on rank 0, where the scheduler is)."""
        rows, updates = self.block_tables.sync([(piece.seq, piece.seq.block_table) for piece in batch.slices])
        step = StepInput([], [], [], [], updates)
        input_ids, positions, logits_indices = step.input_ids, step.positions, step.logits_indices
        for piece, row in zip(batch.slices, rows):
            seq = piece.seq
            start = seq.num_computed_tokens
            if piece.num_tokens == 1 and piece.completes_sequence:  # a decode row (most of a step's slices)
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                logits_indices.append(len(input_ids) - 1)
            else:
                input_ids.extend(seq.token_ids[start : start + piece.num_own_tokens])
                input_ids.extend(piece.draft_token_ids)
                positions.extend(range(start, start + piece.num_tokens))
                logits_indices.extend(range(len(input_ids) - piece.num_sampled_rows, len(input_ids)))
            step.slices.append(SeqSlice(row, start, piece.num_tokens, decode=piece.is_decode))
        return step

    def run(self, step: StepInput) -> torch.Tensor | None:
        """This rank's part of the step; the logits on rank 0 (None on the others)."""
        self.block_tables.apply(step.table_updates)
        if self.graphs is not None:
            logits = self.graphs.run(step, self.block_tables.array)
            if logits is not None:
                return logits
        return self._forward(step, range(self.model.config.num_layers), None)

    def run_stage(self, step: StepInput, layers: range, incoming: StageActivations | None = None) -> torch.Tensor | StageActivations | None:
        """Layers ``layers`` of the step (a pipeline stage, ``CausalLM.run_stage``)."""
        self.block_tables.apply(step.table_updates)
        return self._forward(step, layers, incoming)

    def _forward(self, step: StepInput, layers: range, incoming: StageActivations | None) -> torch.Tensor | StageActivations | None:
        meta = self.attention.build(step.slices, self.block_tables.array)
        return self.model.run_stage(
            torch.tensor(step.input_ids, dtype=torch.long, device=self.device),
            torch.tensor(step.positions, dtype=torch.long, device=self.device),
            self.kv_cache,
            meta,
            torch.tensor(step.logits_indices, dtype=torch.long, device=self.device),
            layers,
            incoming,
        )
