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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

Clock = Callable[[], float]
E = TypeVar("E", bound=Exception)


@dataclass(slots=True)
class LeasePolicy:
    """Timing knobs shared by both sides of a transfer (seconds)."""

    lease_s: float = 60.0  # default lease of a reservation
    grace_s: float = 2.0  # wait past the deadline before freeing unconfirmed blocks
    write_timeout_s: float = 10.0  # a posted write must finish within this or be cancelled
    tombstone_s: float = 600.0  # how long a writer remembers cancelled/finished requests

    def __post_init__(self) -> None:
        if self.write_timeout_s <= 0:
            raise ValueError(f"write_timeout_s: must be > 0, got {self.write_timeout_s!r}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s: must be >= 0, got {self.grace_s!r}")
        if self.lease_s <= 0:
            raise ValueError(f"lease_s: must be > 0, got {self.lease_s!r}")

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
    any lease they could concern has run out.
    """

    def __init__(self, ttl_s: float) -> None:
        self._ttl_s = ttl_s
        self._by_req: dict[str, dict[int | None, _Tombstone[E]]] = {}

    def bury(self, req_id: str, token: int | None, error: E) -> E:
        """Refuse ``token`` of ``req_id`` from now on; return the reason that sticks."""
        tombs = self._by_req.setdefault(req_id, {})
        return tombs.setdefault(token, _Tombstone(error, time.monotonic() + self._ttl_s)).error

    def refusal(self, req_id: str, token: int) -> E | None:
        """Why a push into ``token`` of ``req_id`` is refused, or None if it is not."""
        tombs = self._by_req.get(req_id)
        tomb = tombs and (tombs.get(None) or tombs.get(token))
        return tomb.error if tomb else None

    def expire(self, now: float) -> None:
        for req_id, tombs in list(self._by_req.items()):
            for token in [t for t, tomb in tombs.items() if tomb.expires < now]:
                del tombs[token]
            if not tombs:
                del self._by_req[req_id]
