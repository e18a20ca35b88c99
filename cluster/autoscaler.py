"""The SLA autoscaler: the controller applies the planner's pool sizes to the load it observes.

Off unless the deployment configures it. Every ``interval_s`` it reads the router's recent
traffic (``router.traffic``): the arrival rate over ``window_s``, the mean prompt and output
lengths, and the per-stage queue times. It plans for the rate times ``headroom`` with that
request mix, then corrects the plan by what it sees: a stage whose 90th-percentile queue time
exceeds ``queue_fraction`` of the TTFT target while the plan would not grow it gets one more
worker (the profile underestimates that stage), and keeps that size while the load does (once
the queue is gone the plan alone would drain it, and the queue grow back). Decisions have
hysteresis: a pool grows as soon as a tick asks for more; it shrinks only after every tick for
``scale_down_delay_s`` asked for less, and then to the largest size those ticks asked for.
Shrinking drains (the pool manager removes a worker once it holds nothing).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path

from cluster.planning.planner import SLO, Planner
from cluster.planning.profile import Profile
from cluster.planning.simulator import PipelineSettings
from cluster.planning.workload import WorkloadModel
from router.traffic import TrafficSnapshot

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class AutoscalerConfig:
    profile: Path
    slo_ttft_ms: float
    slo_tpot_ms: float
    percentile: float = 90.0
    interval_s: float = 30.0
    window_s: float = 120.0
    headroom: float = 1.2  # plan for this multiple of the observed rate
    max_workers: int = 16
    min_prefill: int = 0
    min_decode: int = 1
    scale_down_delay_s: float = 300.0
    queue_fraction: float = 0.5
    min_arrivals: int = 5  # fewer in a whole window: the rate is noise, planned at its bound (min_arrivals over the window)

    def validate(self) -> None:
        for name in ("interval_s", "window_s", "headroom", "slo_ttft_ms", "slo_tpot_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"autoscaler.{name}: must be > 0, got {getattr(self, name)}")
        if self.min_decode < 1 or self.min_prefill < 0:
            raise ValueError("autoscaler.min_decode: must be >= 1 (and min_prefill >= 0)")
        if self.min_prefill + self.min_decode > self.max_workers:
            raise ValueError(f"autoscaler.max_workers: {self.max_workers} is below min_prefill + min_decode")
        if self.scale_down_delay_s < 0:
            raise ValueError(f"autoscaler.scale_down_delay_s: must be >= 0, got {self.scale_down_delay_s}")


# A pool the queue correction grew keeps its size until the arrival rate falls this much below
# the rate it grew at (or the plan stays two smaller).
CORRECTION_LOAD_DROP = 0.25


@dataclass(slots=True)
class Decision:
    at: float
    rate: float
    planned: tuple[int, int]  # what the planner (and the queue correction) asked for
    applied: tuple[int, int] | None  # what the pools were set to (None: left as they were)
    reason: str


@dataclass(slots=True)
class _Correction:
    plan: int  # the plan's own size when the queue correction grew the pool
    rate: float  # the arrival rate then
    size: int  # the size it grew the pool to
    lighter_since: float | None = None  # since when the plan has been two smaller


@dataclass(slots=True)
class _Shrink:
    since: float
    largest: tuple[int, int]


class Autoscaler:
    def __init__(
        self,
        config: AutoscalerConfig,
        planner: Planner,
        observe: Callable[[float], TrafficSnapshot],
        current: Callable[[], tuple[int, int]],
        apply: Callable[[int, int], Awaitable[None]],
        clock: Callable[[], float] = time.monotonic,
    ):
        config.validate()
        self.config = config
        self.planner = planner
        self._observe = observe
        self._current = current
        self._apply = apply
        self._clock = clock
        self._shrink: _Shrink | None = None
        self.decisions: list[Decision] = []
        self._task: asyncio.Task | None = None
        # Changes being applied: each in a task of its own, so that a scale-down's drains (up to
        # drain_timeout_s) or a scale-up's launches never hold up the next decisions.
        self._applying: set[asyncio.Task] = set()
        self._target: tuple[int, int] | None = None  # the sizes last asked for
        # Per pool (0: prefill, 1: decode): the size the queue correction took it to, kept.
        self._corrections: dict[int, _Correction] = {}
        self._changed_at: float | None = None  # when the pools last finished changing
        self.in_process = False  # True: plan on the caller's thread (tests); else in a worker process
        self._executor: concurrent.futures.ProcessPoolExecutor | None = None

    @classmethod
    def from_config(cls, config: AutoscalerConfig, observe, current, apply, clock=time.monotonic,
                    pipeline: PipelineSettings | None = PipelineSettings(), aggregated: bool = False) -> "Autoscaler":
        """``pipeline``: how the deployment's router pipelines long prompts (the planner's
        simulations do as it does; None: it does not); ``aggregated``: it never disaggregates
        (only decode workers are planned: a prefill worker would get no prompt)."""
        profile = Profile.load(config.profile)
        mix = WorkloadModel(rate=1.0, num_requests=1, input_len=256, output_len=64, range_ratio=0.5)
        planner = Planner(profile, mix, SLO(config.slo_ttft_ms, config.slo_tpot_ms, config.percentile), config.max_workers,
                          pipeline=pipeline, aggregated=aggregated)
        return cls(config, planner, observe, current, apply, clock)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        for task in (self._task, *self._applying):
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in (self._task, *self._applying) if t is not None), return_exceptions=True)
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                await self.tick()
            except Exception:  # a failed tick leaves the pools as they are; the next one tries again
                logger.exception("autoscaler tick failed")

    async def tick(self) -> Decision:
        snapshot = self._observe(self.config.window_s)
        # While a change is being applied the pools are what it asks for: their routable workers
        # lag the launches (minutes for a model load), and taken for the size they made a dip
        # look like growth, applied at once past scale_down_delay_s.
        current = self._target if self._applying and self._target is not None else self._current()
        # The queue times over the window show the pools as they were before the last change
        # until a window has passed since it was done: corrected on them, each tick added one more.
        settled = not self._applying and (self._changed_at is None or self._clock() - self._changed_at >= self.config.window_s)
        if self.in_process:
            planned, base, reason = self.plan(snapshot, current, settled)
        else:
            # Planning runs simulations in pure Python for seconds: in a process of its own, so
            # that the router sharing this event loop (and its GIL) keeps serving meanwhile.
            try:
                if self._executor is None:
                    self._executor = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
                loop = asyncio.get_running_loop()
                planned, base, reason = await loop.run_in_executor(
                    self._executor, planned_sizes, self.planner, self.config, snapshot, current, settled)
            except (OSError, concurrent.futures.process.BrokenProcessPool) as exc:
                logger.warning("autoscaler: planning process unavailable (%r); planning on a thread", exc)
                self._executor = None
                planned, base, reason = await asyncio.to_thread(planned_sizes, self.planner, self.config, snapshot, current, settled)
        planned, reason = self._keep_corrections(planned, base, reason, snapshot.arrival_rate)
        applied = self._with_hysteresis(planned, current, settled)
        decision = Decision(self._clock(), snapshot.arrival_rate, planned, applied, reason)
        self.decisions.append(decision)
        del self.decisions[:-1000]
        if applied is not None and applied != current:
            logger.info("autoscaler: %.2f req/s (%s): pools %d+%d -> %d+%d", snapshot.arrival_rate, reason, *current, *applied)
            self._target = applied
            task = asyncio.create_task(self._apply(*applied))
            self._applying.add(task)
            task.add_done_callback(self._applied)
        return decision

    def _applied(self, task: asyncio.Task) -> None:
        self._applying.discard(task)
        self._changed_at = self._clock()  # failed too: the pools keep the sizes asked for, relaunching
        if not task.cancelled() and task.exception() is not None:
            # The pools keep the sizes asked for and relaunch what did not start; the next ticks plan on.
            logger.warning("autoscaler: applying a change failed: %r", task.exception())

    async def settle(self) -> None:
        """Wait until every change asked for so far has been applied (drains done, launches up)."""
        while self._applying:
            await asyncio.gather(*self._applying, return_exceptions=True)

    def target(self, snapshot: TrafficSnapshot, current: tuple[int, int], settled: bool = True) -> tuple[tuple[int, int], str]:
        """The sizes this snapshot asks for, and why (no hysteresis)."""
        return plan_target(self.planner, self.config, snapshot, current, settled)

    def plan(self, snapshot: TrafficSnapshot, current: tuple[int, int], settled: bool = True) -> tuple[tuple[int, int], tuple[int, int] | None, str]:
        """``planned_sizes`` on this thread (``in_process``)."""
        return planned_sizes(self.planner, self.config, snapshot, current, settled)

    def _keep_corrections(self, planned: tuple[int, int], base: tuple[int, int] | None, reason: str, rate: float) -> tuple[tuple[int, int], str]:
        """A pool the queue correction grew keeps that size while the load does: the plan alone
        (``base``) is what left it short, and once its queue was gone the plan drained the
        worker (the queue grew back, and a worker came and went every few minutes). A quarter
        less traffic lets it go, or a plan two smaller for ``scale_down_delay_s`` (lighter
        requests at the same rate): the mean lengths a tick reads move the plan by one either
        way on their own (and at the pool's minimum the plan cannot get smaller)."""
        if base is None:  # no plan this tick (no shape meets the SLO: heavy load; too little seen)
            for kept in self._corrections.values():
                kept.lighter_since = None  # (it is no tick of lighter requests)
            return planned, reason
        now = self._clock()
        sizes = list(planned)
        for pool in (0, 1):
            if planned[pool] > base[pool]:  # corrected this tick
                self._corrections[pool] = _Correction(base[pool], rate, planned[pool])
            elif pool in self._corrections:
                kept = self._corrections[pool]
                lighter = base[pool] <= kept.plan - 2  # (lasting: one tick high, the next low is two at one load)
                if not lighter:
                    kept.lighter_since = None
                elif kept.lighter_since is None:
                    kept.lighter_since = now
                if rate < (1 - CORRECTION_LOAD_DROP) * kept.rate or (lighter and now - kept.lighter_since >= self.config.scale_down_delay_s):
                    del self._corrections[pool]  # less load, or lighter requests, than the pool was short at
                elif kept.size > sizes[pool]:
                    sizes[pool] = kept.size
                    reason += f"; {('prefill', 'decode')[pool]} kept at {kept.size} for its queue"
        return _within_cap(sizes[0], sizes[1], self.config), reason

    def _with_hysteresis(self, planned: tuple[int, int], current: tuple[int, int], settled: bool = True) -> tuple[int, int] | None:
        now = self._clock()
        if planned == current:
            self._shrink = None
            return None
        if planned[0] > current[0] or planned[1] > current[1]:
            # Grow what is short now; a pool the plan would shrink keeps its size meanwhile, except
            # for the room the growth needs within max_workers, which it gives up now, down to its
            # plan (current (10, 6) and a plan of (4, 10) within 16: (6, 10). Trimmed by size, it
            # came out (8, 8), and every later tick grew nothing and never let prefill shrink).
            self._shrink = None
            sizes = [max(planned[0], current[0]), max(planned[1], current[1])]
            over = sum(sizes) - self.config.max_workers
            if over > 0 and not settled:
                return None  # a move between the pools drains workers: once the last change has landed
            for pool in (0, 1):
                if over > 0 and planned[pool] < current[pool]:
                    given = min(over, current[pool] - planned[pool])
                    sizes[pool] -= given
                    over -= given
            return _within_cap(sizes[0], sizes[1], self.config)
        if not settled:
            # A change still lands (a model loading for minutes) or its window is not over: a
            # worker the queue correction just added is judged once it has served, not drained
            # as it arrives (the unsettled ticks plan without the correction).
            self._shrink = None
            return None
        if self._shrink is None:
            self._shrink = _Shrink(now, planned)
            return None
        self._shrink.largest = (max(self._shrink.largest[0], planned[0]), max(self._shrink.largest[1], planned[1]))
        if now - self._shrink.since < self.config.scale_down_delay_s:
            return None
        target, self._shrink = self._shrink.largest, None
        return target


def plan_target(planner: Planner, config: AutoscalerConfig, snapshot: TrafficSnapshot, current: tuple[int, int],
                settled: bool = True) -> tuple[tuple[int, int], str]:
    """The pool sizes a traffic snapshot asks for, and why (no hysteresis; picklable for a worker
    process). ``settled``: a window has passed since the pools last changed, so their queue
    times are their own (else no worker is added for them)."""
    sizes, _, reason = planned_sizes(planner, config, snapshot, current, settled)
    return sizes, reason


def planned_sizes(planner: Planner, config: AutoscalerConfig, snapshot: TrafficSnapshot, current: tuple[int, int],
                  settled: bool = True) -> tuple[tuple[int, int], tuple[int, int] | None, str]:
    """``plan_target``'s sizes, the plan's own before the queue correction (within the
    minimums; None: no plan was made, the sizes are the pools'), and why."""
    rate, few = snapshot.arrival_rate, ""
    if snapshot.num_arrivals < config.min_arrivals:
        if snapshot.window_s < config.window_s:  # a router younger than the window: too little seen
            return current, None, f"{snapshot.num_arrivals} arrivals in the window: too few to plan from"
        if snapshot.num_arrivals == 0:
            idle = (config.min_prefill, config.min_decode)
            return idle, idle, "no traffic"
        # Fewer than min_arrivals in a whole window: the rate is at most min_arrivals over it.
        # Keeping the sizes instead held pools sized for a peak through a night of light traffic.
        rate, few = config.min_arrivals / snapshot.window_s, f" (at most: {snapshot.num_arrivals} arrivals in the window)"
    mix = planner.mix
    if snapshot.num_finished:
        mix = replace(
            mix, input_len=max(1, round(snapshot.mean_prompt_tokens)), output_len=max(1, round(snapshot.mean_output_tokens)),
            long_fraction=0.0, trace=None, lengths=None,  # the observed means, not a configured trace's lengths
        )
    planner = replace(planner, mix=mix)
    plan = planner.plan(rate * config.headroom)
    if plan.feasible:
        prefill, decode = plan.num_prefill, plan.num_decode
        reason = f"plan for {rate * config.headroom:.2f} req/s{few}"
        base = max(config.min_prefill, prefill), max(config.min_decode, decode)
    elif (closest := planner.closest(plan)) is not None:
        # Overload no shape meets: grown toward the one that comes closest (kept, the pools stayed
        # as they were and grew a worker a window through the queue correction: minutes behind a
        # spike). Only grown: the closest shape moves with the load, and workers moved between
        # the pools in overload would be capacity lost while the new ones load.
        prefill, decode = max(closest.num_prefill, current[0]), max(closest.num_decode, current[1])
        reason = (f"no shape within {config.max_workers} workers meets the SLO at {rate * config.headroom:.2f} req/s{few}; "
                  f"the closest: {closest.num_prefill} prefill, {closest.num_decode} decode")
        base = max(config.min_prefill, prefill), max(config.min_decode, decode)
    else:
        prefill, decode = current
        reason = f"no shape within {config.max_workers} workers holds every prompt"
        base = None
    budget = config.slo_ttft_ms * config.queue_fraction
    settled = settled and not few  # queue times of a handful of requests are noise too
    if settled and snapshot.prefill_queue_ms_p90 > budget and prefill <= current[0] and current[0] > 0:
        prefill = current[0] + 1
        reason += f"; prefill queue p90 {snapshot.prefill_queue_ms_p90:.0f} ms"
    if settled and max(snapshot.router_queue_ms_p90, snapshot.decode_queue_ms_p90) > budget and decode <= current[1]:
        decode = current[1] + 1
        reason += f"; decode queue p90 {max(snapshot.router_queue_ms_p90, snapshot.decode_queue_ms_p90):.0f} ms"
    prefill = max(config.min_prefill, prefill)
    decode = max(config.min_decode, decode)
    return _within_cap(prefill, decode, config), base, reason


def _within_cap(prefill: int, decode: int, config: AutoscalerConfig) -> tuple[int, int]:
    """The sizes within ``max_workers`` (the queue correction may overshoot it), never below a
    minimum (the decode minimum was taken from: (4, 4) with min_decode 5 and 8 workers at most
    came out (4, 4)); validate keeps the minimums within the cap."""
    while prefill + decode > config.max_workers:
        if prefill > config.min_prefill and (prefill >= decode or decode <= config.min_decode):
            prefill -= 1
        elif decode > config.min_decode:
            decode -= 1
        else:
            break
    return prefill, decode


def observed_sizes(pools) -> tuple[int, int]:
    """Workers per pool of a ``PoolManager``, the replacements of dead ones still starting
    included: counted out, a tick that grew the other pool applied this one's size without them,
    and the scale (which counts them) drained a ready worker in their place."""
    from router.pool import Role

    return pools.num_coming(Role.PREFILL), pools.num_coming(Role.DECODE)


async def apply_sizes(pools, num_prefill: int, num_decode: int) -> None:
    from router.pool import Role

    await asyncio.gather(pools.scale(Role.PREFILL, num_prefill), pools.scale(Role.DECODE, num_decode))

