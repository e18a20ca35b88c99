"""KV block ownership: a free-id queue, reference counts, and chained hashes of full blocks.

A block is referenced by every sequence whose block table holds it; it returns to the
free queue when its last reference is dropped. Full blocks get a hash chained from the
previous block's hash and their token ids, so two prompts with the same prefix produce the
same hashes: the key a prefix cache looks blocks up by.
"""

from __future__ import annotations

import hashlib
import struct
from collections import deque
from typing import Sequence

from engine.errors import EngineError


class OutOfBlocksError(EngineError):
    """Raised when an allocation asks for more blocks than are free."""


def chained_block_hashes(token_ids: Sequence[int], block_size: int, parent: bytes = b"") -> list[bytes]:
    """Hashes of every full block of ``token_ids``; each covers its whole prefix."""
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(struct.pack(f"<{block_size}q", *block))
        parent = digest.digest()
        hashes.append(parent)
    return hashes


class BlockAllocator:
    """Hands out block ids of one KV cache and takes them back."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free_ids: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._hashes: list[bytes | None] = [None] * num_blocks
        self._block_by_hash: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free_ids)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free_ids)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free blocks, each with one reference."""
        if num_blocks > len(self._free_ids):
            raise OutOfBlocksError(f"asked for {num_blocks} KV blocks, {len(self._free_ids)} free")
        block_ids = [self._free_ids.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def allocate_specific(self, block_ids: Sequence[int]) -> None:
        """Take exactly these free blocks (used when a peer dictates the destination)."""
        missing = [b for b in block_ids if self._ref_counts[b] != 0]
        if missing:
            raise OutOfBlocksError(f"blocks {missing} are not free")
        wanted = set(block_ids)
        self._free_ids = deque(b for b in self._free_ids if b not in wanted)
        for block_id in block_ids:
            self._ref_counts[block_id] = 1

    def incref(self, block_ids: Sequence[int]) -> None:
        """Share blocks with one more owner (prefix sharing, forks)."""
        for block_id in block_ids:
            assert self._ref_counts[block_id] > 0, f"block {block_id} is free"
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block; blocks with none left become free."""
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            assert count > 0, f"double free of block {block_id}"
            self._ref_counts[block_id] = count - 1
            if count == 1:
                block_hash = self._hashes[block_id]
                if block_hash is not None and self._block_by_hash.get(block_hash) == block_id:
                    del self._block_by_hash[block_hash]
                self._hashes[block_id] = None
                self._free_ids.append(block_id)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def set_hash(self, block_id: int, block_hash: bytes) -> None:
        """Record that ``block_id`` now holds the full block ``block_hash`` names."""
        self._hashes[block_id] = block_hash
        self._block_by_hash.setdefault(block_hash, block_id)

    def lookup(self, block_hash: bytes) -> int | None:
        """The live block holding the full block with this hash, if any."""
        return self._block_by_hash.get(block_hash)
