"""``pdserve bench`` (load a running router) and ``pdserve bench-scenario NAME`` (launch and compare).

Wiring into a parent parser::

    commands = parser.add_subparsers(dest="command")
    add_bench_parser(commands)      # "bench"          -> run_bench(args)
    add_scenario_parser(commands)   # "bench-scenario" -> run_scenario(args)

Both set ``args.bench_handler``, so a caller may also dispatch with ``args.bench_handler(args)``.
Standalone: ``python -m cluster.bench bench --address HOST:PORT ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import sys
import time
from pathlib import Path

from cluster.arguments import positive_float
from cluster.bench.arrivals import ArrivalSpec
from cluster.bench.metrics import SLO
from cluster.bench.workloads import WORKLOAD_KINDS, WorkloadSpec

logger = logging.getLogger(__name__)


def _rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"a comma-separated list of request rates, got {text!r}") from exc
    if not rates or any(not r > 0 or math.isinf(r) for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be finite and > 0, got {text!r}")
    return rates


def add_workload_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    # Second names are vLLM's `bench serve` flags, so its command lines run here unchanged.
    group.add_argument("--workload", "--dataset-name", dest="workload", choices=WORKLOAD_KINDS, default="random", help="random: synthetic lengths; mixed: long among short prompts; prefix: shared prefixes; sharegpt: --dataset")
    group.add_argument("--num-requests", "--num-prompts", dest="num_requests", type=int, default=100)
    group.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=128, help="prompt tokens (short prompts for mixed, suffix for prefix)")
    group.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=64, help="tokens to generate per request")
    group.add_argument("--range-ratio", "--random-range-ratio", dest="range_ratio", type=float, default=0.0, help="draw lengths uniformly from len*(1±r); 0 = fixed")
    group.add_argument("--long-fraction", type=float, default=0.2, help="mixed: share of long prompts")
    group.add_argument("--long-input-len", type=int, default=1024, help="mixed: tokens of a long prompt")
    group.add_argument("--num-prefixes", type=int, default=4, help="prefix: distinct shared prefixes")
    group.add_argument("--prefix-len", type=int, default=256, help="prefix: tokens of each shared prefix")
    group.add_argument("--dataset", "--dataset-path", dest="dataset", help="sharegpt: path of a ShareGPT-format JSON file")
    group.add_argument("--tokenizer", help="sharegpt: tokenizer.json (or its directory) to count tokens; else estimated")
    group.add_argument("--fixed-output-len", action="store_true", help="sharegpt: --output-len for every request, not the reply's length")
    group.add_argument("--sharegpt-output-len", type=int, help="sharegpt: this many tokens for every request (vLLM's flag: --output-len with --fixed-output-len)")
    group.add_argument("--seed", type=int, default=0, help="seeds the workload and the arrivals")


def add_load_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("load")
    group.add_argument("--request-rate", type=positive_float, default=math.inf, help="requests/s (default inf: all at once)")
    group.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of inter-arrival gaps; 1 = Poisson, <1 burstier")
    group.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    group.add_argument("--num-warmup", "--num-warmups", dest="num_warmup", type=int, default=2, help="requests sent first and not counted")
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction,
                       help="generate exactly the asked tokens (default: on for the synthetic workloads, off for sharegpt, as vLLM's bench serve)")
    group.add_argument("--timeout", type=float, default=600.0, help="per-request deadline in seconds")


def add_slo_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("SLOs (goodput counts requests within all that are set)")
    group.add_argument("--slo-ttft-ms", type=float)
    group.add_argument("--slo-tpot-ms", type=float)
    group.add_argument("--slo-e2e-ms", type=float)
    group.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="vLLM's form of the SLOs: ttft:MS tpot:MS e2el:MS")


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to ``subparsers``; its handler is ``run_bench``."""
    parser = subparsers.add_parser("bench", help="benchmark a running router", description="Benchmark a running pdserve router: TTFT, TPOT, ITL, E2E, throughput, goodput, per-stage timing.")
    parser.add_argument("--address", help="router host:port (default: the deployment `pdserve up` recorded)")
    server = parser.add_argument_group("server (any OpenAI-compatible one: --backend openai)")
    server.add_argument("--backend", choices=["grpc", "openai"], default="grpc", help="grpc: pdserve's router; openai: streamed /v1/completions at --base-url")
    server.add_argument("--base-url", help="openai: the server's base URL, e.g. http://127.0.0.1:8000 (default: pdserve's recorded HTTP API)")
    server.add_argument("--model", help="openai: the model name to request (default: the first /v1/models lists)")
    server.add_argument("--model-dir", type=Path, help="openai: the served checkpoint's directory, for its vocabulary (an OpenAI server does not report it)")
    add_workload_flags(parser)
    add_load_flags(parser)
    add_slo_flags(parser)
    group = parser.add_argument_group("sweep")
    group.add_argument("--sweep", type=_rates, metavar="RATES", help="comma-separated request rates to run in turn, e.g. 0.5,1,2,4")
    group.add_argument("--sweep-refine", type=int, default=0, metavar="N", help="then bisect N times between the highest passing and lowest failing rate")
    group.add_argument("--sweep-target", type=float, default=0.9, help="share of requests that must meet the SLOs for a rate to pass")
    out = parser.add_argument_group("output")
    out.add_argument("--out", type=Path, default=Path("bench-results"), help="directory for bench.json / sweep.json and the PNG plots")
    out.add_argument("--label", default="bench")
    out.add_argument("--no-plots", action="store_true")
    out.add_argument("--no-progress", action="store_true")
    parser.set_defaults(bench_handler=run_bench)
    return parser


def add_scenario_parser(subparsers, scenarios: bool = True) -> argparse.ArgumentParser:
    """Add ``bench-scenario NAME`` to ``subparsers``; its handler is ``run_scenario``. Without
    ``scenarios``, only the command's name and help (for a command line that runs another one)."""
    parser = subparsers.add_parser("bench-scenario", help="launch local clusters and compare them on one claim", description="Launch the clusters a scenario compares (same hardware, one after the other), run its workload, write JSON and plots, print its ratio.")
    if not scenarios:
        return parser
    from cluster.bench.scenarios import SCENARIOS

    names = parser.add_subparsers(dest="scenario", required=True, metavar="NAME")
    for name, scenario in SCENARIOS.items():
        sub = names.add_parser(name, help=scenario.summary, description=scenario.summary)
        scenario.add_arguments(sub)
        sub.add_argument("--out", type=Path, default=Path("bench-results") / name, help="directory for scenario.json and the plots")
        sub.add_argument("--model", type=Path, help="model directory (default: random weights of SmolLM2-135M's shape, byte tokenizer)")
        sub.add_argument("--dtype", default=scenario.default_dtype, choices=["float32", "bfloat16", "float16"])
        sub.add_argument("--seed", type=int, default=0)
        sub.add_argument("--no-progress", action="store_true")
    parser.set_defaults(bench_handler=run_scenario)
    return parser


def _model_tokenizer(model_dir: str | None) -> str | None:
    """The served checkpoint's tokenizer.json, which counts tokens as the server does (None:
    there is none, as beside a SentencePiece-only checkpoint: lengths are estimated)."""
    if model_dir is None:
        return None
    path = Path(model_dir) / "tokenizer.json"
    return str(path) if path.is_file() else None


def bench_spec_from_args(args: argparse.Namespace):
    """The BenchSpec that ``bench``'s flags describe (ValueError names a bad flag)."""
    from cluster.bench.runner import BenchSpec

    fixed_len = getattr(args, "sharegpt_output_len", None) if args.workload == "sharegpt" else None  # (a ShareGPT flag, as vLLM's)
    workload = WorkloadSpec(
        kind=args.workload,
        num_requests=args.num_requests,
        input_len=args.input_len,
        output_len=args.output_len if fixed_len is None else fixed_len,
        range_ratio=args.range_ratio,
        long_fraction=args.long_fraction,
        long_input_len=args.long_input_len,
        num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len,
        dataset_path=args.dataset,
        tokenizer_path=args.tokenizer or _model_tokenizer(getattr(args, "model_dir", None)),
        fixed_output_len=args.fixed_output_len or fixed_len is not None,
        seed=args.seed,
    )
    workload.validate()
    arrivals = ArrivalSpec(rate=args.request_rate, burstiness=args.burstiness, seed=args.seed)
    arrivals.validate()
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)
    for item in getattr(args, "goodput", None) or []:
        key, _, value = item.partition(":")
        fields = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2e_ms"}
        if key not in fields:
            raise ValueError(f"goodput: {item!r}: the key must be ttft, tpot or e2el")
        try:
            setattr(slo, fields[key], float(value))
        except ValueError:
            raise ValueError(f"goodput: {item!r}: the value must be milliseconds") from None
    slo.validate()
    backend = getattr(args, "backend", "grpc")
    if backend == "openai" and getattr(args, "model_dir", None) is None:
        raise ValueError("model_dir: --backend openai needs --model-dir, the served checkpoint's directory (for its vocabulary)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"max_concurrency: must be >= 1, got {args.max_concurrency}")
    if args.num_warmup < 0:
        raise ValueError(f"num_warmup: must be >= 0, got {args.num_warmup}")
    return BenchSpec(
        workload=workload,
        arrivals=arrivals,
        slo=slo,
        num_warmup=args.num_warmup,
        max_concurrency=args.max_concurrency,
        temperature=args.temperature,
        # (A real conversation ends where its model ends it; random tokens have no end to find.)
        ignore_eos=args.ignore_eos if args.ignore_eos is not None else args.workload != "sharegpt",
        timeout_s=args.timeout,
        show_progress=not args.no_progress,
        backend=backend,
        model=getattr(args, "model", None),
        model_dir=getattr(args, "model_dir", None),
    )


def run_bench(args: argparse.Namespace) -> int:
    """Run ``pdserve bench``; 0 on success, 1 if the run failed, 2 on bad flags."""
    from cluster.bench import runner
    from cluster.bench.report import format_summary, format_sweep

    try:
        spec = bench_spec_from_args(args)
    except ValueError as exc:
        print(f"pdserve bench: {exc}", file=sys.stderr)
        return 2
    if spec.backend == "openai":
        args.address = args.base_url or _recorded(getattr(args, "state_file", None), "http_address")
        if not args.address:
            print("pdserve bench: --backend openai needs --base-url (or a deployment `pdserve up` recorded)", file=sys.stderr)
            return 2
    elif not args.address:
        args.address = _recorded(getattr(args, "state_file", None), "router_address")
        if not args.address:
            print("pdserve bench: no --address and no running deployment recorded by `pdserve up`", file=sys.stderr)
            return 2
    extra = {"address": args.address}
    try:
        if args.sweep:
            result, outputs = asyncio.run(runner.sweep(args.address, spec, args.sweep, args.sweep_refine, args.sweep_target, label=args.label))
            runner.write_sweep(args.out, spec, result, outputs, extra, make_plots=not args.no_plots)
            for output in outputs:
                print(format_summary(output.metrics, f"{args.label} @ {output.offered_rate:.3g} req/s"))
            print(format_sweep([(o.offered_rate, o.metrics) for o in outputs], result.max_rate, result.target))
            print(f"results: {args.out / 'sweep.json'}")
            return 0
        output = asyncio.run(runner.bench(args.address, spec, label=args.label))
        runner.write_run(args.out, spec, output, extra, make_plots=not args.no_plots)
    except ValueError as exc:  # e.g. a workload that does not fit the served model
        print(f"pdserve bench: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # the router unreachable, a broken channel: say so, no traceback
        logger.debug("bench failed", exc_info=True)
        print(f"pdserve bench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(format_summary(output.metrics, args.label))
    print(f"results: {args.out / 'bench.json'}")
    return 0 if output.metrics.completed else 1


def run_scenario(args: argparse.Namespace) -> int:
    """Run ``pdserve bench-scenario NAME``; prints the scenario's ratio; 0 on success."""
    from cluster.bench.scenarios import SCENARIOS

    started = time.perf_counter()
    try:
        outcome = SCENARIOS[args.scenario].run(args)
    except ValueError as exc:  # a bad flag or model directory, named by the scenario
        print(f"pdserve bench-scenario {args.scenario}: {exc}", file=sys.stderr)
        return 2
    for line in outcome.lines:
        print(line)
    print(f"results: {outcome.json_path} ({time.perf_counter() - started:.0f} s)")
    return 0 if outcome.ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cluster.bench", description="pdserve's serving benchmark")
    parser.add_argument("--log-level", default="WARNING")
    commands = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(commands)
    add_scenario_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.bench_handler(args)


def _recorded(state_file, key: str) -> str | None:
    """An address (``router_address``, ``http_address``) ``pdserve up`` wrote to its state file, if any."""
    import json
    from pathlib import Path

    if state_file is None:
        return None
    try:
        return json.loads(Path(state_file).read_text()).get(key)
    except (OSError, ValueError):
        return None
