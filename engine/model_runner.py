"""Turn a scheduled batch into packed step inputs, run the model, return next-token logits.

``prepare`` (on the worker, where the scheduler is) reduces a batch to a ``StepInput``: plain
lists a tensor-parallel worker broadcasts to its other ranks, with only the changes to the
sequences' block tables (engine.attention.block_tables); ``run`` (on every rank) applies those
to its copy of the tables, packs the step into tensors and runs that rank's shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention import AttentionBackend, SeqSlice
from engine.attention.block_tables import BlockTables, TableUpdate
from engine.cuda_graphs import DecodeGraphs
from engine.host_to_device import to_device
from engine.kv_cache import KVCache
from engine.lora import AdapterRows, AdapterTable, RowSlots
from engine.model import CausalLM, StageActivations
from engine.scheduler import ScheduledBatch


@dataclass(slots=True)
class PendingSamples:
    """The tokens a step in flight samples on the device, and each sampled sequence's row in them."""

    token_ids: torch.Tensor
    row_of: dict[int, int]  # id(sequence) -> row


@dataclass(slots=True)
class StepInput:
    """One step's tokens and where they go, as every rank of a worker computes it."""

    input_ids: list[int]
    positions: list[int]
    logits_indices: list[int]  # rows that get logits: one per completing sequence, one per draft
    slices: list[SeqSlice]
    table_updates: list[TableUpdate]  # what changed in the slices' block tables since the last step
    # Overlapped steps (engine.overlap): rows of ``input_ids`` whose token the step in flight is
    # sampling on the device (a placeholder here), and each one's row in that step's samples.
    pending_rows: list[int] = field(default_factory=list)
    pending_sources: list[int] = field(default_factory=list)
    # With LoRA adapters loaded (engine.lora): each slice's adapter slot, -1 for the base model
    # (empty when none are loaded).
    slice_adapters: list[int] = field(default_factory=list)

    @property
    def uses_adapters(self) -> bool:
        return any(slot >= 0 for slot in self.slice_adapters)


class ModelRunner:
    """``attention``: the backend that builds each step's attention metadata (engine.attention);
    ``graphs``: decode steps replayed from CUDA graphs (None: every step eager); ``adapters``:
    the LoRA adapters the engine serves (engine.lora)."""

    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        device: str,
        attention: AttentionBackend,
        graphs: DecodeGraphs | None = None,
        adapters: AdapterTable | None = None,
    ):
        self.model = model
        self.adapters = AdapterTable() if adapters is None else adapters  # the engine's, which changes at runtime
        self.kv_cache = kv_cache
        self.device = device
        self.attention = attention
        self.graphs = graphs
        # Decode-only steps through adapters the graphs' way (engine.lora.RowSlots): on a GPU.
        self.decode_adapters_by_row_slot = torch.device(device).type == "cuda"
        self.block_tables = BlockTables()
        # The step in flight's sampled tokens on the device, and each sequence's row in them
        # (engine.overlap; None: no step in flight).
        self.pending: PendingSamples | None = None

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Forward the batch; logits [rows sampled this step, vocab] in slice order: one row per
        sequence completing this step, plus one per draft token."""
        return self.run(self.prepare(batch))

    def prepare(self, batch: ScheduledBatch) -> StepInput:
        """The step's inputs (on rank 0, where the scheduler is). Logits rows: the sampled rows in
        slice order, then the rows of prompts whose log-probabilities are asked for
        (``Sequence.prompt_logprob_positions``), likewise."""
        rows, updates = self.block_tables.sync([(piece.seq, piece.seq.block_table) for piece in batch.slices])
        step = StepInput([], [], [], [], updates)
        input_ids, positions, logits_indices = step.input_ids, step.positions, step.logits_indices
        prompt_rows: list[int] = []
        with_adapters = bool(self.adapters)  # once a step: each slice's adapter slot where any are held
        for piece, row in zip(batch.slices, rows):
            seq = piece.seq
            start = seq.num_computed_tokens
            if piece.num_tokens == 1 and piece.completes_sequence:  # a decode row (most of a step's slices)
                if start < len(seq.token_ids):
                    input_ids.append(seq.token_ids[start])
                else:  # its token is still being sampled by the step in flight
                    step.pending_rows.append(len(input_ids))
                    step.pending_sources.append(self.pending.row_of[id(seq)])
                    input_ids.append(0)
                positions.append(start)
                logits_indices.append(len(input_ids) - 1)
            else:
                first_row = len(input_ids)
                prompt_rows.extend(first_row + p - start for p in seq.prompt_logprob_positions(start, piece.num_own_tokens))
                input_ids.extend(seq.token_ids[start : start + piece.num_own_tokens])
                input_ids.extend(piece.draft_token_ids)
                positions.extend(range(start, start + piece.num_tokens))
                logits_indices.extend(range(len(input_ids) - piece.num_sampled_rows, len(input_ids)))
            step.slices.append(SeqSlice(row, start, piece.num_tokens, decode=piece.is_decode))
            if with_adapters:
                step.slice_adapters.append(seq.adapter_slot)
        logits_indices.extend(prompt_rows)
        return step

    def run(self, step: StepInput) -> torch.Tensor | None:
        """This rank's part of the step; the logits on rank 0 (None on the others)."""
        self.block_tables.apply(step.table_updates)
        if self.graphs is not None:
            logits = self.graphs.run(step, self.block_tables.array, self.pending.token_ids if self.pending is not None else None)
            if logits is not None:
                return logits
        return self._forward(step, range(self.model.config.num_layers), None)

    def run_stage(self, step: StepInput, layers: range, incoming: StageActivations | None = None) -> torch.Tensor | StageActivations | None:
        """Layers ``layers`` of the step (a pipeline stage, ``CausalLM.run_stage``)."""
        self.block_tables.apply(step.table_updates)
        return self._forward(step, layers, incoming)

    def fill_pending_inputs(self, step: StepInput, input_ids: torch.Tensor) -> None:
        """Fill in the rows whose tokens the step in flight sampled, from its samples on the device."""
        if step.pending_rows:
            rows = to_device(step.pending_rows, torch.long, input_ids.device)
            sources = to_device(step.pending_sources, torch.long, input_ids.device)
            input_ids[rows] = self.pending.token_ids[sources]

    def _adapter_rows(self, step: StepInput) -> AdapterRows | RowSlots | None:
        """How the step's rows go through their adapters (None: no row does): on a GPU a
        decode-only step takes the CUDA graphs' way (``RowSlots``), so a step replayed and one
        run eagerly compute alike; elsewhere each adapter's rows grouped (``AdapterRows``)."""
        if not step.uses_adapters:
            return None
        if self.decode_adapters_by_row_slot and all(piece.num_tokens == 1 for piece in step.slices):
            return RowSlots(to_device(step.slice_adapters, torch.long, self.device))
        return AdapterRows.of_slices(step.slice_adapters, [piece.num_tokens for piece in step.slices], self.device)

    def _forward(self, step: StepInput, layers: range, incoming: StageActivations | None) -> torch.Tensor | StageActivations | None:
        meta = self.attention.build(step.slices, self.block_tables.array)
        input_ids = to_device(step.input_ids, torch.long, self.device)
        self.fill_pending_inputs(step, input_ids)
        adapters = self._adapter_rows(step)
        return self.model.run_stage(
            input_ids,
            to_device(step.positions, torch.long, self.device),
            self.kv_cache,
            meta,
            to_device(step.logits_indices, torch.long, self.device),
            layers,
            incoming,
            adapters=adapters,
        )
