"""Worker status is fetched in one place: readers share rounds, and a hung worker costs them a timeout, not a hang."""

from __future__ import annotations

import asyncio
import time

from engine.stats import WorkerState
from router.pool import Role, WorkerPool, WorkerRecord
from router.status_monitor import StatusMonitor


class _Call:
    def __init__(self, fn):
        self._fn = fn

    def remote(self):
        return self._fn()


class _FakeWorker:
    """Stands in for a worker actor's handle: ``status.remote()`` is awaitable."""

    def __init__(self, worker_id: str, hang: bool = False):
        self.worker_id, self.hang, self.calls = worker_id, hang, 0
        self.status = _Call(self._status)

    async def _status(self):
        self.calls += 1
        if self.hang:
            await asyncio.sleep(3600)
        await asyncio.sleep(0.01)
        return {"worker": self.worker_id, "state": WorkerState.READY}


def _pool(*workers: _FakeWorker) -> WorkerPool:
    pool = WorkerPool()
    for worker in workers:
        pool.add(WorkerRecord(worker.worker_id, Role.DECODE, worker))
    return pool


def test_readers_at_the_same_moment_share_one_status_call_per_worker():
    workers = [_FakeWorker("decode-0"), _FakeWorker("decode-1")]
    monitor = StatusMonitor(_pool(*workers), timeout_s=1.0)

    async def scenario():
        # GetClusterStatus, the metrics and another client, all at once.
        results = await asyncio.gather(*(monitor.reports(max_age_s=0.5) for _ in range(5)))
        again = await monitor.reports(max_age_s=0.5)  # fresh enough: no call at all
        return results, again

    results, again = asyncio.run(scenario())
    assert all(set(r) == {"decode-0", "decode-1"} and all(rep.answered for rep in r.values()) for r in results)
    assert [w.calls for w in workers] == [1, 1] and again == results[0]


def test_a_hung_worker_is_reported_after_the_timeout_and_does_not_hold_the_others():
    workers = [_FakeWorker("decode-0"), _FakeWorker("decode-1", hang=True)]
    monitor = StatusMonitor(_pool(*workers), timeout_s=0.2)
    started = time.monotonic()
    reports = asyncio.run(monitor.reports(max_age_s=0.0))
    assert time.monotonic() - started < 1.0
    assert reports["decode-0"].answered
    assert not reports["decode-1"].answered and not reports["decode-1"].gone and "0.2s" in reports["decode-1"].problem


def test_a_stale_report_is_fetched_again():
    worker = _FakeWorker("decode-0")
    monitor = StatusMonitor(_pool(worker), timeout_s=1.0)

    async def scenario():
        await monitor.reports(max_age_s=10.0)
        await asyncio.sleep(0.05)
        await monitor.reports(max_age_s=0.01)

    asyncio.run(scenario())
    assert worker.calls == 2
