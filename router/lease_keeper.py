"""Lease renewal: no time a request spends waiting can void its decode reservation.

A reservation's lease exists so that blocks come back when the writer or the router
disappears. While the router is alive and a request's prefill is still coming, the
router keeps the lease alive: every ``kv_lease_s / 4`` it asks each decode actor to
renew the leases of its reservations still waiting for KV (one call per actor), then
relays the new deadlines to the prefill actors that hold those requests (one call per
actor). The decode actor renews first, so a writer's deadline never exceeds the
reserver's. If the router dies, renewals stop and the leases run out as before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from kvtransfer.messages import KVDestination
from router.pool import within

if TYPE_CHECKING:
    from router.dispatcher import ActiveRequest
    from router.pool import WorkerRecord

logger = logging.getLogger(__name__)


class LeaseKeeper:
    def __init__(self, lease_s: float, call_timeout_s: float, waiting: Callable[[], Iterable["ActiveRequest"]]):
        self.lease_s = lease_s
        self.period_s = lease_s / 4
        self.call_timeout_s = call_timeout_s
        self._waiting = waiting  # requests holding a reservation whose KV has not all landed
        self._task: asyncio.Task | None = None

    def ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            requests = list(self._waiting())
            if not requests:
                return  # started again by the next reservation
            try:
                await self.renew(requests)
            except Exception:
                logger.exception("lease renewal failed; retrying in %.1fs", self.period_s)

    async def renew(self, requests: list["ActiveRequest"]) -> None:
        """One renewal round over ``requests``: decode actors first, then their writers."""
        by_decode: dict[str, tuple[WorkerRecord, list[ActiveRequest]]] = {}
        for active in requests:
            by_decode.setdefault(active.decode.worker_id, (active.decode, []))[1].append(active)
        renewed = await asyncio.gather(
            *(self._renew_on_decode(record, group) for record, group in by_decode.values()), return_exceptions=True
        )
        by_req = {active.key: active for active in requests}
        by_prefill: dict[str, tuple[WorkerRecord, list[KVDestination]]] = {}
        for result in renewed:
            if isinstance(result, BaseException):
                continue  # a dead decode actor: the dispatcher hears of it from its collector
            for dest in result:
                active = by_req[dest.req_id]
                if active.destination is not None and active.destination.token == dest.token:
                    # A prefill retry elsewhere must carry the renewed deadline, not the first one.
                    active.destination.lease_deadline = max(active.destination.lease_deadline, dest.lease_deadline)
                for prefill in active.prefill_workers:  # every stage of a pipelined prefill
                    by_prefill.setdefault(prefill.worker_id, (prefill, []))[1].append(dest)
        await asyncio.gather(
            *(self._extend_on_prefill(record, dests) for record, dests in by_prefill.values()), return_exceptions=True
        )

    async def _renew_on_decode(self, record: "WorkerRecord", group: list["ActiveRequest"]) -> list[KVDestination]:
        req_ids = [active.key for active in group]
        return await within(record.handle.renew_leases.remote(req_ids, self.lease_s), self.call_timeout_s)

    async def _extend_on_prefill(self, record: "WorkerRecord", dests: list[KVDestination]) -> None:
        await within(record.handle.extend_leases.remote(dests), self.call_timeout_s)
