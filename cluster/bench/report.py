"""The readable summary table and the JSON result file.

The JSON holds the run's configuration, its metrics (overall and per workload class) and
every request's record: the raw client timestamps, plus the derived TTFT, TPOT, E2E, ITLs
and SLO verdict, so that a reader can recompute any metric without this code. Non-finite
floats (an unset time, an infinite rate) are written as null, keeping the file strict JSON.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

from cluster.bench.client import RequestRecord
from cluster.bench.metrics import SLO, BenchMetrics, Distribution, e2e_ms, itls_ms, meets_slo, tpot_ms, ttft_ms

SCHEMA = "pdserve-bench/1"
STAGE_LABELS = {
    "router_queue_ms": "router queue",
    "prefill_queue_ms": "prefill queue",
    "prefill_compute_ms": "prefill compute",
    "kv_transfer_ms": "KV transfer (exposed)",
    "decode_queue_ms": "decode queue",
    "time_to_first_token_ms": "TTFT (server)",
    "decode_ms": "decode",
    "total_ms": "total (server)",
}


def record_to_dict(record: RequestRecord, slo: SLO) -> dict[str, Any]:
    """A record's raw fields plus its derived metrics."""
    out = dataclasses.asdict(record)
    out |= {
        "output_tokens": record.output_tokens,
        "ok": record.ok,
        "ttft_ms": ttft_ms(record),
        "tpot_ms": tpot_ms(record),
        "e2e_ms": e2e_ms(record),
        "itl_ms": itls_ms(record),
        "meets_slo": meets_slo(record, slo),
    }
    return out


def run_to_dict(metrics: BenchMetrics, records: list[RequestRecord], by_tag: dict[str, BenchMetrics] | None = None) -> dict[str, Any]:
    return {
        "metrics": dataclasses.asdict(metrics),
        "metrics_by_tag": {tag: dataclasses.asdict(m) for tag, m in (by_tag or {}).items()},
        "records": [record_to_dict(r, metrics.slo) for r in records],
    }


def vllm_keys(metrics: BenchMetrics) -> dict[str, Any]:
    """The run's figures under the keys vLLM's ``bench serve`` writes (mean_ttft_ms, p99_itl_ms,
    ...), so tools that read its JSON read ours."""
    out: dict[str, Any] = {
        "duration": metrics.duration_s,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input_tokens,
        "total_output_tokens": metrics.total_output_tokens,
        "request_throughput": metrics.request_throughput,
        # Only where an SLO was set, as vLLM writes it (without one every request "met" it).
        "request_goodput": metrics.goodput if any(v is not None for v in dataclasses.astuple(metrics.slo)) else None,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
    }
    for name, dist in (("ttft", metrics.ttft_ms), ("tpot", metrics.tpot_ms), ("itl", metrics.itl_ms), ("e2el", metrics.e2e_ms)):
        out |= {
            f"mean_{name}_ms": dist.mean,
            f"median_{name}_ms": dist.p50,
            f"std_{name}_ms": dist.std,
            f"p90_{name}_ms": dist.p90,
            f"p99_{name}_ms": dist.p99,
        }
    return out


def result_document(kind: str, config: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """The top-level JSON object: what ran, when, and its results."""
    return {"schema": SCHEMA, "kind": kind, "created_unix_s": time.time(), "config": config, **body}


def write_json(path: Path, document: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(document), indent=1, default=_default))
    return path


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _finite(dataclasses.asdict(value))
    return value


def _default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "value"):  # enums
        return value.value
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def format_summary(metrics: BenchMetrics, title: str) -> str:
    """A fixed-width table of one run's metrics."""
    width = 66
    lines = [f" {title} ".center(width, "=")]

    def row(name: str, value: str) -> None:
        lines.append(f"{name:<34}{value:>32}")

    row("Requests completed / sent", f"{metrics.completed} / {metrics.num_requests}")
    row("Failed requests", str(metrics.failed))
    row("Duration (s)", f"{metrics.duration_s:.2f}")
    row("Input / output tokens", f"{metrics.total_input_tokens} / {metrics.total_output_tokens}")
    row("Request throughput (req/s)", f"{metrics.request_throughput:.3f}")
    row("Output token throughput (tok/s)", f"{metrics.output_throughput:.1f}")
    row("Total token throughput (tok/s)", f"{metrics.total_token_throughput:.1f}")
    row("SLOs", format_slo(metrics.slo))
    row("Goodput (req/s)", f"{metrics.goodput:.3f}")
    row("SLO attainment", f"{100 * metrics.slo_attainment:.1f}%")
    lines.append(_distribution_header(width))
    for name, dist in (("TTFT", metrics.ttft_ms), ("TPOT", metrics.tpot_ms), ("ITL", metrics.itl_ms), ("E2E latency", metrics.e2e_ms)):
        lines.append(_distribution_row(name, dist))
    lines.append(" per-stage timing from the router (ms) ".center(width, "-"))
    for field_name, label in STAGE_LABELS.items():
        lines.append(_distribution_row(label, metrics.stages_ms.get(field_name, Distribution())))
    lines.append("=" * width)
    return "\n".join(lines)


def format_slo(slo: SLO) -> str:
    parts = [f"{name.upper()}<={value:.1f}".removesuffix(".0") + "ms" for name, value in (("ttft", slo.ttft_ms), ("tpot", slo.tpot_ms), ("e2e", slo.e2e_ms)) if value is not None]
    return ", ".join(parts) if parts else "no SLO"


def _distribution_header(width: int) -> str:
    return "-" * width + "\n" + f"{'(ms)':<26}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"


def _distribution_row(name: str, dist: Distribution) -> str:
    cells = "".join(f"{_num(getattr(dist, key)):>10}" for key in ("mean", "p50", "p90", "p99"))
    return f"{name:<26}{cells}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_sweep(points: list[tuple[float, BenchMetrics]], max_rate: float | None, target: float) -> str:
    """One line per rate: attainment, goodput, p99 latencies; then the highest passing rate."""
    lines = [f"{'rate':>8}{'attain':>9}{'goodput':>9}{'req/s':>8}{'TTFT p99':>10}{'TPOT p99':>10}{'ITL p99':>10}"]
    for rate, m in points:
        lines.append(
            f"{rate:>8.3f}{100 * m.slo_attainment:>8.1f}%{m.goodput:>9.3f}{m.request_throughput:>8.3f}"
            f"{_num(m.ttft_ms.p99):>10}{_num(m.tpot_ms.p99):>10}{_num(m.itl_ms.p99):>10}"
        )
    verdict = f"{max_rate:.3f} req/s" if max_rate is not None else "none (the lowest rate already misses)"
    lines.append(f"highest rate with >= {100 * target:.0f}% of requests within SLO: {verdict}")
    return "\n".join(lines)
