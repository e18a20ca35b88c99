"""The ``pdserve`` command line.

``pdserve generate "prompt"`` streams a generation to the terminal. With ``--address`` it
talks to a running router; without, it starts a local deployment for the one call (a
local Ray instance, one prefill and one decode actor, the router) with the built-in
default model unless ``--model`` names another, and stops it afterwards.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from engine.default_model_path import DEFAULT_MODEL_PATH


def _add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving on Ray")
    parser.add_argument("--log-level", default="WARNING")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="stream a generation for one prompt")
    generate.add_argument("prompt")
    generate.add_argument("--address", help="router host:port; omitted: start a local deployment for this call")
    generate.add_argument("--model", type=Path, default=DEFAULT_MODEL_PATH, help="model directory (local deployment)")
    generate.add_argument("--prefill", type=int, default=1, help="prefill actors (local deployment)")
    generate.add_argument("--decode", type=int, default=1, help="decode actors (local deployment)")
    generate.add_argument("--timing", action="store_true", help="print the timing breakdown at the end")
    _add_sampling_flags(generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "generate":
        return _generate(args)
    return 2


def _generate(args: argparse.Namespace) -> int:
    import grpc

    if args.address:
        return _stream(args, args.address)
    if not (Path(args.model) / "config.json").is_file():
        print(f"pdserve: --model {args.model}: not a model directory (no config.json)", file=sys.stderr)
        return 2
    import ray

    from cluster.deployment import Deployment, DeploymentSpec, PoolSpec
    from engine.config import EngineConfig

    threads = max(1, (os.cpu_count() or 2) // max(1, args.prefill + args.decode))
    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    engine = dict(num_threads=threads, max_num_batched_tokens=512, long_prefill_chunk=256)
    deployment = Deployment(
        DeploymentSpec(
            model_path=Path(args.model),
            prefill=PoolSpec(args.prefill, EngineConfig(**engine), num_cpus=0),
            decode=PoolSpec(args.decode, EngineConfig(**engine), num_cpus=0),
        )
    )
    try:
        address = deployment.start()
        return _stream(args, address)
    except grpc.RpcError as exc:
        print(f"pdserve: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    finally:
        deployment.stop()
        ray.shutdown()


def _stream(args: argparse.Namespace, address: str) -> int:
    import grpc

    from router.api.pdserve.v1 import generation_pb2 as pb
    from router.api.pdserve.v1 import generation_pb2_grpc as pb_grpc

    sampling = pb.SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    if args.seed is not None:
        sampling.seed = args.seed
    request = pb.GenerateRequest(prompt_text=args.prompt, sampling=sampling)
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        try:
            sys.stdout.write(args.prompt)
            last = None
            for message in stub.Generate(request):
                sys.stdout.write(message.text)
                sys.stdout.flush()
                last = message
            sys.stdout.write("\n")
        except grpc.RpcError as exc:
            print(f"\npdserve: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    if getattr(args, "timing", False) and last is not None:
        t = last.timing
        print(
            f"[{last.usage.completion_tokens} tokens, finish {pb.FinishReason.Name(last.finish_reason)}; "
            f"ttft {t.time_to_first_token_ms:.1f} ms = router {t.router_queue_ms:.1f} + prefill queue {t.prefill_queue_ms:.1f}"
            f" + prefill {t.prefill_compute_ms:.1f} + transfer {t.kv_transfer_ms:.1f} + decode queue {t.decode_queue_ms:.1f};"
            f" decode {t.decode_ms:.1f} ms]",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
