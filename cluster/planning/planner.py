"""The SLA planner: the cheapest prefill:decode counts that meet a latency target at a load.

Every candidate shape is judged by the simulator (``cluster.planning.simulator``) on the
workload's request mix at the planned rate: it meets the SLO when the chosen percentile of
TTFT and of TPOT are within their targets and nothing is refused. Two families are searched:
no prefill worker (the decode workers prefill everything; the fewest that meet the SLO, by
binary search), and disaggregated shapes by coordinate descent from an estimate of the prefill
workers the rate keeps busy: the fewest decode workers for that prefill count, the fewest
prefill workers for that decode count, again until neither moves (TTFT depends mostly on the
prefill pool, TPOT on the decode pool; more workers of a pool never hurt). A few dozen
simulations per plan, whatever ``max_workers`` is: planning a 200-worker cluster takes the
same number of steps as a 4-worker one.

A worker of a tensor-parallel pool (``DeploymentFacts.tensor_parallel_size``, per pool) holds that
many devices: it costs that many times its pool's device cost and counts that many against
``max_devices``. Profiles of different sizes are planned each on its own, and in pairs (the
prefill pool's from one, the decode pool's from another: ``profile.combine_profiles``); the
cheapest plan says which sizes to run (``cheapest``): a larger size has faster steps and more KV
room per worker, at more devices each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cluster.planning.profile import Profile
from cluster.planning.simulator import PipelineSettings, SimResult, simulate
from cluster.planning.workload import WorkloadModel

_DESCENT_ROUNDS = 4


@dataclass(slots=True)
class SLO:
    ttft_ms: float
    tpot_ms: float
    percentile: float = 90.0

    def validate(self) -> None:
        if not self.ttft_ms > 0:
            raise ValueError(f"slo_ttft_ms: must be > 0, got {self.ttft_ms}")
        if not self.tpot_ms > 0:
            raise ValueError(f"slo_tpot_ms: must be > 0, got {self.tpot_ms}")
        if not 0 < self.percentile < 100:
            raise ValueError(f"percentile: must be in (0, 100), got {self.percentile}")

    def met_by(self, result: SimResult) -> bool:
        if result.rejected or result.completed < result.num_requests:
            return False
        ttft = result.ttft.percentile(self.percentile)
        tpot = result.tpot.percentile(self.percentile)
        return ttft is not None and ttft <= self.ttft_ms and (tpot is None or tpot <= self.tpot_ms)


@dataclass(slots=True)
class Candidate:
    num_prefill: int
    num_decode: int
    meets_slo: bool
    ttft_ms: float | None
    tpot_ms: float | None
    fits: bool = True  # every prompt fits a decode worker's KV cache (a rejection for a full queue is overload)
    served: float = 1.0  # the share of the requests it completed

    def shortfall(self, slo: SLO) -> float | None:
        """How far the shape is from the SLO: its worse latency over its target (at most 1: it
        meets it), over the share of requests it served (an overloaded shape's latencies are its
        completed requests'); None where some prompt fits no worker."""
        if not self.fits or self.ttft_ms is None or self.served <= 0:
            return None
        return max(self.ttft_ms / slo.ttft_ms, (self.tpot_ms or 0.0) / slo.tpot_ms) / self.served


@dataclass(slots=True)
class Plan:
    rate: float
    num_prefill: int | None  # None: no shape within max_workers meets the SLO
    num_decode: int | None
    cost: float | None
    result: SimResult | None  # the chosen shape's simulation
    candidates: list[Candidate] = field(default_factory=list)
    tensor_parallel_size: dict[str, int] = field(default_factory=lambda: {"prefill": 1, "decode": 1})  # devices per worker, per pool

    @property
    def feasible(self) -> bool:
        return self.num_decode is not None

    @property
    def num_devices(self) -> int | None:
        if not self.feasible:
            return None
        return self.num_prefill * self.tensor_parallel_size["prefill"] + self.num_decode * self.tensor_parallel_size["decode"]

    def to_dict(self) -> dict:
        return {
            "rate": self.rate,
            "num_prefill": self.num_prefill,
            "num_decode": self.num_decode,
            "tensor_parallel_size": self.tensor_parallel_size,
            "num_devices": self.num_devices,
            "cost": self.cost,
            "simulated": self.result.to_dict() if self.result is not None else None,
            "num_candidates": len(self.candidates),
        }


@dataclass(slots=True)
class Planner:
    profile: Profile
    mix: WorkloadModel  # the request mix; its rate is replaced by the planned one
    slo: SLO
    max_workers: int = 16
    prefill_cost: float = 1.0  # of one device of a prefill worker (a worker: its pool's tensor_parallel_size of them)
    decode_cost: float = 1.0
    min_requests: int = 1500
    max_requests: int = 6000
    sim_seconds: float = 300.0  # simulated traffic per candidate, within the request bounds
    max_devices: int | None = None  # most devices of both pools together (None: only max_workers bounds)
    # How the deployment's router pipelines long prompts over the prefill pool (the router's
    # defaults; None: it does not).
    pipeline: PipelineSettings | None = PipelineSettings()
    # The router never disaggregates (router.disaggregation: never): the decode workers prefill
    # every prompt, so only shapes without prefill workers serve as simulated.
    aggregated: bool = False

    def __post_init__(self) -> None:
        self.slo.validate()
        if self.max_workers < 1:
            raise ValueError(f"max_workers: must be >= 1, got {self.max_workers}")
        if self.max_devices is not None and self.max_devices < 1:
            raise ValueError(f"max_devices: must be >= 1, got {self.max_devices}")

    @property
    def devices_per_worker(self) -> dict[str, int]:
        return self.profile.facts.tensor_parallel_size

    def room(self, role: str, num_other: int) -> int:
        """Most workers of ``role`` beside ``num_other`` of the other pool: within ``max_workers``
        and, where set, ``max_devices`` (0: none fits)."""
        other = "decode" if role == "prefill" else "prefill"
        most = self.max_workers - num_other
        if self.max_devices is not None:
            most = min(most, (self.max_devices - num_other * self.devices_per_worker[other]) // self.devices_per_worker[role])
        return max(0, most)

    def cost(self, num_prefill: int, num_decode: int) -> float:
        ranks = self.devices_per_worker
        return num_prefill * self.prefill_cost * ranks["prefill"] + num_decode * self.decode_cost * ranks["decode"]

    def workload_at(self, rate: float) -> WorkloadModel:
        num = int(min(self.max_requests, max(self.min_requests, rate * self.sim_seconds)))
        workload = self.mix.with_rate(rate)
        workload.duration_s, workload.num_requests = None, num
        return workload

    def evaluate(self, rate: float, num_prefill: int, num_decode: int) -> tuple[bool, SimResult]:
        result = simulate(self.profile, self.workload_at(rate), num_prefill, num_decode, pipeline=self.pipeline)
        return self.slo.met_by(result), result

    def plan(self, rate: float) -> Plan:
        """The cheapest shape meeting the SLO at ``rate`` (``Plan.feasible`` False if none fits)."""
        if not rate > 0:
            raise ValueError(f"rate: must be > 0, got {rate}")
        search = _Search(self, rate)
        search.fewest(lambda d: (0, d), self.room("decode", 0))
        disaggregated = None if self.aggregated else search.coordinate_descent(self._prefill_estimate(rate))
        if disaggregated is not None:
            p, d = disaggregated
            # Trading one worker of a pool for one of the other can be cheaper when costs differ.
            for shape in ((p - 1, d + 1), (p + 1, d - 1)):
                if shape[0] >= 1 and shape[1] >= 1:
                    search.meets(*shape)
        # The cheapest of every shape simulated that met the SLO.
        ranks = dict(self.devices_per_worker)
        best = Plan(rate, None, None, None, None, tensor_parallel_size=ranks)
        for (p, d), ok in search.verdicts.items():
            cost = self.cost(p, d)
            if ok and (best.cost is None or cost < best.cost):
                best = Plan(rate, p, d, cost, search.results[p, d], tensor_parallel_size=ranks)
        best.candidates = search.candidates
        return best

    def closest(self, plan: Plan) -> Candidate | None:
        """For a plan no shape met: the shape simulated that came closest to the SLO (fewer
        workers among equals); None where some prompt fits none."""
        scored = [(shortfall, c.num_prefill + c.num_decode, c) for c in plan.candidates if (shortfall := c.shortfall(self.slo)) is not None]
        return min(scored, key=lambda item: item[:2])[2] if scored else None

    def _prefill_estimate(self, rate: float) -> int:
        """Prefill workers to start from: the mean prompt's prefill time at 70% utilization."""
        from cluster.planning.profiler import predicted_prefill_s

        profile = self.profile
        busy_s = predicted_prefill_s(max(1, round(self.mix.mean_input_len)), False, profile.step, profile.transfer, profile.facts)
        return max(1, math.ceil(rate * busy_s / 0.7))


class _Search:
    """Simulations of one plan's candidates, each shape simulated at most once."""

    def __init__(self, planner: Planner, rate: float) -> None:
        self.planner = planner
        self.rate = rate
        self.results: dict[tuple[int, int], SimResult] = {}
        self.verdicts: dict[tuple[int, int], bool] = {}
        self.candidates: list[Candidate] = []

    def meets(self, num_prefill: int, num_decode: int) -> bool:
        shape = (num_prefill, num_decode)
        if shape not in self.verdicts:
            if num_decode > self.planner.room("decode", num_prefill):  # beyond max_workers or max_devices
                return False
            ok, result = self.planner.evaluate(self.rate, num_prefill, num_decode)
            self.verdicts[shape], self.results[shape] = ok, result
            pct = self.planner.slo.percentile
            served = result.completed / result.num_requests if result.num_requests else 1.0
            self.candidates.append(Candidate(num_prefill, num_decode, ok, result.ttft.percentile(pct), result.tpot.percentile(pct), not result.too_long, served))
        return self.verdicts[shape]

    def fewest(self, shape_of, most: int) -> int | None:
        """The smallest n in [1, most] with ``shape_of(n)`` meeting the SLO (more never hurts), or None."""
        if most < 1 or not self.meets(*shape_of(most)):
            return None
        low, high = 1, most
        while low < high:
            middle = (low + high) // 2
            if self.meets(*shape_of(middle)):
                high = middle
            else:
                low = middle + 1
        return high

    def coordinate_descent(self, prefill_guess: int) -> tuple[int, int] | None:
        """Fewest decode workers for a prefill count, then fewest prefill workers for that decode
        count, and again, until neither moves (TTFT depends mostly on the one, TPOT on the other)."""
        planner = self.planner
        most_prefill = planner.room("prefill", 1)  # beside one decode worker at least
        if most_prefill < 1:
            return None  # no room for a worker of each pool
        p = min(prefill_guess, most_prefill)
        while True:  # a prefill count with which some decode count meets the SLO
            d = self.fewest(lambda n: (p, n), planner.room("decode", p))
            if d is not None or p >= most_prefill:
                break
            p = min(most_prefill, p * 2)
        if d is None:
            return None
        for _ in range(_DESCENT_ROUNDS):
            # (Simulated latencies are not perfectly monotone in a pool's size: where a search
            # finds nothing, the count it started from stands.)
            p_next = self.fewest(lambda n: (n, d), planner.room("prefill", d)) or p
            d_next = self.fewest(lambda n: (p_next, n), planner.room("decode", p_next)) or d
            if (p_next, d_next) == (p, d):
                break
            p, d = p_next, d_next
        return p, d


def cheapest(plans: list[Plan]) -> Plan | None:
    """The cheapest feasible plan (the first of equals: list the preferred profile first), or None."""
    feasible = [plan for plan in plans if plan.feasible]
    return min(feasible, key=lambda plan: plan.cost) if feasible else None
