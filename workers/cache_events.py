"""A worker's prefix-cache events, kept for the routers that follow them.

The engine thread appends what its block allocator stored and evicted, once per turn (so at
most once per step). A router follows a worker with ``since(cursor)``: the events after its
cursor, and the cursor to pass next time. The log is bounded; a router that fell further
behind than it reaches (or follows for the first time, cursor -1) gets a snapshot instead: every
hash the cache holds, with ``reset`` set, so what it knew is replaced, never patched wrongly.
Several routers may follow one worker: each keeps its own cursor; nothing is consumed.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass, field

from engine.block_allocator import CacheEvent

# Events kept for followers that lag (16-byte hashes: about 2 MiB of them).
MAX_LOGGED_EVENTS = 65536


@dataclass(slots=True)
class CacheUpdate:
    """What one worker's prefix cache did after a follower's cursor."""

    worker_id: str
    cursor: int  # pass it back to get what follows
    events: list[CacheEvent] = field(default_factory=list)
    reset: bool = False  # ``events`` is a snapshot (all stored): forget what was known first


class CacheEventLog:
    def __init__(self, worker_id: str, max_events: int = MAX_LOGGED_EVENTS) -> None:
        self.worker_id = worker_id
        self._events: deque[CacheEvent] = deque(maxlen=max_events)
        self._next = 0  # the cursor after the newest event
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: set[asyncio.Event] = set()

    @property
    def cursor(self) -> int:
        with self._lock:
            return self._next

    def append(self, events: list[CacheEvent]) -> None:
        """From the engine thread: one turn's events, in order."""
        if not events:
            return
        with self._lock:
            self._events.extend(events)
            self._next += len(events)
            loop, waiters = self._loop, list(self._waiters)
        if loop is not None:
            for waiter in waiters:
                loop.call_soon_threadsafe(waiter.set)

    def since(self, cursor: int) -> CacheUpdate | None:
        """The events after ``cursor``; None when the log no longer reaches back that far."""
        with self._lock:
            oldest = self._next - len(self._events)
            if cursor < oldest or cursor > self._next:
                return None
            events = list(self._events)[cursor - oldest :] if cursor < self._next else []
            return CacheUpdate(self.worker_id, self._next, events)

    async def wait_since(self, cursor: int, timeout_s: float) -> CacheUpdate | None:
        """``since(cursor)``, waiting up to ``timeout_s`` for something new (on the actor's loop)."""
        update = self.since(cursor)
        if update is None or update.events or timeout_s <= 0:
            return update
        waiter = asyncio.Event()
        with self._lock:
            self._loop = asyncio.get_running_loop()
            self._waiters.add(waiter)
        try:
            update = self.since(cursor)  # an append between the check and the registration
            if update is not None and not update.events:
                try:
                    await asyncio.wait_for(waiter.wait(), timeout_s)
                except asyncio.TimeoutError:
                    pass
                update = self.since(cursor)
            return update
        finally:
            with self._lock:
                self._waiters.discard(waiter)

    def snapshot(self, cached_hashes: list[bytes]) -> CacheUpdate:
        """Everything the cache holds, as of the current cursor (call on the engine thread,
        after appending the allocator's pending events, so the two agree)."""
        return CacheUpdate(self.worker_id, self.cursor, [CacheEvent(h, stored=True) for h in cached_hashes], reset=True)
