"""Scenario 4: the share of TTFT spent in KV transfer, per prompt length.

One disaggregated cluster (1 prefill + 1 decode, every prompt through the prefill actor).
Prompts of each length are sent one at a time, so nothing queues and the router's per-stage
timing isolates the pieces of TTFT. ``kv_transfer_ms`` there is the transfer still in
flight after the last chunk was computed, i.e. the part that chunk compute did not hide:
pdserve pushes each chunk's blocks while the next chunk computes, so the claim is that this
share stays small and does not grow with the prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics

from cluster.bench import plots
from cluster.bench.client import BenchClient, RequestRecord
from cluster.bench.metrics import SLO, ttft_ms
from cluster.bench.report import result_document, run_to_dict, write_json
from cluster.bench.runner import BenchSpec, RunOutput, run_load
from cluster.bench.scenarios.common import ClusterShape, ScenarioOutcome, engine_config, flags_of, local_cluster, ray_running, scenario_model
from cluster.bench.workloads import BenchRequest, random_token_ids
from router.config import Disaggregation

NAME = "kv-transfer"
SUMMARY = "share of TTFT spent in KV transfer, per prompt length (disaggregated, one request at a time)"


def _lengths(text: str) -> list[int]:
    lengths = [int(part) for part in text.split(",") if part.strip()]
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"a comma-separated list of prompt lengths >= 1, got {text!r}")
    return lengths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", type=_lengths, default=[128, 256, 512, 1024, 2048], help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--reps", type=int, default=3, help="requests per length")
    parser.add_argument("--output-len", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "int8", "fp8_e4m3"], default="auto", help="KV cache elements of both actors")
    parser.add_argument("--kv-memory-gib", type=float, default=4.0, help="for the report: sequences of each length that many GiB of KV hold")


def run(args: argparse.Namespace) -> ScenarioOutcome:
    engine = engine_config(args.dtype, args.chunk, args.chunk, seed=args.seed)
    engine.kv_cache_dtype = args.kv_cache_dtype
    shape = ClusterShape("1 prefill + 1 decode", 1, 1, Disaggregation.ALWAYS, engine, engine)
    with scenario_model(args.model, args.dtype, args.seed) as model_dir, ray_running():
        with local_cluster(model_dir, shape) as deployment:
            output = asyncio.run(_run(deployment.address, args))
    per_length = {length: _per_length([r for r in output.records if r.tag == f"{length}"]) for length in args.lengths}
    ratios = {f"transfer_share_{length}": f["transfer_share"] for length, f in per_length.items()}
    out = args.out
    stage_groups = {f"{length} tokens": f["stage_medians_ms"] for length, f in per_length.items() if f["num_ok"]}
    notes = {f"{length} tokens": f"transfer {100 * f['transfer_share']:.2f}% of TTFT" for length, f in per_length.items() if f["transfer_share"] is not None}
    ttft_stages = (*plots.TTFT_STAGES, "ttft_other_ms")
    paths = [
        plots.plot_stage_breakdown(stage_groups, out / "ttft_breakdown.png", stages=ttft_stages, title=f"where TTFT goes (median of {args.reps}, chunk {args.chunk})", notes=notes, xlabel="median time (ms)"),
        plots.plot_stage_breakdown(stage_groups, out / "ttft_shares.png", stages=ttft_stages, title="TTFT stages as shares of the whole", notes=notes, normalize=True),
    ]
    config = {"scenario": NAME, **flags_of(args), "clusters": [shape.describe()]}
    body = {"ratios": ratios, "per_length": {str(k): v for k, v in per_length.items()}, "runs": {output.label: run_to_dict(output.metrics, output.records, output.by_tag)}, "plots": [str(p) for p in paths]}
    json_path = write_json(out / "scenario.json", result_document(f"scenario:{NAME}", config, body))
    lines = [
        f"KV cache {args.kv_cache_dtype} ({args.dtype} model)",
        f"{'prompt':>8}{'TTFT':>10}{'prefill':>10}{'transfer':>10}{'share':>8}{'KV bytes':>12}{'seqs in ' + str(args.kv_memory_gib) + ' GiB':>16}"
        "   (medians, ms; transfer = exposed after the last chunk)",
    ]
    for length, f in per_length.items():
        if not f["num_ok"]:
            lines.append(f"{length:>8}  (no request completed)")
            continue
        m = f["stage_medians_ms"]
        # Every prompt block crosses (no prefix cache hits between distinct random prompts).
        capacity = int(args.kv_memory_gib * 2**30 // f["kv_bytes"]) if f["kv_bytes"] else 0
        lines.append(
            f"{length:>8}{f['client_ttft_ms']:>10.1f}{m['prefill_compute_ms']:>10.1f}{m['kv_transfer_ms']:>10.1f}{100 * f['transfer_share']:>7.2f}%"
            f"{f['kv_bytes']:>12,}{capacity:>16,}"
        )
    shares = [f"{length}: {100 * f['transfer_share']:.2f}%" for length, f in per_length.items() if f["transfer_share"] is not None]
    lines.append("share of TTFT spent in KV transfer, by prompt length: " + ", ".join(shares))
    return ScenarioOutcome(NAME, lines, json_path, ratios, ok=output.metrics.completed == output.metrics.num_requests)


async def _run(address: str, args: argparse.Namespace) -> RunOutput:
    spec = BenchSpec(max_concurrency=1, show_progress=not args.no_progress)
    async with BenchClient(spec.client_config(address, "kv-transfer")) as client:
        limits = await client.model_limits()
        rng = random.Random(args.seed)
        # Lengths interleaved rep by rep, so slow drift of a shared machine hits them alike.
        requests = [BenchRequest(args.output_len, random_token_ids(rng, limits, n), tag=f"{n}", prompt_len=n) for _ in range(args.reps) for n in args.lengths]
        # One warm-up per length: the first transfer to a new peer and the first allocation
        # of each size are one-off costs.
        for n in args.lengths:
            await client.warm_up([BenchRequest(args.output_len, random_token_ids(rng, limits, n), prompt_len=n)])
        return await run_load(client, requests, [0.0] * len(requests), SLO(), "kv-transfer", spec.show_progress)


def _per_length(records: list[RequestRecord]) -> dict:
    done = [r for r in records if r.ok and r.timing is not None]
    if not done:
        return {"num_ok": 0, "transfer_share": None, "client_ttft_ms": None, "stage_medians_ms": {}}
    stages = ("router_queue_ms", "prefill_queue_ms", "prefill_compute_ms", "kv_transfer_ms", "decode_queue_ms", "time_to_first_token_ms")
    medians = {s: statistics.median(getattr(r.timing, s) for r in done) for s in stages}
    medians["ttft_other_ms"] = max(0.0, medians["time_to_first_token_ms"] - sum(medians[s] for s in plots.TTFT_STAGES))
    shares = [r.timing.kv_transfer_ms / r.timing.time_to_first_token_ms for r in done if r.timing.time_to_first_token_ms > 0]
    return {
        "num_ok": len(done),
        "client_ttft_ms": statistics.median(ttft_ms(r) for r in done),
        "stage_medians_ms": medians,
        "transfer_share": statistics.median(shares) if shares else None,  # per request, then the median
        "kv_bytes": int(statistics.median(r.timing.kv_bytes_transferred for r in done)),
    }
