"""KV block ownership: reference counts, chained hashes of full blocks, and the prefix cache.

A block is referenced by every sequence whose block table holds it. Full blocks get a hash
chained from the previous block's hash and their token ids, so two prompts with the same
prefix produce the same hashes: the key the prefix cache looks blocks up by.

With prefix caching on, a block whose last reference is dropped keeps its contents and its
hash: it is free (it counts in ``num_free`` and can be handed out) but a later request with
the same prefix takes it back instead of computing it again. New allocations use blocks that
hold nothing first, then evict cached ones, least recently used first. Within one sequence
the later blocks are evicted before the earlier ones: a prefix is only useful from its start.

Every change to what the cache holds can also be recorded, in order (``CacheEvent``: a hash
stored or evicted), for a worker that publishes them to a router's prefix index.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from dataclasses import dataclass
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


def adapter_hash_salt(adapter_digest: str | None) -> bytes:
    """What seeds the hash chain of a request's blocks through the LoRA adapter of this digest
    (engine.lora_loading.adapter_digest): its KV differs from the base model's, and every other
    adapter's, for the same tokens. b"" for the base model."""
    return b"" if adapter_digest is None else b"lora:" + adapter_digest.encode()


def cache_hash_salt(cache_salt: str | None) -> bytes:
    """What a request's ``cache_salt`` (vLLM's) adds to the seed of its blocks' hash chain: its
    prefix is found only by requests with the same salt, so one tenant cannot tell from cache
    hits (time to first token) what another's prompts were. b"" unsalted."""
    return b"" if cache_salt is None else b"salt:" + hashlib.sha256(cache_salt.encode()).digest()


def prefix_lookup_hashes(token_ids: Sequence[int], block_size: int, salt: bytes = b"") -> list[bytes]:
    """Hashes of the full blocks a prefix-cache hit may cover: all but the last token, which
    must be computed to give the logits of the next one. The engine and the router's prefix
    index both look prompts up with these (``salt``: a pipeline stage's, ``Sequence.hash_salt``)."""
    return chained_block_hashes(token_ids[: len(token_ids) - 1], block_size, salt)


@dataclass(slots=True, frozen=True)
class CacheEvent:
    """A full block's hash entered the prefix cache (``stored``) or left it."""

    block_hash: bytes
    stored: bool


class BlockAllocator:
    """Hands out block ids of one KV cache, takes them back and remembers what full ones hold."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._empty_ids: deque[int] = deque(range(num_blocks))  # free, holding nothing reusable
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free, cached; oldest first
        self._ref_counts = [0] * num_blocks
        self._hashes: list[bytes | None] = [None] * num_blocks
        self._block_by_hash: dict[bytes, int] = {}
        self._events: list[CacheEvent] = []
        self.record_events = False  # set by a worker that publishes them; nothing piles up otherwise
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks no sequence references (cached ones included: they can be handed out)."""
        return len(self._empty_ids) + len(self._evictable)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold a cached prefix block."""
        return len(self._evictable)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free blocks, each with one reference; empty ones before cached ones."""
        if num_blocks > self.num_free:
            raise OutOfBlocksError(f"asked for {num_blocks} KV blocks, {self.num_free} free")
        block_ids = []
        for _ in range(num_blocks):
            if self._empty_ids:
                block_id = self._empty_ids.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                self._evict(block_id)
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def _evict(self, block_id: int) -> None:
        block_hash = self._hashes[block_id]
        self._hashes[block_id] = None
        if block_hash is not None and self._block_by_hash.get(block_hash) == block_id:
            del self._block_by_hash[block_hash]
            self.num_evictions += 1
            if self.record_events:
                self._events.append(CacheEvent(block_hash, stored=False))

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block; blocks with none left become free (and stay cached)."""
        # Last block first: the cache evicts in this order, so a prefix loses its tail first.
        for block_id in reversed(block_ids):
            count = self._ref_counts[block_id]
            assert count > 0, f"double free of block {block_id}"
            self._ref_counts[block_id] = count - 1
            if count > 1:
                continue
            block_hash = self._hashes[block_id]
            if block_hash is not None and self._block_by_hash.get(block_hash) == block_id:
                self._evictable[block_id] = None
            else:
                self._hashes[block_id] = None
                self._empty_ids.append(block_id)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def set_hash(self, block_id: int, block_hash: bytes) -> None:
        """Record that ``block_id`` now holds the full block ``block_hash`` names.

        The first block to hold a hash is the one the cache serves; a second computation of
        the same block (two prompts that missed together) stays private to its sequence.
        """
        if not self.enable_prefix_caching:
            return
        self._hashes[block_id] = block_hash
        if block_hash not in self._block_by_hash:
            self._block_by_hash[block_hash] = block_id
            if self.record_events:
                self._events.append(CacheEvent(block_hash, stored=True))

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding the full block with this hash, if the cache has it."""
        return self._block_by_hash.get(block_hash)

    def num_cached_prefix(self, block_hashes: Sequence[bytes]) -> int:
        """How many of the leading ``block_hashes`` the cache holds (nothing is taken)."""
        count = 0
        for block_hash in block_hashes:
            if block_hash not in self._block_by_hash:
                break
            count += 1
        return count

    def take_cached(self, block_hashes: Sequence[bytes]) -> list[int]:
        """One reference to each block of the longest cached prefix of ``block_hashes``."""
        block_ids = []
        for block_hash in block_hashes:
            block_id = self._block_by_hash.get(block_hash)
            if block_id is None:
                break
            if self._ref_counts[block_id] == 0:
                del self._evictable[block_id]
            self._ref_counts[block_id] += 1
            block_ids.append(block_id)
        return block_ids

    def drain_events(self) -> list[CacheEvent]:
        """What the cache stored and evicted since the last call, in order."""
        events, self._events = self._events, []
        return events

    def cached_hashes(self) -> list[bytes]:
        """Every hash the cache holds now (a snapshot for a new subscriber)."""
        return list(self._block_by_hash)
