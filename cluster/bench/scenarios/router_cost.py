"""Scenario: what streaming costs the router, and how router replicas carry more.

One deployment per router count (decode actors prefilling their own prompts, so the router's
work is all streaming): the client, in its own processes, opens ``--streams`` gRPC streams at
once over ``--connections`` connections (SO_REUSEPORT spreads connections, not calls, over the
routers on a host) and reads ``--tokens`` tokens from each. Measured per run: the tokens per
second the client received, and the CPU time of every router process (this one, which hosts
the managing router and the Ray driver, plus each replica's, read from /proc) per streamed
token. The issue's yardsticks: router CPU per token with the built-in model at 64 x 256, and
2 replicas against 1 on a load that saturates one router (which needs more decode throughput
than one router can stream: on a 2-core host the decode actor, the client and the routers
share the cores and nothing saturates alone).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from cluster.bench.report import write_json
from cluster.bench.scenarios.common import ClusterShape, ScenarioOutcome, engine_config, flags_of, fmt, int_list, local_cluster, ratio, ray_running
from engine.default_model_path import DEFAULT_MODEL_PATH
from router.config import Disaggregation

NAME = "router-cost"
SUMMARY = "router CPU per streamed token, and tokens/s through 1 and more router replicas (gRPC streams)"
DEFAULT_DTYPE = "float32"

# The load generator, run in its own processes: a Python client in the benchmark's process
# would take the router's CPU and be counted as its cost.
_CLIENT = r'''
import asyncio, json, sys, time
import grpc
from router.api.pdserve.v1 import generation_pb2 as pb, generation_pb2_grpc as pb_grpc

async def stream(stub, index, num_tokens):
    request = pb.GenerateRequest(prompt_text=f"stream {index}:", sampling=pb.SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True))
    tokens = messages = 0
    async for message in stub.Generate(request):
        tokens += len(message.token_ids)
        messages += 1
    return tokens, messages

async def main(address, first, num_streams, num_tokens, num_connections):
    channels = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(num_connections)]
    stubs = [pb_grpc.GenerationStub(c) for c in channels]
    await asyncio.gather(*(stream(s, -1, 2) for s in stubs))  # connect every channel first
    print("ready", flush=True)
    sys.stdin.readline()
    started = time.perf_counter()
    results = await asyncio.gather(*(stream(stubs[i % len(stubs)], first + i, num_tokens) for i in range(num_streams)))
    print(json.dumps({"tokens": sum(t for t, _ in results), "messages": sum(m for _, m in results), "seconds": time.perf_counter() - started}), flush=True)
    for channel in channels:
        await channel.close()

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])))
'''

# The same load over an HTTP front end: streamed, one SSE event per message; the tokens counted
# from the usage each API reports at its end.
_HTTP_CLIENT = r'''
import asyncio, json, sys, time
import aiohttp

def body(front_end, model, index, num_tokens):
    text = f"stream {index}:"
    common = {"model": model, "stream": True, "temperature": 0.0, "ignore_eos": True}
    if front_end == "completions":
        return "/v1/completions", {**common, "prompt": text, "max_tokens": num_tokens, "stream_options": {"include_usage": True}}
    if front_end == "chat":
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": text}], "max_tokens": num_tokens, "stream_options": {"include_usage": True}}
    if front_end == "responses":
        return "/v1/responses", {**common, "input": text, "max_output_tokens": num_tokens, "store": False}
    return "/v1/messages", {**common, "messages": [{"role": "user", "content": text}], "max_tokens": num_tokens}

def tokens_of(front_end, event):
    if front_end in ("completions", "chat"):
        return (event.get("usage") or {}).get("completion_tokens")
    if front_end == "responses":
        return ((event.get("response") or {}).get("usage") or {}).get("output_tokens") if event.get("type") == "response.completed" else None
    return (event.get("usage") or {}).get("output_tokens") if event.get("type") == "message_delta" else None

async def stream(session, base, front_end, model, index, num_tokens):
    path, payload = body(front_end, model, index, num_tokens)
    tokens = messages = 0
    async with session.post(base + path, json=payload) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            messages += 1
            counted = tokens_of(front_end, json.loads(line[6:]))
            if counted is not None:
                tokens = counted
    return tokens, messages

async def main(base, front_end, model, first, num_streams, num_tokens, num_connections):
    connector = aiohttp.TCPConnector(limit=num_connections)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=3600)) as session:
        await asyncio.gather(*(stream(session, base, front_end, model, -1, 2) for _ in range(num_connections)))
        print("ready", flush=True)
        sys.stdin.readline()
        started = time.perf_counter()
        results = await asyncio.gather(*(stream(session, base, front_end, model, first + i, num_tokens) for i in range(num_streams)))
        print(json.dumps({"tokens": sum(t for t, _ in results), "messages": sum(m for _, m in results), "seconds": time.perf_counter() - started}), flush=True)

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])))
'''
FRONT_ENDS = ("grpc", "completions", "chat", "responses", "messages")
# A minimal ChatML template for a model that has none (the built-in one): chat, Responses and
# Messages render their conversations with it.
_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int_list, default=[1, 2], help="router counts to compare, comma-separated")
    parser.add_argument("--streams", type=int, default=64, help="concurrent streams")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per stream")
    parser.add_argument("--num-decode", type=int, default=1, help="decode actors (each prefills its own prompts)")
    parser.add_argument("--decode-threads", type=int, default=1, help="torch threads per decode actor")
    parser.add_argument("--connections", type=int, default=16, help="client connections (spread over the routers by the kernel)")
    parser.add_argument("--client-processes", type=int, default=1, help="client processes sharing the streams")
    parser.add_argument("--stream-interval", type=int, default=1, help="router.stream_interval: tokens per message after the first")
    parser.add_argument("--reps", type=int, default=2, help="measured runs per router count (after one warm-up)")
    parser.add_argument(
        "--front-ends", type=_front_ends, default=["grpc"],
        help=f"APIs to stream through, comma-separated ({', '.join(FRONT_ENDS)}); HTTP ones are measured with the first router count",
    )


def _front_ends(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names or any(name not in FRONT_ENDS for name in names):
        raise argparse.ArgumentTypeError(f"a comma-separated list of {', '.join(FRONT_ENDS)}, got {text!r}")
    return names


def run(args: argparse.Namespace) -> ScenarioOutcome:
    model_dir = Path(args.model) if args.model is not None else DEFAULT_MODEL_PATH
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"model: {model_dir} is not a model directory (no config.json)")
    http_front_ends = [name for name in args.front_ends if name != "grpc"]
    if http_front_ends:
        model_dir = _with_chat_template(model_dir, args.out)
    results = []
    front_end_runs: dict[str, list[dict]] = {}
    with ray_running():
        for replicas in args.replicas:
            engine = engine_config(args.dtype, 512, 256, seed=args.seed)
            engine.num_threads = args.decode_threads
            engine.max_num_seqs = max(engine.max_num_seqs, args.streams)
            shape = ClusterShape(
                f"{replicas} router(s)", 0, args.num_decode, Disaggregation.NEVER, engine, engine,
                router_overrides={"stream_interval": args.stream_interval, "max_queued_requests": max(256, 2 * args.streams)},
                router_replicas=replicas,
            )
            with local_cluster(model_dir, shape) as deployment:
                replica_pids = [info.pid for info in deployment.replica_infos]
                runs = [_measure(deployment, args, replica_pids) for _ in range(args.reps + 1)][1:] if "grpc" in args.front_ends else []
                if replicas == args.replicas[0]:
                    for front_end in http_front_ends:
                        front_end_runs[front_end] = [_measure(deployment, args, replica_pids, front_end) for _ in range(args.reps + 1)][1:]
                served = [asyncio.run(_served(deployment))] if deployment.replicas else []
            results.append({"replicas": replicas, "runs": runs, "replica_served": served})
    summary = {r["replicas"]: _summarize(r["runs"]) for r in results if r["runs"]}
    by_front_end = {name: _summarize(runs) for name, runs in front_end_runs.items()}
    base = summary.get(args.replicas[0])
    lines = []
    for replicas, s in summary.items():
        lines.append(
            f"{replicas} router(s): {fmt(s['tokens_per_s'], ' tok/s', 0)}, router CPU {fmt(s['router_us_per_token'], ' us/token')} "
            f"({fmt(s['tokens_per_message'], ' tokens/message', 2)})"
        )
    for name, s in by_front_end.items():
        lines.append(f"{name} (HTTP, 1 router): {fmt(s['tokens_per_s'], ' tok/s', 0)}, router CPU {fmt(s['router_us_per_token'], ' us/token')}")
    ratios = {f"router_us_per_token_{r}": s["router_us_per_token"] for r, s in summary.items()}
    chat = by_front_end.get("chat")
    for name, s in by_front_end.items():
        ratios[f"router_us_per_token_{name}"] = s["router_us_per_token"]
        if chat is not None and name in ("responses", "messages"):
            ratios[f"router_cpu_{name}_vs_chat"] = ratio(s["router_us_per_token"], chat["router_us_per_token"])
            lines.append(f"router CPU per token, {name} vs chat completions: {fmt(ratios[f'router_cpu_{name}_vs_chat'], 'x', 2)}")
    if base is not None:
        for replicas, s in summary.items():
            if replicas != args.replicas[0]:
                ratios[f"tokens_per_s_{replicas}_vs_{args.replicas[0]}"] = ratio(s["tokens_per_s"], base["tokens_per_s"])
                lines.insert(0, f"tokens/s through {replicas} routers vs {args.replicas[0]}: {fmt(ratios[f'tokens_per_s_{replicas}_vs_{args.replicas[0]}'], 'x', 2)}")
    path = write_json(args.out / "scenario.json", {"scenario": NAME, "flags": flags_of(args), "cpu": _cpu_model(), "results": results, "summary": summary,
                                                     "front_ends": {"runs": front_end_runs, "summary": by_front_end}})
    return ScenarioOutcome(NAME, lines, path, ratios)


def _measure(deployment, args: argparse.Namespace, replica_pids: list[int], front_end: str = "grpc") -> dict:
    per_process = [args.streams // args.client_processes + (1 if i < args.streams % args.client_processes else 0) for i in range(args.client_processes)]
    connections = max(1, args.connections // args.client_processes)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[3]), os.environ.get("PYTHONPATH", "")])}
    clients, first = [], 0
    for count in per_process:
        if front_end == "grpc":
            command = [sys.executable, "-c", _CLIENT, deployment.address, str(first), str(count), str(args.tokens), str(connections)]
        else:
            base = f"http://127.0.0.1:{deployment.http_port}"
            model = deployment.router.model_info.name
            command = [sys.executable, "-c", _HTTP_CLIENT, base, front_end, model, str(first), str(count), str(args.tokens), str(connections)]
        clients.append(subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env))
        first += count
    try:
        for client in clients:
            if client.stdout.readline().strip() != "ready":
                raise RuntimeError("the load client did not start")
        pids = ["self", *replica_pids]
        cpu_before = {pid: _cpu_s(pid) for pid in pids}
        started = time.perf_counter()
        for client in clients:
            client.stdin.write("\n")
            client.stdin.flush()
        reports = [json.loads(client.stdout.readline()) for client in clients]
        wall_s = time.perf_counter() - started
        cpu = {str(pid): _cpu_s(pid) - cpu_before[pid] for pid in pids}
    finally:
        for client in clients:
            client.wait(30)
    tokens = sum(r["tokens"] for r in reports)
    router_cpu_s = sum(cpu.values())
    return {
        "tokens": tokens,
        "messages": sum(r["messages"] for r in reports),
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s,
        "router_cpu_s": cpu,
        "router_us_per_token": 1e6 * router_cpu_s / tokens if tokens else None,
    }


async def _served(deployment) -> list:
    return [list(await handle.served.remote()) for handle in deployment.replicas]


def _summarize(runs: list[dict]) -> dict:
    def median(values):
        values = sorted(v for v in values if v is not None)
        return values[len(values) // 2] if values else None

    return {
        "tokens_per_s": median(r["tokens_per_s"] for r in runs),
        "router_us_per_token": median(r["router_us_per_token"] for r in runs),
        "tokens_per_message": median(r["tokens"] / r["messages"] for r in runs if r["messages"]),
    }


def _cpu_s(pid) -> float:
    """User plus system CPU seconds of a process on this host."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _with_chat_template(model_dir: Path, out: Path) -> Path:
    """``model_dir``, or a copy of it with a ChatML template where it has none."""
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    if config.get("chat_template") or (model_dir / "chat_template.jinja").exists():
        return model_dir
    import shutil

    copy = out / "model_with_chat_template"
    if copy.exists():
        shutil.rmtree(copy)
    shutil.copytree(model_dir, copy)
    (copy / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": _CHATML}))
    return copy


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"
