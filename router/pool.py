"""The router's view of its workers: who exists, who may take work, how loaded each is.

Load is tracked from the router's own bookkeeping (requests it assigned and has not seen
finish; prompt tokens it sent to each prefill actor and not yet seen prefilled), so picking
a worker costs no remote call. ``GetClusterStatus`` asks the workers themselves.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.stats import WorkerState
from router.admission import BusyRate

if TYPE_CHECKING:
    from router.routing import RouteQuery, Selector

logger = logging.getLogger(__name__)


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class RoutingPolicy(str, enum.Enum):
    """How workers are chosen (router.routing has one Selector for each)."""

    LEAST_LOADED = "least_loaded"
    ROUND_ROBIN = "round_robin"
    KV_AWARE = "kv_aware"  # cached prefix (from the workers' cache events) against load


@dataclass(slots=True)
class WorkerRecord:
    worker_id: str
    role: Role
    handle: Any  # a Ray actor handle
    state: WorkerState = WorkerState.READY
    epoch: str = ""
    handshake_offer: Any = None  # decode workers: what prefill actors connect to
    num_assigned: int = 0  # requests assigned and not finished
    # Prompt tokens of those requests: on a prefill actor, the ones still to compute; on a
    # decode actor, the KV it holds for them.
    num_assigned_prompt_tokens: int = 0
    assigned_tokens: dict[str, int] = field(default_factory=dict)  # request -> its share of the above
    # Decode workers: blocks a new reservation may take, from the actor's last report less
    # what the router reserved since (None: no report yet).
    num_reservable_blocks: int | None = None
    num_kv_blocks: int | None = None  # decode workers: their whole cache, from the same reports
    # Decode workers: prompt tokens of requests sent to be prefilled there (conditional
    # disaggregation) whose first token has not come back yet: its own queue of prompts.
    num_local_prefill_tokens: int = 0
    # Measured prompt tokens per second of busy time, and since when busy: a prefill worker's,
    # or a decode worker's for its own queue of prompts (its decode steps share that time).
    prefill_rate: BusyRate = field(default_factory=BusyRate)
    busy_since: float | None = None
    node: str = ""  # the Ray node it runs on (its rank 0's), as the worker names it

    @property
    def routable(self) -> bool:
        return self.state is WorkerState.READY

    @property
    def req_ids(self):
        """The requests assigned here and not finished."""
        return self.assigned_tokens.keys()


class WorkerPool:
    def __init__(self, selector: Selector | None = None):
        if selector is None:
            from router.routing import LeastLoaded  # router.routing builds on this module

            selector = LeastLoaded()
        self.selector = selector
        self.workers: dict[str, WorkerRecord] = {}
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

    def pick(self, role: Role, exclude: set[str] = frozenset(), query: RouteQuery | None = None) -> WorkerRecord | None:
        """The worker the next request of ``role`` should go to, or None if none may take it."""
        candidates = [w for w in self.routable(role) if w.worker_id not in exclude]
        if not candidates:
            return None
        return self.selector.choose(role, candidates, query)

    def min_prefill_backlog(self) -> int | None:
        """Prompt tokens queued on the least busy routable prefill actor (None: no prefill actor)."""
        backlogs = [w.num_assigned_prompt_tokens for w in self.routable(Role.PREFILL)]
        return min(backlogs) if backlogs else None

    def assign(self, record: WorkerRecord, req_id: str, prompt_tokens: int = 0) -> None:
        if req_id in record.assigned_tokens:
            self.release(record, req_id)
        record.num_assigned += 1
        record.num_assigned_prompt_tokens += prompt_tokens
        record.assigned_tokens[req_id] = prompt_tokens

    def release(self, record: WorkerRecord, req_id: str) -> None:
        prompt_tokens = record.assigned_tokens.pop(req_id, None)
        if prompt_tokens is None:
            return
        record.num_assigned -= 1
        record.num_assigned_prompt_tokens -= prompt_tokens


async def within(ref, timeout_s: float | None):
    """The result of a worker call (a Ray ObjectRef, or any awaitable); asyncio.TimeoutError
    after ``timeout_s``.

    On Python 3.11+ through ``asyncio.timeout``: 3.11's ``wait_for`` drops a cancellation of the
    caller that arrives as the call ends (it returns the result instead), and a loop of such
    calls then outlived its own stop."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout_s):
            return await ref

    async def result():
        return await ref

    return await asyncio.wait_for(result(), timeout_s)
