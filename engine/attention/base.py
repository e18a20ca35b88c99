"""What every attention backend shares: a step's sequences as slices, the metadata a backend
builds from them once per step, and that metadata's ``forward`` which every layer calls.

A step packs its tokens without padding, decode rows first (a decoding sequence has one row per
token it computes: several when it speculates), then prompt chunks of any size. Each layer hands
``forward`` its q, k and v; the new keys and values go into the paged cache before attention
reads it, so a chunk sees itself and everything cached before it.
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from engine import fused_ops
from engine.attention.kv_write import rotate_and_write_kv, write_kv
from engine.host_to_device import to_device
from engine.rope import RopeTables, RotaryEmbedding


@dataclass(slots=True)
class SeqSlice:
    """A sequence's part of a step, as the model runner describes it."""

    row: int  # the sequence's row in the step's block tables (engine.attention.block_tables)
    context_len: int
    num_tokens: int
    decode: bool = False  # generated tokens (decode attention, a row each); else a prompt chunk, of any size


@dataclass(slots=True)
class StepLayout:
    """A step's slices as arrays: what every backend builds its metadata from.

    Built with a handful of numpy operations whatever the step's tokens and contexts: the
    Python work is one pass over the slices."""

    tables: np.ndarray  # [rows, width] int64 block ids (engine.attention.block_tables.BlockTables.array)
    slot_blocks: np.ndarray  # [num_tokens] int64: the block each new token's KV goes into
    slot_offsets: np.ndarray  # [num_tokens] int64: and the offset inside it
    decode_rows: np.ndarray  # [num_single] int64: each decode row's table row
    decode_lens: np.ndarray  # [num_single] int64: tokens it attends, its own included
    chunk_first_rows: np.ndarray  # [chunks] int64: each multi-token chunk's first row in the step
    chunk_rows: np.ndarray  # [chunks] int64: its table row
    chunk_context_lens: np.ndarray  # [chunks] int64: tokens of its sequence cached before it
    chunk_num_tokens: np.ndarray  # [chunks] int64
    block_size: int

    @property
    def num_single(self) -> int:
        return len(self.decode_rows)

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_rows)

    def decode_tables(self) -> np.ndarray:
        """[num_single, widest] the decode rows' block tables (past a row's length: stale ids)."""
        return _table_prefixes(self.tables, self.decode_rows, self.decode_lens, self.block_size)

    def chunk_tables(self) -> np.ndarray:
        """[chunks, widest] the blocks covering each chunk's context and itself."""
        return _table_prefixes(self.tables, self.chunk_rows, self.chunk_context_lens + self.chunk_num_tokens, self.block_size)


def _table_prefixes(tables: np.ndarray, rows: np.ndarray, lens: np.ndarray, block_size: int) -> np.ndarray:
    width = int(-(-lens.max() // block_size)) if len(lens) else 0
    return tables[rows, :width]


def lay_out(slices: list[SeqSlice], tables: np.ndarray, block_size: int) -> StepLayout:
    """A step's layout from its slices (decode slices first) over ``tables``."""
    columns = np.array([(s.row, s.context_len, s.num_tokens, s.decode) for s in slices], dtype=np.int64).reshape(-1, 4)
    rows, context_lens, num_tokens, decode = np.ascontiguousarray(columns.T)
    num_decode = int(decode.sum())
    assert decode[:num_decode].all(), "decode slices come before every chunk"
    # Per token: its sequence's row and its position.
    first_rows = np.cumsum(num_tokens) - num_tokens
    token_rows = np.repeat(rows, num_tokens)
    positions = np.arange(int(num_tokens.sum()), dtype=np.int64) + np.repeat(context_lens - first_rows, num_tokens)
    # One decode row per token of a decode slice (more than one: speculative drafts), each
    # attending up to itself: the same computation as decoding those tokens one step at a time.
    num_single = int(num_tokens[:num_decode].sum())
    return StepLayout(
        tables=tables,
        slot_blocks=tables[token_rows, positions // block_size],
        slot_offsets=positions % block_size,
        decode_rows=token_rows[:num_single],
        decode_lens=positions[:num_single] + 1,
        chunk_first_rows=first_rows[num_decode:],
        chunk_rows=rows[num_decode:],
        chunk_context_lens=context_lens[num_decode:],
        chunk_num_tokens=num_tokens[num_decode:],
        block_size=block_size,
    )


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
        rope: RopeTables | None = None,
    ) -> torch.Tensor:
        """Write k/v into the cache, then attend. q [T, H, D], k/v [T, KVH, D] -> [T, H, D].

        ``key_cache``/``value_cache``: the layer's views [num_blocks, block_size, KVH, D];
        ``window``: this layer's sliding window (each query attends its latest ``window`` keys);
        ``key_scales``/``value_scales`` [num_blocks, KVH]: a quantized cache's (engine.kv_cache);
        ``rope``: the step's rotation, applied to q and k first (None: they come rotated)."""
        # A plain cache on CUDA is written and q/k rotated in one launch; elsewhere FlashInfer's
        # rotation or the torch formula, then the write.
        fused = rope is not None and key_scales is None and rotate_and_write_kv(q, k, v, key_cache, value_cache, self.slot_blocks, self.slot_offsets, rope)
        if not fused:
            if rope is not None and not fused_ops.rotate_qk_(q, k, rope):
                q, k = RotaryEmbedding.rotate(q, k, rope.cos, rope.sin)
            self.write(k, v, key_cache, value_cache, key_scales, value_scales)
        return self.attend(q, k, v, key_cache, value_cache, window, key_scales, value_scales)

    def write(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        key_scales: torch.Tensor | None,
        value_scales: torch.Tensor | None,
    ) -> None:
        """The step's new keys and values into the layer's cache (engine.attention.kv_write)."""
        write_kv(k, v, key_cache, value_cache, self.slot_blocks, self.slot_offsets, key_scales, value_scales)

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
        self._plans_copied: torch.cuda.Event | None = None

    @contextlib.contextmanager
    def planning(self):
        """Around a step's plans: what a step stages in page-locked host buffers (FlashInfer's
        plan, a CUDA graph's inputs and block tables) is copied to the device asynchronously; a
        step staged while the step before's copy still waits in the stream (overlapped steps,
        engine.overlap) would overwrite what that copy reads. So a step first waits for the last
        one's copies (by then the stream has reached them: what it waits for is the step before
        that, already read), and marks its own."""
        if self._plans_copied is not None:
            self._plans_copied.synchronize()
        yield
        if torch.device(self.device).type == "cuda":
            self._plans_copied = torch.cuda.Event()
            self._plans_copied.record()

    def build(self, slices: list[SeqSlice], tables: np.ndarray) -> AttentionMetadata:
        """The step's metadata for ``slices`` (decode slices first) over the block ``tables``
        (engine.attention.block_tables)."""
        return self.build_layout(lay_out(slices, tables, self.block_size))

    @abc.abstractmethod
    def build_layout(self, layout: StepLayout) -> AttentionMetadata:
        """The step's metadata from its layout."""

    def slot_tensors(self, layout: StepLayout) -> tuple[torch.Tensor, torch.Tensor]:
        return self.to_device(layout.slot_blocks), self.to_device(layout.slot_offsets)

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        """A host array as a tensor on this backend's device (no copy on a CPU; on CUDA one that
        does not wait for the stream: engine.host_to_device)."""
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        return tensor if torch.device(self.device).type == "cpu" else to_device(tensor, tensor.dtype, self.device)


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
    rope: RopeTables | None = None,
) -> torch.Tensor:
    """``meta.forward``: the call every decoder layer makes."""
    return meta.forward(q, k, v, key_cache, value_cache, window, key_scales, value_scales, rope)
