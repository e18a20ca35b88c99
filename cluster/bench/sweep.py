"""Request-rate sweeps: the latency/throughput curve, and the highest rate that meets the SLOs.

A sweep runs the same workload at each rate of a grid, then optionally bisects between the
highest passing rate and the next failing one. A rate passes when at least ``target``
(default 90%) of its requests met every SLO. The answer is the highest rate below which
every rate tried also passed: a lucky pass above a failure is noise, not a rate the cluster
sustains.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from cluster.bench.metrics import BenchMetrics

logger = logging.getLogger(__name__)

DEFAULT_TARGET = 0.9


@dataclass(slots=True)
class SweepPoint:
    rate: float  # offered requests per second
    metrics: BenchMetrics

    @property
    def attainment(self) -> float:
        return self.metrics.slo_attainment


@dataclass(slots=True)
class SweepResult:
    target: float
    points: list[SweepPoint] = field(default_factory=list)  # by rate
    max_rate: float | None = None  # None: even the lowest rate missed the target


def max_rate_meeting(points: list[tuple[float, float]], target: float = DEFAULT_TARGET) -> float | None:
    """Highest rate of (rate, attainment) pairs such that it and every lower rate reach ``target``."""
    best = None
    for rate, attainment in sorted(points):
        if attainment < target:
            break
        best = rate
    return best


def bisection_bounds(points: list[tuple[float, float]], target: float = DEFAULT_TARGET) -> tuple[float, float] | None:
    """(highest passing rate, lowest failing rate above it) to bisect, or None if there is no such gap."""
    best = max_rate_meeting(points, target)
    if best is None:
        return None
    above = [rate for rate, _ in points if rate > best]
    return (best, min(above)) if above else None


async def run_sweep(
    run_at: Callable[[float], Awaitable[BenchMetrics]],
    rates: list[float],
    target: float = DEFAULT_TARGET,
    refine_steps: int = 0,
) -> SweepResult:
    """Run ``run_at`` at every rate, then ``refine_steps`` bisections; return the points and the answer."""
    if not rates or any(not r > 0 or r == float("inf") for r in rates):
        raise ValueError(f"sweep: rates must be finite and > 0, got {rates}")
    if not 0 < target <= 1:
        raise ValueError(f"sweep_target: must be in (0, 1], got {target}")
    result = SweepResult(target=target)

    async def measure(rate: float) -> None:
        metrics = await run_at(rate)
        result.points.append(SweepPoint(rate, metrics))
        logger.info("sweep: %.3f req/s -> SLO attainment %.1f%%, goodput %.3f req/s", rate, 100 * metrics.slo_attainment, metrics.goodput)

    for rate in sorted(set(rates)):
        await measure(rate)
    for _ in range(refine_steps):
        bounds = bisection_bounds([(p.rate, p.attainment) for p in result.points], target)
        if bounds is None:
            break
        await measure(sum(bounds) / 2)
    result.points.sort(key=lambda p: p.rate)
    result.max_rate = max_rate_meeting([(p.rate, p.attainment) for p in result.points], target)
    return result
