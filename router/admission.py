"""Admission: refuse early and cheaply what would wait longer than the TTFT budget.

A request that the cluster will serve only after ``ttft_budget_s`` is better refused at
once (RESOURCE_EXHAUSTED with a retry hint) than queued: the client can retry elsewhere or
later, and the queue does not grow without bound. The estimate is made from measured
rates, never guessed ones; until a rate is measured it does not refuse:

- prefill wait: prompt tokens queued on the prefill pool (plus this prompt) over the
  pool's measured prefill throughput (tokens per second of busy time);
- KV wait: blocks the decode pool lacks for the requests waiting for room (plus this one)
  over the measured rate at which finished requests give blocks back.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass


class BusyRate:
    """Work per second while busy: e.g. prompt tokens a prefill actor completes per second.

    Each completion is timed from the later of the previous completion and the moment the
    work became busy, so idle gaps do not count as slowness. An exponential average smooths it.
    """

    def __init__(self, smoothing: float = 0.3):
        self.smoothing = smoothing
        self.per_second: float | None = None
        self._last_done: float | None = None

    def done(self, amount: float, busy_since: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        start = busy_since if self._last_done is None else max(busy_since, self._last_done)
        self._last_done = now
        elapsed = now - start
        if elapsed <= 0 or amount <= 0:
            return
        sample = amount / elapsed
        self.per_second = sample if self.per_second is None else (
            self.smoothing * sample + (1 - self.smoothing) * self.per_second
        )


class WindowRate:
    """Amount per second over a sliding window: e.g. KV blocks that finished requests free.

    ``clock``: the seconds it measures in (default: the monotonic clock). A clock that runs only
    while something holds (the seconds the decode pool was short of room) gives the rate during
    that: what the KV term of a wait needs, which applies only while the pool is short; over wall
    time, a window of light traffic (one request freeing 10 blocks in 29 s) made a burst that filled
    the pool look minutes from room, and refused it."""

    def __init__(self, window_s: float = 30.0, clock=time.monotonic):
        self.window_s = window_s
        self.clock = clock
        self._events: collections.deque[tuple[float, float]] = collections.deque()
        self._started: float | None = None

    def add(self, amount: float, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        if self._started is None:
            self._started = now
        self._events.append((now, amount))
        self._trim(now)

    def per_second(self, now: float | None = None) -> float | None:
        now = self.clock() if now is None else now
        self._trim(now)
        if not self._events or self._started is None:
            return None
        span = min(self.window_s, now - self._started)
        if span < 1.0:
            return None  # too little history to say anything
        return sum(amount for _, amount in self._events) / span

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()


@dataclass(slots=True)
class WaitEstimate:
    prefill_s: float | None  # the queued prompts ahead of it, then its own
    kv_s: float | None
    own_s: float = 0.0  # of prefill_s, its own prompt's: no later moment shortens that

    @property
    def total_s(self) -> float | None:
        parts = [p for p in (self.prefill_s, self.kv_s) if p is not None]
        return sum(parts) if parts else None

    @property
    def ahead_s(self) -> float | None:
        """The wait that others' work makes: what a retry later would not have."""
        total = self.total_s
        return None if total is None else total - self.own_s


def estimate_wait(
    queued_prompt_tokens: int,
    prefill_tokens_per_s: float | None,
    kv_blocks_short: int,
    kv_blocks_freed_per_s: float | None,
    own_prompt_tokens: int = 0,
) -> WaitEstimate:
    """Seconds until a new request would get its first token computed, from measured rates
    (``queued_prompt_tokens`` include its own ``own_prompt_tokens``)."""
    prefill_s = None
    own_s = 0.0
    if prefill_tokens_per_s:
        prefill_s = queued_prompt_tokens / prefill_tokens_per_s
        own_s = own_prompt_tokens / prefill_tokens_per_s
    kv_s = 0.0 if kv_blocks_short <= 0 else None
    if kv_blocks_short > 0 and kv_blocks_freed_per_s:
        kv_s = kv_blocks_short / kv_blocks_freed_per_s
    return WaitEstimate(prefill_s, kv_s, own_s)
