"""One benchmark against a router address: build the workload, warm up, run (or sweep), write.

This is what ``pdserve bench`` does and what every scenario calls once per cluster. The
warm-up requests have the workload's shape but their own seed, so they touch the same code
paths (first KV transfer, first allocations) without being the measured requests.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.bench import plots
from cluster.bench.arrivals import ArrivalSpec, arrival_offsets
from cluster.bench.client import BenchClient, ClientConfig, RequestRecord
from cluster.bench.metrics import SLO, BenchMetrics, compute_metrics, metrics_by_tag
from cluster.bench.progress import ProgressBar
from cluster.bench.report import result_document, run_to_dict, vllm_keys, write_json
from cluster.bench.sweep import DEFAULT_TARGET, SweepResult, run_sweep
from cluster.bench.workloads import BenchRequest, WorkloadSpec, build_workload

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class BenchSpec:
    """Everything that defines a run apart from the cluster it runs against."""

    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    arrivals: ArrivalSpec = field(default_factory=ArrivalSpec)
    slo: SLO = field(default_factory=SLO)
    num_warmup: int = 2
    max_concurrency: int | None = None
    temperature: float = 0.0
    ignore_eos: bool = True
    timeout_s: float = 600.0
    show_progress: bool = True
    # "grpc": pdserve's router; "openai": any OpenAI-compatible server at a base URL (vLLM's,
    # pdserve's own HTTP API), measured by the same schedule and metrics.
    backend: str = "grpc"
    model: str | None = None  # openai: the model name to request (default: the first listed)
    model_dir: Path | None = None  # openai: the served checkpoint's directory (its vocabulary)

    def client_config(self, address: str, label: str = "bench", admin_address: str | None = None) -> ClientConfig:
        return ClientConfig(
            address=address,
            admin_address=admin_address,
            max_concurrency=self.max_concurrency,
            temperature=self.temperature,
            ignore_eos=self.ignore_eos,
            timeout_s=self.timeout_s,
            request_id_prefix=_id_safe(label),
        )


@dataclass(slots=True)
class RunOutput:
    label: str
    records: list[RequestRecord]
    metrics: BenchMetrics
    by_tag: dict[str, BenchMetrics]
    offered_rate: float | None = None  # requests/s; None when sent all at once


async def run_load(client: BenchClient, requests: list[BenchRequest], offsets: list[float], slo: SLO, label: str, show_progress: bool = True) -> RunOutput:
    """Send ``requests`` at ``offsets`` through ``client``; metrics over the run."""
    bar = ProgressBar(len(requests), label=label, enabled=show_progress)
    result = await client.run(requests, offsets, on_done=lambda record: bar.advance(record.ok))
    bar.close()
    failed = [r for r in result.records if not r.ok]
    if failed:
        logger.warning("%s: %d of %d requests failed, first %s: %s", label, len(failed), len(result.records), failed[0].req_id, failed[0].error)
    return RunOutput(label, result.records, compute_metrics(result.records, result.duration_s, slo), metrics_by_tag(result.records, result.duration_s, slo))


def make_client(address: str, spec: BenchSpec, label: str) -> BenchClient:
    """The load generator for ``spec.backend`` at ``address`` (host:port, or a base URL)."""
    config = spec.client_config(address, label)
    if spec.backend == "openai":
        from cluster.bench.openai_client import OpenAIClient

        return OpenAIClient(config, model=spec.model, seed=None, model_dir=spec.model_dir)
    return BenchClient(config)


async def bench(address: str, spec: BenchSpec, label: str = "bench") -> RunOutput:
    """Warm up, then run ``spec``'s workload at its arrival process against ``address``."""
    async with make_client(address, spec, label) as client:
        requests, warmup = await _workload(client, spec)
        if warmup:
            await client.warm_up(warmup)
        output = await run_load(client, requests, arrival_offsets(len(requests), spec.arrivals), spec.slo, label, spec.show_progress)
    output.offered_rate = spec.arrivals.rate if spec.arrivals.rate != float("inf") else None
    return output


async def sweep(address: str, spec: BenchSpec, rates: list[float], refine_steps: int = 0, target: float = DEFAULT_TARGET, label: str = "sweep") -> tuple[SweepResult, list[RunOutput]]:
    """The workload at each rate (warm-up once); the highest rate meeting the SLOs. Each run
    sends prompts of its own (the workload's, drawn with another seed): the same prompts again
    were prefix-cache hits on a server that caches (pdserve's and vLLM's default), and every
    rate after the first measured a warm cache (TTFT understated, max_rate overstated)."""
    outputs: list[RunOutput] = []
    async with make_client(address, spec, label) as client:
        requests, warmup = await _workload(client, spec)
        if warmup:
            await client.warm_up(warmup)
        limits = await client.model_limits()
        runs = itertools.count()

        async def run_at(rate: float) -> BenchMetrics:
            arrivals = dataclasses.replace(spec.arrivals, rate=rate)
            run = next(runs)
            fresh = requests if run == 0 else build_workload(dataclasses.replace(spec.workload, seed=spec.workload.seed + run * 7919), limits)
            output = await run_load(client, fresh, arrival_offsets(len(fresh), arrivals), spec.slo, f"{label} {rate:.3g} req/s", spec.show_progress)
            output.offered_rate = rate
            outputs.append(output)
            return output.metrics

        result = await run_sweep(run_at, rates, target=target, refine_steps=refine_steps)
    outputs.sort(key=lambda o: o.offered_rate)
    return result, outputs


async def _workload(client: BenchClient, spec: BenchSpec) -> tuple[list[BenchRequest], list[BenchRequest]]:
    limits = await client.model_limits()
    requests = build_workload(spec.workload, limits)
    warmup = []
    if spec.num_warmup > 0:
        warm_spec = dataclasses.replace(spec.workload, num_requests=spec.num_warmup, seed=spec.workload.seed + 1_000_003)
        warmup = build_workload(warm_spec, limits)
    return requests, warmup


def write_run(out_dir: Path, spec: BenchSpec, output: RunOutput, config_extra: dict[str, Any] | None = None, make_plots: bool = True) -> dict[str, Any]:
    """``bench.json`` and the run's plots under ``out_dir``; return the JSON document.

    The JSON is written first (with vLLM's keys at the top level as well as ours), so a plot
    that fails, or matplotlib missing, never costs the results."""
    config = {**spec_to_dict(spec), **(config_extra or {})}
    body = {"label": output.label, **vllm_keys(output.metrics), **run_to_dict(output.metrics, output.records, output.by_tag), "plots": []}
    document = result_document("bench", config, body)
    write_json(out_dir / "bench.json", document)
    if make_plots:
        document["plots"] = _plots(
            lambda: plots.plot_latency_cdfs({output.label: output.records}, out_dir / "latency_cdf.png", spec.slo, title=output.label),
            lambda: plots.plot_stage_breakdown({output.label: stage_means(output.metrics)}, out_dir / "stage_breakdown.png", title="per-stage timing (router's breakdown)"),
        )
        write_json(out_dir / "bench.json", document)
    return document


def _plots(*makers) -> list[str]:
    """Each plot that can be made; without matplotlib a warning and none."""
    if importlib.util.find_spec("matplotlib") is None:
        logger.warning("no plots: matplotlib is not installed (pip install 'pdserve[bench]'); the JSON has every figure")
        return []
    return [str(make()) for make in makers]


def write_sweep(out_dir: Path, spec: BenchSpec, result: SweepResult, outputs: list[RunOutput], config_extra: dict[str, Any] | None = None, make_plots: bool = True) -> dict[str, Any]:
    """``sweep.json`` (every rate's records) and then the sweep's plots under ``out_dir``."""
    body = {
        "target_attainment": result.target,
        "max_rate": result.max_rate,
        "runs": [{"rate": o.offered_rate, **vllm_keys(o.metrics), **run_to_dict(o.metrics, o.records, o.by_tag)} for o in outputs],
        "plots": [],
    }
    document = result_document("sweep", {**spec_to_dict(spec), **(config_extra or {})}, body)
    write_json(out_dir / "sweep.json", document)
    if make_plots:
        points = [(o.offered_rate, o.metrics) for o in outputs]
        document["plots"] = _plots(
            lambda: plots.plot_rate_sweep(points, out_dir / "rate_sweep.png", result.max_rate, title="throughput / latency vs offered load"),
            lambda: plots.plot_latency_cdfs({f"{o.offered_rate:.3g} req/s": o.records for o in outputs}, out_dir / "latency_cdf.png", spec.slo),
            lambda: plots.plot_stage_breakdown({f"{o.offered_rate:.3g} req/s": stage_means(o.metrics) for o in outputs}, out_dir / "stage_breakdown.png", title="per-stage timing by offered load"),
        )
        write_json(out_dir / "sweep.json", document)
    return document


def stage_means(metrics: BenchMetrics) -> dict[str, float]:
    """Mean ms of each of the router's timing stages (0 where none reported it), plus
    ``ttft_other_ms``: the part of the router's TTFT that no stage accounts for (relaying,
    the hop back from the decode actor), so that the stages add up to the TTFT."""
    means = {name: dist.mean or 0.0 for name, dist in metrics.stages_ms.items()}
    means["ttft_other_ms"] = max(0.0, means.get("time_to_first_token_ms", 0.0) - sum(means.get(s, 0.0) for s in plots.TTFT_STAGES))
    return means


def spec_to_dict(spec: BenchSpec) -> dict[str, Any]:
    out = dataclasses.asdict(spec)
    out["arrivals"]["all_at_once"] = spec.arrivals.rate == float("inf")
    return out


def _id_safe(label: str) -> str:
    """``label`` reduced to the characters the API allows in request ids."""
    safe = "".join(ch if ch.isalnum() or ch in "._:-" else "-" for ch in label)
    return safe[:64] or "bench"
