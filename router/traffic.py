"""What the router has seen lately: arrivals, request sizes and per-stage queue times.

The autoscaler (``cluster/autoscaler.py``) reads a snapshot of the last minutes:
the arrival rate it plans for, the request mix it plans with, and the queue times that say
whether the pools keep up (time in the router's queue waiting for decode capacity, in the
prefill workers' queues, and between the KV landing and the decode batch taking it).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class TrafficSnapshot:
    window_s: float  # the span observed: the window asked for, or less for a router younger than it
    num_arrivals: int
    num_finished: int
    arrival_rate: float  # requests per second over the window
    mean_prompt_tokens: float
    mean_output_tokens: float
    router_queue_ms_p90: float
    prefill_queue_ms_p90: float
    decode_queue_ms_p90: float


HORIZON_S = 900.0  # the router keeps this much traffic history: the longest window a decision may look at


class TrafficWindow:
    def __init__(self, horizon_s: float = HORIZON_S, clock=time.monotonic) -> None:
        self.horizon_s = horizon_s  # nothing older is kept
        self._clock = clock
        self._arrivals: deque[float] = deque()
        # (when, prompt tokens, output tokens, router queue ms, prefill queue ms, decode queue ms)
        self._finished: deque[tuple[float, int, int, float, float, float]] = deque()
        self.started = clock()
        self.total_arrivals = 0  # since start (a router replica reports what it carried)
        self.total_output_tokens = 0

    def on_arrival(self) -> None:
        now = self._clock()
        self.total_arrivals += 1
        self._arrivals.append(now)
        self._forget(now)

    def on_finished(self, prompt_tokens: int, output_tokens: int, router_queue_ms: float, prefill_queue_ms: float, decode_queue_ms: float) -> None:
        now = self._clock()
        self.total_output_tokens += output_tokens
        self._finished.append((now, prompt_tokens, output_tokens, router_queue_ms, prefill_queue_ms, decode_queue_ms))
        self._forget(now)

    def _forget(self, now: float) -> None:
        cutoff = now - self.horizon_s
        while self._arrivals and self._arrivals[0] < cutoff:
            self._arrivals.popleft()
        while self._finished and self._finished[0][0] < cutoff:
            self._finished.popleft()

    def snapshot(self, window_s: float) -> TrafficSnapshot:
        now = self._clock()
        self._forget(now)
        since = now - window_s
        # A router younger than the window has seen traffic for less time than that.
        span = max(1e-9, min(window_s, now - self.started))
        arrivals = sum(1 for t in self._arrivals if t >= since)
        finished = [r for r in self._finished if r[0] >= since]
        if finished:
            rows = np.asarray([r[1:] for r in finished], dtype=np.float64)
            means = rows[:, :2].mean(axis=0)
            p90 = np.percentile(rows[:, 2:], 90, axis=0)
        else:
            means, p90 = (0.0, 0.0), (0.0, 0.0, 0.0)
        return TrafficSnapshot(
            span, arrivals, len(finished), arrivals / span, float(means[0]), float(means[1]), float(p90[0]), float(p90[1]), float(p90[2])
        )
