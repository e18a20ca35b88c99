"""Which rank writes which KV heads where, between workers of different tensor-parallel sizes.

Each rank of a worker holds some of the model's KV heads (``KVShard``: a contiguous range,
split across ranks, or one head replicated on several ranks where the model has fewer KV heads
than ranks). Blocks are heads-outermost (``kvtransfer.layout``), so any head range of a block
is one contiguous run of ``bytes_per_head`` per head. A transfer from a writer of TP size P to
a reader of TP size D is a set of ``Leg``s: for every reader rank, each of its heads comes from
the writer rank of the same index if that one holds it (replicas spread the writes), else the
first writer rank that does, and consecutive heads from the same writer rank form one leg (one run per block, straight from that writer rank's memory into that reader rank's).
Descriptors per block: (1,1) and (2,2) one leg per rank pair covering whole blocks, so adjacent
blocks merge into one descriptor per run; (2,1) two legs, each half a reader block; (1,2) two
legs, each half the writer's block; a piece of a block is one descriptor per block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtransfer.errors import LayoutError


@dataclass(slots=True, frozen=True)
class KVShard:
    """Rank ``rank`` of a worker of ``tp_size`` ranks holds KV heads [head_start, head_start + num_heads)."""

    tp_size: int
    rank: int
    head_start: int
    num_heads: int

    @property
    def head_end(self) -> int:
        return self.head_start + self.num_heads

    def __str__(self) -> str:
        return f"rank {self.rank}: heads [{self.head_start}, {self.head_end})"


def whole_shards(num_kv_heads: int) -> list[KVShard]:
    """A worker of one rank: it holds every head."""
    return [KVShard(1, 0, 0, num_kv_heads)]


def describe(shards: Sequence[KVShard]) -> str:
    """'TP 2 (rank 0: heads [0, 2), rank 1: heads [2, 4))': a worker's shape, for errors."""
    return f"TP {len(shards)} ({', '.join(str(s) for s in shards)})"


@dataclass(slots=True, frozen=True)
class Leg:
    """One writer rank's heads into one reader rank: a byte range of every block on each side."""

    src_rank: int
    dst_rank: int
    src_offset: int
    dst_offset: int
    num_bytes: int
    whole: bool  # the whole block on both sides (runs of adjacent blocks are one descriptor)


def check_shards(shards: Sequence[KVShard], num_kv_heads: int, who: str) -> None:
    """Raise LayoutError unless ``shards`` are ranks 0..n-1 of one worker covering every head."""
    if not shards:
        raise LayoutError(f"{who}: no ranks")
    problems = []
    if [s.rank for s in shards] != list(range(len(shards))) or any(s.tp_size != len(shards) for s in shards):
        problems.append("ranks must be 0..tp_size-1, each once")
    if any(s.num_heads < 1 or s.head_start < 0 or s.head_end > num_kv_heads for s in shards):
        problems.append(f"a head range falls outside the model's {num_kv_heads} KV heads")
    held = set().union(*(range(s.head_start, s.head_end) for s in shards))
    if held != set(range(num_kv_heads)):
        problems.append(f"heads {sorted(set(range(num_kv_heads)) - held)[:8]} are held by no rank")
    if problems:
        raise LayoutError(f"{who} {describe(shards)}: " + "; ".join(problems))


def plan_legs(writer: Sequence[KVShard], reader: Sequence[KVShard], num_kv_heads: int, bytes_per_head: int) -> list[Leg]:
    """The legs that move every KV head of a block from ``writer``'s ranks into ``reader``'s.

    Raises LayoutError naming both shapes when the pair cannot be mapped (a side whose ranks
    do not cover the model's heads).
    """
    try:
        check_shards(writer, num_kv_heads, "writer")
        check_shards(reader, num_kv_heads, "reader")
    except LayoutError as exc:
        raise LayoutError(f"cannot map writer {describe(writer)} onto reader {describe(reader)}: {exc}") from None
    legs: list[Leg] = []
    for dst in reader:
        run: list[int] | None = None  # [src rank, first head, count]
        for head in range(dst.head_start, dst.head_end):
            holders = [s for s in writer if s.head_start <= head < s.head_end]
            src = next((s for s in holders if s.rank == dst.rank), holders[0])
            if run is not None and run[0] == src.rank and run[1] + run[2] == head:
                run[2] += 1
                continue
            if run is not None:
                legs.append(_leg(writer[run[0]], dst, run[1], run[2], bytes_per_head))
            run = [src.rank, head, 1]
        legs.append(_leg(writer[run[0]], dst, run[1], run[2], bytes_per_head))
    return legs


def _leg(src: KVShard, dst: KVShard, first_head: int, num_heads: int, bytes_per_head: int) -> Leg:
    whole = num_heads == src.num_heads == dst.num_heads
    return Leg(
        src_rank=src.rank,
        dst_rank=dst.rank,
        src_offset=(first_head - src.head_start) * bytes_per_head,
        dst_offset=(first_head - dst.head_start) * bytes_per_head,
        num_bytes=num_heads * bytes_per_head,
        whole=whole,
    )


def descriptors_per_block(legs: Sequence[Leg], run_length: int = 1) -> float:
    """Descriptors one block of a run of ``run_length`` adjacent blocks costs under ``legs``."""
    return sum(1.0 / run_length if leg.whole else 1.0 for leg in legs)
