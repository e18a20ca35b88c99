"""Prefix caching and KV-aware routing on a shared-prefix workload, three clusters in one run.

Chat, agents and RAG send the same long system prompt again and again. The workload: a few
shared prefixes (system prompts) of ``--prefix-len`` tokens, each request one of them plus a
unique suffix, Poisson arrivals. The same pools (by default 2 prefill + 2 decode actors,
every prompt through a prefill actor) run it three times:

- ``off``: no prefix caching: every prompt computed and pushed in full;
- ``on``: caching on every actor, workers chosen least loaded (a prefix is reused only where
  it happens to be);
- ``kv_aware``: caching, and the router scores workers by the prefix their caches hold
  against their load (``kv_aware:W`` with ``kv_overlap_weight`` W instead of the default).

Reported per cluster: TTFT p50/p99, output tok/s, prompt tokens computed, KV bytes moved and
prompt tokens served from a cache, from each request's own usage and timing breakdown. The
claim: with caching and KV-aware routing, TTFT p50 at least 4x better and KV bytes at most
0.2x of no caching.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses

from cluster.bench.arrivals import ArrivalSpec
from cluster.bench.report import format_summary, result_document, run_to_dict, write_json
from cluster.bench.runner import BenchSpec, RunOutput, bench
from cluster.bench.scenarios.common import ClusterShape, ScenarioOutcome, engine_config, flags_of, fmt, local_cluster, ratio, ray_running, scenario_model
from cluster.bench.workloads import WorkloadSpec
from router.config import Disaggregation
from router.pool import RoutingPolicy

NAME = "prefix-cache"
SUMMARY = "shared system prompts on 2 prefill + 2 decode actors: no caching vs caching vs caching with KV-aware routing (TTFT, KV bytes, tokens computed)"
DEFAULT_DTYPE = "float32"  # exact on every CPU; --dtype bfloat16 where the CPU has it natively

# label -> (prefix caching on the actors, routing policy)
CONFIGS = {
    "off": (False, RoutingPolicy.LEAST_LOADED),
    "on": (True, RoutingPolicy.LEAST_LOADED),
    "kv_aware": (True, RoutingPolicy.KV_AWARE),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--num-prefixes", type=int, default=8, help="distinct shared prefixes (system prompts)")
    parser.add_argument("--prefix-len", type=int, default=1500, help="tokens of each shared prefix")
    parser.add_argument("--suffix-len", type=int, default=100, help="each request's own tokens after its prefix")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--request-rate", type=float, default=0.4, help="Poisson arrivals, requests/s")
    parser.add_argument("--num-prefill", type=int, default=2)
    parser.add_argument("--num-decode", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk")
    parser.add_argument("--token-budget", type=int, default=512, help="tokens per engine step")
    parser.add_argument(
        "--configs", default=",".join(CONFIGS), help=f"which of {', '.join(CONFIGS)} to run, in order; kv_aware:W sets kv_overlap_weight W"
    )


def _configs(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if _parse_config(n) is None]
    if unknown or not names:
        raise ValueError(f"configs: choose from {', '.join(CONFIGS)} (kv_aware:W for a weight W), got {text!r}")
    return names


def _parse_config(name: str) -> tuple[bool, RoutingPolicy, float | None] | None:
    """(caching, policy, kv_overlap_weight or None for the default) of a config name."""
    base, _, weight = name.partition(":")
    if base not in CONFIGS or (weight and base != "kv_aware"):
        return None
    try:
        value = float(weight) if weight else None
    except ValueError:
        return None
    if value is not None and not value >= 0:
        return None
    return (*CONFIGS[base], value)


def run(args: argparse.Namespace) -> ScenarioOutcome:
    names = _configs(args.configs)
    shapes = []
    for name in names:
        caching, policy, weight = _parse_config(name)
        engine = dataclasses.replace(engine_config(args.dtype, args.token_budget, args.chunk, seed=args.seed), enable_prefix_caching=caching)
        label = f"{name} ({args.num_prefill}P+{args.num_decode}D, caching {'on' if caching else 'off'}, {policy.value})"
        shapes.append(ClusterShape(
            label, args.num_prefill, args.num_decode, Disaggregation.ALWAYS, engine, engine, routing_policy=policy, kv_overlap_weight=weight
        ))
    workload = WorkloadSpec(
        kind="prefix", num_requests=args.num_requests, input_len=args.suffix_len, output_len=args.output_len,
        num_prefixes=args.num_prefixes, prefix_len=args.prefix_len, seed=args.seed,
    )
    spec = BenchSpec(workload=workload, arrivals=ArrivalSpec(rate=args.request_rate, seed=args.seed), num_warmup=2, show_progress=not args.no_progress)
    outputs: list[RunOutput] = []
    with scenario_model(args.model, args.dtype, args.seed) as model_dir, ray_running():
        for shape in shapes:
            with local_cluster(model_dir, shape) as deployment:
                outputs.append(asyncio.run(bench(deployment.address, spec, shape.label)))
    by_name = dict(zip(names, outputs))
    rows = {name: _row(output) for name, output in by_name.items()}
    ratios: dict[str, float | None] = {}
    base = rows.get("off")
    for name in names[1:] if base is not None else []:
        ratios[f"ttft_p50_off_over_{name}"] = ratio(base["ttft_p50_ms"], rows[name]["ttft_p50_ms"])
        ratios[f"kv_bytes_{name}_over_off"] = ratio(rows[name]["kv_bytes"], base["kv_bytes"])
        ratios[f"prompt_tokens_computed_{name}_over_off"] = ratio(rows[name]["prompt_tokens_computed"], base["prompt_tokens_computed"])
    out = args.out
    config = {"scenario": NAME, **flags_of(args), "bench": dataclasses.asdict(spec), "clusters": [s.describe() for s in shapes]}
    body = {"rows": rows, "ratios": ratios, "runs": {o.label: run_to_dict(o.metrics, o.records, o.by_tag) for o in outputs}}
    json_path = write_json(out / "scenario.json", result_document(f"scenario:{NAME}", config, body))
    table = _table(workload, rows, names)
    (out / "comparison.md").write_text(table + "\n")
    lines = [format_summary(o.metrics, o.label) for o in outputs] + [table]
    for name in [n for n in names if n.startswith("kv_aware") and base is not None]:
        ttft_gain, kv_share = ratios[f"ttft_p50_off_over_{name}"], ratios[f"kv_bytes_{name}_over_off"]
        lines.append(
            f"goals ({name} vs off): TTFT p50 {fmt(ttft_gain, 'x', 2)} better (>=4x: "
            f"{_verdict(ttft_gain is not None and ttft_gain >= 4)}), KV bytes {fmt(kv_share, 'x', 3)} (<=0.2x: "
            f"{_verdict(kv_share is not None and kv_share <= 0.2)})"
        )
    return ScenarioOutcome(NAME, lines, json_path, ratios, ok=all(o.metrics.completed == o.metrics.num_requests for o in outputs))


def _verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def _row(output: RunOutput) -> dict[str, float | int | None]:
    done = [r for r in output.records if r.ok and r.timing is not None]
    metrics = output.metrics
    return {
        "completed": metrics.completed,
        "failed": metrics.failed,
        "ttft_p50_ms": metrics.ttft_ms.p50,
        "ttft_p99_ms": metrics.ttft_ms.p99,
        "tpot_p50_ms": metrics.tpot_ms.p50,
        "output_tok_s": metrics.output_throughput,
        "prompt_tokens": sum(r.prompt_len for r in done),
        "prompt_tokens_computed": sum(r.timing.prompt_tokens_computed for r in done),
        "cached_prompt_tokens": sum(r.cached_prompt_tokens for r in done),
        "kv_bytes": sum(r.timing.kv_bytes_transferred for r in done),
    }


def _table(workload: WorkloadSpec, rows: dict[str, dict], names: list[str]) -> str:
    header = (
        f"**{workload.num_requests} requests, {workload.num_prefixes} shared prefixes of {workload.prefix_len} tokens + "
        f"{workload.input_len} own tokens, {workload.output_len} output tokens each**\n\n"
        "| cluster | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | output tok/s | prompt tokens computed | from cache | KV MiB moved | failed |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    lines = [header]
    for name in names:
        r = rows[name]
        lines.append(
            f"| {name} | {fmt(r['ttft_p50_ms'], '', 0)} | {fmt(r['ttft_p99_ms'], '', 0)} | {fmt(r['tpot_p50_ms'])} | "
            f"{r['output_tok_s']:.1f} | {r['prompt_tokens_computed']:,} of {r['prompt_tokens']:,} | {r['cached_prompt_tokens']:,} | "
            f"{r['kv_bytes'] / 2**20:,.1f} | {r['failed']} |"
        )
    return "\n".join(lines)
