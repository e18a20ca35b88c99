"""Scenario 3: offered load rises, a pool is scaled up mid-run through Admin.ScalePool.

The load runs in three phases: ``--phase-s`` seconds low, ``--phase-s`` high, then
``--after-s`` more at the high rate. At the start of the third, the scenario asks the router (the public RPC, as an operator would) to grow ``--role``
to ``--to-replicas``; the call returns once the new actors are routable. Latency is plotted
against send time with both moments marked. The figure: TTFT and TPOT p90 of the requests
sent after the new actors were ready, over those of the high-load phase before the scale.

If the router refuses to scale (a deployment without a pool manager), the scenario says so
and reports no ratio rather than inventing one; the load still runs and is still plotted.
"""

from __future__ import annotations

import argparse
import asyncio
import random

from cluster.bench import plots
from cluster.bench.arrivals import phased_offsets
from cluster.bench.client import BenchClient, RequestRecord, ScaleOutcome
from cluster.bench.metrics import SLO, compute_metrics, distribution, tpot_ms, ttft_ms
from cluster.bench.report import format_summary, result_document, run_to_dict, write_json
from cluster.bench.runner import BenchSpec, RunOutput, run_load
from cluster.bench.scenarios.common import ClusterShape, ScenarioOutcome, engine_config, flags_of, fmt, local_cluster, ratio, ray_running, scenario_model
from cluster.bench.workloads import BenchRequest, random_token_ids
from router.config import Disaggregation

NAME = "scaling"
SUMMARY = "offered load rises, a pool is scaled up mid-run (Admin.ScalePool): latency over time, before vs after"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--role", choices=["prefill", "decode"], default="decode", help="the pool to scale")
    parser.add_argument("--to-replicas", type=int, default=2)
    parser.add_argument("--low-rate", type=float, default=0.5, help="requests/s in the first phase")
    parser.add_argument("--high-rate", type=float, default=1.0, help="requests/s in the second and third phases")
    parser.add_argument("--phase-s", type=float, default=20.0, help="seconds of the low and of the high phase before scaling")
    parser.add_argument("--after-s", type=float, default=45.0, help="seconds of high load from the scale request on (new actors take a while to load)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--chunk", type=int, default=256)


def run(args: argparse.Namespace) -> ScenarioOutcome:
    engine = engine_config(args.dtype, 2 * args.chunk, args.chunk, seed=args.seed)
    shape = ClusterShape("1 prefill + 1 decode", 1, 1, Disaggregation.ALWAYS, engine, engine)
    phases = [(args.phase_s, args.low_rate), (args.phase_s, args.high_rate), (args.after_s, args.high_rate)]
    with scenario_model(args.model, args.dtype, args.seed) as model_dir, ray_running():
        with local_cluster(model_dir, shape) as deployment:
            output, scale = asyncio.run(_run(deployment.address, deployment.admin_address, args, phases))
    records = output.records
    high_start, scale_at = args.phase_s, 2 * args.phase_s
    before = [r for r in records if r.ok and high_start <= r.send_s < scale_at]
    after = [r for r in records if r.ok and not scale.error and r.send_s >= scale.done_s]
    windows = {
        "high load, before scaling": _window(before),
        "high load, after the new actors were ready": _window(after),
    }
    ratios = {
        "ttft_p90_after_over_before": ratio(windows["high load, after the new actors were ready"]["ttft_ms"].p90, windows["high load, before scaling"]["ttft_ms"].p90),
        "tpot_p90_after_over_before": ratio(windows["high load, after the new actors were ready"]["tpot_ms"].p90, windows["high load, before scaling"]["tpot_ms"].p90),
    }
    events = [(scale.requested_s, f"ScalePool {args.role} -> {args.to_replicas}")]
    if not scale.error:
        events.append((scale.done_s, "new actors ready"))
    offered = [(0.0, args.low_rate), (args.phase_s, args.high_rate), (2 * args.phase_s + args.after_s, args.high_rate)]
    out = args.out
    title = f"{args.role} pool scaled to {args.to_replicas} at {scale_at:.0f}s" if not scale.error else "scaling unavailable: load only"
    paths = [
        plots.plot_latency_over_time(records, out / "latency_over_time.png", events, offered, title=title),
        plots.plot_latency_cdfs({k: v for k, v in (("before", before), ("after", after)) if v}, out / "latency_cdf.png", title="high-load phase, before vs after scaling"),
    ]
    config = {"scenario": NAME, **flags_of(args), "clusters": [shape.describe()], "phases": phases}
    body = {"scale": scale, "ratios": ratios, "windows": windows, "runs": {output.label: run_to_dict(output.metrics, records, output.by_tag)}, "plots": [str(p) for p in paths]}
    json_path = write_json(out / "scenario.json", result_document(f"scenario:{NAME}", config, body))
    lines = [format_summary(output.metrics, "whole run (rising load)")]
    if scale.error:
        lines.append(f"scaling unavailable: {scale.error} -- no before/after ratio is reported")
    else:
        lines.append(f"ScalePool({args.role}, {args.to_replicas}) at {scale.requested_s:.1f}s: {scale.previous_replicas} -> {args.to_replicas} replicas, ready at {scale.done_s:.1f}s ({scale.done_s - scale.requested_s:.1f}s to start)")
    for name, w in windows.items():
        lines.append(f"{name}: {w['num_requests']} requests, TTFT p90 {fmt(w['ttft_ms'].p90, ' ms')}, TPOT p90 {fmt(w['tpot_ms'].p90, ' ms')}, throughput {w['output_tok_s']:.1f} tok/s")
    lines.append(f"TTFT p90 after / before scaling = {fmt(ratios['ttft_p90_after_over_before'], 'x', 2)}; TPOT p90 after / before = {fmt(ratios['tpot_p90_after_over_before'], 'x', 2)}")
    return ScenarioOutcome(NAME, lines, json_path, ratios, ok=output.metrics.completed > 0 and not scale.error)


async def _run(address: str, admin_address: str | None, args: argparse.Namespace, phases: list[tuple[float, float]]) -> tuple[RunOutput, ScaleOutcome]:
    spec = BenchSpec(show_progress=not args.no_progress)
    async with BenchClient(spec.client_config(address, "scaling", admin_address)) as client:
        limits = await client.model_limits()
        rng = random.Random(args.seed)
        offsets = phased_offsets(phases, seed=args.seed)
        requests = [BenchRequest(args.output_len, random_token_ids(rng, limits, args.input_len), prompt_len=args.input_len) for _ in range(len(offsets) + 2)]
        # Warmed up with two prompts of their own: the measured ones sent again were cache hits.
        warmup, requests = requests[:2], requests[2:]
        await client.warm_up(warmup)
        scale_at = 2 * args.phase_s

        async def scale_later() -> ScaleOutcome:
            await asyncio.sleep(0)  # let run() set the clock first
            await asyncio.sleep(max(0.0, scale_at - client.now_s()))
            return await client.scale_pool(args.role, args.to_replicas)

        output, scale = await asyncio.gather(run_load(client, requests, offsets, SLO(), "scaling", spec.show_progress), scale_later())
    return output, scale


def _window(records: list[RequestRecord]) -> dict:
    if records:
        duration = max(r.end_s for r in records) - min(r.send_s for r in records)
        output_tok_s = compute_metrics(records, duration).output_throughput
    else:
        output_tok_s = 0.0
    return {
        "num_requests": len(records),
        "ttft_ms": distribution([ttft_ms(r) for r in records]),
        "tpot_ms": distribution([t for r in records if (t := tpot_ms(r)) is not None]),
        "output_tok_s": output_tok_s,
    }
