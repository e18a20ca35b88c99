"""Turn a scheduled batch into packed tensors, run the model, return next-token logits."""

from __future__ import annotations

import torch

from engine.attention import SeqSlice, build_metadata
from engine.kv_cache import KVCache
from engine.model import CausalLM
from engine.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache, device: str = "cpu", native_attention: bool = False):
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.native_attention = native_attention  # attention through engine.cpu_attention

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Forward the batch; logits [rows sampled this step, vocab] in slice order: one row per
        sequence completing this step, plus one per draft token."""
        input_ids: list[int] = []
        positions: list[int] = []
        logits_indices: list[int] = []
        slices: list[SeqSlice] = []
        for piece in batch.slices:
            seq = piece.seq
            start = seq.num_computed_tokens
            end = start + piece.num_tokens
            input_ids.extend(seq.token_ids[start : start + piece.num_own_tokens])
            input_ids.extend(piece.draft_token_ids)
            positions.extend(range(start, end))
            logits_indices.extend(range(len(input_ids) - piece.num_sampled_rows, len(input_ids)))
            slices.append(SeqSlice(seq.block_table, start, piece.num_tokens, decode=piece.is_decode))
        meta = build_metadata(slices, self.kv_cache.block_size, self.device, self.native_attention)
        return self.model(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            self.kv_cache,
            meta,
            torch.tensor(logits_indices, dtype=torch.long, device=self.device),
        )
