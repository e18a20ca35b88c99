"""``pdserve profile``, ``pdserve simulate`` and ``pdserve plan``."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from pathlib import Path

from cluster.arguments import positive_float
from cluster.planning.simulator import PipelineSettings
from router.pipeline import PipelineMode
from router.pool import RoutingPolicy

logger = logging.getLogger(__name__)


def add_planning_parsers(commands) -> None:
    profile = commands.add_parser(
        "profile", help="start a local deployment, run a profiling sweep, write its fitted step-time model as JSON",
        description="Start a deployment on the local Ray instance (one thread per actor), sweep it through the router "
        "(prefill lengths, decode batches, mixed steps), read every worker's step log and fit the step-time and transfer models.",
    )
    profile.add_argument("--out", type=Path, default=Path("profile.json"), help="where the profile JSON goes")
    profile.add_argument("--model", type=Path, help="model directory (default: the built-in model)")
    profile.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    profile.add_argument("--prefill", type=int, default=1, help="prefill actors (0: the decode actors prefill everything)")
    profile.add_argument("--decode", type=int, default=1, help="decode actors")
    profile.add_argument("--token-budget", type=int, default=512, help="tokens per engine step")
    profile.add_argument("--chunk", type=int, help="most tokens of one prompt per step (default: the budget)")
    profile.add_argument("--kv-cache-mb", type=int, default=1024, help="KV cache per actor")
    profile.add_argument("--tensor-parallel-size", type=int, default=1,
                         help="ranks of every worker of both pools (profile each size you would run; `pdserve plan` takes several)")
    profile.add_argument("--quick", action="store_true", help="a short sweep (for small models and tests)")
    profile.add_argument("--seed", type=int, default=0)
    profile.set_defaults(bench_handler=run_profile)

    sim = commands.add_parser(
        "simulate", help="predict TTFT/TPOT/ITL and throughput of a pool shape from a profile and a workload",
        description="A discrete-event simulation of the router, queues, chunked prefill, KV transfer and continuous batching.",
    )
    sim.add_argument("--profile", type=Path, required=True, help="a profile JSON from `pdserve profile`")
    sim.add_argument("--workload", type=Path, required=True, help="a workload YAML/JSON (cluster/planning/workload.py)")
    sim.add_argument("--prefill", type=int, required=True, help="prefill workers (0: decode workers prefill everything)")
    sim.add_argument("--decode", type=int, required=True, help="decode workers")
    sim.add_argument("--window-s", type=positive_float, help="also report per window of this many seconds")
    sim.add_argument("--colocated", action="store_true", help="all workers share one machine, as when profiled on it (the profile's contention applies)")
    sim.add_argument(
        "--routing-policy", choices=[p.value for p in RoutingPolicy], default=RoutingPolicy.KV_AWARE.value,
        help="the router's routing_policy (kv_aware is simulated without prefix-cache hits)",
    )
    add_pipeline_arguments(sim)
    sim.add_argument("--json", type=Path, help="write the result here")
    sim.set_defaults(bench_handler=run_simulate)

    plan = commands.add_parser(
        "plan", help="the cheapest prefill:decode counts that meet a TTFT/TPOT target at a request rate",
        description="Search pool shapes with the simulator; with --diurnal, plan every hour of the workload's day, "
        "simulate the day with the pools following the plan, and plot it.",
    )
    plan.add_argument("--profile", type=Path, nargs="+", required=True,
                      help="profile JSONs from `pdserve profile`; several (e.g. one per tensor-parallel size): each, and each pairing of one's "
                      "prefill pool with another's decode pool, is planned; the cheapest plan wins")
    plan.add_argument("--slo-ttft-ms", type=float, required=True)
    plan.add_argument("--slo-tpot-ms", type=float, required=True)
    plan.add_argument("--rate", type=float, help="requests per second (default: the workload's rate)")
    plan.add_argument("--workload", type=Path, help="the request mix (default: 256-token prompts, 64-token outputs, range 0.5)")
    plan.add_argument("--percentile", type=float, default=90.0, help="the SLO holds at this percentile of TTFT and TPOT")
    plan.add_argument("--max-workers", type=int, default=16, help="most workers of both pools together")
    plan.add_argument("--max-devices", type=int, help="most devices of both pools together (a worker holds its profile's tensor-parallel size)")
    plan.add_argument("--prefill-cost", type=positive_float, default=1.0,
                      help="cost of one device of a prefill worker (e.g. a GPU's price; a worker of tensor-parallel size N costs N of them)")
    plan.add_argument("--decode-cost", type=positive_float, default=1.0)
    plan.add_argument("--diurnal", action="store_true", help="plan each hour of the workload's diurnal day")
    plan.add_argument("--headroom", type=float, default=1.1, help="--diurnal: plan each hour for this multiple of its peak rate")
    plan.add_argument("--out", type=Path, help="directory for plan.json (and the diurnal plot)")
    add_pipeline_arguments(plan)
    plan.set_defaults(bench_handler=run_plan)


def add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    """The deployment's pipelined prefill, as `pdserve up` takes it (the defaults are its own)."""
    defaults = PipelineSettings()
    parser.add_argument("--prefill-pipeline", choices=[m.value for m in PipelineMode], default=defaults.mode.value,
                        help="how the router spreads one long prompt over several prefill workers (prefill.pipeline)")
    parser.add_argument("--max-pipeline-stages", type=int, help="most workers in one prompt's pipeline (prefill.max_pipeline_stages)")
    parser.add_argument("--pipeline-decode-stage", choices=[m.value for m in PipelineMode], default=defaults.decode_stage.value,
                        help="the decode worker computes a pipeline's last stage (prefill.pipeline_decode_stage)")
    parser.add_argument("--pipeline-tokens-per-stage", type=int, default=defaults.tokens_per_stage, help="prefill.pipeline_tokens_per_stage")
    parser.add_argument("--pipeline-chunk-tokens", type=int, default=defaults.chunk_tokens, help="prefill.pipeline_chunk_tokens")


def pipeline_settings(args: argparse.Namespace) -> PipelineSettings:
    for name in ("max_pipeline_stages", "pipeline_tokens_per_stage", "pipeline_chunk_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"{name.replace('_', '-')}: must be >= 1, got {value}")
    return PipelineSettings(PipelineMode(args.prefill_pipeline), args.max_pipeline_stages, args.pipeline_tokens_per_stage,
                            args.pipeline_chunk_tokens, PipelineMode(args.pipeline_decode_stage))


# -- profile ----------------------------------------------------------------------------


def run_profile(args: argparse.Namespace) -> int:
    from cluster.bench.scenarios.common import ClusterShape, engine_config, local_cluster, ray_running
    from cluster.planning.profiler import SweepPlan, run_sweep
    from engine.default_model_path import DEFAULT_MODEL_PATH
    from router.config import Disaggregation, RouterConfig
    from router.pipeline import PipelineMode

    if args.decode < 1 or args.prefill < 0:
        print("error: --decode must be >= 1 and --prefill >= 0", file=sys.stderr)
        return 2
    if args.tensor_parallel_size < 1:
        print("error: --tensor-parallel-size must be >= 1", file=sys.stderr)
        return 2
    model = args.model or DEFAULT_MODEL_PATH
    engine = engine_config(args.dtype, args.token_budget, args.chunk, kv_cache_bytes=args.kv_cache_mb * 2**20, seed=args.seed)
    engine.tensor_parallel_size = args.tensor_parallel_size
    mode = Disaggregation.AUTO if args.prefill else Disaggregation.NEVER
    # Step costs of one actor computing whole prompts: no pipelined prefill (its stage steps are not logged).
    shape = ClusterShape("profile", args.prefill, args.decode, mode, engine, engine, router_overrides={"prefill_pipeline": PipelineMode.OFF})
    plan = SweepPlan.quick() if args.quick else SweepPlan()
    plan.seed = args.seed
    source = {"model": str(model), "dtype": args.dtype, "num_prefill": args.prefill, "num_decode": args.decode, "threads_per_actor": 1,
              "tensor_parallel_size": args.tensor_parallel_size}
    with ray_running(), local_cluster(Path(model), shape) as deployment:
        profile = asyncio.run(run_sweep(deployment.address, deployment.handles, plan, RouterConfig().local_prefill_max_tokens, source=source))
    profile.save(args.out)
    print(_describe_profile(profile))
    print(f"wrote {args.out}")
    return 0


def _describe_profile(profile) -> str:
    step, fit = profile.step, profile.step.fit
    lines = [
        f"step = {step.intercept_s['prefill'] * 1e3:.2f} ms (prefill) | {step.intercept_s['decode'] * 1e3:.2f} ms (decode)"
        f" + {step.prefill_token_s * 1e6:.1f} us/prefill token + {step.prefill_attention_s * 1e9:.3f} ns/(token x context)"
        f" + {step.prefill_seq_s * 1e3:.2f} ms/chunk + {step.decode_row_s * 1e6:.1f} us/decode row + {step.decode_kv_s * 1e9:.1f} ns/KV token",
        f"transfer = {profile.transfer.intercept_s * 1e3:.2f} ms + {profile.transfer.per_byte_s * 2**20 * 1e3:.3f} ms/MiB"
        f" + {profile.transfer.per_descriptor_s * 1e6:.1f} us/descriptor",
        f"client overhead on TTFT: remote {profile.ttft_overhead_s['remote'] * 1e3:.1f} ms, local {profile.ttft_overhead_s['local'] * 1e3:.1f} ms",
    ]
    for role, quality in fit.items():
        lines.append(
            f"fit ({role}, {int(quality['num_samples'])} steps): R^2 {quality['r2']:.3f}, median error {quality['median_abs_error_pct']:.1f}%,"
            f" p90 error {quality['p90_abs_error_pct']:.1f}%"
        )
    for role, factors in step.contention.items():
        residuals = step.residuals.get(role)
        scatter = f"; steps scatter x{residuals[0]:.2f}-x{residuals[-1]:.2f} (2.5-97.5%)" if residuals else ""
        lines.append(f"{role} steps beside another worker's: {factors.get('prefill', 0) * 100:.0f}% slower if it prefills,"
                     f" {factors.get('decode', 0) * 100:.0f}% if it decodes{scatter}")
    return "\n".join(lines)


# -- simulate ---------------------------------------------------------------------------


def run_simulate(args: argparse.Namespace) -> int:
    from cluster.planning.profile import Profile
    from cluster.planning.simulator import simulate
    from cluster.planning.workload import WorkloadModel

    try:
        profile = Profile.load(args.profile)
        workload = WorkloadModel.load(args.workload)
        started = time.perf_counter()
        result = simulate(profile, workload, args.prefill, args.decode, window_s=args.window_s, colocated=args.colocated,
                          routing_policy=RoutingPolicy(args.routing_policy), pipeline=pipeline_settings(args))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    wall = time.perf_counter() - started
    print(format_result(result))
    print(f"simulated {result.duration_s:.0f} s of traffic ({result.num_requests} requests, {result.num_events} events) in {wall:.1f} s")
    if args.json is not None:
        body = {"profile": str(args.profile), "workload": workload.to_dict() if workload.trace is None else str(args.workload),
                "wall_s": wall, "result": result.to_dict(),
                "windows": [{"start_s": w.start_s, "arrived": w.arrived, "completed": w.completed, "rejected": w.rejected,
                             "ttft_ms": w.ttft.summary(), "tpot_ms": w.tpot.summary()} for w in result.windows]}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(body, indent=2) + "\n")
    return 0


def format_result(result) -> str:
    def row(name: str, hist) -> str:
        s = hist.summary()
        cells = "  ".join(f"{k} {'n/a' if v is None else f'{v:.1f}'}" for k, v in s.items())
        return f"  {name:<5} ms: {cells}"

    return "\n".join([
        f"{result.num_prefill} prefill + {result.num_decode} decode: {result.completed}/{result.num_requests} completed,"
        f" {result.rejected} refused; {result.output_throughput:.1f} output tok/s, {result.request_throughput:.2f} req/s",
        row("TTFT", result.ttft), row("TPOT", result.tpot), row("ITL", result.itl), row("E2E", result.e2e),
    ])


# -- plan -------------------------------------------------------------------------------


def run_plan(args: argparse.Namespace) -> int:
    from cluster.planning.diurnal import plan_day
    from cluster.planning.planner import SLO, Planner, cheapest
    from cluster.planning.profile import Profile, combine_profiles
    from cluster.planning.workload import WorkloadModel

    try:
        loaded = [Profile.load(path) for path in args.profile]
        mix = WorkloadModel.load(args.workload) if args.workload else WorkloadModel(rate=1.0, num_requests=1, input_len=256, output_len=64, range_ratio=0.5)
        slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.percentile)
        # Every pairing: the prefill pool as one profile measured it, the decode pool as another
        # (or the same) did; each pool's size then is its own profile's.
        pairs = [(p, d) for p in range(len(loaded)) for d in range(len(loaded))]
        profiles = [loaded[p] if p == d else combine_profiles(loaded[p], loaded[d]) for p, d in pairs]
        pipeline = pipeline_settings(args)
        planners = [Planner(profile, mix, slo, args.max_workers, args.prefill_cost, args.decode_cost, max_devices=args.max_devices, pipeline=pipeline)
                    for profile in profiles]
        if args.diurnal:
            if mix.diurnal is None:
                raise ValueError("workload.diurnal: --diurnal needs a workload with a diurnal section")
            if len(planners) > 1:
                raise ValueError("profile: --diurnal plans one profile's day; plan the peak hour with several to pick one")
            day = plan_day(planners[0], mix, args.out, headroom=args.headroom)
            print(day.summary())
            return 0 if day.all_feasible else 1
        rate = args.rate if args.rate is not None else (mix.trace_rate or mix.rate)  # a trace's own rate
        started = time.perf_counter()
        plans = [planner.plan(rate) for planner in planners]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    wall = time.perf_counter() - started
    simulated = sum(len(plan.candidates) for plan in plans)

    def pools(pair: tuple[int, int], plan) -> str:
        p, d = pair
        ranks = plan.tensor_parallel_size
        if p == d:
            return f"{args.profile[p]} (tensor-parallel size {ranks['decode']})"
        return f"prefill as {args.profile[p]} (size {ranks['prefill']}), decode as {args.profile[d]} (size {ranks['decode']})"

    if len(plans) > 1:
        for pair, plan in zip(pairs, plans):
            verdict = (f"{plan.num_prefill} prefill + {plan.num_decode} decode, {_devices(plan.num_devices)}, cost {plan.cost:g}"
                       if plan.feasible else "no shape meets the SLO")
            print(f"  {pools(pair, plan)}: {verdict}")
    plan = cheapest(plans)
    if plan is None:
        bound = f"{args.max_workers} workers" + (f" and {_devices(args.max_devices)}" if args.max_devices is not None else "")
        print(f"no shape of at most {bound} meets TTFT p{args.percentile:g} <= {args.slo_ttft_ms:g} ms and "
              f"TPOT p{args.percentile:g} <= {args.slo_tpot_ms:g} ms at {rate:g} req/s ({simulated} shapes simulated in {wall:.1f} s)")
        return 1
    pair = pairs[plans.index(plan)]
    ranks = plan.tensor_parallel_size
    print(f"plan at {rate:g} req/s: {plan.num_prefill} prefill of tensor-parallel size {ranks['prefill']} + {plan.num_decode} decode of size"
          f" {ranks['decode']} ({_devices(plan.num_devices)}, cost {plan.cost:g}; {pools(pair, plan)}); {simulated} shapes simulated in {wall:.1f} s")
    print(format_result(plan.result))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        body = {**plan.to_dict(), "prefill_profile": str(args.profile[pair[0]]), "decode_profile": str(args.profile[pair[1]]),
                "candidates": [_candidate(c) for c in plan.candidates]}
        (args.out / "plan.json").write_text(json.dumps(body, indent=2) + "\n")
    return 0


def _devices(count: int) -> str:
    return f"{count} device{'s' * (count != 1)}"


def _candidate(candidate) -> dict:
    return {"num_prefill": candidate.num_prefill, "num_decode": candidate.num_decode, "meets_slo": candidate.meets_slo,
            "ttft_ms": candidate.ttft_ms, "tpot_ms": candidate.tpot_ms}
