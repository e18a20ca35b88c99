"""The router's picture of every worker's prefix cache, kept from the workers' own events.

Each worker's allocator records the full-block hashes it stores and evicts; ``PrefixFeed``
follows every worker (one long-poll task each, woken at most once per engine step) and
applies what they report to a ``PrefixIndex``. The index answers "how many leading blocks of
this prompt does worker W hold", with the same chained hashes the engine computes, so routing
can weigh a cache hit against load. It is a hint: a worker that evicted a block since its
last report still computes it; output never depends on the index.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from engine.block_allocator import prefix_lookup_hashes
from router.pool import WorkerPool, WorkerRecord, within
from workers.cache_events import CacheUpdate

logger = logging.getLogger(__name__)

_GONE = (ActorDiedError, ActorUnavailableError, RayActorError)
# How long one long-poll waits for news before it returns empty (and is asked again).
POLL_S = 1.0


class PrefixIndex:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._held: dict[str, set[bytes]] = {}

    def prompt_hashes(self, token_ids: Sequence[int], salt: bytes = b"") -> list[bytes]:
        """Hashes of the prompt's blocks a cache hit may cover, as the engine looks them up
        (``salt``: the request's LoRA adapter's, ``adapter_hash_salt``)."""
        return prefix_lookup_hashes(token_ids, self.block_size, salt)

    def apply(self, update: CacheUpdate) -> None:
        held = self._held.setdefault(update.worker_id, set())
        if update.reset:
            held.clear()
        for event in update.events:
            if event.stored:
                held.add(event.block_hash)
            else:
                held.discard(event.block_hash)

    def forget(self, worker_id: str) -> None:
        self._held.pop(worker_id, None)

    def num_cached_tokens(self, worker_id: str, prompt_hashes: Iterable[bytes]) -> int:
        """Prompt tokens whose KV the worker's cache holds, by its last report."""
        held = self._held.get(worker_id)
        if not held:
            return 0
        count = 0
        for block_hash in prompt_hashes:
            if block_hash not in held:
                break
            count += 1
        return count * self.block_size

    def num_hashes(self, worker_id: str) -> int:
        return len(self._held.get(worker_id, ()))


class PrefixFeed:
    """Follows every worker's cache events into a ``PrefixIndex``: one task per worker."""

    def __init__(self, pool: WorkerPool, index: PrefixIndex, call_timeout_s: float) -> None:
        self.pool = pool
        self.index = index
        self.call_timeout_s = call_timeout_s
        self._tasks: dict[str, asyncio.Task] = {}
        self._stopped = False

    def ensure(self) -> None:
        """Start following workers that joined; cheap to call on every dispatch."""
        if self._stopped:
            return
        for record in list(self.pool.workers.values()):
            task = self._tasks.get(record.worker_id)
            if task is None or task.done():
                self._tasks[record.worker_id] = asyncio.get_running_loop().create_task(self._follow(record))

    async def _follow(self, record: WorkerRecord) -> None:
        cursor = -1
        try:
            while not self._stopped and self.pool.workers.get(record.worker_id) is record:
                try:
                    update = await within(record.handle.cache_events.remote(cursor, POLL_S), POLL_S + self.call_timeout_s)
                except asyncio.TimeoutError:
                    continue  # a busy actor; ask again from the same cursor
                except _GONE:
                    return
                self.index.apply(update)
                cursor = update.cursor
        except Exception:
            logger.exception("following the prefix cache of %s failed; routing ignores its cache", record.worker_id)
        finally:
            self.index.forget(record.worker_id)

    async def stop(self) -> None:
        """Stop following. A task's cancellation can be lost: Python 3.11's ``wait_for`` drops it
        when the call it waits on ends at that moment (or turns it into the TimeoutError the loop
        asks again on), and a router's stop then waited for ever. So the loops also check a flag,
        and a task still running is cancelled again until every one has ended."""
        self._stopped = True
        running = [task for task in self._tasks.values() if not task.done()]
        while running:
            for task in running:
                task.cancel()
            _, pending = await asyncio.wait(running, timeout=0.1)
            running = list(pending)
        self._tasks.clear()
