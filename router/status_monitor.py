"""The one place that asks workers for their status: typed load reports for every reader.

GetClusterStatus, the Prometheus gauges and the pool manager (is a draining worker idle yet?)
all read ``LoadReport``s from here. Each reader says how old a report it can use; a round of
status calls already in flight is shared, so however many readers ask at once, each worker
gets at most one status call per round, and every call is bounded by the timeout (a hung
worker's report says so, it does not hang its readers).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from router.pool import WorkerPool, WorkerRecord, within

_GONE_ERRORS = (ActorDiedError, ActorUnavailableError, RayActorError)


@dataclass(slots=True, frozen=True)
class LoadReport:
    """One worker's status at ``fetched_at`` (time.monotonic()), or why there is none."""

    worker_id: str
    fetched_at: float
    status: Any = None  # PrefillStatus or DecodeStatus; None when the call failed
    gone: bool = False  # the worker's process is gone
    problem: str = ""  # what went wrong, when ``status`` is None

    @property
    def answered(self) -> bool:
        return self.status is not None


class StatusMonitor:
    def __init__(self, pool: WorkerPool, timeout_s: float):
        self.pool = pool
        self.timeout_s = timeout_s
        self._reports: dict[str, LoadReport] = {}
        self._round: asyncio.Task | None = None
        self._round_started = 0.0
        self.num_calls = 0  # status calls made (the monitor's cost, for tests and debugging)

    async def reports(self, max_age_s: float) -> dict[str, LoadReport]:
        """A report for every worker in the pool, none older than ``max_age_s``."""
        records = list(self.pool.workers.values())
        oldest_usable = time.monotonic() - max_age_s
        if any(self._stale(r, oldest_usable) for r in records):
            await self._shared_round(oldest_usable)
        return {r.worker_id: self._reports[r.worker_id] for r in records if r.worker_id in self._reports}

    async def report(self, record: WorkerRecord, max_age_s: float) -> LoadReport:
        """``record``'s report, none older than ``max_age_s`` (its own call if need be)."""
        oldest_usable = time.monotonic() - max_age_s
        if self._stale(record, oldest_usable):
            report = await self._fetch(record)
            self._store(record, report)  # unless it left the pool meanwhile
            return report
        return self._reports[record.worker_id]

    def _stale(self, record: WorkerRecord, oldest_usable: float) -> bool:
        report = self._reports.get(record.worker_id)
        return report is None or report.fetched_at < oldest_usable

    async def _shared_round(self, oldest_usable: float) -> None:
        if self._round is None or self._round.done() or self._round_started < oldest_usable:
            self._round_started = time.monotonic()
            self._round = asyncio.ensure_future(self._fetch_all())
        await asyncio.shield(self._round)

    async def _fetch_all(self) -> None:
        records = list(self.pool.workers.values())
        results = await asyncio.gather(*(self._fetch(r) for r in records))
        for record, report in zip(records, results):
            self._store(record, report)
        for worker_id in set(self._reports) - set(self.pool.workers):
            del self._reports[worker_id]  # left the pool

    def _store(self, record: WorkerRecord, report: LoadReport) -> None:
        if self.pool.workers.get(record.worker_id) is record:
            self._reports[record.worker_id] = report

    async def _fetch(self, record: WorkerRecord) -> LoadReport:
        self.num_calls += 1
        try:
            status = await within(record.handle.status.remote(), self.timeout_s)
        except asyncio.TimeoutError:
            return LoadReport(record.worker_id, time.monotonic(), problem=f"no status within {self.timeout_s:g}s")
        except Exception as exc:
            gone = isinstance(exc, _GONE_ERRORS)
            return LoadReport(record.worker_id, time.monotonic(), gone=gone, problem=f"{type(exc).__name__}: {exc}")
        return LoadReport(record.worker_id, time.monotonic(), status=status)
