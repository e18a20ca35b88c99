"""How a worker is chosen among those that may take a request: one ``Selector`` per policy.

The router asks its selector for a prefill actor, for a decode actor among those with KV room,
and how many of a prompt's tokens a worker's cache holds (which conditional disaggregation
counts out). ``KVAware`` scores each candidate by the work the request would add there, its
uncached prompt tokens, on top of the work the worker already has:

    cost(w) = assigned tokens(w) + prompt tokens - weight * cached tokens(w)

so a worker holding a long prefix wins unless it is busier by more than that prefix is worth
(``weight`` 1: a cached token saves as much as a queued one costs; 0: least loaded). A prefill
actor on another node than the request's decode actor also pays what crossing nodes costs
(measured, ``router/transfer_costs.py``) and loses ties: prefill and decode pair on one node
when that is as good.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from router.pool import Role, RoutingPolicy, WorkerRecord
from router.prefix_index import PrefixIndex


@dataclass(slots=True)
class RouteQuery:
    """What a selector may look at of one request."""

    num_prompt_tokens: int
    prompt_hashes: list[bytes] = field(default_factory=list)  # empty unless routing by prefix
    # Prefill only: the node of the decode actor its KV goes to, and what a prefill actor on
    # another node costs on top (router/transfer_costs.py): its rate turns it into tokens.
    near_node: str = ""
    cross_node_s: float = 0.0


def node_penalty(record: WorkerRecord, query: RouteQuery | None) -> tuple[float, bool]:
    """(prompt tokens of queue a worker off the query's node is worth less, whether it is off it)."""
    if query is None or not query.near_node or not record.node:
        return 0.0, False
    if record.node == query.near_node:
        return 0.0, False
    rate = record.prefill_rate.per_second or 0.0
    return query.cross_node_s * rate, True


class Selector(Protocol):
    def choose(self, role: Role, candidates: Sequence[WorkerRecord], query: RouteQuery | None) -> WorkerRecord:
        """One of ``candidates`` (never empty)."""
        ...

    def num_cached_tokens(self, record: WorkerRecord, query: RouteQuery | None) -> int:
        """Prompt tokens the worker's cache holds, as far as this selector knows (0: unknown)."""
        ...

    def query(self, prompt_token_ids: Sequence[int], salt: bytes = b"") -> RouteQuery:
        """What ``choose`` needs of a prompt (``salt``: its adapter's prefix-cache salt)."""
        ...


def _least_loaded_key(role: Role, query: RouteQuery | None = None):
    if role is Role.PREFILL:
        def key(w: WorkerRecord):
            extra, off_node = node_penalty(w, query)
            return (w.num_assigned_prompt_tokens + extra, off_node, w.num_assigned)

        return key
    return lambda w: w.num_assigned


class LeastLoaded:
    """Prefill: fewest prompt tokens waiting (a worker off the decode actor's node pays what
    crossing costs, and loses ties); decode: fewest requests."""

    def choose(self, role: Role, candidates: Sequence[WorkerRecord], query: RouteQuery | None) -> WorkerRecord:
        return min(candidates, key=_least_loaded_key(role, query))

    def num_cached_tokens(self, record: WorkerRecord, query: RouteQuery | None) -> int:
        return 0

    def query(self, prompt_token_ids: Sequence[int], salt: bytes = b"") -> RouteQuery:
        return RouteQuery(len(prompt_token_ids))


class RoundRobin(LeastLoaded):
    def __init__(self) -> None:
        self._turns = {Role.PREFILL: itertools.count(), Role.DECODE: itertools.count()}

    def choose(self, role: Role, candidates: Sequence[WorkerRecord], query: RouteQuery | None) -> WorkerRecord:
        return candidates[next(self._turns[role]) % len(candidates)]


class KVAware:
    """Cached prefix against load, from the workers' published cache events."""

    def __init__(self, index: PrefixIndex, weight: float = 1.0) -> None:
        self.index = index
        self.weight = weight

    def query(self, prompt_token_ids: Sequence[int], salt: bytes = b"") -> RouteQuery:
        return RouteQuery(len(prompt_token_ids), self.index.prompt_hashes(prompt_token_ids, salt))

    def num_cached_tokens(self, record: WorkerRecord, query: RouteQuery | None) -> int:
        if query is None or not query.prompt_hashes:
            return 0
        return self.index.num_cached_tokens(record.worker_id, query.prompt_hashes)

    def choose(self, role: Role, candidates: Sequence[WorkerRecord], query: RouteQuery | None) -> WorkerRecord:
        tie_break = _least_loaded_key(role, query)
        if query is None:
            return min(candidates, key=tie_break)

        def cost(record: WorkerRecord):
            added = query.num_prompt_tokens - self.weight * self.num_cached_tokens(record, query)
            extra, off_node = node_penalty(record, query) if role is Role.PREFILL else (0.0, False)
            return (record.num_assigned_prompt_tokens + added + extra, off_node, tie_break(record))

        return min(candidates, key=cost)


def make_selector(policy: RoutingPolicy, index: PrefixIndex | None, kv_weight: float) -> Selector:
    if policy is RoutingPolicy.ROUND_ROBIN:
        return RoundRobin()
    if policy is RoutingPolicy.KV_AWARE:
        if index is None:
            raise ValueError("routing_policy kv_aware needs a prefix index")
        return KVAware(index, kv_weight)
    return LeastLoaded()
