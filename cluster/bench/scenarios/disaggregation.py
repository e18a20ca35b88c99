"""Scenario 1: disaggregated (1 prefill + 1 decode actor) vs aggregated (2 actors doing both).

Both clusters get two actors on the same hardware and the same mixed workload: a share of
long prompts among short ones, Poisson arrivals. Aggregated, a long prompt's prefill chunks
share steps with the running decodes on the same actor, so every stream there slows (TPOT)
while it prefills; disaggregated, decodes never wait for a prefill, at the price of a KV
transfer and of one actor doing all the prefill. The claim: TPOT p99 and goodput at the
same SLOs favour disaggregation.

Unless given, the SLOs are calibrated on the aggregated cluster first: ``--slo-scale`` times
a lone long prompt's TTFT and a lone short request's TPOT (as SLO-scale studies do), so the
objectives track the hardware the scenario runs on.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics

from cluster.bench import plots
from cluster.bench.arrivals import ArrivalSpec
from cluster.bench.client import BenchClient
from cluster.bench.metrics import SLO, tpot_ms, ttft_ms
from cluster.bench.report import format_slo, format_summary, result_document, run_to_dict, write_json
from cluster.bench.runner import BenchSpec, RunOutput, bench, stage_means
from cluster.bench.scenarios.common import ClusterShape, ScenarioOutcome, engine_config, flags_of, fmt, local_cluster, ratio, ray_running, scenario_model
from cluster.bench.workloads import BenchRequest, WorkloadSpec, random_token_ids
from router.config import Disaggregation

NAME = "disaggregation"
SUMMARY = "disaggregated (1 prefill + 1 decode) vs aggregated (2 actors doing both) on long and short prompts: TPOT p99, TTFT p99, goodput"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--request-rate", type=float, default=0.25, help="Poisson arrivals, requests/s")
    parser.add_argument("--long-fraction", type=float, default=0.25)
    parser.add_argument("--long-input-len", type=int, default=1024)
    parser.add_argument("--short-input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk (both clusters)")
    parser.add_argument("--token-budget", type=int, default=512, help="tokens per engine step (both clusters)")
    parser.add_argument("--slo-ttft-ms", type=float, help="default: --slo-scale x a lone long prompt's TTFT")
    parser.add_argument("--slo-tpot-ms", type=float, help="default: --slo-scale x a lone short request's TPOT")
    parser.add_argument("--slo-scale", type=float, default=3.0)


def run(args: argparse.Namespace) -> ScenarioOutcome:
    engine = engine_config(args.dtype, args.token_budget, args.chunk, seed=args.seed)
    shapes = [
        ClusterShape("aggregated (2 x prefill+decode)", 0, 2, Disaggregation.NEVER, engine, engine),
        ClusterShape("disaggregated (1 prefill + 1 decode)", 1, 1, Disaggregation.ALWAYS, engine, engine),
    ]
    workload = WorkloadSpec(kind="mixed", num_requests=args.num_requests, input_len=args.short_input_len, output_len=args.output_len, long_fraction=args.long_fraction, long_input_len=args.long_input_len, seed=args.seed)
    spec = BenchSpec(workload=workload, arrivals=ArrivalSpec(rate=args.request_rate, seed=args.seed), slo=SLO(args.slo_ttft_ms, args.slo_tpot_ms), num_warmup=2, show_progress=not args.no_progress)
    calibration: dict[str, float] = {}
    outputs: list[RunOutput] = []
    with scenario_model(args.model, args.dtype, args.seed) as model_dir, ray_running():
        for shape in shapes:
            with local_cluster(model_dir, shape) as deployment:
                if spec.slo.ttft_ms is None or spec.slo.tpot_ms is None:
                    calibration = asyncio.run(_calibrate(deployment.address, args))
                    spec.slo = SLO(
                        spec.slo.ttft_ms or round(args.slo_scale * calibration["solo_long_ttft_ms"], 1),
                        spec.slo.tpot_ms or round(args.slo_scale * calibration["solo_short_tpot_ms"], 1),
                    )
                outputs.append(asyncio.run(bench(deployment.address, spec, shape.label)))
    agg, disagg = outputs
    ratios = {
        "tpot_p99_aggregated_over_disaggregated": ratio(agg.metrics.tpot_ms.p99, disagg.metrics.tpot_ms.p99),
        "ttft_p99_aggregated_over_disaggregated": ratio(agg.metrics.ttft_ms.p99, disagg.metrics.ttft_ms.p99),
        "goodput_disaggregated_over_aggregated": ratio(disagg.metrics.goodput, agg.metrics.goodput),
    }
    out = args.out
    paths = [
        plots.plot_latency_cdfs({o.label: o.records for o in outputs}, out / "latency_cdf.png", spec.slo, title="mixed long/short prompts"),
        plots.plot_comparison(_comparison(outputs), out / "comparison.png", title=f"same SLOs: {format_slo(spec.slo)}"),
        plots.plot_stage_breakdown({o.label: stage_means(o.metrics) for o in outputs}, out / "stage_breakdown.png", title="per-stage timing (router's breakdown)"),
    ]
    config = {"scenario": NAME, **flags_of(args), "bench": dataclasses.asdict(spec), "clusters": [s.describe() for s in shapes]}
    body = {"calibration": calibration, "ratios": ratios, "runs": {o.label: run_to_dict(o.metrics, o.records, o.by_tag) for o in outputs}, "plots": [str(p) for p in paths]}
    json_path = write_json(out / "scenario.json", result_document(f"scenario:{NAME}", config, body))
    lines = [format_summary(o.metrics, o.label) for o in outputs]
    lines += [
        f"SLOs: {format_slo(spec.slo)}" + (f" (x{args.slo_scale:g} of a lone request on the aggregated cluster)" if calibration else ""),
        f"TPOT p99: aggregated {fmt(agg.metrics.tpot_ms.p99, ' ms')} / disaggregated {fmt(disagg.metrics.tpot_ms.p99, ' ms')} = {fmt(ratios['tpot_p99_aggregated_over_disaggregated'], 'x', 2)}",
        f"TTFT p99: aggregated {fmt(agg.metrics.ttft_ms.p99, ' ms')} / disaggregated {fmt(disagg.metrics.ttft_ms.p99, ' ms')} = {fmt(ratios['ttft_p99_aggregated_over_disaggregated'], 'x', 2)}",
        f"goodput: disaggregated {disagg.metrics.goodput:.3f} / aggregated {agg.metrics.goodput:.3f} req/s = {fmt(ratios['goodput_disaggregated_over_aggregated'], 'x', 2)}"
        f" (SLO attainment {100 * disagg.metrics.slo_attainment:.0f}% vs {100 * agg.metrics.slo_attainment:.0f}%)",
    ]
    return ScenarioOutcome(NAME, lines, json_path, ratios, ok=all(o.metrics.completed for o in outputs))


async def _calibrate(address: str, args: argparse.Namespace, reps: int = 2) -> dict[str, float]:
    """Median TTFT of a lone long prompt and TPOT of a lone short request (after one warm-up each)."""
    import random

    async with BenchClient(BenchSpec().client_config(address, "calibrate")) as client:
        limits = await client.model_limits()
        rng = random.Random(args.seed + 7)
        long_ttfts, short_tpots = [], []
        for rep in range(reps + 1):
            long_req = BenchRequest(args.output_len, random_token_ids(rng, limits, args.long_input_len), tag="long", prompt_len=args.long_input_len)
            short_req = BenchRequest(args.output_len, random_token_ids(rng, limits, args.short_input_len), tag="short", prompt_len=args.short_input_len)
            long_rec = (await client.run([long_req], [0.0])).records[0]
            short_rec = (await client.run([short_req], [0.0])).records[0]
            if rep == 0:
                continue  # warm-up
            if ttft_ms(long_rec) is not None:
                long_ttfts.append(ttft_ms(long_rec))
            if tpot_ms(short_rec) is not None:
                short_tpots.append(tpot_ms(short_rec))
    if not long_ttfts or not short_tpots:
        raise RuntimeError("SLO calibration failed: the lone requests did not complete (see the log)")
    return {"solo_long_ttft_ms": statistics.median(long_ttfts), "solo_short_tpot_ms": statistics.median(short_tpots)}


def _comparison(outputs: list[RunOutput]) -> dict[str, dict[str, float]]:
    short = {o.label.split(" ")[0]: o for o in outputs}
    return {
        "TTFT p99 (ms)": {k: o.metrics.ttft_ms.p99 or 0.0 for k, o in short.items()},
        "TPOT p99 (ms)": {k: o.metrics.tpot_ms.p99 or 0.0 for k, o in short.items()},
        "ITL p99 (ms)": {k: o.metrics.itl_ms.p99 or 0.0 for k, o in short.items()},
        "goodput (req/s)": {k: o.metrics.goodput for k, o in short.items()},
        "SLO attainment (%)": {k: 100 * o.metrics.slo_attainment for k, o in short.items()},
    }

