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

from collections.abc import Callable
from dataclasses import dataclass

Clock = Callable[[], float]


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
