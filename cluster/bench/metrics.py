"""Serving metrics from request records, with the meanings vLLM's benchmark gives them.

Per request (successful ones only; times from the moment Generate was sent):

* TTFT: until the first message that carries a token;
* E2E latency: until the last message of the stream;
* TPOT: (E2E - TTFT) / (output tokens - 1), the mean time per token after the first;
  undefined for a one-token output;
* ITL: every gap between consecutive messages that carry tokens (one request contributes
  one value per gap, so ITL percentiles are over all gaps of all requests).

Per run, over ``duration_s`` (the first send to the end of the last request): request
throughput (completed / s), output and total (prompt + output) token throughput, goodput
(requests / s that completed and met every SLO given) and SLO attainment (the share of all
requests sent, failures included, that met them). Percentiles interpolate linearly between
the closest ranks (numpy's default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cluster.bench.client import STAGE_FIELDS, RequestRecord

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class SLO:
    """Latency objectives in ms; None leaves that metric unconstrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def validate(self) -> None:
        for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"slo_{name}: must be > 0, got {value}")


@dataclass(slots=True)
class Distribution:
    count: int = 0
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    min: float | None = None
    max: float | None = None
    std: float | None = None  # population standard deviation, as vLLM's benchmark reports it


@dataclass(slots=True)
class BenchMetrics:
    num_requests: int
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (prompt + output) tokens / s
    goodput: float  # requests / s that met every SLO
    slo_attainment: float  # share of requests that met every SLO
    slo: SLO
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2e_ms: Distribution
    stages_ms: dict[str, Distribution] = field(default_factory=dict)  # the router's Timing fields


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), interpolating linearly between the closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q: must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: list[float]) -> Distribution:
    if not values:
        return Distribution()
    p50, p90, p99 = (percentile(values, q) for q in PERCENTILES)
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    return Distribution(count=len(values), mean=mean, p50=p50, p90=p90, p99=p99, min=min(values), max=max(values), std=std)


def ttft_ms(record: RequestRecord) -> float | None:
    return (record.chunk_s[0] - record.send_s) * 1000 if record.ok else None


def e2e_ms(record: RequestRecord) -> float | None:
    return (record.end_s - record.send_s) * 1000 if record.ok else None


def tpot_ms(record: RequestRecord) -> float | None:
    if not record.ok or record.output_tokens < 2:
        return None
    return (e2e_ms(record) - ttft_ms(record)) / (record.output_tokens - 1)


def itls_ms(record: RequestRecord) -> list[float]:
    if not record.ok:
        return []
    return [(b - a) * 1000 for a, b in zip(record.chunk_s, record.chunk_s[1:])]


def meets_slo(record: RequestRecord, slo: SLO) -> bool:
    """Completed, and within every objective set (a one-token output has no TPOT to miss)."""
    if not record.ok:
        return False
    tpot = tpot_ms(record)
    return (
        (slo.ttft_ms is None or ttft_ms(record) <= slo.ttft_ms)
        and (slo.tpot_ms is None or tpot is None or tpot <= slo.tpot_ms)
        and (slo.e2e_ms is None or e2e_ms(record) <= slo.e2e_ms)
    )


def compute_metrics(records: list[RequestRecord], duration_s: float, slo: SLO | None = None) -> BenchMetrics:
    """Every run-level metric of ``records`` over ``duration_s`` seconds."""
    slo = slo or SLO()
    done = [r for r in records if r.ok]
    num_good = sum(1 for r in done if meets_slo(r, slo))
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(r.output_tokens for r in done)
    tpots = [t for r in done if (t := tpot_ms(r)) is not None]
    timed = [r.timing for r in done if r.timing is not None]
    return BenchMetrics(
        num_requests=len(records),
        completed=len(done),
        failed=len(records) - len(done),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=per_s(len(done)),
        output_throughput=per_s(total_out),
        total_token_throughput=per_s(total_in + total_out),
        goodput=per_s(num_good),
        slo_attainment=num_good / len(records) if records else 0.0,
        slo=slo,
        ttft_ms=distribution([ttft_ms(r) for r in done]),
        tpot_ms=distribution(tpots),
        itl_ms=distribution([gap for r in done for gap in itls_ms(r)]),
        e2e_ms=distribution([e2e_ms(r) for r in done]),
        stages_ms={name: distribution([getattr(t, name) for t in timed]) for name in STAGE_FIELDS},
    )


def metrics_by_tag(records: list[RequestRecord], duration_s: float, slo: SLO | None = None) -> dict[str, BenchMetrics]:
    """``compute_metrics`` per workload class (long/short, prefix group); throughputs share the run's duration."""
    tags = sorted({r.tag for r in records if r.tag})
    return {tag: compute_metrics([r for r in records if r.tag == tag], duration_s, slo) for tag in tags}
