"""A plan for a day: pool sizes per hour of a diurnal load, checked by simulating the whole day.

Each hour is planned at the highest rate the hour reaches (its start, middle or end) times
``headroom``, so the pools are sized for the hour's peak (a plan is judged on a few thousand
simulated requests; an hour of them at the edge of the SLO drifts past it, hence the margin). The day is then simulated with the pools following the
plan: a pool grows ``startup_s`` before its hour starts (new workers need that long to load),
shrinks at the hour's start by draining. The check is per hour: the SLO percentile of TTFT and
TPOT of the requests that hour, and the worker-hours against one static deployment sized for
the day's peak.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from cluster.planning.planner import Plan, Planner
from cluster.planning.simulator import PoolChange, SimResult, simulate
from cluster.planning.workload import WorkloadModel

HOURS = 24


@dataclass(slots=True)
class DayPlan:
    slot_s: float
    rates: list[float]
    plans: list[Plan]
    day: SimResult | None = None
    planning_s: float = 0.0
    simulating_s: float = 0.0
    percentile: float = 90.0
    slo: tuple[float, float] = (0.0, 0.0)
    paths: list[Path] = field(default_factory=list)

    @property
    def all_feasible(self) -> bool:
        return all(p.feasible for p in self.plans)

    def worker_hours(self) -> float:
        return sum((p.num_prefill or 0) + (p.num_decode or 0) for p in self.plans) * self.slot_s / 3600

    def static_worker_hours(self) -> float:
        peak = max(((p.num_prefill or 0) + (p.num_decode or 0)) for p in self.plans)
        return peak * len(self.plans) * self.slot_s / 3600

    def hourly(self) -> list[dict]:
        rows = []
        windows = self.day.windows if self.day is not None else []
        for hour, (rate, plan) in enumerate(zip(self.rates, self.plans)):
            window = windows[hour] if hour < len(windows) else None
            row = {"hour": hour, "rate": rate, "num_prefill": plan.num_prefill, "num_decode": plan.num_decode}
            if window is not None:
                row.update(
                    arrived=window.arrived, completed=window.completed, rejected=window.rejected,
                    ttft_ms=window.ttft.percentile(self.percentile), tpot_ms=window.tpot.percentile(self.percentile),
                )
            rows.append(row)
        return rows

    def summary(self) -> str:
        ttft_slo, tpot_slo = self.slo
        lines = [f"{'hour':>4} {'req/s':>7} {'P':>4} {'D':>4} {'TTFT p' + format(self.percentile, 'g'):>10} {'TPOT p' + format(self.percentile, 'g'):>10}  SLO"]
        for row in self.hourly():
            ttft, tpot = row.get("ttft_ms"), row.get("tpot_ms")
            ok = ttft is not None and ttft <= ttft_slo and (tpot is None or tpot <= tpot_slo) and not row.get("rejected")
            lines.append(
                f"{row['hour']:>4} {row['rate']:>7.2f} {row['num_prefill'] if row['num_prefill'] is not None else '-':>4}"
                f" {row['num_decode'] if row['num_decode'] is not None else '-':>4} {_ms(ttft):>10} {_ms(tpot):>10}  {'met' if ok else 'MISSED'}"
            )
        lines.append(
            f"worker-hours: {self.worker_hours():.0f} following the plan, {self.static_worker_hours():.0f} static at the peak's size"
            f" ({self.worker_hours() / max(self.static_worker_hours(), 1e-9):.2f}x)"
        )
        if self.day is not None:
            lines.append(
                f"planned in {self.planning_s:.0f} s; the day ({self.day.num_requests} requests, up to"
                f" {self.day.num_prefill} + {self.day.num_decode} workers) simulated in {self.simulating_s:.0f} s"
            )
        lines += [f"wrote {p}" for p in self.paths]
        return "\n".join(lines)


def plan_day(planner: Planner, workload: WorkloadModel, out_dir: Path | None = None, startup_s: float = 60.0, headroom: float = 1.0) -> DayPlan:
    diurnal = workload.diurnal
    slot = diurnal.period_s / HOURS
    rates = [max(diurnal.rate_at(h * slot), diurnal.rate_at((h + 0.5) * slot), diurnal.rate_at((h + 1) * slot)) for h in range(HOURS)]
    started = time.perf_counter()
    by_rate: dict[float, Plan] = {}
    plans = []
    for rate in rates:
        key = round(rate, 3)
        if key not in by_rate:
            by_rate[key] = planner.plan(rate * headroom)
        plans.append(by_rate[key])
    day = DayPlan(slot, rates, plans, planning_s=time.perf_counter() - started, percentile=planner.slo.percentile,
                  slo=(planner.slo.ttft_ms, planner.slo.tpot_ms))
    if day.all_feasible:
        started = time.perf_counter()
        day.day = simulate_day(planner, workload, plans, slot, startup_s)
        day.simulating_s = time.perf_counter() - started
    if out_dir is not None:
        day.paths = write_day(day, out_dir)
    return day


def simulate_day(planner: Planner, workload: WorkloadModel, plans: list[Plan], slot_s: float, startup_s: float) -> SimResult:
    """One day of ``workload`` with the pools following ``plans`` (one per slot)."""
    day = WorkloadModel.from_dict({**workload.to_dict(), "duration_s": slot_s * len(plans), "num_requests": None})
    changes = []
    for hour in range(1, len(plans)):
        before, after = plans[hour - 1], plans[hour]
        grows = after.num_prefill > before.num_prefill or after.num_decode > before.num_decode
        # Grow ahead of the hour (workers take startup_s to load); shrink when it starts.
        at = hour * slot_s - (startup_s if grows else 0.0)
        changes.append(PoolChange(at, max(after.num_prefill, before.num_prefill) if grows else after.num_prefill,
                                  max(after.num_decode, before.num_decode) if grows else after.num_decode))
        if grows and (after.num_prefill < before.num_prefill or after.num_decode < before.num_decode):
            changes.append(PoolChange(hour * slot_s, after.num_prefill, after.num_decode))
    first = plans[0]
    return simulate(planner.profile, day, first.num_prefill, first.num_decode, window_s=slot_s, worker_startup_s=startup_s, pool_changes=changes,
                    pipeline=planner.pipeline)


def write_day(day: DayPlan, out_dir: Path) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    body = {
        "slo": {"ttft_ms": day.slo[0], "tpot_ms": day.slo[1], "percentile": day.percentile},
        "hours": day.hourly(),
        "worker_hours": day.worker_hours(),
        "static_worker_hours": day.static_worker_hours(),
        "planning_s": day.planning_s,
        "simulating_s": day.simulating_s,
        "day": day.day.to_dict() if day.day is not None else None,
    }
    json_path = out_dir / "diurnal_plan.json"
    json_path.write_text(json.dumps(body, indent=2) + "\n")
    return [json_path, _plot_day(day, out_dir / "diurnal_plan.png")]


def _plot_day(day: DayPlan, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = day.hourly()
    hours = [r["hour"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    top.step(hours, [r["num_prefill"] or 0 for r in rows], where="post", label="prefill workers", color="tab:blue")
    top.step(hours, [r["num_decode"] or 0 for r in rows], where="post", label="decode workers", color="tab:orange")
    top.set_ylabel("workers")
    rate_axis = top.twinx()
    rate_axis.plot(hours, day.rates, color="gray", linestyle="--", label="peak rate in the hour")
    rate_axis.set_ylabel("requests / s")
    top.legend(loc="upper left")
    rate_axis.legend(loc="upper right")
    top.set_title(f"plan for a diurnal load: TTFT p{day.percentile:g} <= {day.slo[0]:g} ms, TPOT p{day.percentile:g} <= {day.slo[1]:g} ms")
    bottom.plot(hours, [r.get("ttft_ms") or 0 for r in rows], marker="o", label=f"TTFT p{day.percentile:g} (simulated)")
    bottom.axhline(day.slo[0], color="tab:blue", linestyle=":", label="TTFT SLO")
    bottom.set_ylabel("TTFT ms")
    tpot_axis = bottom.twinx()
    tpot_axis.plot(hours, [r.get("tpot_ms") or 0 for r in rows], marker="s", color="tab:red", label=f"TPOT p{day.percentile:g} (simulated)")
    tpot_axis.axhline(day.slo[1], color="tab:red", linestyle=":", label="TPOT SLO")
    tpot_axis.set_ylabel("TPOT ms")
    bottom.set_xlabel("hour of the day")
    bottom.legend(loc="upper left")
    tpot_axis.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"
