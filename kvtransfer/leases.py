"""Leases: how "a freed block never receives a late write" holds with one-sided writes.

NIXL writes are one-sided: the receiver cannot refuse bytes, it can only make sure no
writer still means to send them before it frees the blocks. Three rules do that:

1. A reservation carries a wall-clock ``lease_deadline``. The writer posts a write only
   if ``now + write_timeout_s <= lease_deadline``, and a write still running after
   ``write_timeout_s`` is cancelled and fails its request. So no write the writer
   started is meant to run past the deadline.
2. On abort the receiver keeps the blocks until the writer confirms (a ``QuiesceReport``
   relayed by the workers) that it stopped accepting writes for the request and has
   none in flight, or the writer is known dead.
3. Without a confirmation the receiver frees at ``lease_deadline + grace_s``; the grace
   covers clock skew between hosts and the time the writer takes to notice a timeout.

The residue, stated plainly: a write that the transport can neither finish nor cancel
within ``write_timeout_s + grace_s`` could still land late. The writer keeps such a
write counted as in flight, so rule 2 never confirms it; only rule 3 can free its blocks.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Hashable, TypeVar

Clock = Callable[[], float]
E = TypeVar("E", bound=Exception)


@dataclass(slots=True)
class LeasePolicy:
    """Timing knobs shared by both sides of a transfer (seconds)."""

    lease_s: float = 60.0  # default lease of a reservation
    grace_s: float = 2.0  # wait past the deadline before freeing unconfirmed blocks
    write_timeout_s: float = 10.0  # a posted write must finish within this or be cancelled
    tombstone_s: float = 600.0  # how long a writer remembers cancelled/finished requests
    max_write_retries: int = 2  # a write that failed (or timed out and was cancelled) is posted again this often

    def __post_init__(self) -> None:
        if self.write_timeout_s <= 0:
            raise ValueError(f"write_timeout_s: must be > 0, got {self.write_timeout_s!r}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s: must be >= 0, got {self.grace_s!r}")
        if self.lease_s <= 0:
            raise ValueError(f"lease_s: must be > 0, got {self.lease_s!r}")
        if self.max_write_retries < 0:
            raise ValueError(f"max_write_retries: must be >= 0, got {self.max_write_retries!r}")

    def can_post(self, lease_deadline: float, now: float) -> bool:
        """Rule 1: a write posted now must be done or cancelled before the deadline."""
        return now + self.write_timeout_s <= lease_deadline

    def free_at(self, lease_deadline: float) -> float:
        """Rule 3: the earliest time unconfirmed blocks may be freed."""
        return lease_deadline + self.grace_s


@dataclass(slots=True)
class _Tombstone(Generic[E]):
    error: E
    expires: float


class Tombstones(Generic[E]):
    """Writer-side memory of reservations that must never be written again (rule 2).

    Keyed by req_id and reservation token; token None covers every reservation of the
    request. The first reason recorded sticks. Entries expire after ``ttl_s``, long after
    any lease they could concern has run out; expiry walks a FIFO, so a poll costs
    nothing per remembered request.
    """

    def __init__(self, ttl_s: float) -> None:
        self._ttl_s = ttl_s
        self._by_req: dict[str, dict[int | None, _Tombstone[E]]] = {}
        self._order: deque[tuple[float, str, int | None]] = deque()

    def bury(self, req_id: str, token: int | None, error: E) -> E:
        """Refuse ``token`` of ``req_id`` from now on; return the reason that sticks."""
        tombs = self._by_req.setdefault(req_id, {})
        if token not in tombs:
            expires = time.monotonic() + self._ttl_s
            tombs[token] = _Tombstone(error, expires)
            self._order.append((expires, req_id, token))
        return tombs[token].error

    def refusal(self, req_id: str, token: int) -> E | None:
        """Why a push into ``token`` of ``req_id`` is refused, or None if it is not."""
        tombs = self._by_req.get(req_id)
        tomb = tombs and (tombs.get(None) or tombs.get(token))
        return tomb.error if tomb else None

    def expire(self, now: float) -> None:
        while self._order and self._order[0][0] < now:
            _, req_id, token = self._order.popleft()
            tombs = self._by_req.get(req_id, {})
            tombs.pop(token, None)
            if not tombs:
                self._by_req.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._order)


class RecentKeys:
    """The last ``capacity`` keys remembered, oldest forgotten first: what a worker keeps of
    things already ended (a cancelled reservation, an aborted attempt, a quiesced token) so
    that a call or notification about them arriving late is recognised."""

    def __init__(self, capacity: int = 4096) -> None:
        self._capacity = capacity
        self._keys: OrderedDict[Hashable, None] = OrderedDict()

    def add(self, key: Hashable) -> None:
        self._keys[key] = None
        if len(self._keys) > self._capacity:
            self._keys.popitem(last=False)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._keys
