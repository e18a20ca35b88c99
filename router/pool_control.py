"""The small protocol between the router and whoever runs its worker pools.

The router does not hold the pool manager's internals, nor the pool manager the router's:
each sees the other through one of these. ``cluster.pools.PoolManager`` implements
``PoolControl``; ``router.core.Router`` implements ``PoolHost``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from router.pool import Role, WorkerPool, WorkerRecord
    from router.readiness import Readiness
    from router.status_monitor import StatusMonitor


class PoolControl(Protocol):
    """What the router (its Admin service) asks of the pools' manager."""

    manage: bool  # False: it follows pools another manager runs; scaling and draining go there

    async def check_resources(self, role: "Role", replicas: int) -> None:
        """Raise FailedPreconditionError, naming the resource, if ``replicas`` cannot fit."""

    async def scale(self, role: "Role", replicas: int) -> int:
        """Grow or shrink ``role``'s pool to ``replicas``; return the previous size."""

    async def retire(self, record: "WorkerRecord", shrink: bool = True) -> None:
        """Drain ``record`` and remove it once nothing of any request is left on it."""

    async def adopted(self) -> None:
        """Return once the workers that were running when it started (a restarted controller's
        durable workers) are in the pool."""


class PoolHost(Protocol):
    """What the pools' manager needs from the router it fills with workers."""

    pool: "WorkerPool"  # the routing table: records are added, read and removed here
    readiness: "Readiness"  # health SERVING while a decode worker can take requests
    status_monitor: "StatusMonitor"  # load reports (is a draining worker idle?)

    async def add_worker(self, role: "Role", worker_id: str, handle: Any, adopted: bool = False) -> "WorkerRecord":
        """Route to a started worker from now on (``adopted``: found running as the manager started)."""

    async def drain(self, record: "WorkerRecord") -> None:
        """No new requests for this worker; it finishes what it has."""

    def worker_died(self, record: "WorkerRecord") -> None:
        """Stop routing to a dead worker; its requests are restarted or migrated."""
