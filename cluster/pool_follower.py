"""Following pools: route to the live workers of a deployment and health-check them.

A router that does not manage the pools (a replica of the router, or a second router started
beside the first) adopts the deployment's durable workers by name ("<deployment name>/<worker
id>" in Ray namespace "pdserve"), health-checks them, stops routing to one that dies, and
every health interval adopts what the managing pool manager launched since; it never launches,
drains or kills. The managing ``PoolManager`` (cluster/pools.py) is this plus launching,
scaling and replacing. This module imports no worker or engine code: a router replica loads it.
"""

from __future__ import annotations

import asyncio
import logging

import ray

from engine.stats import WorkerState
from router.pool import Role, WorkerRecord, within
from router.pool_control import PoolHost

logger = logging.getLogger(__name__)

WORKER_NAMESPACE = "pdserve"  # Ray namespace of durable workers


def durable_worker_names(deployment_name: str) -> list[str]:
    """The Ray names of the deployment's live durable workers (not its other named actors,
    the router replicas and the responses board), sorted."""
    workers = tuple(f"{deployment_name}/{role.value}-" for role in Role)
    return sorted(a["name"] for a in ray.util.list_named_actors(True) if a["namespace"] == WORKER_NAMESPACE and a["name"].startswith(workers))


class PoolFollower:
    """Routes to the pools another manager runs; runs on the router's event loop."""

    manage = False  # Admin refuses to scale or drain through a router that only follows

    def __init__(self, deployment_name: str, router: PoolHost, health_interval_s: float = 1.0, health_timeout_s: float = 10.0, metrics=None):
        self.deployment_name = deployment_name
        self.router = router
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.metrics = metrics
        self.handles: dict[str, object] = {}
        self._health_task: asyncio.Task | None = None
        self._started = False
        # Set once the workers that were running when this manager started are in the pool: a
        # restarted controller serves its API while it adopts, and a status read before then
        # would list no worker (tests/cluster/test_cli.py saw an empty table after a restart).
        self._first_adoption = asyncio.Event()

    async def start(self) -> None:
        await self._adopt()
        self._started = True
        await self.refresh_readiness()
        self._health_task = asyncio.create_task(self._health_loop())

    async def refresh_readiness(self) -> None:
        """Ready once start-up is done and while a decode actor takes requests."""
        if not self._started:
            return  # still starting: every requested worker must be up first
        if self.router.pool.routable(Role.DECODE):
            await self.router.readiness.set_ready()
        else:
            await self.router.readiness.set_not_ready("no decode worker is ready (a replacement is starting, or the pool was drained)")

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        self.handles.clear()

    def size(self, role: Role) -> int:
        """Workers of ``role`` that take requests (starting or ready, not draining)."""
        return sum(1 for w in self.router.pool.of_role(role) if w.state is WorkerState.READY)

    # -- adopting -------------------------------------------------------------------------

    def _name_prefix(self) -> str:
        return f"{self.deployment_name}/"

    async def _adopt(self) -> dict[Role, int]:
        """Route to the live durable workers of this deployment; return how many per role."""
        prefix = self._name_prefix()
        names = await asyncio.to_thread(durable_worker_names, self.deployment_name)
        adopted = {Role.PREFILL: 0, Role.DECODE: 0}
        for name in names:
            worker_id = name[len(prefix):]
            if worker_id in self.router.pool.workers:
                adopted[self.router.pool.workers[worker_id].role] += 1
                continue
            role = Role.PREFILL if worker_id.startswith(f"{Role.PREFILL.value}-") else Role.DECODE
            try:
                handle = ray.get_actor(name, namespace=WORKER_NAMESPACE)
            except ValueError:
                continue  # gone since it was listed
            try:
                await within(handle.ping.remote(), self.health_timeout_s)
                # The workers found as this manager starts carry what they served before it.
                await self.router.add_worker(role, worker_id, handle, adopted=not self._first_adoption.is_set())
            except Exception as exc:
                logger.warning("%s does not answer (%r); not adopted", name, exc)
                if self.manage:
                    ray.kill(handle)  # a hung worker: the pool launches a replacement
                continue
            self.handles[worker_id] = handle
            record = self.router.pool.workers[worker_id]
            if record.state is not WorkerState.DRAINING:  # one being retired is no part of its pool's size
                adopted[role] += 1
            self._adopted(role, worker_id)
            logger.info("adopted %s", worker_id)
        self._first_adoption.set()
        return adopted

    async def adopted(self) -> None:
        """Return once the workers that were running when this manager started are in the pool."""
        await self._first_adoption.wait()

    def _adopted(self, role: Role, worker_id: str) -> None:
        """A worker was adopted (a manager that launches takes note of its id)."""

    # -- health ---------------------------------------------------------------------------

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self._health_round()
            except Exception:  # one round's failure (Ray's control store briefly away) must not end the loop
                logger.warning("a health round failed; the next one runs in %.1f s", self.health_interval_s, exc_info=True)

    async def _health_round(self) -> None:
        """Check every worker, adopt the ones started since, follow drains, refresh readiness."""
        records = [w for w in list(self.router.pool.workers.values()) if w.state is not WorkerState.STARTING]
        results = await asyncio.gather(*(self._check(w) for w in records), return_exceptions=True)
        for record, healthy in zip(records, results):
            if healthy is not True:
                self._on_unhealthy(record, healthy)
        try:
            await self._after_health_checks()
        finally:  # readiness and gauges follow the checks above even where adopting failed
            await self.refresh_readiness()
            if self.metrics is not None:
                await self.metrics.refresh(self.router, max_age_s=self.health_interval_s, pools=self.manage)

    async def _after_health_checks(self) -> None:
        await self._adopt()  # what the managing pool manager launched since
        await self._follow_drains()

    async def _follow_drains(self) -> None:
        """Stop routing to the workers the managing controller began draining (scaling down): each
        refuses new work, and every request routed here would try one first before going
        elsewhere. Their status reports say so; the round is shared with the metrics' refresh."""
        reports = await self.router.status_monitor.reports(max_age_s=self.health_interval_s)
        for worker_id, report in reports.items():
            record = self.router.pool.workers.get(worker_id)
            if record is not None and record.state is WorkerState.READY and report.answered and report.status.state is WorkerState.DRAINING:
                record.state = WorkerState.DRAINING
                logger.info("%s is draining: no longer routed to", worker_id)

    async def _check(self, record: WorkerRecord) -> bool:
        if record.state is WorkerState.DEAD:
            return False
        await within(record.handle.ping.remote(), self.health_timeout_s)
        return True

    def _on_unhealthy(self, record: WorkerRecord, reason) -> None:
        self.router.worker_died(record)
        logger.warning("%s failed its health check (%r): no longer routed to", record.worker_id, reason)
        self.router.pool.remove(record.worker_id)
        self.handles.pop(record.worker_id, None)  # the managing pool manager replaces it
