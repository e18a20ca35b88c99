"""Serving microbenchmark: disaggregated vs local-prefill TTFT, and the router's per-token cost.

Run as ``python -m cluster.serving_bench``. One deployment (one prefill actor, one decode
actor, the router in this process) on a random-weight model of SmolLM2-135M's shape, so
both measurements share hardware, model and run:

* TTFT of a long prompt prefilled by the prefill actor (KV pushed after every chunk) vs
  prefilled by the decode actor itself; the claim is that the transfer hides behind chunk
  compute, so the first is at most about 1.1x the second;
* the mean gap between streamed tokens seen by a gRPC client of the router vs by a caller
  of the decode actor itself (Ray calls), for the same single decoding sequence.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import grpc
import ray
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from cluster.deployment import Deployment, DeploymentSpec, PoolSpec
from decode_workers.messages import DecodeRequest
from engine.bench import SMOLLM2_135M_SHAPE, write_random_checkpoint
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from router.api.pdserve.v1 import generation_pb2 as pb
from router.api.pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.config import Disaggregation, RouterConfig
from router.pool import Role


def _write_byte_tokenizer(model_dir: Path) -> None:
    """A byte-level tokenizer with no merges: the router needs one; prompts here are token ids."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(model_dir / "tokenizer.json"))


def _ttft_ms(stub, prompt: list[int]) -> tuple[float, pb.GenerateResponse]:
    started = time.perf_counter()
    first = None
    last = None
    for message in stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))):
        if first is None and message.token_ids:
            first = (time.perf_counter() - started) * 1000
        last = message
    return first, last


def _router_gaps_ms(stub, prompt: list[int], num_tokens: int) -> list[float]:
    times = []
    request = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True))
    for message in stub.Generate(request):
        times.extend([time.perf_counter()] * max(1, len(message.token_ids)))
    return [1000 * (b - a) for a, b in zip(times[1:], times[2:])]


def _direct_gaps_ms(decode_handle, prompt: list[int], num_tokens: int, req_id: str) -> list[float]:
    ray.get(decode_handle.add_local.remote(DecodeRequest(req_id, prompt, SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True))))
    times, received = [], 0
    while received < num_tokens:
        for out in ray.get(decode_handle.poll_outputs.remote(0.05)).outputs:
            if out.req_id == req_id:
                received += len(out.token_ids)
                times.extend([time.perf_counter()] * len(out.token_ids))
    return [1000 * (b - a) for a, b in zip(times[1:], times[2:])]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_random_checkpoint(Path(tmp) / "smollm2-shape", SMOLLM2_135M_SHAPE, getattr(torch, args.dtype))
        _write_byte_tokenizer(model_dir)
        # No prefix cache: each prompt is sent twice (disaggregated, then local), and the decode
        # actor kept the first run's blocks, so the local run read all but one block from its
        # cache (a step, not a prefill: the TTFT ratio was inflated many times).
        engine = EngineConfig(dtype=args.dtype, num_threads=1, max_num_batched_tokens=args.chunk, long_prefill_chunk=args.chunk,
                              kv_cache_bytes=512 * 2**20, enable_prefix_caching=False)
        ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False)
        deployment = Deployment(
            DeploymentSpec(model_path=model_dir, prefill=PoolSpec(1, engine, num_cpus=0), decode=PoolSpec(1, engine, num_cpus=0), router=RouterConfig(disaggregation=Disaggregation.ALWAYS))
        )
        try:
            address = deployment.start()
            stub = pb_grpc.GenerationStub(grpc.insecure_channel(address))
            generator = torch.Generator().manual_seed(0)
            prompts = [torch.randint(300, 40000, (args.prompt_len,), generator=generator).tolist() for _ in range(args.reps + 1)]
            results: dict = {"prompt_len": args.prompt_len, "chunk": args.chunk, "dtype": args.dtype, "runs": []}
            for index, prompt in enumerate(prompts):
                for mode in (Disaggregation.ALWAYS, Disaggregation.NEVER):
                    deployment.router.config.disaggregation = mode
                    ttft, last = _ttft_ms(stub, prompt)
                    if index == 0:
                        continue  # warm-up: first NIXL connection, first allocations
                    t = last.timing
                    results["runs"].append({
                        "mode": "disaggregated" if mode is Disaggregation.ALWAYS else "local",
                        "ttft_ms": ttft,
                        "prefill_compute_ms": t.prefill_compute_ms,
                        "kv_transfer_ms": t.kv_transfer_ms,
                        "router_queue_ms": t.router_queue_ms,
                        "decode_queue_ms": t.decode_queue_ms,
                        "prompt_tokens_computed": t.prompt_tokens_computed,  # the whole prompt, in both modes
                    })
            disagg = statistics.median(r["ttft_ms"] for r in results["runs"] if r["mode"] == "disaggregated")
            local = statistics.median(r["ttft_ms"] for r in results["runs"] if r["mode"] == "local")
            exposed = statistics.median(r["kv_transfer_ms"] for r in results["runs"] if r["mode"] == "disaggregated")
            results |= {"ttft_disaggregated_ms": disagg, "ttft_local_ms": local, "ttft_ratio": disagg / local, "exposed_transfer_ms": exposed}
            print(f"TTFT of a {args.prompt_len}-token prompt, chunks of {args.chunk}, median of {args.reps}:")
            print(f"  disaggregated {disagg:8.1f} ms (exposed KV transfer {exposed:.1f} ms)")
            print(f"  local prefill {local:8.1f} ms")
            print(f"  ratio          {disagg / local:8.3f}  (goal <= 1.1)")
            deployment.router.config.disaggregation = Disaggregation.NEVER
            short = prompts[0][:32]
            decode_handle = deployment.handles[deployment.workers(Role.DECODE)[0]]
            # Alternated and repeated: on a shared machine, load drifts between measurements.
            router_means, direct_means = [], []
            for rep in range(args.reps):
                router_means.append(statistics.mean(_router_gaps_ms(stub, short, args.decode_tokens)))
                direct_means.append(statistics.mean(_direct_gaps_ms(decode_handle, short, args.decode_tokens, f"direct-{rep}")))
            router_gap, direct_gap = statistics.median(router_means), statistics.median(direct_means)
            results |= {"itl_router_ms": router_gap, "itl_direct_ms": direct_gap, "router_added_ms_per_token": router_gap - direct_gap}
            print(f"inter-token gap, one sequence, {args.decode_tokens} tokens, median of {args.reps} alternated runs:")
            print(f"  through the router (gRPC) {router_gap:7.2f} ms")
            print(f"  decode actor directly     {direct_gap:7.2f} ms")
            print(f"  router adds               {router_gap - direct_gap:7.2f} ms per token ({router_gap / direct_gap:.3f}x)")
        finally:
            deployment.stop()
            ray.shutdown()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
