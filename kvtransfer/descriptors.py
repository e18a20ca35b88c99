"""Turning block id lists into as few transfer descriptors as possible.

NIXL costs a few microseconds per descriptor, and a block-major cache makes adjacent
blocks adjacent in memory, so a push of blocks (3, 4, 5) into (10, 11, 12) is one
descriptor, not three. ``merge_runs`` finds the fewest such runs; the backends turn runs
into byte descriptors (or, for prepared lists, into per-block indices that NIXL merges
back the same way).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtransfer.errors import InvalidBlocksError
from kvtransfer.layout import KVRegion


@dataclass(slots=True, frozen=True)
class BlockRun:
    """``num_blocks`` consecutive blocks from ``src_start`` on into ``dst_start`` on."""

    src_start: int
    dst_start: int
    num_blocks: int


def check_block_ids(block_ids: Sequence[int], num_blocks: int, field: str) -> list[int]:
    """Return the ids as a list of ints, or raise naming ``field`` if any is out of range."""
    ids = [int(b) for b in block_ids]
    for b in ids:
        if b < 0 or b >= num_blocks:
            raise InvalidBlocksError(field, f"block id {b} is outside [0, {num_blocks})")
    return ids


def merge_runs(src_block_ids: Sequence[int], dst_block_ids: Sequence[int], merge: bool = True) -> list[BlockRun]:
    """Pair src[i] with dst[i] and merge pairs that are adjacent on both sides.

    Pairs are sorted by source first, so a reversed or shuffled list that is adjacent as
    a set still becomes one run; with unique sources this greedy pass is minimal. With
    ``merge=False`` every block is its own run (the benchmark's baseline).
    """
    if len(src_block_ids) != len(dst_block_ids):
        raise InvalidBlocksError(
            "dst_block_ids", f"has {len(dst_block_ids)} ids for {len(src_block_ids)} source blocks"
        )
    if len(set(dst_block_ids)) != len(dst_block_ids):
        raise InvalidBlocksError("dst_block_ids", "names a destination block twice in one push")
    pairs = sorted(zip(src_block_ids, dst_block_ids))
    runs: list[BlockRun] = []
    for src, dst in pairs:
        if merge and runs:
            last = runs[-1]
            if src == last.src_start + last.num_blocks and dst == last.dst_start + last.num_blocks:
                runs[-1] = BlockRun(last.src_start, last.dst_start, last.num_blocks + 1)
                continue
        runs.append(BlockRun(src, dst, 1))
    return runs


def dst_spans(runs: Sequence[BlockRun]) -> list[tuple[int, int]]:
    """(first destination block, count) per run: what a notification says landed."""
    return [(r.dst_start, r.num_blocks) for r in runs]


def spans_to_ids(spans: Sequence[tuple[int, int]]) -> list[int]:
    return [start + i for start, count in spans for i in range(count)]


def expand_runs(runs: Sequence[BlockRun]) -> tuple[np.ndarray, np.ndarray]:
    """Per-block (src, dst) index arrays in run order, for prepared descriptor lists."""
    total = sum(r.num_blocks for r in runs)
    src = np.empty(total, dtype=np.int32)
    dst = np.empty(total, dtype=np.int32)
    pos = 0
    for r in runs:
        src[pos : pos + r.num_blocks] = np.arange(r.src_start, r.src_start + r.num_blocks, dtype=np.int32)
        dst[pos : pos + r.num_blocks] = np.arange(r.dst_start, r.dst_start + r.num_blocks, dtype=np.int32)
        pos += r.num_blocks
    return src, dst


def run_byte_descs(runs: Sequence[BlockRun], region: KVRegion, side: str) -> np.ndarray:
    """An Nx3 (address, length, device id) array: one descriptor per run on one side."""
    descs = np.empty((len(runs), 3), dtype=np.uint64)
    for i, r in enumerate(runs):
        start = r.src_start if side == "src" else r.dst_start
        descs[i] = (region.block_addr(start), r.num_blocks * region.bytes_per_block, region.device_id)
    return descs


def block_byte_descs(region: KVRegion) -> np.ndarray:
    """One descriptor per block of the region, index = block id (for prepared lists)."""
    ids = np.arange(region.num_blocks, dtype=np.uint64)
    descs = np.empty((region.num_blocks, 3), dtype=np.uint64)
    descs[:, 0] = np.uint64(region.base_addr) + ids * np.uint64(region.bytes_per_block)
    descs[:, 1] = region.bytes_per_block
    descs[:, 2] = region.device_id
    return descs
