"""Scenario: the simulator against the real deployment, same requests, two workloads x two pool shapes.

For each pool shape (default: one prefill + one decode actor with conditional
disaggregation; no prefill actor and two decode actors that prefill themselves) a local
cluster runs each workload (default: "chat", 256 +- 50% prompt tokens and 64 +- 50% output
tokens; "mixed", 128-token prompts with a fifth of 1024-token ones and 32 output tokens) at
its Poisson rate. The very same requests (arrival offsets, prompt and output lengths) are then
replayed through ``pdserve simulate``'s simulation with the profile, and the measured and
predicted p50 and p99 of TTFT, TPOT and ITL, and the output throughput, are set side by side.
With ``--prefill-pipeline auto`` the clusters pipeline long prompts and so does the simulation;
the "long" workload (2k-6k-token prompts, about one per ``1 / --long-rate`` seconds) is what
that is for.

The profile is fitted on a separate sweep, never on these runs. By default each shape's
cluster is profiled (``pdserve profile``'s sweep) right before its workloads run on it: a
shared host's speed drifts by tens of percent within half an hour (measured here: the decode
step intercept went from 51 to 75 ms in 20 minutes), so a profile from earlier describes
another machine. ``--profile`` (and ``--aggregated-profile`` for shapes without prefill
actors) uses a given profile instead; it must come from the same model, engine settings and
machine. Either way each case also reports how well the profile predicted the steps the
workers ran during that case (their step logs: measured / predicted duration), which
separates the step model's error (drift) from the simulator's.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from cluster.bench.client import BenchClient, RequestRecord
from cluster.bench.metrics import SLO, distribution, e2e_ms, itls_ms, tpot_ms, ttft_ms
from cluster.bench.report import result_document, write_json
from cluster.bench.runner import BenchSpec, run_load
from cluster.bench.scenarios.common import ClusterShape, ScenarioOutcome, engine_config, flags_of, fmt, local_cluster, ray_running, scenario_model
from cluster.bench.workloads import BenchRequest, random_token_ids
from cluster.planning.profile import Profile
from cluster.planning.profiler import SweepPlan, log_positions, run_sweep, step_logs_since, step_model_check
from cluster.planning.simulator import PipelineSettings, SimResult, Simulation
from cluster.planning.workload import WorkloadModel
from router.config import Disaggregation, RouterConfig
from router.pipeline import PipelineMode

NAME = "simulator"
SUMMARY = "simulated vs measured TTFT/TPOT/ITL p50 and p99 and throughput, two workloads on two pool shapes, same requests"
DEFAULT_DTYPE = "float32"

P50_TOLERANCE = 0.15
P99_TOLERANCE = 0.25


@dataclass(slots=True)
class Case:
    shape: str
    workload: str
    measured: dict
    simulated: dict
    # Per role: measured / predicted duration of the steps the workers ran in this case.
    step_check: dict[str, dict[str, float]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--profile", type=Path,
        help="a profile JSON of this model, engine settings and machine (default: profile each shape's cluster before measuring it)",
    )
    parser.add_argument(
        "--aggregated-profile", type=Path,
        help="with --profile: the profile for shapes without prefill actors (`pdserve profile --prefill 0`; default: --profile)",
    )
    parser.add_argument("--quick-profile", action="store_true", help="profile each shape with the quick sweep (tests, tiny models)")
    parser.add_argument("--duration", type=float, default=150.0, help="seconds of arrivals per run")
    parser.add_argument("--chat-rate", type=float, default=0.4, help="requests per second of the chat workload")
    parser.add_argument("--mixed-rate", type=float, default=0.3, help="requests per second of the mixed workload")
    parser.add_argument("--shapes", default="1p1d,0p2d", help="pool shapes: NpMd, comma-separated (0p: no prefill actor)")
    parser.add_argument("--workloads", default="chat,mixed", help="chat, mixed, long (one 2k-6k-token prompt about every 20 s)")
    parser.add_argument("--long-rate", type=float, default=0.05, help="requests per second of the long workload")
    parser.add_argument("--prefill-pipeline", choices=[m.value for m in PipelineMode], default=PipelineMode.OFF.value,
                        help="the clusters' and the simulation's pipelined prefill (prefill.pipeline; its other settings: the router's defaults)")
    parser.add_argument("--kv-cache-mb", type=int, default=1024, help="per actor (as profiled)")
    parser.add_argument("--token-budget", type=int, default=512, help="as profiled")


def workloads(args: argparse.Namespace) -> dict[str, WorkloadModel]:
    return {
        "chat": WorkloadModel(rate=args.chat_rate, duration_s=args.duration, input_len=256, output_len=64, range_ratio=0.5, seed=args.seed),
        "mixed": WorkloadModel(rate=args.mixed_rate, duration_s=args.duration, input_len=128, output_len=32, long_fraction=0.2,
                               long_input_len=1024, seed=args.seed + 1),
        # What a pipelined prefill is for: long prompts that find the prefill pool idle.
        "long": WorkloadModel(rate=args.long_rate, duration_s=args.duration, input_len=4000, output_len=16, range_ratio=0.5,
                              burstiness=20.0, seed=args.seed + 2),
    }


def parse_shape(text: str) -> tuple[int, int]:
    try:
        prefill, decode = text.lower().rstrip("d").split("p")
        return int(prefill), int(decode)
    except ValueError:
        raise ValueError(f"shapes: {text!r} is not of the form NpMd (e.g. 1p1d)") from None


def run(args: argparse.Namespace) -> ScenarioOutcome:
    given = Profile.load(args.profile) if args.profile else None
    aggregated = Profile.load(args.aggregated_profile) if args.aggregated_profile else given
    chosen = {name: w for name, w in workloads(args).items() if name in args.workloads.split(",")}
    shapes = [parse_shape(s) for s in args.shapes.split(",")]
    engine = engine_config(args.dtype, args.token_budget, None, kv_cache_bytes=args.kv_cache_mb * 2**20, seed=args.seed)
    pipeline = PipelineSettings.of(RouterConfig(prefill_pipeline=PipelineMode(args.prefill_pipeline)))
    cases: list[Case] = []
    profiles: dict[str, dict] = {}
    with scenario_model(args.model, args.dtype, args.seed) as model_dir, ray_running():
        for num_prefill, num_decode in shapes:
            label = f"{num_prefill}P+{num_decode}D"
            mode = Disaggregation.AUTO if num_prefill else Disaggregation.NEVER
            shape = ClusterShape(label, num_prefill, num_decode, mode, engine, engine, router_overrides={"prefill_pipeline": pipeline.mode})
            profile = aggregated if not num_prefill else given
            if profile is None and pipeline.mode is not PipelineMode.OFF:
                # The sweep times one actor computing whole prompts (a stage's steps are not
                # logged): on a cluster of the same shape that does not pipeline, just before.
                plain = replace(shape, router_overrides={"prefill_pipeline": PipelineMode.OFF})
                with local_cluster(model_dir, plain) as deployment:
                    profile = _profile_now(deployment, label, model_dir, args)
            with local_cluster(model_dir, shape) as deployment:
                profile = profile or _profile_now(deployment, label, model_dir, args)
                profiles[label] = {"source": profile.source, "step": asdict(profile.step)}
                for index, (name, workload) in enumerate(chosen.items()):
                    trace = list(workload.requests())
                    positions = asyncio.run(log_positions(deployment.handles))
                    # Prompts of their own per workload: one workload's prompts must not be cached
                    # prefixes of the next one's on the same cluster.
                    records = asyncio.run(_measure(deployment.address, trace, f"{label}-{name}", args.seed + 1000 * (index + 1), args))
                    step_logs = asyncio.run(step_logs_since(deployment.handles, positions))
                    simulation = Simulation(profile, num_prefill, num_decode, colocated=True, keep_requests=True, pipeline=pipeline)
                    simulated = simulation.run(trace)
                    case = Case(label, name, measured_figures(records), simulated_figures(simulated, simulation.kept),
                                step_model_check(profile.step, step_logs))
                    # Per request, in trace order: what the client saw and what the simulator predicted.
                    case.measured["requests"] = [[r.prompt_len, r.max_tokens, ttft_ms(r), e2e_ms(r)] for r in records]
                    case.simulated["requests"] = [
                        [q.prompt_len, q.output_len, _finite((q.first_token - q.arrival) * 1000), _finite((q.finished - q.arrival) * 1000)]
                        for q in simulation.kept
                    ]
                    cases.append(case)
    table, worst = comparison(cases)
    config = {"scenario": NAME, **flags_of(args), "workloads": {name: w.to_dict() for name, w in chosen.items()}}
    body = {"profiles": profiles,
            "cases": [{"shape": c.shape, "workload": c.workload, "measured": c.measured, "simulated": c.simulated, "step_model_check": c.step_check}
                      for c in cases],
            "worst_error": worst}
    json_path = write_json(args.out / "scenario.json", result_document(f"scenario:{NAME}", config, body))
    lines = table + [
        f"largest p50 error {fmt(worst['p50'] * 100, '%')} (target {P50_TOLERANCE:.0%}), largest p99 error {fmt(worst['p99'] * 100, '%')}"
        f" (target {P99_TOLERANCE:.0%}), largest throughput error {fmt(worst['throughput'] * 100, '%')}",
    ]
    ok = all(c.measured["failed"] == 0 for c in cases)
    ratios = {"worst_p50_error": worst["p50"], "worst_p99_error": worst["p99"]}
    return ScenarioOutcome(NAME, lines, json_path, ratios, ok=ok)


def _profile_now(deployment, label: str, model_dir: Path, args: argparse.Namespace) -> Profile:
    """Profile the cluster about to be measured (a separate sweep, before its workloads)."""
    plan = SweepPlan.quick() if args.quick_profile else SweepPlan()
    plan.seed = args.seed
    source = {"model": str(model_dir), "dtype": args.dtype, "shape": label, "threads_per_actor": 1}
    profile = asyncio.run(run_sweep(deployment.address, deployment.handles, plan, RouterConfig().local_prefill_max_tokens, source=source))
    profile.save(args.out / f"profile-{label.lower().replace('+', '')}.json")
    return profile


async def _measure(address: str, trace: list[tuple[float, int, int]], label: str, seed: int, args: argparse.Namespace) -> list[RequestRecord]:
    spec = BenchSpec(show_progress=not args.no_progress)
    rng = random.Random(seed)
    async with BenchClient(spec.client_config(address, label)) as client:
        limits = await client.model_limits()
        await client.warm_up([BenchRequest(4, random_token_ids(rng, limits, 64), prompt_len=64) for _ in range(2)])
        requests = [BenchRequest(output, random_token_ids(rng, limits, prompt), prompt_len=prompt) for _, prompt, output in trace]
        output = await run_load(client, requests, [t for t, _, _ in trace], SLO(), label, spec.show_progress)
    return output.records


def measured_figures(records: list[RequestRecord]) -> dict:
    ok = [r for r in records if r.ok]
    ttft = distribution([ttft_ms(r) for r in ok])
    tpot = distribution([v for r in ok if (v := tpot_ms(r)) is not None])
    itl = distribution([gap for r in ok for gap in itls_ms(r)])
    start = min((r.send_s for r in ok), default=0.0)
    end = max((r.end_s for r in ok), default=0.0)
    tokens = sum(r.output_tokens for r in ok)
    return {
        "completed": len(ok), "failed": len(records) - len(ok),
        "ttft_ms": {"p50": ttft.p50, "p99": ttft.p99}, "tpot_ms": {"p50": tpot.p50, "p99": tpot.p99}, "itl_ms": {"p50": itl.p50, "p99": itl.p99},
        "output_throughput": tokens / (end - start) if end > start else 0.0,
    }


def simulated_figures(result: SimResult, kept: list | None = None) -> dict:
    """The simulation's figures. With its requests (``kept``), TTFT and TPOT percentiles are taken
    from them the way the measured ones are (``distribution``: linear between ranks); the
    histograms' are nearest-rank, and on 35 requests a p99 between the largest value and the
    next differs by far more than any prediction error (seen: 180 against 144 ms for the same
    largest TPOT). ITL, thousands of samples per run, comes from the histogram."""
    def pair(hist) -> dict:
        return {"p50": hist.percentile(50), "p99": hist.percentile(99)}

    def per_request(values: list[float]) -> dict:
        figures = distribution(values)
        return {"p50": figures.p50, "p99": figures.p99}

    ttft, tpot = pair(result.ttft), pair(result.tpot)
    if kept:
        done = [q for q in kept if not math.isnan(q.finished)]
        ttft = per_request([(q.first_token - q.arrival) * 1000 for q in done])
        tpot = per_request([(q.finished - q.first_token) * 1000 / (q.output_len - 1) for q in done if q.output_len > 1])
    return {"completed": result.completed, "rejected": result.rejected, "ttft_ms": ttft, "tpot_ms": tpot,
            "itl_ms": pair(result.itl), "output_throughput": result.output_throughput}


def comparison(cases: list[Case]) -> tuple[list[str], dict[str, float]]:
    """The table the closing note quotes, and the largest relative errors."""
    worst = {"p50": 0.0, "p99": 0.0, "throughput": 0.0}
    lines = [f"{'shape':<7} {'workload':<7} {'metric':<6} {'measured p50':>13} {'simulated':>10} {'err':>6} {'measured p99':>13} {'simulated':>10} {'err':>6}"]
    for case in cases:
        for metric in ("ttft_ms", "tpot_ms", "itl_ms"):
            m, s = case.measured[metric], case.simulated[metric]
            errors = {q: _error(s[q], m[q]) for q in ("p50", "p99")}
            for q, e in errors.items():
                if e is not None:
                    worst[q] = max(worst[q], abs(e))
            lines.append(
                f"{case.shape:<7} {case.workload:<7} {metric[:4].upper():<6} {fmt(m['p50']):>13} {fmt(s['p50']):>10} {_pct(errors['p50']):>6}"
                f" {fmt(m['p99']):>13} {fmt(s['p99']):>10} {_pct(errors['p99']):>6}"
            )
        e = _error(case.simulated["output_throughput"], case.measured["output_throughput"])
        if e is not None:
            worst["throughput"] = max(worst["throughput"], abs(e))
        lines.append(f"{case.shape:<7} {case.workload:<7} output tok/s: measured {case.measured['output_throughput']:.1f},"
                     f" simulated {case.simulated['output_throughput']:.1f} ({_pct(e)})")
        checks = ", ".join(f"{role} x{c['median']:.2f} (p10 {c['p10']:.2f}, p90 {c['p90']:.2f})" for role, c in case.step_check.items())
        lines.append(f"{case.shape:<7} {case.workload:<7} steps run / profile predicted: {checks or 'n/a'}")
    return lines, worst


def _finite(value: float) -> float | None:
    return None if math.isnan(value) else value


def _error(simulated: float | None, measured: float | None) -> float | None:
    if simulated is None or not measured:
        return None
    return (simulated - measured) / measured


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:+.0f}%"
