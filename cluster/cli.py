"""The ``pdserve`` command line: up, down, status, scale, generate, bench, bench-scenario, profile, simulate, plan.

``pdserve up`` starts a local Ray instance (or joins one with ``--address``), creates the
controller actor that hosts the router and the pools, prints the gRPC address once the
router's health service says SERVING (every worker is up) and serves in the foreground
until Ctrl-C; ``--detach`` leaves it serving and records where in the
state file, which ``down``, ``status``, ``scale`` and ``generate`` read.
``pdserve generate "prompt"`` streams to the terminal: to ``--address``, else to the
recorded deployment, else to a local deployment started for this one call (one prefill
and one decode actor, the built-in default model unless ``--model`` names another).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from cluster.arguments import INT32_MAX, UINT32_MAX, int_in
from cluster.local_ray import confine_to_loopback
from engine.default_model_path import DEFAULT_MODEL_PATH
from router.config import MAX_POOL_REPLICAS
from router.addresses import bare_host
from router.openai_api.parser_names import REASONING_PARSERS, TOOL_CALL_PARSERS

DEFAULT_STATE_FILE = Path.home() / ".pdserve" / "state.json"
SERVING_TIMEOUT_S = 60.0  # after the controller reported every worker up
FOREGROUND_STOP_WAIT_S = 90.0  # `down` waits this long for a foreground `up` to stop its deployment
PROMPT_MAX_TOKENS = 64  # generate's default length for a prompt (a chat's is its context's room)


def _add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int_in(1, UINT32_MAX),
                        help=f"default: {PROMPT_MAX_TOKENS} for a prompt; with --chat, the room the context leaves (capped by the model's max_new_tokens)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    parser.add_argument("--top-k", type=int_in(-1, INT32_MAX), default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pdserve")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def build_parser(scenarios: bool = True) -> argparse.ArgumentParser:
    """The whole command line; ``scenarios`` False leaves out each ``bench-scenario``'s own flags
    (their modules import torch: every other command starts in a fraction of the time)."""
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving on Ray")
    parser.add_argument("--log-level", default="WARNING", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])
    parser.add_argument("--version", action="version", version=f"pdserve {_version()}")
    parser.add_argument("--state-file", type=Path, default=DEFAULT_STATE_FILE, help="where `up` records what `down`, `status` and `generate` find")
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="start (or join) a Ray cluster and serve")
    up.add_argument("--config", type=Path, help="YAML deployment config; flags override its fields")
    up.add_argument("--address", help="Ray cluster to join ('auto' or host:port); omitted: start a local Ray instance")
    up.add_argument("--detach", action="store_true", help="leave the deployment serving and return")
    up.add_argument("--model", help="model directory, or a Hugging Face id in the local cache (default: the built-in model)")
    up.add_argument("--prefill", type=int_in(0, MAX_POOL_REPLICAS), help="prefill actors")
    up.add_argument("--decode", type=int_in(0, MAX_POOL_REPLICAS), help="decode actors")
    up.add_argument("--prefill-tp", type=int, help="tensor-parallel ranks per prefill worker (prefill.tensor_parallel_size)")
    up.add_argument("--decode-tp", type=int, help="tensor-parallel ranks per decode worker (decode.tensor_parallel_size)")
    up.add_argument("--prefill-pipeline", choices=["auto", "always", "off"], help="one long prompt over several prefill actors (prefill.pipeline)")
    up.add_argument("--max-pipeline-stages", type=int, help="most prefill actors in one prompt's pipeline (prefill.max_pipeline_stages)")
    up.add_argument("--pipeline-decode-stage", choices=["auto", "always", "off"],
                    help="the decode actor computes a pipeline's last stage (prefill.pipeline_decode_stage)")
    up.add_argument("--prefill-gpus", type=float, help="GPUs per prefill actor")
    up.add_argument("--decode-gpus", type=float, help="GPUs per decode actor")
    up.add_argument("--prefill-cpus", type=float, help="CPUs per prefill actor")
    up.add_argument("--decode-cpus", type=float, help="CPUs per decode actor")
    up.add_argument("--token-budget", type=int, help="tokens per engine step, both pools")
    up.add_argument("--block-size", type=int)
    up.add_argument("--kv-cache-dtype", choices=["auto", "int8", "fp8_e4m3"], help="KV cache elements (default auto: the model's dtype)")
    up.add_argument("--kv-cache-mb", type=int, help="KV cache per actor, both pools")
    up.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], help="auto (default): the fastest dtype each actor's device computes natively (bfloat16 where it has it)")
    up.add_argument("--max-model-len", type=int, help="longest prompt plus output a request may have (default: the model's context)")
    up.add_argument("--host", help="address the router binds, its gRPC and OpenAI APIs both (as vLLM's --host binds its server)")
    up.add_argument("--port", type=int, help="router gRPC port")
    up.add_argument("--no-ship-code", dest="ship_code", action="store_false", default=True,
                    help="joining a cluster (--address): rely on pdserve installed on every node instead of shipping this checkout's code")
    up.add_argument("--router-replicas", type=int, help="routers serving the deployment, on the same ports (default 1)")
    up.add_argument("--stream-interval", type=int, help="tokens per streamed message after the first (default 1)")
    up.add_argument(
        "--tool-call-parser", choices=TOOL_CALL_PARSERS,
        help='how chat answers with tool_choice "auto" are read for tool calls (default: recognised in the chat template)',
    )
    up.add_argument(
        "--reasoning-parser", choices=REASONING_PARSERS,
        help="split a reasoning model's thinking (<think>...</think>) off its answers, as vLLM's --reasoning-parser does",
    )
    up.add_argument("--chat-template", help="a chat template instead of the model's own: a Jinja file, or the template itself")
    up.add_argument(
        "--default-chat-template-kwargs", type=_json_object,
        help='template variables every chat renders with, as JSON (e.g. \'{"enable_thinking": false}\'); a request\'s chat_template_kwargs win',
    )
    up.add_argument("--http-port", type=int, help="OpenAI-compatible HTTP API port (default 8000)")
    up.add_argument("--admin-port", type=int, help="Admin service port, loopback by default (default 50052; 0: any free port)")
    up.add_argument("--served-model-name", nargs="+", help="names the OpenAI API answers to (default: the model directory's name)")
    up.add_argument("--metrics-port", type=int, help="Prometheus port")
    up.add_argument("--routing-policy", choices=["kv_aware", "least_loaded", "round_robin"])
    up.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                    help="--no-enable-prefix-caching: compute every prompt in full (prefix caching is on by default)")
    # vLLM's names for what pdserve's flags and config set (vllm serve's command lines work as written).
    up.add_argument("--tensor-parallel-size", "-tp", type=int, help="ranks per actor, both pools (vLLM's name; per pool: --prefill-tp, --decode-tp)")
    up.add_argument("--max-num-seqs", type=int, help="most sequences in one batch, both pools")
    up.add_argument("--max-num-batched-tokens", type=int, help="tokens per engine step, both pools (vLLM's name for --token-budget)")
    up.add_argument("--gpu-memory-utilization", type=float, help="the share of each GPU an actor's weights, activations and KV cache may take")
    up.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="decode actors schedule the next step while the device computes this one (default: on for GPUs, off for CPUs)")
    up.add_argument("--disaggregation", choices=["auto", "always", "never"])
    up.add_argument("--speculative-method", choices=["ngram", "draft_model"], help="speculative decoding on the decode pool (default: off)")
    up.add_argument("--draft-model", help="the draft's model directory (turns speculative decoding on: method draft_model)")
    up.add_argument("--num-speculative-tokens", type=int, help="draft tokens verified per sequence per step (turns speculative decoding on: ngram, unless --speculative-method or --draft-model says otherwise)")
    up.add_argument(
        "--lora-modules", nargs="+", type=_lora_module, metavar="NAME=PATH",
        help="LoRA adapters served beside the model (PEFT adapter directories); a request's model field names one",
    )
    up.add_argument("--max-loras", type=int, help="taken for vLLM's command lines: a batch here mixes any of the adapters held")
    up.add_argument("--max-lora-rank", type=int, help="the largest rank a LoRA adapter may have, as vLLM's flag (default: no bound)")
    up.add_argument("--enable-lora", action="store_true", help="taken for vLLM's command lines: LoRA adapters are always served here")
    up.add_argument(
        "--allow-runtime-lora-updating", action="store_true", default=None,
        help="serve vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (router.allow_runtime_lora_updating)",
    )

    down = commands.add_parser("down", help="stop the deployment `up` started")
    down.add_argument("--address", help="Ray cluster address (default: from the state file)")

    status = commands.add_parser("status", help="a table of the workers")
    status.add_argument("--address", help="router host:port (default: from the state file)")

    scale = commands.add_parser("scale", help="resize the pools while serving")
    scale.add_argument("--prefill", type=int_in(0, MAX_POOL_REPLICAS))
    scale.add_argument("--decode", type=int_in(0, MAX_POOL_REPLICAS))
    scale.add_argument("--force", action="store_true", help="allow scaling the decode pool to 0 (nothing left serving)")
    scale.add_argument("--address", help="the Admin service's host:port (default: from the state file)")

    generate = commands.add_parser("generate", help="stream a generation for one prompt")
    generate.add_argument("prompt")
    generate.add_argument("--address", help="router host:port; default: the running deployment, else a local one for this call")
    generate.add_argument("--model", default=str(DEFAULT_MODEL_PATH), help="model directory or Hugging Face id in the local cache (local deployment)")
    generate.add_argument("--prefill", type=int_in(0, MAX_POOL_REPLICAS), default=1, help="prefill actors (local deployment)")
    generate.add_argument("--decode", type=int_in(1, MAX_POOL_REPLICAS), default=1, help="decode actors (local deployment)")
    generate.add_argument("--timing", action="store_true", help="print the timing breakdown at the end")
    generate.add_argument("--lora-name", help="generate through this LoRA adapter of the running deployment (GenerateRequest.lora_name)")
    generate.add_argument("--chat", action="store_true",
                          help="send the prompt as a user message through the model's chat template (GenerateRequest.chat); "
                               "a reasoning deployment's thinking goes to stderr")
    generate.add_argument("--system", help="with --chat: a system message before it")
    _add_sampling_flags(generate)

    from cluster.bench.cli import add_bench_parser, add_scenario_parser

    from cluster.planning.cli import add_planning_parsers

    add_bench_parser(commands)
    add_scenario_parser(commands, scenarios)
    add_planning_parsers(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(scenarios="bench-scenario" in argv).parse_args(argv)
    if (Path.home() / ".ray" / "auth_token").is_file():
        # Ray reads its auth mode from the environment once, at import: a cluster started on
        # this host with a token (Ray's default) needs its clients to present it.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handlers = {"up": _up, "down": _down, "status": _status, "scale": _scale, "generate": _generate}
    if args.command in handlers:
        return handlers[args.command](args)
    return args.bench_handler(args)


# -- state shared between commands --------------------------------------------------------


def _channel(address: str, ca_file: Path | None = None, server_name: str | None = None):
    """A channel to the router with the client's credentials: $PDSERVE_AUTH_TOKEN, and TLS
    verified against $PDSERVE_TLS_CA (or ``ca_file``) when either is there, for the name
    $PDSERVE_TLS_SERVER_NAME (or ``server_name``: router.tls_server_name, as up recorded it)."""
    from router.security import AUTH_TOKEN_ENV, TLS_CA_ENV, TLS_SERVER_NAME_ENV, client_channel

    ca = os.environ.get(TLS_CA_ENV) or ca_file
    name = os.environ.get(TLS_SERVER_NAME_ENV) or server_name
    return client_channel(address, os.environ.get(AUTH_TOKEN_ENV) or None, Path(ca) if ca else None, name)


def _recorded_server_name(args: argparse.Namespace) -> str | None:
    """The name up recorded for the router's certificate (router.tls_server_name; None where no
    deployment is recorded: a one-off generate's own)."""
    state_file = getattr(args, "state_file", None)
    return _read_state(state_file).get("tls_server_name") if state_file is not None else None


def _read_state(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _router_address(args: argparse.Namespace) -> str | None:
    return args.address or _read_state(args.state_file).get("router_address")


# -- up / down ----------------------------------------------------------------------------


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def up_overrides(args: argparse.Namespace) -> dict:
    """``pdserve up``'s flags as the config fields they set (dotted; None: not given)."""
    return {
        "model": args.model, "dtype": args.dtype, "max_model_len": args.max_model_len, "block_size": args.block_size, "kv_cache_dtype": args.kv_cache_dtype,
        "prefill.replicas": args.prefill, "decode.replicas": args.decode,
        "prefill.tensor_parallel_size": _either(args.prefill_tp, args.tensor_parallel_size),
        "decode.tensor_parallel_size": _either(args.decode_tp, args.tensor_parallel_size),
        "prefill.pipeline": args.prefill_pipeline, "prefill.max_pipeline_stages": args.max_pipeline_stages,
        "prefill.pipeline_decode_stage": args.pipeline_decode_stage,
        "prefill.num_gpus": args.prefill_gpus, "decode.num_gpus": args.decode_gpus,
        "prefill.num_cpus": args.prefill_cpus, "decode.num_cpus": args.decode_cpus,
        "prefill.token_budget": _either(args.token_budget, args.max_num_batched_tokens), "decode.token_budget": _either(args.token_budget, args.max_num_batched_tokens),
        "prefill.max_num_seqs": args.max_num_seqs, "decode.max_num_seqs": args.max_num_seqs,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "prefill.kv_cache_mb": args.kv_cache_mb, "decode.kv_cache_mb": args.kv_cache_mb,
        "router.host": args.host, "router.http_host": args.host, "router.port": args.port, "router.metrics_port": args.metrics_port,
        "router.replicas": args.router_replicas, "router.stream_interval": args.stream_interval,
        "router.tool_call_parser": args.tool_call_parser, "router.reasoning_parser": args.reasoning_parser,
        "router.chat_template": args.chat_template, "router.default_chat_template_kwargs": args.default_chat_template_kwargs,
        "router.http_port": args.http_port, "router.admin_port": args.admin_port, "router.served_model_names": args.served_model_name,
        "router.routing_policy": args.routing_policy, "router.disaggregation": args.disaggregation,
        "prefill.enable_prefix_caching": args.enable_prefix_caching, "decode.enable_prefix_caching": args.enable_prefix_caching,
        "decode.async_scheduling": args.async_scheduling,
        "speculative.method": args.speculative_method, "speculative.num_speculative_tokens": args.num_speculative_tokens,
        "speculative.draft_model": args.draft_model,
        "lora_modules": dict(args.lora_modules) if args.lora_modules else None,
        "max_loras": args.max_loras, "max_lora_rank": args.max_lora_rank,
        "router.allow_runtime_lora_updating": args.allow_runtime_lora_updating,
    }


def _either(specific, general):
    """A per-pool flag's value, else the flag for both pools' (None: neither given)."""
    return specific if specific is not None else general


def _lora_module(value: str) -> tuple[str, str]:
    """``--lora-modules``' NAME=PATH, as vLLM takes it."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{value!r}: expected NAME=PATH (an adapter's name and its directory)")
    return name, path


def _interrupted(*_) -> None:
    raise KeyboardInterrupt


def _up(args: argparse.Namespace) -> int:
    from cluster.config import ConfigError, load_config

    try:
        config = load_config(args.config, up_overrides(args))
    except ConfigError as exc:
        print(f"pdserve up: {exc}", file=sys.stderr)
        return 2
    if _read_state(args.state_file).get("router_address"):
        # Either kind: a foreground `up` would overwrite a detached deployment's record, and
        # remove it as it stops. (Checked before the ports: that deployment holds them, and a
        # port clash's advice, another port, only led to this refusal.)
        print(f"pdserve up: a deployment is already recorded in {args.state_file}; run `pdserve down` first", file=sys.stderr)
        return 2
    taken = _port_taken(config)
    if taken is not None:
        print(f"pdserve up: {taken}", file=sys.stderr)
        return 1
    if args.address is None:
        confine_to_loopback()  # before ray is imported, and inherited by a head started here
        if not config.autoscaler.enabled:  # an autoscaler needs free CPUs to place the actors it adds
            config.share_local_cores(len(os.sched_getaffinity(0)))  # one machine: the pools share the cores this process may use
    import ray

    from cluster.controller import create_controller, find_controller

    head = None
    ray_address = args.address
    if ray_address is None and args.detach:
        try:
            head, ray_address = _start_ray_head()
        except RuntimeError as exc:
            print(f"pdserve up: {exc}", file=sys.stderr)
            return 1
    try:
        _connect_ray(ray_address, log_to_driver=not args.detach, ship_code=args.address is not None and args.ship_code, worker_log_level=args.log_level)
    except Exception as exc:
        print(f"pdserve up: cannot reach Ray at {ray_address}: {exc}", file=sys.stderr)
        if head is not None:
            _stop_pid(head)
        return 1
    if find_controller() is not None:
        print("pdserve up: this Ray cluster already runs a pdserve deployment; run `pdserve down` first", file=sys.stderr)
        return 2
    spec = config.to_spec()
    if args.address is None:  # a Ray of this machine, started for this deployment: it cannot grow
        from cluster.pools import start_shortfall

        shortfall = start_shortfall(spec, ray.available_resources())
        if shortfall is not None:  # (the workers waited startup_timeout_s for room that never came)
            print(f"pdserve up: {shortfall}", file=sys.stderr)
            ray.shutdown()
            if head is not None:
                _stop_pid(head)
            return 1
    spec.durable_workers = True  # they outlive the controller; a restarted one adopts them
    controller = create_controller(spec, config.router.metrics_port, config.router.metrics_host, detached=args.detach)

    def abandon() -> None:
        """Stop what this `up` started: the controller and its workers (detached: they outlive
        it), and the Ray head."""
        try:
            ray.get(controller.stop.remote(), timeout=30)
        except Exception:
            pass
        finally:
            ray.kill(controller)
            if head is not None:
                _stop_pid(head)

    # Until the deployment is recorded, SIGTERM (a service manager, `timeout`) and SIGHUP (the
    # terminal closed while a model loads) stop what this `up` started, as Ctrl-C does: Ray's
    # SIGTERM handler exited, and the head (its own session) and the detached controller lived
    # on, serving, with no record for `down` to find.
    starting = {sig: signal.signal(sig, _interrupted) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        info = ray.get(controller.start.remote())
        # The controller returns once every worker is up; the health check is what a client sees.
        serving = _wait_until_serving(info.router_address, SERVING_TIMEOUT_S, config.router.tls_cert_file, config.router.tls_server_name)
    except KeyboardInterrupt:
        # The head (its own session) and the detached controller never saw the Ctrl-C, and
        # nothing was recorded yet for `down` to find: they are stopped here.
        print("pdserve up: interrupted; stopping what it started", file=sys.stderr)
        abandon()
        return 130
    except Exception as exc:
        # A Ray task error carries the actor's whole traceback; the cause's own message is what a user acts on.
        cause = getattr(exc, "cause", None) or exc
        print(f"pdserve up: the deployment failed to start: {cause}", file=sys.stderr)
        abandon()
        return 1
    if not serving:
        print(f"pdserve up: the router at {info.router_address} did not report SERVING within {SERVING_TIMEOUT_S:.0f}s", file=sys.stderr)
        abandon()
        return 1
    for sig, handler in starting.items():
        signal.signal(sig, handler)
    state = {"router_address": info.router_address, "admin_address": info.admin_address, "http_address": info.http_address,
             "metrics_address": info.metrics_address,
             "ray_address": ray_address, "ray_head_pid": head, "ray_head_start": process_start(head) if head else None,
             "up_pid": None if args.detach else os.getpid(), "up_start": None if args.detach else process_start(os.getpid()),
             "tls_server_name": config.router.tls_server_name}
    print(f"pdserve serving on {info.router_address} ({info.prefill_replicas} prefill, {info.decode_replicas} decode actors)")
    if info.router_replicas:
        print(f"router replicas on {', '.join(info.router_replicas)} (the same ports)")
    if info.http_address:
        scheme = "https" if config.router.tls_cert_file else "http"
        print(f"OpenAI API on {scheme}://{info.http_address}/v1")
    if info.admin_address:
        print(f"admin on {info.admin_address}")
    if info.metrics_address:
        print(f"metrics on http://{info.metrics_address}/metrics")
    sys.stdout.flush()
    if args.detach:
        args.state_file.parent.mkdir(parents=True, exist_ok=True)
        args.state_file.write_text(json.dumps(state))
        return 0
    args.state_file.parent.mkdir(parents=True, exist_ok=True)
    args.state_file.write_text(json.dumps(state))
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: its terminal closed
        signal.signal(sig, lambda *_: stopping.set())
    stopping.wait()
    print("pdserve: stopping", file=sys.stderr)
    try:
        ray.get(controller.stop.remote(), timeout=30)
    finally:
        ray.kill(controller)
        if _read_state(args.state_file).get("up_pid") == os.getpid():  # still this up's record, no later one's
            args.state_file.unlink(missing_ok=True)
        ray.shutdown()
    return 0


def _down(args: argparse.Namespace) -> int:
    state = _read_state(args.state_file)
    # The record is this command's to act on unless --address names another cluster.
    recorded = bool(state) and (args.address is None or args.address == state.get("ray_address"))
    if recorded and state.get("up_pid") is not None and (state.get("ray_address") is None or _recorded_alive(state, "up")):
        return _down_foreground(args, state)  # a foreground up stops its own deployment (on its own cluster or a joined one)
    ray_address = args.address or state.get("ray_address")
    if ray_address is None:
        print(f"pdserve down: no detached deployment recorded in {args.state_file}; give --address", file=sys.stderr)
        return 2
    if recorded and state.get("ray_head_pid"):
        if not _recorded_alive(state, "ray_head"):  # the machine rebooted, the head was killed
            args.state_file.unlink(missing_ok=True)
            print(f"pdserve down: the deployment recorded at {ray_address} is gone (its Ray head no longer runs); its record is removed")
            return 0
        if not args.address:
            confine_to_loopback()  # the Ray head `up --detach` started listens on loopback only
    import ray

    from cluster.controller import find_controller

    try:
        _connect_ray(ray_address, log_to_driver=False)
    except Exception as exc:
        print(f"pdserve down: cannot reach Ray at {ray_address}: {exc}", file=sys.stderr)
        return 1
    controller = find_controller()
    if controller is not None:
        try:
            ray.get(controller.stop.remote(), timeout=60)
        except Exception as exc:  # a stop that timed out or failed: what it left is stopped below
            print(f"pdserve down: the controller's stop failed ({type(exc).__name__}); stopping what it left", file=sys.stderr)
        finally:
            ray.kill(controller)
    from cluster.pools import DeploymentSpec, stop_leftover_workers
    from cluster.router_replica import find_replicas
    from router.responses_api.board import find_shared_board

    name = DeploymentSpec().name
    leftovers = find_replicas(name) + [find_shared_board(name)]  # left by a controller that did not stop them
    for actor in leftovers:
        if actor is not None:
            ray.kill(actor, no_restart=True)
    # Durable workers outlive a controller killed with its `up` process (SIGHUP, SIGKILL).
    workers = stop_leftover_workers(name)
    if workers and controller is None:
        print(f"pdserve down: stopped {len(workers)} workers no controller was running for")
    ray.shutdown()
    if recorded:  # a deployment on another cluster (--address) leaves this one's record and head alone
        if state.get("ray_head_pid"):
            _stop_pid(state["ray_head_pid"])
        args.state_file.unlink(missing_ok=True)
    print("pdserve stopped" if controller is not None else "no pdserve deployment was running")
    return 0


def _down_foreground(args: argparse.Namespace, state: dict) -> int:
    """A deployment a foreground `pdserve up` serves: that process is asked to stop (it stops its
    deployment itself, and removes the record); a record whose process is gone is removed."""
    pid = state["up_pid"]
    try:
        if not _recorded_alive(state, "up"):
            raise ProcessLookupError
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:  # gone (or its number is another's now)
        args.state_file.unlink(missing_ok=True)
        print(f"pdserve down: the `pdserve up` recorded in {args.state_file} no longer runs; its record is removed")
        return 0
    except PermissionError:  # it runs, as another user (sudo pdserve up): it and its record stay
        print(f"pdserve down: `pdserve up` (pid {pid}) runs as another user; stop it as that user", file=sys.stderr)
        return 1
    deadline = time.monotonic() + FOREGROUND_STOP_WAIT_S
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if process_alive(pid):
        print(f"pdserve down: `pdserve up` (pid {pid}) has not stopped within {FOREGROUND_STOP_WAIT_S:.0f}s", file=sys.stderr)
        return 1
    print("pdserve stopped")
    return 0


def _wait_until_serving(address: str, timeout_s: float, ca_file: Path | None = None, server_name: str | None = None) -> bool:
    """Whether the router's gRPC health service said SERVING within ``timeout_s``."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with _channel(address, ca_file, server_name) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    return False


def _connect_ray(address: str | None, log_to_driver: bool, ship_code: bool = False, worker_log_level: str | None = None) -> None:
    """Join Ray at ``address`` (None: a local instance of this process); ``ship_code``: every
    node gets this checkout's packages through the job's runtime environment;
    ``worker_log_level``: the level the worker actors this job starts log at (``--log-level``)."""
    import ray

    kwargs = {"include_dashboard": False} if address is None else {}
    runtime_env: dict = {}
    if ship_code and address is not None:
        from cluster.node_check import code_runtime_env

        runtime_env = code_runtime_env()
    if worker_log_level is not None:
        from workers.base import WORKER_LOG_LEVEL_ENV

        runtime_env["env_vars"] = {WORKER_LOG_LEVEL_ENV: worker_log_level.upper()}
    if runtime_env:
        kwargs["runtime_env"] = runtime_env
    if address is None:
        confine_to_loopback()  # a Ray started here serves this machine only
    ray.init(address=address or "local", log_to_driver=log_to_driver, configure_logging=False, namespace="pdserve", **kwargs)


def _start_ray_head() -> tuple[int, str]:
    """A Ray head in its own session, blocking in the background: ending it stops its processes.
    It runs no log monitor: that relays worker output to attached drivers, and a detached
    deployment has none (the logs stay in the session's directory), while the monitor re-reads
    that directory ten times a second, 5% of a core once a few hundred workers have come and gone."""
    # The port is chosen free here and bound by the GCS a moment later: another process may take
    # it in between (the head then exits at once), so a head that exits before its port answers
    # is started again on another port.
    for attempt in range(3):
        port = _free_port()
        process = subprocess.Popen(
            [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--block",
             "--include-dashboard=false", "--include-log-monitor=false", "--disable-usage-stats"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and process.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    return process.pid, f"127.0.0.1:{port}"
            except OSError:
                time.sleep(0.3)
        if process.poll() is None:
            _stop_pid(process.pid)
            raise RuntimeError(f"ray start --head did not listen on port {port} within 60s; see /tmp/ray/session_latest/logs")
        print(f"pdserve up: ray start --head on port {port} exited (attempt {attempt + 1} of 3)", file=sys.stderr)
    raise RuntimeError("ray start --head exited three times; see /tmp/ray/session_latest/logs")


def _stop_pid(pid: int, grace_s: float = 10.0, kill_wait_s: float = 10.0) -> None:
    """Stop the ``ray start --block`` process ``pid`` and the process group it leads; return
    once no process of the group runs.

    Only the leader gets the SIGTERM: it stops its Ray processes itself and exits, in about 2 s
    here; a SIGTERM to every process of the group at once kept the GCS server up for about 30 s.
    Whatever of the group still runs after ``grace_s`` is killed, and waited for: a killed
    process runs on until the kernel has torn it down, and on a loaded 2-core host CI saw the
    GCS server still there after `down` had returned."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    if _wait_until_group_ends(pid, grace_s):
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    _wait_until_group_ends(pid, kill_wait_s)


def _wait_until_group_ends(pgid: int, timeout_s: float) -> bool:
    """Whether, within ``timeout_s``, no process of group ``pgid`` runs (zombies do not)."""
    deadline = time.monotonic() + timeout_s
    while _group_runs(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def _stat_fields(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields after the command name (which may hold anything); OSError as open raises it."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()


def _group_runs(pgid: int) -> bool:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = _stat_fields(int(entry))
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def _recorded_alive(state: dict, name: str) -> bool:
    """Whether the process the record names (``<name>_pid``, started at ``<name>_start``) still
    runs: after a reboot its number may be another process's."""
    pid = state.get(f"{name}_pid")
    if not pid or not process_alive(pid):
        return False
    started = state.get(f"{name}_start")
    return started is None or process_start(pid) == started


def process_start(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (None where /proc does not say)."""
    try:
        return int(_stat_fields(pid)[19])
    except (OSError, ValueError, IndexError):
        return None


def process_alive(pid: int) -> bool:
    """Running (a zombie waiting for a parent that is gone does not count)."""
    try:
        return _stat_fields(pid)[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _port_taken(config) -> str | None:
    """Which fixed port of the router (gRPC, Admin, HTTP, metrics) cannot be listened on here, as
    the router would word it; None if every one can. The router runs on this machine (the
    controller is pinned to the driver's node), so a taken port fails ``up`` in a moment instead
    of after a Ray head, the controller and the workers started and were stopped again. A port
    taken between this look and the router's bind still fails there, with the same message."""
    router = config.router
    listeners = [("port", router.host, router.port), ("admin_port", router.admin_host, router.admin_port),
                 ("http_port", router.http_host, router.http_port), ("metrics_port", router.metrics_host, router.metrics_port)]
    for field, host, port in listeners:
        if not port:  # None: off; 0: any free port
            continue
        try:
            family = socket.getaddrinfo(bare_host(host), port, type=socket.SOCK_STREAM)[0][0]
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC, aiohttp and prometheus_client bind
                sock.bind((bare_host(host), port))
        except OSError:
            from router.errors import cannot_listen

            return cannot_listen(field, host, port)
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- status / scale -----------------------------------------------------------------------


def _status(args: argparse.Namespace) -> int:
    import grpc

    from router.api.pdserve.v1 import generation_pb2 as pb
    from router.api.pdserve.v1 import generation_pb2_grpc as pb_grpc

    address = _router_address(args)
    if address is None:
        print("pdserve status: no running deployment recorded; give --address", file=sys.stderr)
        return 2
    with _channel(address, server_name=_recorded_server_name(args)) as channel:
        try:
            workers = pb_grpc.GenerationStub(channel).GetClusterStatus(pb.GetClusterStatusRequest(), timeout=30).workers
        except grpc.RpcError as exc:
            print(f"pdserve status: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    rows = [("WORKER", "ROLE", "STATE", "QUEUE", "KV USED", "RUNNING", "EPOCH", "NODE", "RANKS")]
    for w in workers:
        rows.append((
            w.worker_id,
            pb.WorkerRole.Name(w.role).removeprefix("WORKER_ROLE_").lower(),
            pb.WorkerState.Name(w.state).removeprefix("WORKER_STATE_").lower(),
            str(w.queue_depth),
            f"{w.num_kv_blocks_used}/{w.num_kv_blocks_used + w.num_kv_blocks_free}",
            str(w.num_running_seqs),
            w.epoch,
            w.node,
            _ranks_cell(w.node, list(w.rank_nodes)),
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


def _ranks_cell(node: str, rank_nodes: list[str]) -> str:
    """'1' for a worker of one rank; '2: r0@nodeA r1@nodeA' for a tensor-parallel one."""
    if len(rank_nodes) <= 1:
        return "1"
    return f"{len(rank_nodes)}: " + " ".join(f"r{rank}@{where}" for rank, where in enumerate(rank_nodes))


def _scale(args: argparse.Namespace) -> int:
    import grpc

    from router.api.pdserve.v1 import generation_pb2 as pb
    from router.api.pdserve.v1 import generation_pb2_grpc as pb_grpc

    address = args.address or _read_state(args.state_file).get("admin_address")
    if address is None:
        print("pdserve scale: no running deployment with Admin recorded; give --address (the admin address)", file=sys.stderr)
        return 2
    if args.prefill is None and args.decode is None:
        print("pdserve scale: give --prefill N and/or --decode M", file=sys.stderr)
        return 2
    with _channel(address, server_name=_recorded_server_name(args)) as channel:
        admin = pb_grpc.AdminStub(channel)
        for role, replicas in ((pb.WORKER_ROLE_PREFILL, args.prefill), (pb.WORKER_ROLE_DECODE, args.decode)):
            if replicas is None:
                continue
            try:
                reply = admin.ScalePool(pb.ScalePoolRequest(role=role, replicas=replicas, force=args.force), timeout=900)
            except grpc.RpcError as exc:
                print(f"pdserve scale: {exc.code().name}: {exc.details()}", file=sys.stderr)
                return 1
            name = pb.WorkerRole.Name(role).removeprefix("WORKER_ROLE_").lower()
            print(f"{name}: {reply.previous_replicas} -> {reply.replicas}")
    return 0


# -- generate -----------------------------------------------------------------------------


def _generate(args: argparse.Namespace) -> int:
    import grpc

    address = _router_address(args)
    if address:
        return _stream(args, address)
    from engine.errors import ModelLoadError
    from engine.model_source import resolve_model

    try:
        args.model = resolve_model(args.model).path
    except ModelLoadError as exc:
        print(f"pdserve: --model {exc}", file=sys.stderr)
        return 2
    if not (Path(args.model) / "config.json").is_file():
        print(f"pdserve: --model {args.model}: not a model directory (no config.json)", file=sys.stderr)
        return 2
    if not (Path(args.model) / "tokenizer.json").is_file():
        print(f"pdserve: --model {args.model}: no tokenizer.json (the model's fast tokenizer; pdserve needs it)", file=sys.stderr)
        return 2
    from engine.config import ModelConfig

    try:  # an architecture or quantization the engine does not serve: said here, not by a worker's traceback
        ModelConfig.from_model_dir(Path(args.model))
    except (ModelLoadError, OSError) as exc:
        print(f"pdserve: --model {exc}", file=sys.stderr)
        return 2
    if getattr(args, "chat", False):
        from router.tokenizer import Tokenizer, TokenizerLoadError

        try:
            template = Tokenizer.from_model_dir(args.model).chat_template
        except TokenizerLoadError as exc:
            print(f"pdserve: --model {exc}", file=sys.stderr)
            return 2
        if template is None:  # said before a deployment starts for nothing
            print(f"pdserve: --chat: {args.model} has no chat template (tokenizer_config.json or chat_template.jinja); "
                  "leave --chat out to continue the prompt as text", file=sys.stderr)
            return 2
    import ray

    from cluster.deployment import Deployment, DeploymentSpec, PoolSpec
    from engine.config import EngineConfig

    threads = max(1, (os.cpu_count() or 2) // max(1, args.prefill + args.decode))
    _connect_ray(None, log_to_driver=False)
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

    chat = getattr(args, "chat", False)
    sampling = pb.SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    if args.max_tokens is not None or not chat:  # unset, a chat's answer has the context's room (a reasoning model's thinking with it)
        sampling.max_tokens = args.max_tokens if args.max_tokens is not None else PROMPT_MAX_TOKENS
    if args.seed is not None:
        sampling.seed = args.seed & (2**64 - 1)  # uint64 in the proto: a negative seed as its two's complement
    if getattr(args, "system", None) and not chat:
        print("pdserve generate: --system needs --chat", file=sys.stderr)
        return 2
    if chat:
        messages = ([pb.ChatMessage(role="system", content=args.system)] if args.system else []) + [pb.ChatMessage(role="user", content=args.prompt)]
        request = pb.GenerateRequest(chat=pb.ChatPrompt(messages=messages), sampling=sampling, lora_name=args.lora_name)
    else:
        request = pb.GenerateRequest(prompt_text=args.prompt, sampling=sampling, lora_name=args.lora_name)
    with _channel(address, server_name=_recorded_server_name(args)) as channel:
        stub = pb_grpc.GenerationStub(channel)
        try:
            if not chat:
                sys.stdout.write(args.prompt)  # the answer goes on from it
            last = None
            for message in stub.Generate(request):
                if message.reasoning_text:
                    sys.stderr.write(message.reasoning_text)
                    sys.stderr.flush()
                sys.stdout.write(message.text)
                sys.stdout.flush()
                last = message
            sys.stdout.write("\n")
        except grpc.RpcError as exc:
            print(f"\npdserve: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    failed = last is not None and last.finish_reason in (pb.FINISH_REASON_ERROR, pb.FINISH_REASON_ABORT)
    if failed:  # the stream ended without its answer (the text so far is above)
        reason = pb.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
        print(f"pdserve: the generation ended with {reason}: {last.finish_detail or 'no detail given'}", file=sys.stderr)
    if getattr(args, "timing", False) and last is not None:
        t = last.timing
        print(
            f"[{last.usage.completion_tokens} tokens, finish {pb.FinishReason.Name(last.finish_reason)}; "
            f"ttft {t.time_to_first_token_ms:.1f} ms = router {t.router_queue_ms:.1f} + prefill queue {t.prefill_queue_ms:.1f}"
            f" + prefill {t.prefill_compute_ms:.1f} + transfer {t.kv_transfer_ms:.1f} + decode queue {t.decode_queue_ms:.1f};"
            f" decode {t.decode_ms:.1f} ms]",
            file=sys.stderr,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
