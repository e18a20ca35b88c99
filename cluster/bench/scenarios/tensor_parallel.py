"""Scenario: what tensor parallelism costs on this machine, and what a transfer between pools of
different TP sizes moves.

On a 2-core CPU host a TP-2 worker is two processes of one thread each, against a TP-1 worker
of two threads: the same cores, plus an all-reduce after every attention and MLP block and a
broadcast of each step's inputs. These figures are the price of TP here, not a speed-up (TP
pays where a model does not fit one device, or where each rank has its own GPU).

1. Step times, in this process (rank 0) with rank 1 a subprocess: decode steps at several batch
   sizes and a long prompt's prefill, TP-1 (2 threads) against TP-2 (1 thread per rank), with
   transformers' own forward (2 threads) as the outside reference; the share of a TP-2 step
   rank 0 spends in all-reduces (waiting for rank 1 included), the logits' gather and the
   step broadcast.
2. The shared burst workload (32 prompts of 64-1024 tokens, 128 output tokens, all at once)
   through one decode worker that prefills locally: TP-1 (2 threads) against TP-2.
3. For (prefill TP, decode TP) in {1, 2} x {1, 2}: the KV bytes and transfer descriptors per
   request, from the prefill worker's transfer log.

The model is SmolLM2-135M's shape with 8 attention heads of 64 and 4 KV heads (the real one has
9 and 3, which no TP size above 1 divides), random weights.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from pathlib import Path

import torch

from cluster.bench.client import BenchClient
from cluster.bench.metrics import SLO
from cluster.bench.report import result_document, run_to_dict, write_json
from cluster.bench.runner import BenchSpec, run_load
from cluster.bench.scenarios.common import ClusterShape, ScenarioOutcome, flags_of, fmt, int_list, local_cluster, ratio, ray_running, scenario_model
from cluster.bench.workloads import BenchRequest, random_token_ids
from engine.bench import SMOLLM2_135M_SHAPE, seat_decoding
from engine.bench_reference import TransformersReference
from engine.config import DTYPES, EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from router.config import Disaggregation

NAME = "tensor-parallel"
SUMMARY = "TP-2 (1 thread per rank) vs TP-1 (2 threads) on this host: decode step, all-reduce share, burst tok/s; KV bytes and descriptors per request for (P, D) in {1,2}x{1,2}"
DEFAULT_DTYPE = "float32"

TP_SHAPE = {**SMOLLM2_135M_SHAPE, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", type=int_list, default=[1, 8, 32], help="decode batch sizes")
    parser.add_argument("--context", type=int, default=512, help="tokens each decoding sequence holds")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per batch size")
    parser.add_argument("--prefill-len", type=int, default=512, help="prompt length of the prefill measurement")
    parser.add_argument("--burst-requests", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--pair-prompts", type=int, default=4, help="prompts per (P, D) pair")
    parser.add_argument("--pair-prompt-len", type=int, default=300)
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk (token budget of the prefill and decode workers)")
    parser.add_argument("--skip", default="", help="parts to leave out, comma-separated: steps, burst, pairs")


def run(args: argparse.Namespace) -> ScenarioOutcome:
    skip = {part.strip() for part in args.skip.split(",") if part.strip()}
    results: dict = {}
    with scenario_model(args.model, args.dtype, args.seed, shape=TP_SHAPE) as model_dir:
        if "steps" not in skip:
            results["steps"] = _step_times(model_dir, args)
        if not {"burst", "pairs"} <= skip:
            with ray_running():
                if "burst" not in skip:
                    results["burst"] = {f"tp{tp}": _burst(model_dir, tp, args) for tp in (1, 2)}
                if "pairs" not in skip:
                    results["pairs"] = {f"{p},{d}": _pair_costs(model_dir, p, d, args) for p in (1, 2) for d in (1, 2)}
    lines, ratios = _report(results, args)
    json_path = write_json(args.out / "scenario.json", result_document(f"scenario:{NAME}", {"scenario": NAME, **flags_of(args)}, {"ratios": ratios, **results}))
    return ScenarioOutcome(NAME, lines, json_path, ratios)


# -- 1. step times ------------------------------------------------------------------------


def _engine(model_dir: Path, dtype: str, tp: int, threads: int, num_blocks: int, batch: int) -> LLMEngine:
    config = EngineConfig(dtype=dtype, num_kv_blocks=num_blocks, max_num_seqs=max(batch, 1), max_num_batched_tokens=2048,
                          num_threads=threads, tensor_parallel_size=tp)
    return LLMEngine(model_dir, config)


def _step_times(model_dir: Path, args: argparse.Namespace) -> dict:
    """Decode step (ms) per batch and prefill tok/s: TP-1 with 2 threads, TP-2 with 1 per rank, transformers with 2."""
    blocks = 2 * max(args.batches) * (-(-(args.context + args.steps + 16) // 16)) + 16
    out: dict = {"decode": {}, "prefill": {}}
    prompt = [random.Random(args.seed + i).randrange(3, 40000) for i in range(args.prefill_len)]
    for label, tp, threads in (("tp1", 1, 2), ("tp2", 2, 1)):
        torch.set_num_threads(threads)
        engine = _engine(model_dir, args.dtype, tp, threads, blocks, max(args.batches))
        try:
            group = engine.executor.group if tp > 1 else None
            for batch in args.batches:
                seat_decoding(engine, batch, args.context, args.steps + 8)
                engine.step()  # warm-up
                before = _times(group)
                durations = []
                for _ in range(args.steps):
                    started = time.perf_counter()
                    engine.step()
                    durations.append(time.perf_counter() - started)
                spent = _delta(before, _times(group))
                total = sum(durations)
                for req_id in list(engine.scheduler.requests):
                    engine.abort_request(req_id)
                out["decode"].setdefault(str(batch), {})[label] = {
                    "step_ms": 1000 * statistics.median(durations),
                    "tok_s": batch * args.steps / total,
                    **({f"{k}_share": v / total for k, v in spent.items()} if group is not None else {}),
                }
            engine.generate([prompt[:64]], SamplingParams(max_tokens=1, temperature=0.0))  # warm-up
            started = time.perf_counter()
            engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
            out["prefill"][label] = {"tok_s": len(prompt) / (time.perf_counter() - started)}
        finally:
            engine.close()
    torch.set_num_threads(2)
    reference = TransformersReference(model_dir, DTYPES[args.dtype])
    for batch in args.batches:
        tok_s = reference.decode_tok_s(batch, args.context, args.steps)
        out["decode"][str(batch)]["transformers"] = {"step_ms": 1000 * batch / tok_s, "tok_s": tok_s}
    out["prefill"]["transformers"] = {"tok_s": reference.prefill_tok_s(prompt)}
    return out


def _times(group) -> dict[str, float]:
    if group is None:
        return {}
    t = group.times
    return {"all_reduce": t.all_reduce_s, "gather": t.gather_s, "broadcast": t.broadcast_s}


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


# -- 2. the burst -------------------------------------------------------------------------


def _burst(model_dir: Path, tp: int, args: argparse.Namespace) -> dict:
    engine = EngineConfig(dtype=args.dtype, num_threads=2 // tp, max_num_batched_tokens=args.chunk, long_prefill_chunk=args.chunk,
                          kv_cache_bytes=1024 * 2**20, tensor_parallel_size=tp, enable_prefix_caching=False)
    shape = ClusterShape(f"1 decode worker, TP {tp}", 0, 1, Disaggregation.NEVER, engine, engine)
    with local_cluster(model_dir, shape) as deployment:
        output = asyncio.run(_burst_load(deployment.address, args))
    metrics = output.metrics
    return {"output_tok_s": metrics.output_throughput, "duration_s": metrics.duration_s, "completed": metrics.completed,
            "num_requests": metrics.num_requests, "run": run_to_dict(output.metrics, output.records, output.by_tag)}


async def _burst_load(address: str, args: argparse.Namespace):
    spec = BenchSpec(max_concurrency=args.burst_requests, show_progress=not args.no_progress)
    async with BenchClient(spec.client_config(address, NAME)) as client:
        limits = await client.model_limits()
        rng = random.Random(args.seed)
        requests = [BenchRequest(args.output_len, random_token_ids(rng, limits, rng.randint(64, 1024)), tag="burst") for _ in range(args.burst_requests)]
        await client.warm_up([BenchRequest(4, random_token_ids(rng, limits, 64))])
        return await run_load(client, requests, [0.0] * len(requests), SLO(), "burst", spec.show_progress)


# -- 3. what a request moves between pools of each TP pair ------------------------------------


def _pair_costs(model_dir: Path, prefill_tp: int, decode_tp: int, args: argparse.Namespace) -> dict:
    import ray

    def config(tp: int) -> EngineConfig:
        return EngineConfig(dtype=args.dtype, num_threads=1, max_num_batched_tokens=args.chunk, long_prefill_chunk=args.chunk,
                            kv_cache_bytes=256 * 2**20, tensor_parallel_size=tp, enable_prefix_caching=False)

    shape = ClusterShape(f"prefill TP {prefill_tp}, decode TP {decode_tp}", 1, 1, Disaggregation.ALWAYS, config(prefill_tp), config(decode_tp))
    with local_cluster(model_dir, shape) as deployment:
        output = asyncio.run(_pair_load(deployment.address, args))
        batch = ray.get(deployment.pools.handles["prefill-0"].step_profile.remote(0, 0))
    done = [r for r in output.records if r.ok]
    num = max(1, len(done))
    return {
        "requests": len(done),
        "kv_bytes_per_request": sum(t.num_bytes for t in batch.transfers) / num,
        "descriptors_per_request": sum(t.num_descriptors for t in batch.transfers) / num,
        "writes_per_request": len(batch.transfers) / num,
        "blocks_per_request": -(-args.pair_prompt_len // 16),
    }


async def _pair_load(address: str, args: argparse.Namespace):
    spec = BenchSpec(max_concurrency=1, show_progress=False)
    async with BenchClient(spec.client_config(address, NAME)) as client:
        limits = await client.model_limits()
        rng = random.Random(args.seed)
        requests = [BenchRequest(2, random_token_ids(rng, limits, args.pair_prompt_len), tag="pair") for _ in range(args.pair_prompts)]
        return await run_load(client, requests, [0.0] * len(requests), SLO(), "pairs", False)


# -- report -------------------------------------------------------------------------------


def _report(results: dict, args: argparse.Namespace) -> tuple[list[str], dict]:
    lines: list[str] = ["what TP costs on this host (not a speed-up): TP-1 = one process, 2 threads; TP-2 = 2 ranks, 1 thread each"]
    ratios: dict = {}
    steps = results.get("steps")
    if steps:
        lines.append(f"{'decode batch':>12}{'TP-1 ms':>10}{'TP-2 ms':>10}{'transformers ms':>17}{'TP-2/TP-1':>11}{'all-reduce':>12}{'gather':>8}{'bcast':>8}")
        for batch, row in steps["decode"].items():
            tp1, tp2, ref = row["tp1"], row["tp2"], row["transformers"]
            ratios[f"decode_step_tp2_over_tp1_b{batch}"] = ratio(tp2["step_ms"], tp1["step_ms"])
            ratios[f"decode_step_tp2_over_transformers_b{batch}"] = ratio(tp2["step_ms"], ref["step_ms"])
            lines.append(
                f"{batch:>12}{tp1['step_ms']:>10.1f}{tp2['step_ms']:>10.1f}{ref['step_ms']:>17.1f}{ratio(tp2['step_ms'], tp1['step_ms']):>10.2f}x"
                f"{100 * tp2['all_reduce_share']:>11.1f}%{100 * tp2['gather_share']:>7.1f}%{100 * tp2['broadcast_share']:>7.1f}%"
            )
        prefill = steps["prefill"]
        ratios["prefill_tp2_over_tp1"] = ratio(prefill["tp2"]["tok_s"], prefill["tp1"]["tok_s"])
        lines.append(
            f"prefill {args.prefill_len} tokens: TP-1 {prefill['tp1']['tok_s']:.0f} tok/s, TP-2 {prefill['tp2']['tok_s']:.0f}, "
            f"transformers {prefill['transformers']['tok_s']:.0f}"
        )
    burst = results.get("burst")
    if burst:
        ratios["burst_tok_s_tp2_over_tp1"] = ratio(burst["tp2"]["output_tok_s"], burst["tp1"]["output_tok_s"])
        lines.append(
            f"burst of {args.burst_requests} (64-1024 in, {args.output_len} out), one decode worker: TP-1 {fmt(burst['tp1']['output_tok_s'])} tok/s "
            f"in {fmt(burst['tp1']['duration_s'])} s, TP-2 {fmt(burst['tp2']['output_tok_s'])} tok/s in {fmt(burst['tp2']['duration_s'])} s"
        )
    pairs = results.get("pairs")
    if pairs:
        lines.append(f"{'(P, D)':>8}{'KV bytes/request':>18}{'descriptors/request':>21}{'writes/request':>16}   ({args.pair_prompt_len}-token prompts, chunk {args.chunk})")
        for pair, row in pairs.items():
            lines.append(f"{'(' + pair + ')':>8}{row['kv_bytes_per_request']:>18,.0f}{row['descriptors_per_request']:>21.1f}{row['writes_per_request']:>16.1f}")
            ratios[f"descriptors_per_request_{pair.replace(',', '_')}"] = row["descriptors_per_request"]
    return lines, ratios
