"""The portable attention backend: SDPA over blocks gathered out of the paged cache.

It runs anywhere torch does (any device, any dtype, a quantized cache): the fallback where the
CPU kernels or FlashInfer do not apply, and the reference the tests hold them to. Decode rows
are attended together in batched calls over their block tables; each multi-token chunk is
attended against the blocks already cached for its sequence plus its own tokens, causally.

Reading the paged cache for SDPA means gathering each layer's blocks into a contiguous buffer for
SDPA. On a CPU that copy, not the attention, dominated a decode step (57% of a batch-32
step at context 600, from fresh 15 MB allocations per layer and the element-wise index
kernel). So the gather goes into buffers allocated once per step and reused by every
layer (``index_select`` of whole block rows, a memcpy each), and decode sequences are
gathered a few at a time so what SDPA reads back is still in the CPU's cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionMetadata, StepLayout


@dataclass(slots=True)
class ChunkSpan:
    """One multi-token chunk of a sequence in the packed batch."""

    token_start: int
    token_end: int
    context_len: int  # tokens of this sequence already in the cache before the chunk
    block_ids: torch.Tensor  # blocks covering context + chunk
    mask: torch.Tensor | None  # [chunk, context + chunk] bool, None when causal from zero
    sliding_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> additive mask, made at its first layer


@dataclass(slots=True)
class SdpaMetadata(AttentionMetadata):
    """A step for SDPA: decode rows' padded tables and mask, and each chunk on its own."""

    single_block_tables: torch.Tensor | None = None  # [num_single, max_blocks]
    single_lens: torch.Tensor | None = None  # [num_single] tokens each attends, its new one included
    single_mask: torch.Tensor | None = None  # [num_single, 1, 1, max_blocks * block_size], from the lengths at the first layer
    chunks: list[ChunkSpan] = field(default_factory=list)
    single_groups: list["GatherGroup"] | None = None  # derived at the first layer of a step
    gather_keys: torch.Tensor | None = None  # reused per layer: [rows, block_size, kv_heads, head_dim]
    gather_values: torch.Tensor | None = None

    def attend(self, q, k, v, key_cache, value_cache, window, key_scales, value_scales) -> torch.Tensor:
        out = torch.empty_like(q)
        if self.num_single:
            self.attend_single(q, key_cache, value_cache, out, window, key_scales, value_scales)
        self.attend_chunks(q, k, v, key_cache, value_cache, out, window, key_scales, value_scales)
        return out

    def attend_single(self, q, key_cache, value_cache, out, window, key_scales, value_scales) -> None:
        """The decode rows' attention into ``out[:num_single]``."""
        _attend_single(q, key_cache, value_cache, self, out, window, key_scales, value_scales)

    def attend_chunks(self, q, k, v, key_cache, value_cache, out, window, key_scales, value_scales) -> None:
        """Each prompt chunk's attention into its rows of ``out``."""
        group = q.shape[1] // key_cache.shape[2]
        for chunk in self.chunks:
            queries = q[chunk.token_start : chunk.token_end].transpose(0, 1)
            if chunk.mask is not None:
                chunk.mask = additive_mask(chunk.mask, q.dtype)
            mask = chunk.mask
            num_tokens = chunk.token_end - chunk.token_start
            if window is not None and window < chunk.context_len + num_tokens:
                if window not in chunk.sliding_masks:
                    chunk.sliding_masks[window] = _sliding_mask(chunk.context_len, num_tokens, window, q.dtype, q.device)
                mask = chunk.sliding_masks[window]
            if chunk.mask is None and key_scales is None:
                keys = k[chunk.token_start : chunk.token_end].transpose(0, 1)
                values = v[chunk.token_start : chunk.token_end].transpose(0, 1)
            else:
                # With context, or from a quantized cache (attention reads what the cache holds).
                total = chunk.context_len + num_tokens
                keys, values = _gather(key_cache, value_cache, chunk.block_ids, self, key_scales, value_scales, q.dtype)
                keys = keys.flatten(0, 1)[:total].transpose(0, 1)
                values = values.flatten(0, 1)[:total].transpose(0, 1)
            # 4-D inputs (a batch of one): with 3-D ones the CPU kernel falls back to the plain
            # math path, measured 20x slower for a 256-token chunk over a 2048-token context.
            attended = F.scaled_dot_product_attention(
                queries.unsqueeze(0),
                keys.unsqueeze(0),
                values.unsqueeze(0),
                attn_mask=mask,
                is_causal=mask is None,
                enable_gqa=group > 1,
            )
            out[chunk.token_start : chunk.token_end] = attended[0].transpose(0, 1)


class SdpaBackend(AttentionBackend):
    """Gather + SDPA: any device, any dtype, plain or quantized caches."""

    name = "sdpa"
    metadata_class = SdpaMetadata

    def build_layout(self, layout: StepLayout) -> SdpaMetadata:
        device, block_size = self.device, self.block_size
        meta = self.metadata_class(*self.slot_tensors(layout), num_single=layout.num_single)
        if layout.num_chunks:
            chunk_tables = layout.chunk_tables()
            for first_row, context_len, num_tokens, table in zip(
                layout.chunk_first_rows.tolist(), layout.chunk_context_lens.tolist(), layout.chunk_num_tokens.tolist(), chunk_tables
            ):
                total = context_len + num_tokens
                mask = None
                if context_len > 0:
                    query_pos = torch.arange(context_len, total, device=device).unsqueeze(1)
                    key_pos = torch.arange(total, device=device).unsqueeze(0)
                    mask = key_pos <= query_pos
                meta.chunks.append(
                    ChunkSpan(
                        token_start=first_row,
                        token_end=first_row + num_tokens,
                        context_len=context_len,
                        block_ids=self.to_device(table[: -(-total // block_size)]),
                        mask=mask,
                    )
                )
        if layout.num_single:
            meta.single_block_tables = self.to_device(layout.decode_tables())
            meta.single_lens = self.to_device(layout.decode_lens)
        return meta

def _gather(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_ids: torch.Tensor,
    meta: SdpaMetadata,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy ``block_ids``' keys and values into the step's reusable buffers: [n, block_size, KVH, D]
    each; from a quantized cache, dequantized to ``dtype``."""
    num = block_ids.numel()
    block_shape = key_cache.shape[1:]
    if meta.gather_keys is None or meta.gather_keys.shape[0] < num or meta.gather_keys.shape[1:] != block_shape:
        meta.gather_keys = key_cache.new_empty((num, *block_shape))
        meta.gather_values = value_cache.new_empty((num, *block_shape))
    # The views are strided (heads outermost in a block): the copies come out dense.
    keys = torch.index_select(key_cache, 0, block_ids, out=meta.gather_keys[:num])
    values = torch.index_select(value_cache, 0, block_ids, out=meta.gather_values[:num])
    if key_scales is not None:
        # [n, KVH] scales over each block's tokens and head dimension.
        keys = (keys.to(torch.float32) * key_scales.index_select(0, block_ids)[:, None, :, None]).to(dtype)
        values = (values.to(torch.float32) * value_scales.index_select(0, block_ids)[:, None, :, None]).to(dtype)
    return keys, values


def _sliding_mask(context_len: int, num_tokens: int, window: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive [chunk, context + chunk] mask: each query sees itself and the window - 1 keys before it."""
    query_pos = torch.arange(context_len, context_len + num_tokens, device=device).unsqueeze(1)
    key_pos = torch.arange(context_len + num_tokens, device=device).unsqueeze(0)
    return additive_mask((key_pos <= query_pos) & (key_pos > query_pos - window), dtype)


def _attend_single(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: SdpaMetadata,
    out: torch.Tensor,
    window: int | None = None,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
) -> None:
    """Attention of the step's single-token entries, a group of sequences at a time."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = key_cache.shape[2]
    block_size = key_cache.shape[1]
    group = num_heads // num_kv_heads
    if meta.single_groups is None:
        # Once per step, at the first layer: the grouping, with each group's mask made additive
        # (SDPA would convert a boolean mask again in every layer).
        if meta.single_mask is None:
            key_pos = torch.arange(meta.single_block_tables.shape[1] * block_size, device=q.device)
            meta.single_mask = (key_pos.unsqueeze(0) < meta.single_lens.unsqueeze(1)).view(meta.num_single, 1, 1, -1)
        meta.single_groups = single_groups(meta.single_block_tables, meta.single_mask, key_cache[0].nbytes * 2, q.device.type)
        for gathered in meta.single_groups:
            width = gathered.num_blocks * block_size
            gathered.mask = additive_mask(meta.single_mask.index_select(0, gathered.rows)[..., :width], q.dtype)
    for gathered in meta.single_groups:
        rows, width = gathered.rows, gathered.num_blocks
        n = rows.numel()
        keys, values = _gather(key_cache, value_cache, gathered.block_ids, meta, key_scales, value_scales, q.dtype)
        # [n * blocks, block_size, KVH, D] -> [n, KVH, blocks * block_size, D]
        keys = keys.view(n, width * block_size, num_kv_heads, head_dim).transpose(1, 2)
        values = values.view(n, width * block_size, num_kv_heads, head_dim).transpose(1, 2)
        # The query heads sharing a KV head ride as that head's query rows: GQA without repeat.
        queries = q.index_select(0, rows).view(n, num_kv_heads, group, head_dim)
        mask = gathered.mask
        if window is not None:
            if window not in gathered.sliding_masks:
                key_pos = torch.arange(width * block_size, device=q.device)
                before = key_pos.unsqueeze(0) < (meta.single_lens.index_select(0, rows) - window).unsqueeze(1)
                gathered.sliding_masks[window] = mask.masked_fill(before.view(n, 1, 1, -1), float("-inf"))
            mask = gathered.sliding_masks[window]
        attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask)
        out.index_copy_(0, rows, attended.reshape(n, num_heads, head_dim))


# What one group's gathered keys and values may occupy: small enough to stay in a CPU's
# last-level cache between the copy and SDPA's read (measured best at 4-8 MB on a 32 MB L3).
GROUP_GATHER_BYTES = 8 * 1024 * 1024


@dataclass(slots=True)
class GatherGroup:
    """Single-token entries ``rows`` gathered together, over their first ``num_blocks`` blocks."""

    rows: torch.Tensor  # indices among the step's single-token entries
    num_blocks: int
    block_ids: torch.Tensor  # [len(rows) * num_blocks]
    mask: torch.Tensor | None = None  # [len(rows), 1, 1, num_blocks * block_size], additive
    sliding_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> mask, made at its first layer


def single_groups(tables: torch.Tensor, mask: torch.Tensor, block_kv_bytes: int, device_type: str) -> list[GatherGroup]:
    """Split the single-token entries into gather groups of similar length, each as wide as its longest.

    On a CPU the entries are taken shortest first, and a group holds as many as fit
    ``GROUP_GATHER_BYTES``: sequences of like length share a group, so little padding is
    copied or attended (on the 135M shape, batch 32 of 64-1024 tokens, batch order cost 292
    ms a step against 208 for equal lengths). A GPU takes one group.
    """
    num, width = tables.shape
    if device_type != "cpu":
        return [GatherGroup(torch.arange(num, device=tables.device), width, tables.flatten())]
    block_size = mask.shape[-1] // width
    lengths = mask.reshape(num, -1).sum(dim=1).tolist() if mask.dtype == torch.bool else [width * block_size] * num
    blocks = [-(-int(length) // block_size) for length in lengths]
    order = sorted(range(num), key=blocks.__getitem__)
    groups: list[GatherGroup] = []
    start = 0
    while start < num:
        end = start + 1
        # Shortest first: the last entry taken is the group's widest.
        while end < num and (end - start + 1) * blocks[order[end]] * block_kv_bytes <= GROUP_GATHER_BYTES:
            end += 1
        rows = order[start:end]
        group_width = blocks[rows[-1]]
        index = torch.tensor(rows, dtype=torch.long, device=tables.device)
        groups.append(GatherGroup(index, group_width, tables.index_select(0, index)[:, :group_width].flatten()))
        start = end
    return groups


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask (True: attend) as 0 / -inf to add to the scores; others as they are."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
