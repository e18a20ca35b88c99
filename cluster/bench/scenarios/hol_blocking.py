"""Scenario 2: head-of-line blocking, chunked vs unchunked prefill.

Short requests arrive steadily (Poisson); one very long prompt arrives among them. Unchunked,
that prompt's whole prefill is one engine step: the short prompts queued behind it wait for
all of it (TTFT), and on an actor that also decodes, every running stream stalls for as long
(ITL). Chunked, the prompt is split into ``--chunk``-token pieces and each step also carries
the other prompts' chunks and the running decodes, so the stall is bounded by one chunk.

Default: one actor that prefills and decodes (aggregated), where both effects show;
``--mode disaggregated`` puts the prefill on its own actor (then only the TTFT effect is
expected). The figures: short-request TTFT p99, and ITL p99 of the streams that were running
while the long prompt was prefilled, unchunked over chunked.

``--more-chunks`` adds fixed chunk sizes and ``--adaptive-target-ms`` a variant whose chunk
size adapts (engine.chunk_sizer): beside decodes, steps carry what fits in the target; with
nothing to decode, the whole budget. Its figures against each fixed size: running streams'
ITL p99 (TPOT kept) and the long prompt's TTFT (prefill throughput kept).
"""

from __future__ import annotations

import argparse
import asyncio
import random

from cluster.bench import plots
from cluster.bench.arrivals import phased_offsets
from cluster.bench.client import BenchClient, RequestRecord
from cluster.bench.metrics import SLO, distribution, itls_ms, ttft_ms
from cluster.bench.report import format_summary, result_document, run_to_dict, write_json
from cluster.bench.runner import BenchSpec, RunOutput, run_load
from cluster.bench.scenarios.common import ClusterShape, ScenarioOutcome, engine_config, flags_of, fmt, local_cluster, ratio, ray_running, scenario_model
from cluster.bench.workloads import BenchRequest, ModelLimits, random_token_ids
from router.config import Disaggregation

NAME = "hol-blocking"
SUMMARY = "one very long prompt among steady short requests: short TTFT p99 and running streams' ITL p99, chunked vs unchunked prefill"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mode", choices=["aggregated", "disaggregated"], default="aggregated")
    parser.add_argument("--short-rate", type=float, default=1.0, help="short requests per second (Poisson)")
    parser.add_argument("--duration", type=float, default=24.0, help="seconds of short-request arrivals")
    parser.add_argument("--short-input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32, help="tokens per short request")
    parser.add_argument("--long-input-len", type=int, default=2048)
    parser.add_argument("--long-at", type=float, default=8.0, help="seconds into the run the long prompt arrives")
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk of the chunked variant (its step budget is two chunks)")
    parser.add_argument("--more-chunks", default="", help="more fixed chunk sizes to compare, comma-separated (e.g. 32,64)")
    parser.add_argument(
        "--adaptive-target-ms", type=float,
        help="add a variant with adaptive chunk size: steps that also decode stay within this many ms (engine.chunk_sizer)",
    )


def run(args: argparse.Namespace) -> ScenarioOutcome:
    # Unchunked: the budget admits the whole long prompt in one step, as an engine without
    # chunked prefill would run it.
    variants = [("unchunked", engine_config(args.dtype, args.long_input_len + args.chunk, None, seed=args.seed))]
    # Chunked: a step's budget is two chunks, so a long prompt takes at most half of any
    # step and short prompts queued behind it still get the other half (split-fuse).
    variants.append(("chunked", engine_config(args.dtype, 2 * args.chunk, args.chunk, seed=args.seed)))
    chunked = variants[-1][1]
    for size in (int(c) for c in args.more_chunks.split(",") if c.strip()):
        variants.append((f"chunk-{size}", engine_config(args.dtype, 2 * size, size, seed=args.seed)))
    if args.adaptive_target_ms is not None:
        # Adaptive: with nothing to decode a step takes as much prompt as the unchunked one;
        # beside decodes, what the measured step time allows within the target.
        adaptive = engine_config(args.dtype, args.long_input_len + args.chunk, None, seed=args.seed)
        adaptive.target_step_ms = args.adaptive_target_ms
        variants.append(("adaptive", adaptive))
    shapes = []
    for label, engine in variants:
        if args.mode == "aggregated":
            shapes.append(ClusterShape(label, 0, 1, Disaggregation.NEVER, engine, engine))
        else:
            shapes.append(ClusterShape(label, 1, 1, Disaggregation.ALWAYS, engine, chunked))
    outputs: list[RunOutput] = []
    with scenario_model(args.model, args.dtype, args.seed) as model_dir, ray_running():
        for shape in shapes:
            with local_cluster(model_dir, shape) as deployment:
                outputs.append(asyncio.run(_run_one(deployment.address, args, shape.label)))
    figures = {o.label: _figures(o.records) for o in outputs}
    unch, ch = figures["unchunked"], figures["chunked"]
    ratios = {
        "short_ttft_p99_unchunked_over_chunked": ratio(unch["short_ttft_ms"].p99, ch["short_ttft_ms"].p99),
        "running_itl_p99_unchunked_over_chunked": ratio(unch["running_itl_ms"].p99, ch["running_itl_ms"].p99),
    }
    if "adaptive" in figures:
        ad = figures["adaptive"]
        for label, f in figures.items():
            if label.startswith("chunk"):
                ratios[f"running_itl_p99_{label}_over_adaptive"] = ratio(f["running_itl_ms"].p99, ad["running_itl_ms"].p99)
                ratios[f"long_ttft_{label}_over_adaptive"] = ratio(f["long_ttft_ms"], ad["long_ttft_ms"])
    out = args.out
    paths = [
        plots.plot_gap_timeline({o.label: o.records for o in outputs}, out / "timeline.png", {label: f["long_window_s"] for label, f in figures.items()}, title=f"{args.long_input_len}-token prompt among short requests ({args.mode})"),
        plots.plot_latency_cdfs({o.label: [r for r in o.records if r.tag == "short"] for o in outputs}, out / "latency_cdf.png", title="short requests"),
        plots.plot_comparison(
            {
                "short TTFT p99 (ms)": {k: f["short_ttft_ms"].p99 or 0.0 for k, f in figures.items()},
                "running streams' ITL p99 (ms)": {k: f["running_itl_ms"].p99 or 0.0 for k, f in figures.items()},
                "running streams' max ITL (ms)": {k: f["running_itl_ms"].max or 0.0 for k, f in figures.items()},
                "long prompt TTFT (ms)": {k: f["long_ttft_ms"] or 0.0 for k, f in figures.items()},
            },
            out / "comparison.png",
            title="head-of-line blocking",
        ),
    ]
    config = {"scenario": NAME, **flags_of(args), "clusters": [s.describe() for s in shapes]}
    body = {"ratios": ratios, "figures": figures, "runs": {o.label: run_to_dict(o.metrics, o.records, o.by_tag) for o in outputs}, "plots": [str(p) for p in paths]}
    json_path = write_json(out / "scenario.json", result_document(f"scenario:{NAME}", config, body))
    lines = [format_summary(o.metrics, f"{o.label} prefill ({args.mode})") for o in outputs]
    for label, f in figures.items():
        lines.append(
            f"{label:>9}: long prompt TTFT {fmt(f['long_ttft_ms'], ' ms')}; short TTFT p99 {fmt(f['short_ttft_ms'].p99, ' ms')};"
            f" {f['running_itl_ms'].count} gaps of {f['num_running_streams']} running streams: ITL p99 {fmt(f['running_itl_ms'].p99, ' ms')}, max {fmt(f['running_itl_ms'].max, ' ms')}"
        )
    lines += [
        f"short-request TTFT p99: unchunked / chunked = {fmt(ratios['short_ttft_p99_unchunked_over_chunked'], 'x', 2)}",
        f"running streams' ITL p99: unchunked / chunked = {fmt(ratios['running_itl_p99_unchunked_over_chunked'], 'x', 2)}",
    ]
    lines += [f"{name}: {fmt(value, 'x', 2)}" for name, value in ratios.items() if "adaptive" in name]
    ok = all(o.metrics.completed == o.metrics.num_requests for o in outputs)
    return ScenarioOutcome(NAME, lines, json_path, ratios, ok=ok)


def build_requests(args: argparse.Namespace, vocab_size: int, eos: tuple[int, ...]) -> tuple[list[BenchRequest], list[float]]:
    """Short requests at Poisson times, and the long prompt at ``--long-at``; sorted by time."""
    limits = ModelLimits(vocab_size, 1 << 30, eos)
    rng = random.Random(args.seed)
    timed = [(t, BenchRequest(args.output_len, random_token_ids(rng, limits, args.short_input_len), tag="short", prompt_len=args.short_input_len)) for t in phased_offsets([(args.duration, args.short_rate)], seed=args.seed)]
    # The long one generates a few tokens only: its prefill is the point.
    timed.append((args.long_at, BenchRequest(4, random_token_ids(rng, limits, args.long_input_len), tag="long", prompt_len=args.long_input_len)))
    timed.sort(key=lambda pair: pair[0])
    return [r for _, r in timed], [t for t, _ in timed]


async def _run_one(address: str, args: argparse.Namespace, label: str) -> RunOutput:
    spec = BenchSpec(show_progress=not args.no_progress)
    async with BenchClient(spec.client_config(address, label)) as client:
        limits = await client.model_limits()
        requests, offsets = build_requests(args, limits.vocab_size, limits.eos_token_ids)
        warm = random.Random(args.seed + 1)
        await client.warm_up([BenchRequest(4, random_token_ids(warm, limits, args.short_input_len), prompt_len=args.short_input_len) for _ in range(2)])
        return await run_load(client, requests, offsets, SLO(), label, spec.show_progress)


def _figures(records: list[RequestRecord]) -> dict:
    """The long prompt's prefill window, and what the short requests saw around it."""
    long = next((r for r in records if r.tag == "long" and r.ok), None)
    shorts = [r for r in records if r.tag == "short" and r.ok]
    if long is None:
        return {"long_ttft_ms": None, "long_window_s": None, "num_running_streams": 0, "short_ttft_ms": distribution([ttft_ms(r) for r in shorts]), "blocked_short_ttft_ms": distribution([]), "running_itl_ms": distribution([])}
    start, end = long.send_s, long.chunk_s[0]
    running = [r for r in shorts if r.chunk_s[0] < end and r.end_s > start]
    return {
        "long_ttft_ms": ttft_ms(long),
        "long_window_s": (start, end),
        "num_running_streams": len(running),
        "short_ttft_ms": distribution([ttft_ms(r) for r in shorts]),
        "blocked_short_ttft_ms": distribution([ttft_ms(r) for r in shorts if start <= r.send_s <= end]),
        "running_itl_ms": distribution([gap for r in running for gap in itls_ms(r)]),
    }
