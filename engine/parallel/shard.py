"""Which part of a model one tensor-parallel rank holds.

Tensor parallelism as vLLM and nano-vllm do it: q/k/v and gate/up are split by output rows
(column-parallel: each rank computes its own heads and its own slice of the MLP), o_proj and
down_proj by input columns (row-parallel: each rank's partial product is summed by an
all-reduce), the embedding and LM head by vocabulary rows (each rank looks up or scores its
slice; logits are gathered where the sampler runs). KV heads split across ranks, or, where a
model has fewer KV heads than ranks, each KV head is replicated on ``tp // num_kv_heads``
consecutive ranks. A vocabulary that does not divide is padded to a multiple of the size.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import ModelConfig


def check_tensor_parallel(config: ModelConfig, tp_size: int) -> None:
    """Raise ValueError naming both numbers when ``config`` cannot be split ``tp_size`` ways."""
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size: must be >= 1, got {tp_size}")
    if config.num_heads % tp_size:
        raise ValueError(
            f"tensor_parallel_size {tp_size} does not divide the model's {config.num_heads} attention heads "
            f"(num_attention_heads): each rank must hold whole heads"
        )
    kv = config.num_kv_heads
    if (kv >= tp_size and kv % tp_size) or (kv < tp_size and tp_size % kv):
        raise ValueError(
            f"tensor_parallel_size {tp_size} and the model's {kv} KV heads (num_key_value_heads): one must divide "
            "the other (KV heads are split across ranks, or replicated where there are fewer of them)"
        )
    if config.intermediate_size % tp_size:
        raise ValueError(
            f"tensor_parallel_size {tp_size} does not divide the model's MLP width {config.intermediate_size} (intermediate_size)"
        )


@dataclass(slots=True, frozen=True)
class TPShard:
    """Rank ``rank`` of ``tp_size``: its heads, KV heads, MLP columns and vocabulary rows."""

    tp_size: int
    rank: int
    num_heads: int  # this rank's query heads
    head_start: int
    num_kv_heads: int  # this rank's KV heads (replicas included)
    kv_head_start: int
    intermediate_size: int
    intermediate_start: int
    vocab_size: int  # rows per rank, padded: tp_size * vocab_size >= the model's vocabulary
    vocab_start: int

    @classmethod
    def of(cls, config: ModelConfig, tp_size: int = 1, rank: int = 0) -> "TPShard":
        check_tensor_parallel(config, tp_size)
        if not 0 <= rank < tp_size:
            raise ValueError(f"rank: must be in [0, {tp_size}), got {rank}")
        heads = config.num_heads // tp_size
        kv_heads, kv_start = kv_head_range(config.num_kv_heads, tp_size, rank)
        inter = config.intermediate_size // tp_size
        vocab = -(-config.vocab_size // tp_size)
        return cls(tp_size, rank, heads, rank * heads, kv_heads, kv_start, inter, rank * inter, vocab, rank * vocab)

    @property
    def is_whole(self) -> bool:
        return self.tp_size == 1


def kv_head_range(num_kv_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """(how many, first) of the KV heads rank ``rank`` of ``tp_size`` holds."""
    if num_kv_heads >= tp_size:
        per_rank = num_kv_heads // tp_size
        return per_rank, rank * per_rank
    replicas = tp_size // num_kv_heads
    return 1, rank // replicas
