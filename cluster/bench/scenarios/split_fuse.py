"""Scenario: distributed split-fuse, the paper's long-prompt table measured on pdserve.

A prompt's time to first token, for short (~64), medium (~1k) and long (8k) prompts, each alone
but for a light background load of short requests, on five clusters:

- whole: one prefill actor computes the prompt in one step (a token budget as long as it);
- split-fuse: one prefill actor, the prompt in chunks (the ordinary path);
- pipelined: two prefill actors, every remote prompt pipelined over both (``prefill.pipeline:
  always``), each a half of the layers, chunks flowing from one to the other;
- pipelined-ray: the same with every chunk's activations over Ray instead of NIXL (no inbox);
- pipelined-decode: one prefill actor and the decode actor as the second stage (``prefill.
  pipeline_decode_stage: always``): the decode actor computes the last half of the layers straight
  into its reservation;
- dynamic: two prefill actors, the router deciding per prompt (``auto``: long prompts over the
  actors that bring their first token soonest, the decode actor among them while it has no
  other request; short ones on one).

Each cluster has one decode actor and disaggregation ALWAYS (every prompt through a prefill
actor). The figure: the long prompt's TTFT pipelined over split-fuse (the issue asks <= 0.6x),
and short prompts no slower dynamic than split-fuse. The background requests are not measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import random
import statistics

from cluster.bench.client import BenchClient
from cluster.bench.metrics import SLO, ttft_ms
from cluster.bench.report import result_document, write_json
from cluster.bench.runner import BenchSpec
from cluster.bench.scenarios.common import ClusterShape, ScenarioOutcome, engine_config, flags_of, fmt, int_list, local_cluster, ratio, ray_running, scenario_model
from cluster.bench.workloads import BenchRequest, random_token_ids
from kvtransfer.agent import KVTransferConfig
from router.config import Disaggregation
from router.pipeline import PipelineMode

NAME = "split-fuse"
SUMMARY = "one prompt over several prefill actors (distributed split-fuse): TTFT of 64/1k/8k prompts, whole vs split-fuse vs pipelined over 2 vs dynamic"
DEFAULT_DTYPE = "float32"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", type=int_list, default=[64, 1024, 8000], help="prompt lengths measured")
    parser.add_argument("--reps", type=int, default=3, help="timed prompts per length and cluster (after one warm-up)")
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk and pipeline chunk")
    parser.add_argument("--background-rate", type=float, default=0.5, help="short background requests per second (0: none)")
    parser.add_argument("--clusters", default="whole,split-fuse,pipelined,pipelined-decode,dynamic", help="which clusters, comma-separated")


def _shapes(args: argparse.Namespace) -> list[ClusterShape]:
    longest = max(args.lengths)
    chunked = engine_config(args.dtype, args.chunk, args.chunk, seed=args.seed)
    whole = engine_config(args.dtype, longest + 64, None, seed=args.seed)
    pipeline = {"pipeline_chunk_tokens": args.chunk, "max_pipeline_stages": 2}  # two stages: this host has two cores
    off, always, auto = PipelineMode.OFF, PipelineMode.ALWAYS, PipelineMode.AUTO

    def shape(label: str, num_prefill: int, prefill_engine, mode: PipelineMode, decode_stage: PipelineMode, transfer=None) -> ClusterShape:
        overrides = {"prefill_pipeline": mode, "pipeline_decode_stage": decode_stage, **pipeline}
        return ClusterShape(label, num_prefill, 1, Disaggregation.ALWAYS, prefill_engine, chunked, router_overrides=overrides, transfer=transfer)

    shapes = {
        "whole": shape("whole", 1, whole, off, off),
        "split-fuse": shape("split-fuse", 1, chunked, off, off),
        "pipelined": shape("pipelined", 2, chunked, always, off),
        "pipelined-ray": shape("pipelined-ray", 2, chunked, always, off, KVTransferConfig(stage_inbox_slots=0)),
        "pipelined-decode": shape("pipelined-decode", 1, chunked, always, always),
        "dynamic": shape("dynamic", 2, chunked, auto, auto),
    }
    wanted = [name.strip() for name in args.clusters.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in shapes]
    if unknown:
        raise ValueError(f"--clusters: unknown {unknown}; known: {sorted(shapes)}")
    return [shapes[name] for name in wanted]


def run(args: argparse.Namespace) -> ScenarioOutcome:
    shapes = _shapes(args)
    results: dict[str, dict] = {}
    with scenario_model(args.model, args.dtype, args.seed) as model_dir, ray_running():
        for shape in shapes:
            with local_cluster(model_dir, shape) as deployment:
                results[shape.label] = asyncio.run(_measure(deployment.address, args, shape.label))
    long_len, short_len = max(args.lengths), min(args.lengths)

    def p50(label: str, length: int) -> float | None:
        return results.get(label, {}).get(str(length), {}).get("ttft_p50_ms")

    ratios = {
        "long_ttft_pipelined_over_split_fuse": ratio(p50("pipelined", long_len), p50("split-fuse", long_len)),
        "long_ttft_pipelined_decode_over_split_fuse": ratio(p50("pipelined-decode", long_len), p50("split-fuse", long_len)),
        "long_ttft_dynamic_over_split_fuse": ratio(p50("dynamic", long_len), p50("split-fuse", long_len)),
        "short_ttft_dynamic_over_split_fuse": ratio(p50("dynamic", short_len), p50("split-fuse", short_len)),
        "long_ttft_whole_over_split_fuse": ratio(p50("whole", long_len), p50("split-fuse", long_len)),
    }
    config = {"scenario": NAME, **flags_of(args), "clusters": [s.describe() for s in shapes]}
    json_path = write_json(args.out / "scenario.json", result_document(f"scenario:{NAME}", config, {"ratios": ratios, "clusters": results}))
    lines = [
        f"long ({long_len}) TTFT p50: pipelined over 2 / split-fuse on 1 = {fmt(ratios['long_ttft_pipelined_over_split_fuse'], 'x', 2)} "
        f"(with the decode actor as the second stage {fmt(ratios['long_ttft_pipelined_decode_over_split_fuse'], 'x', 2)}, "
        f"dynamic {fmt(ratios['long_ttft_dynamic_over_split_fuse'], 'x', 2)}, whole {fmt(ratios['long_ttft_whole_over_split_fuse'], 'x', 2)})",
        f"short ({short_len}) TTFT p50: dynamic / split-fuse = {fmt(ratios['short_ttft_dynamic_over_split_fuse'], 'x', 2)}",
        "TTFT ms p50 / p99 (output tok/s of the timed requests):",
    ]
    for label, by_length in results.items():
        cells = [f"{length}: {fmt(row['ttft_p50_ms'], '', 0)} / {fmt(row['ttft_p99_ms'], '', 0)} ({fmt(row['output_tok_s'], '', 1)})" for length, row in by_length.items()]
        lines.append(f"  {label:<16} " + "; ".join(cells))
    ok = all(row["num_failed"] == 0 for by_length in results.values() for row in by_length.values())
    return ScenarioOutcome(NAME, lines, json_path, ratios, ok=ok)


async def _measure(address: str, args: argparse.Namespace, label: str) -> dict[str, dict]:
    """Per length: one warm-up, then ``reps`` lone prompts, one after another, under the background load."""
    spec = BenchSpec(slo=SLO(None, None), temperature=0.0)
    rng = random.Random(args.seed)
    rows: dict[str, dict] = {}
    async with BenchClient(spec.client_config(address, label)) as client, BenchClient(spec.client_config(address, f"{label}-bg")) as background:
        limits = await client.model_limits()
        async with _background_load(background, limits, args, rng):
            for length in args.lengths:
                requests = [BenchRequest(args.output_len, random_token_ids(rng, limits, length), tag=str(length), prompt_len=length) for _ in range(args.reps + 1)]
                await client.warm_up(requests[:1])
                records = [(await client.run([request], [0.0])).records[0] for request in requests[1:]]
                ttfts = sorted(t for t in (ttft_ms(r) for r in records) if t is not None)
                seconds = sum(r.end_s - r.send_s for r in records if r.ok)
                rows[str(length)] = {
                    "ttft_p50_ms": statistics.median(ttfts) if ttfts else None,
                    "ttft_p99_ms": ttfts[-1] if ttfts else None,  # of a few reps: the worst
                    "ttft_ms": ttfts,
                    "output_tok_s": sum(len(r.token_ids) for r in records if r.ok) / seconds if seconds else None,
                    "num_failed": sum(1 for r in records if not r.ok),
                }
    return rows


@contextlib.asynccontextmanager
async def _background_load(client: BenchClient, limits, args: argparse.Namespace, rng: random.Random):
    """Short requests at ``--background-rate`` per second while the measurement runs."""
    if args.background_rate <= 0:
        yield
        return
    sent: list[asyncio.Task] = []

    async def send_forever() -> None:
        for index in itertools.count():
            request = BenchRequest(args.output_len, random_token_ids(rng, limits, 64), tag="background", prompt_len=64)
            sent.append(asyncio.ensure_future(client.send(request, f"{client.config.request_id_prefix}-{index}")))
            await asyncio.sleep(1 / args.background_rate)

    task = asyncio.create_task(send_forever())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(*sent, return_exceptions=True)
