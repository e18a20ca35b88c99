"""Decode capacity: requests that wait for KV room on the decode pool, and who gets it next.

The router never asks a decode actor for blocks it knows the actor lacks. Each actor's
reports (every ``poll_outputs``, so at least every ``output_poll_s`` while anything runs
or waits) say how many blocks a new reservation may take; the router debits its copy as
it reserves, and the next report corrects it. A request that fits on no decode actor
waits here instead of failing, as in vLLM's waiting queue: served by priority, then
arrival, and a request that does not fit yet holds back the ones behind it, so a large
prompt is never starved by a stream of small ones.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from dataclasses import dataclass, field

from router.errors import InvalidArgumentError
from router.pool import Role, WorkerPool, WorkerRecord
from router.routing import RouteQuery

logger = logging.getLogger(__name__)


class NoDecodeWorkerError(Exception):
    """No decode actor is routable: nobody's room can be waited for. The waiter waits for the
    decode pool to come back (bounded) and queues again in its place."""


@dataclass(order=True, slots=True)
class _Waiter:
    not_aged: int  # 0 once it has waited ``max_wait_s``: then ahead of every priority
    neg_priority: int
    order: int
    num_blocks: int = field(compare=False)
    granted: asyncio.Future = field(compare=False)
    since: float = field(compare=False, default=0.0)
    query: RouteQuery | None = field(compare=False, default=None)  # what the pool's selector weighs
    room_unknown: bool = field(compare=False, default=False)  # granted on an actor whose room was not reported yet


class DecodeCapacity:
    """The queue of requests waiting for decode KV room.

    ``max_wait_s`` ages priorities: a request queued that long goes ahead of every priority
    (oldest first), so a low priority delays a request but never starves it. None: strict.
    """

    def __init__(self, pool: WorkerPool, max_wait_s: float | None = None):
        self.pool = pool
        self.max_wait_s = max_wait_s
        self._waiters: list[_Waiter] = []
        self._order = itertools.count()
        self._short_total_s = 0.0  # seconds during which requests waited for room, but the current spell
        self._short_since: float | None = None  # when the current spell began (None: nobody waits)

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    @property
    def num_blocks_waiting(self) -> int:
        """KV blocks the waiting requests need, all together."""
        return sum(w.num_blocks for w in self._waiters)

    def short_seconds(self) -> float:
        """Seconds so far during which requests waited here for room: a clock that runs only
        while the decode pool is short (what the admission's KV-freed rate is measured in)."""
        if self._short_since is None:
            return self._short_total_s
        return self._short_total_s + time.monotonic() - self._short_since

    def _note_waiters(self) -> None:
        """Start or end a spell of waiting (``short_seconds``) as the queue fills or empties."""
        if self._waiters and self._short_since is None:
            self._short_since = time.monotonic()
        elif not self._waiters and self._short_since is not None:
            self._short_total_s += time.monotonic() - self._short_since
            self._short_since = None

    def total_reservable(self) -> int | None:
        """Blocks the routable decode actors say a reservation may take now (None: no report yet)."""
        known = [w.num_reservable_blocks for w in self.pool.routable(Role.DECODE) if w.num_reservable_blocks is not None]
        return sum(known) if known else None

    async def acquire(
        self, num_blocks: int, priority: int, order: int | None = None, since: float | None = None, query: RouteQuery | None = None
    ) -> WorkerRecord:
        """A decode actor with room for ``num_blocks`` now, its room debited; waits for one.

        ``order`` keeps a request's place when it comes back after a refused reservation;
        ``since`` (default: now) is when its wait began, for aging.
        Cancel the awaiting task to give up the place (a deadline, a client that left).
        """
        order = next(self._order) if order is None else order
        start = time.monotonic() if since is None else since
        waiter = _Waiter(1, -priority, order, num_blocks, asyncio.get_running_loop().create_future(), start, query)
        heapq.heappush(self._waiters, waiter)
        self._note_waiters()
        self.on_report()
        try:
            return await waiter.granted
        except BaseException:
            if waiter.granted.done() and not waiter.granted.cancelled() and waiter.granted.exception() is None:
                # Granted, but its task was cancelled before it took the grant (a client that
                # left, a deadline): the room goes back, or the next waiters would wait for a
                # report that may never come (an actor that just joined has no collector yet).
                self._give_back(waiter)
            raise
        finally:
            if not waiter.granted.done() or waiter.granted.cancelled():
                self._remove(waiter)

    def _give_back(self, waiter: _Waiter) -> None:
        record = waiter.granted.result()
        if waiter.room_unknown and record.num_reservable_blocks == 0:
            record.num_reservable_blocks = None  # as it was: no report since
        elif record.num_reservable_blocks is not None:
            record.num_reservable_blocks += waiter.num_blocks
        self.on_report()

    def next_order(self) -> int:
        return next(self._order)

    def on_report(self) -> None:
        """Capacity may have changed (a report, a death, a new worker): grant waiters in order."""
        try:
            self._grant()
        finally:
            self._note_waiters()

    def _grant(self) -> None:
        if self._waiters and not self.pool.routable(Role.DECODE):
            # The last decode actor died or left: no report will come to grant anyone.
            waiters, self._waiters = self._waiters, []
            for waiter in waiters:
                if not waiter.granted.done():
                    waiter.granted.set_exception(NoDecodeWorkerError())
            return
        self._age()
        while self._waiters:
            head = self._waiters[0]
            if head.granted.done():  # cancelled while waiting
                heapq.heappop(self._waiters)
                continue
            record = self._fitting(head.num_blocks, head.query)
            largest = self._largest_cache() if record is None else None
            if largest is not None and head.num_blocks > largest:
                # More than any decode actor's whole cache: it would wait for good, and hold
                # back everyone behind it (possible where the KV cache is smaller than the context).
                heapq.heappop(self._waiters)
                head.granted.set_exception(InvalidArgumentError(
                    "prompt", f"needs {head.num_blocks} KV blocks, more than the largest decode worker's cache of {largest} blocks holds"
                ))
                continue
            if record is None:
                return  # the head does not fit anywhere yet: everyone behind it waits too
            heapq.heappop(self._waiters)
            if record.num_reservable_blocks is not None:
                record.num_reservable_blocks -= head.num_blocks
            else:
                # Its room not reported yet (it just joined): one request until its first report,
                # or it was given every waiter at once, and most came back refused.
                record.num_reservable_blocks = 0
                head.room_unknown = True
            head.granted.set_result(record)

    def _age(self) -> None:
        """Move the waiters queued ``max_wait_s`` or longer ahead (reports come every poll interval)."""
        if self.max_wait_s is None:
            return
        now = time.monotonic()
        aged = False
        for waiter in self._waiters:
            if waiter.not_aged and now - waiter.since >= self.max_wait_s:
                # Ahead of every priority, and among the aged the oldest first (its priority kept
                # in the key, a newer urgent request aged too went ahead of it: starvation).
                waiter.not_aged = waiter.neg_priority = 0
                aged = True
        if aged:
            heapq.heapify(self._waiters)

    def _fitting(self, num_blocks: int, query: RouteQuery | None) -> WorkerRecord | None:
        """The routable decode actor with room (unknown room counts as room) that the pool's
        selector prefers (least loaded, or by cached prefix against load)."""
        fits = [
            w for w in self.pool.routable(Role.DECODE)
            if w.num_reservable_blocks is None or w.num_reservable_blocks >= num_blocks
        ]
        return self.pool.selector.choose(Role.DECODE, fits, query) if fits else None

    def _largest_cache(self) -> int | None:
        """The most blocks any routable decode actor's cache holds (None: not known for all)."""
        sizes = [w.num_kv_blocks for w in self.pool.routable(Role.DECODE)]
        return None if not sizes or None in sizes else max(sizes)

    def _remove(self, waiter: _Waiter) -> None:
        try:
            self._waiters.remove(waiter)
            heapq.heapify(self._waiters)
        except ValueError:
            pass
        self.on_report()  # the head may have left: the next may fit
