"""Turning block id lists into as few transfer descriptors as possible.

NIXL costs a few microseconds per descriptor, and a block-major cache makes adjacent
blocks adjacent in memory, so a push of blocks (3, 4, 5) into (10, 11, 12) is one
descriptor, not three. ``merge_runs`` finds the fewest such runs; the backends turn runs
into byte descriptors (or, for prepared lists, into per-block indices that NIXL merges
back the same way). Everything is vectorized: a push of thousands of small blocks must
cost far less than moving them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtransfer.errors import InvalidBlocksError
from kvtransfer.layout import KVRegion

_SMALL = 64  # up to this many blocks (or runs), plain Python is faster than numpy


@dataclass(slots=True, frozen=True)
class BlockRun:
    """``num_blocks`` consecutive blocks from ``src_start`` on into ``dst_start`` on."""

    src_start: int
    dst_start: int
    num_blocks: int


@dataclass(slots=True, frozen=True)
class BlockRuns:
    """Runs as three parallel int64 arrays (source start, destination start, length)."""

    src: np.ndarray
    dst: np.ndarray
    count: np.ndarray

    def __len__(self) -> int:
        return len(self.count)

    @property
    def num_blocks(self) -> int:
        return int(self.count.sum())

    def as_list(self) -> list[BlockRun]:
        return [BlockRun(int(s), int(d), int(n)) for s, d, n in zip(self.src, self.dst, self.count)]

    def dst_spans(self) -> list[tuple[int, int]]:
        """(first destination block, count) per run: what a notification says landed."""
        return list(zip(self.dst.tolist(), self.count.tolist()))

    def expand(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-block (src, dst) int32 index arrays in run order, for prepared descriptor lists."""
        if len(self) <= _SMALL:
            src_list: list[int] = []
            dst_list: list[int] = []
            for s, d, n in zip(self.src.tolist(), self.dst.tolist(), self.count.tolist()):
                src_list.extend(range(s, s + n))
                dst_list.extend(range(d, d + n))
            return np.array(src_list, dtype=np.int32), np.array(dst_list, dtype=np.int32)
        offsets = np.arange(self.num_blocks, dtype=np.int64) - np.repeat(np.cumsum(self.count) - self.count, self.count)
        src = np.repeat(self.src, self.count) + offsets
        dst = np.repeat(self.dst, self.count) + offsets
        return src.astype(np.int32), dst.astype(np.int32)

    def byte_descs(self, region: KVRegion, side: str, offset: int = 0, num_bytes: int | None = None) -> np.ndarray:
        """An Nx3 (address, length, device id) uint64 array: one descriptor per run, or, for
        ``num_bytes`` of each block from ``offset`` (a piece), one per block. A piece is one per
        block on both sides, even the side where it is the whole block: a transfer's two lists
        must be as long as each other (a piece of a 2-rank reader's block is the whole block of
        a 1-rank writer's)."""
        if num_bytes is not None:
            src, dst = self.expand()
            blocks = (src if side == "src" else dst).astype(np.uint64)
            descs = np.empty((len(blocks), 3), dtype=np.uint64)
            descs[:, 0] = np.uint64(region.base_addr + offset) + blocks * np.uint64(region.bytes_per_block)
            descs[:, 1] = num_bytes
            descs[:, 2] = region.device_id
            return descs
        starts = self.src if side == "src" else self.dst
        descs = np.empty((len(self), 3), dtype=np.uint64)
        descs[:, 0] = np.uint64(region.base_addr) + starts.astype(np.uint64) * np.uint64(region.bytes_per_block)
        descs[:, 1] = self.count.astype(np.uint64) * np.uint64(region.bytes_per_block)
        descs[:, 2] = region.device_id
        return descs


def check_block_ids(block_ids: Sequence[int], num_blocks: int, field: str) -> np.ndarray:
    """Return the ids as an int64 array, or raise naming ``field`` if any is out of range."""
    try:
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError) as e:
        raise InvalidBlocksError(field, f"must be a list of integers ({e})") from e
    if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
        bad = int(ids[(ids < 0) | (ids >= num_blocks)][0])
        raise InvalidBlocksError(field, f"block id {bad} is outside [0, {num_blocks})")
    return ids


def _merge_small(src: list[int], dst: list[int], merge: bool) -> BlockRuns:
    # Plain Python beats a dozen numpy calls for the few blocks of a typical chunk.
    if len(set(dst)) != len(dst):
        raise InvalidBlocksError("dst_block_ids", "names a destination block twice in one push")
    starts_src: list[int] = []
    starts_dst: list[int] = []
    counts: list[int] = []
    for s, d in sorted(zip(src, dst)):
        if merge and counts and s == starts_src[-1] + counts[-1] and d == starts_dst[-1] + counts[-1]:
            counts[-1] += 1
        else:
            starts_src.append(s)
            starts_dst.append(d)
            counts.append(1)
    return BlockRuns(np.array(starts_src, dtype=np.int64), np.array(starts_dst, dtype=np.int64),
                     np.array(counts, dtype=np.int64))


def merge_runs(src_block_ids: Sequence[int], dst_block_ids: Sequence[int], merge: bool = True) -> BlockRuns:
    """Pair src[i] with dst[i] and merge pairs that are adjacent on both sides.

    Pairs are sorted by source first, so a shuffled list that is adjacent as a set still
    becomes one run; with unique sources one pass over the sorted pairs is minimal. With
    ``merge=False`` every block is its own run (the benchmark's baseline).
    """
    if len(src_block_ids) != len(dst_block_ids):
        raise InvalidBlocksError(
            "dst_block_ids", f"has {len(dst_block_ids)} ids for {len(src_block_ids)} source blocks"
        )
    if len(src_block_ids) <= _SMALL:
        as_ints = (lambda ids: ids.tolist()) if isinstance(src_block_ids, np.ndarray) else list
        return _merge_small([int(b) for b in as_ints(src_block_ids)], [int(b) for b in dst_block_ids], merge)
    src = np.asarray(src_block_ids, dtype=np.int64).reshape(-1)
    dst = np.asarray(dst_block_ids, dtype=np.int64).reshape(-1)
    # Pushes usually list blocks in order; skip the sorts then (they dominate for 1000s of blocks).
    src_sorted = bool(np.all(src[1:] > src[:-1]))
    if not (src_sorted and np.all(dst[1:] > dst[:-1])) and len(np.unique(dst)) != len(dst):
        raise InvalidBlocksError("dst_block_ids", "names a destination block twice in one push")
    if not src_sorted:
        order = np.lexsort((dst, src))
        src, dst = src[order], dst[order]
    if not merge or len(src) < 2:
        return BlockRuns(src, dst, np.ones(len(src), dtype=np.int64))
    # A run breaks wherever either side stops counting up by one.
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [len(src)])))
    return BlockRuns(src[starts], dst[starts], counts)


def spans_to_ids(spans: Sequence[tuple[int, int]]) -> list[range]:
    """The block ids of (start, count) spans, as ranges (cheap to test and to add to sets)."""
    return [range(start, start + count) for start, count in spans]


def block_byte_descs(region: KVRegion, offset: int = 0, num_bytes: int | None = None) -> np.ndarray:
    """One descriptor per block of the region, index = block id (for prepared lists): each
    whole block, or ``num_bytes`` of it from ``offset`` (one piece of every block)."""
    ids = np.arange(region.num_blocks, dtype=np.uint64)
    descs = np.empty((region.num_blocks, 3), dtype=np.uint64)
    descs[:, 0] = np.uint64(region.base_addr + offset) + ids * np.uint64(region.bytes_per_block)
    descs[:, 1] = region.bytes_per_block if num_bytes is None else num_bytes
    descs[:, 2] = region.device_id
    return descs
