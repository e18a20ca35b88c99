"""The router's view of its workers: who exists, who may take work, how loaded each is.

Load is tracked from the router's own bookkeeping (requests it assigned and has not seen
finish; prompt tokens it sent to each prefill actor and not yet seen prefilled), so picking
a worker costs no remote call. ``GetClusterStatus`` asks the workers themselves.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.stats import WorkerState
from router.admission import BusyRate

logger = logging.getLogger(__name__)


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class RoutingPolicy(str, enum.Enum):
    LEAST_LOADED = "least_loaded"
    ROUND_ROBIN = "round_robin"


@dataclass(slots=True)
class WorkerRecord:
    worker_id: str
    role: Role
    handle: Any  # a Ray actor handle
    state: WorkerState = WorkerState.READY
    epoch: str = ""
    handshake_offer: Any = None  # decode workers: what prefill actors connect to
    num_assigned: int = 0  # requests assigned and not finished
    num_assigned_prompt_tokens: int = 0  # prefill workers: prompt tokens not yet prefilled
    req_ids: set[str] = field(default_factory=set)
    # Decode workers: blocks a new reservation may take, from the actor's last report less
    # what the router reserved since (None: no report yet).
    num_reservable_blocks: int | None = None
    # Prefill workers: measured prompt tokens per second of busy time, and since when busy.
    prefill_rate: BusyRate = field(default_factory=BusyRate)
    busy_since: float | None = None

    @property
    def routable(self) -> bool:
        return self.state is WorkerState.READY


class WorkerPool:
    def __init__(self, policy: RoutingPolicy = RoutingPolicy.LEAST_LOADED):
        self.policy = policy
        self.workers: dict[str, WorkerRecord] = {}
        self._round_robin = {Role.PREFILL: itertools.count(), Role.DECODE: itertools.count()}
        self.on_change: Callable[[], None] = lambda: None  # a worker joined or left

    def add(self, record: WorkerRecord) -> None:
        self.workers[record.worker_id] = record
        logger.info("worker %s (%s, epoch %s) joined the pool", record.worker_id, record.role.value, record.epoch)
        self.on_change()

    def remove(self, worker_id: str) -> WorkerRecord | None:
        record = self.workers.pop(worker_id, None)
        if record is not None:
            logger.info("worker %s left the pool", worker_id)
            self.on_change()
        return record

    def of_role(self, role: Role) -> list[WorkerRecord]:
        return [w for w in self.workers.values() if w.role is role]

    def routable(self, role: Role) -> list[WorkerRecord]:
        return [w for w in self.workers.values() if w.role is role and w.routable]

    def pick(self, role: Role, exclude: set[str] = frozenset()) -> WorkerRecord | None:
        """The worker the next request of ``role`` should go to, or None if none may take it."""
        candidates = [w for w in self.routable(role) if w.worker_id not in exclude]
        if not candidates:
            return None
        if self.policy is RoutingPolicy.ROUND_ROBIN:
            return candidates[next(self._round_robin[role]) % len(candidates)]
        if role is Role.PREFILL:
            return min(candidates, key=lambda w: (w.num_assigned_prompt_tokens, w.num_assigned))
        return min(candidates, key=lambda w: w.num_assigned)

    def min_prefill_backlog(self) -> int | None:
        """Prompt tokens queued on the least busy routable prefill actor (None: no prefill actor)."""
        backlogs = [w.num_assigned_prompt_tokens for w in self.routable(Role.PREFILL)]
        return min(backlogs) if backlogs else None

    def assign(self, record: WorkerRecord, req_id: str, prompt_tokens: int = 0) -> None:
        record.num_assigned += 1
        record.num_assigned_prompt_tokens += prompt_tokens
        record.req_ids.add(req_id)

    def release(self, record: WorkerRecord, req_id: str, prompt_tokens: int = 0) -> None:
        if req_id not in record.req_ids:
            return
        record.req_ids.discard(req_id)
        record.num_assigned -= 1
        record.num_assigned_prompt_tokens -= prompt_tokens


async def within(ref, timeout_s: float | None):
    """The result of a worker call (a Ray ObjectRef); asyncio.TimeoutError after ``timeout_s``."""

    async def result():
        return await ref

    return await asyncio.wait_for(result(), timeout_s)
