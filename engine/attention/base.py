"""What every attention backend shares: a step's sequences as slices, the metadata a backend
builds from them once per step, and that metadata's ``forward`` which every layer calls.

A step packs its tokens without padding, decode rows first (a decoding sequence has one row per
token it computes: several when it speculates), then prompt chunks of any size. Each layer hands
``forward`` its q, k and v; the new keys and values go into the paged cache before attention
reads it, so a chunk sees itself and everything cached before it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from engine.attention.kv_write import write_kv


@dataclass(slots=True)
class SeqSlice:
    """A sequence's part of a step, as the model runner describes it."""

    block_table: list[int]
    context_len: int
    num_tokens: int
    decode: bool = False  # generated tokens (decode attention, a row each); else a prompt chunk, of any size


@dataclass(slots=True)
class PackedSlices:
    """A step's slices as plain lists, the part of the metadata every backend needs."""

    slot_blocks: list[int]  # per token: the block its KV goes into
    slot_offsets: list[int]  # and the offset inside that block
    single_tables: list[list[int]]  # per decode row: the blocks it attends
    single_lens: list[int]  # per decode row: the tokens it attends, its own included
    chunks: list[tuple[int, SeqSlice]]  # (first row, slice) of each multi-token chunk, in step order


def pack_slices(slices: list[SeqSlice], block_size: int) -> PackedSlices:
    """Slot mapping, decode rows and chunks of a step (decode slices must come first)."""
    packed = PackedSlices([], [], [], [], [])
    row = 0
    for seq in slices:
        total = seq.context_len + seq.num_tokens
        for pos in range(seq.context_len, total):
            packed.slot_blocks.append(seq.block_table[pos // block_size])
            packed.slot_offsets.append(pos % block_size)
        if seq.decode:
            assert not packed.chunks, "decode slices come before every chunk"
            # One decode row per token (more than one: speculative drafts), each attending up to
            # itself: the same computation as decoding those tokens one step at a time.
            for length in range(seq.context_len + 1, total + 1):
                packed.single_tables.append(seq.block_table[: -(-length // block_size)])
                packed.single_lens.append(length)
        else:
            packed.chunks.append((row, seq))
        row += seq.num_tokens
    return packed


@dataclass(slots=True)
class AttentionMetadata(abc.ABC):
    """One step's attention, built once per step by a backend; ``forward`` runs it for a layer.

    Subclasses hold what their kernels read and implement ``attend``."""

    slot_blocks: torch.Tensor  # [num_tokens] block id of each new token's KV
    slot_offsets: torch.Tensor  # [num_tokens] offset inside that block
    num_single: int  # tokens [0, num_single) are decode rows

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        window: int | None = None,
        key_scales: torch.Tensor | None = None,
        value_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write k/v into the cache, then attend. q [T, H, D], k/v [T, KVH, D] -> [T, H, D].

        ``key_cache``/``value_cache``: the layer's views [num_blocks, block_size, KVH, D];
        ``window``: this layer's sliding window (each query attends its latest ``window`` keys);
        ``key_scales``/``value_scales`` [num_blocks, KVH]: a quantized cache's (engine.kv_cache)."""
        write_kv(k, v, key_cache, value_cache, self.slot_blocks, self.slot_offsets, key_scales, value_scales)
        return self.attend(q, k, v, key_cache, value_cache, window, key_scales, value_scales)

    @abc.abstractmethod
    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        window: int | None,
        key_scales: torch.Tensor | None,
        value_scales: torch.Tensor | None,
    ) -> torch.Tensor:
        """This layer's attention of q [T, H, D] over the cache (its new keys and values already written)."""


class AttentionBackend(abc.ABC):
    """Builds each step's ``AttentionMetadata`` for one model's cache (chosen by
    ``engine.attention.registry``)."""

    name = "base"
    supports_cuda_graphs = False  # a decode step's metadata can be replayed from fixed buffers

    def __init__(self, device: str, block_size: int):
        self.device = device
        self.block_size = block_size

    @abc.abstractmethod
    def build(self, slices: list[SeqSlice]) -> AttentionMetadata:
        """The step's metadata for ``slices`` (decode slices first)."""

    def slot_tensors(self, packed: PackedSlices) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            torch.tensor(packed.slot_blocks, dtype=torch.long, device=self.device),
            torch.tensor(packed.slot_offsets, dtype=torch.long, device=self.device),
        )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    window: int | None = None,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """``meta.forward``: the call every decoder layer makes."""
    return meta.forward(q, k, v, key_cache, value_cache, window, key_scales, value_scales)
