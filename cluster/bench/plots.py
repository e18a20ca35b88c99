"""PNG figures of benchmark results (matplotlib, Agg backend, imported only when plotting).

matplotlib is the optional ``bench`` extra: everything else in the benchmark runs without it,
and a missing install fails here with the command that fixes it.
"""

from __future__ import annotations

from pathlib import Path

from cluster.bench.client import RequestRecord
from cluster.bench.metrics import SLO, BenchMetrics, e2e_ms, itls_ms, tpot_ms, ttft_ms

TTFT_STAGES = ("router_queue_ms", "prefill_queue_ms", "prefill_compute_ms", "kv_transfer_ms", "decode_queue_ms")
ALL_STAGES = (*TTFT_STAGES, "ttft_other_ms", "decode_ms")
_STAGE_NAMES = {
    "router_queue_ms": "router queue",
    "prefill_queue_ms": "prefill queue",
    "prefill_compute_ms": "prefill compute",
    "kv_transfer_ms": "KV transfer",
    "decode_queue_ms": "decode queue",
    "ttft_other_ms": "other (to first token)",
    "decode_ms": "decode",
}


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("plots need matplotlib: pip install 'pdserve[bench]'") from exc
    matplotlib.use("Agg")  # files only; never a display, which CI machines lack
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def plot_latency_cdfs(groups: dict[str, list[RequestRecord]], path: Path, slo: SLO | None = None, title: str = "") -> Path:
    """CDFs of TTFT, TPOT, ITL and E2E latency, one line per group of records."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    panels = (
        ("TTFT (ms)", lambda rs: [v for r in rs if (v := ttft_ms(r)) is not None], slo.ttft_ms if slo else None),
        ("TPOT (ms)", lambda rs: [v for r in rs if (v := tpot_ms(r)) is not None], slo.tpot_ms if slo else None),
        ("ITL (ms)", lambda rs: [g for r in rs for g in itls_ms(r)], None),
        ("E2E latency (ms)", lambda rs: [v for r in rs if (v := e2e_ms(r)) is not None], slo.e2e_ms if slo else None),
    )
    for ax, (name, values_of, threshold) in zip(axes.flat, panels):
        for label, records in groups.items():
            values = sorted(values_of(records))
            if values:
                ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=label)
        if threshold is not None:
            ax.axvline(threshold, color="gray", linestyle="--", linewidth=1, label="SLO")
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests" if name != "ITL (ms)" else "fraction of gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def plot_rate_sweep(points: list[tuple[float, BenchMetrics]], path: Path, max_rate: float | None = None, title: str = "") -> Path:
    """Latency percentiles and throughput against offered request rate."""
    plt = _pyplot()
    rates = [rate for rate, _ in points]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("E2E", "e2e_ms")):
        for q, style in (("p50", "-"), ("p99", "--")):
            left.plot(rates, [getattr(getattr(m, key), q) or float("nan") for _, m in points], style, marker="o", label=f"{name} {q}")
    left.set_yscale("log")
    left.set_xlabel("offered load (req/s)")
    left.set_ylabel("latency (ms)")
    left.grid(alpha=0.3, which="both")
    left.legend(fontsize=8)
    right.plot(rates, [m.request_throughput for _, m in points], marker="o", label="throughput (req/s)")
    right.plot(rates, [m.goodput for _, m in points], marker="s", label="goodput (req/s)")
    right.plot(rates, rates, color="gray", linestyle=":", label="offered")
    right.set_xlabel("offered load (req/s)")
    right.set_ylabel("req/s")
    attainment = right.twinx()
    attainment.plot(rates, [100 * m.slo_attainment for _, m in points], color="tab:red", marker="^", label="SLO attainment")
    attainment.set_ylabel("SLO attainment (%)")
    attainment.set_ylim(0, 105)
    if max_rate is not None:
        right.axvline(max_rate, color="tab:green", linestyle="--", label=f"max rate within SLO: {max_rate:.2f}")
    right.legend(loc="upper left", fontsize=8)
    right.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def plot_stage_breakdown(
    groups: dict[str, dict[str, float]],
    path: Path,
    stages: tuple[str, ...] = ALL_STAGES,
    title: str = "",
    notes: dict[str, str] | None = None,
    xlabel: str = "mean time (ms)",
    normalize: bool = False,
) -> Path:
    """Stacked horizontal bars of ms per stage (the router's Timing fields) per group;
    ``normalize`` draws each bar as percentages of its own total instead."""
    plt = _pyplot()
    labels = list(groups)
    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.6 * len(labels)))
    left = [0.0] * len(labels)
    totals = [sum(groups[label].get(stage, 0.0) for stage in stages) or 1.0 for label in labels]
    for stage in stages:
        widths = [groups[label].get(stage, 0.0) for label in labels]
        if normalize:
            widths = [100 * w / t for w, t in zip(widths, totals)]
        ax.barh(labels, widths, left=left, label=_STAGE_NAMES.get(stage, stage))
        left = [a + b for a, b in zip(left, widths)]
    for i, label in enumerate(labels):
        if notes and label in notes:
            ax.text(left[i], i, f"  {notes[label]}", va="center", fontsize=8)
    ax.set_xlabel("share (%)" if normalize else xlabel)
    ax.invert_yaxis()
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.grid(alpha=0.3, axis="x")
    if notes:
        ax.set_xlim(0, max(left) * 1.25 if max(left) > 0 else 1)
    if title:
        ax.set_title(title)
    return _save(fig, path)


def plot_comparison(values: dict[str, dict[str, float]], path: Path, title: str = "") -> Path:
    """Grouped bars: for each metric (one panel), its value under each configuration."""
    plt = _pyplot()
    metrics = list(values)
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.3 * len(metrics), 3.8), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        configs = list(values[metric])
        heights = [values[metric][c] for c in configs]
        bars = ax.bar(configs, heights, color=[f"C{i}" for i in range(len(configs))])
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
        ax.set_title(metric, fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(alpha=0.3, axis="y")
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def plot_latency_over_time(records: list[RequestRecord], path: Path, events: list[tuple[float, str]] = (), offered: list[tuple[float, float]] = (), title: str = "") -> Path:
    """TTFT and TPOT of each request against its send time, with marked events (a scale-up)."""
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    done = [r for r in records if r.ok]
    top.scatter([r.send_s for r in done], [ttft_ms(r) for r in done], s=10, label="TTFT")
    timed = [(r.send_s, t) for r in done if (t := tpot_ms(r)) is not None]
    bottom.scatter([s for s, _ in timed], [t for _, t in timed], s=10, color="tab:orange", label="TPOT")
    failed = [r for r in records if not r.ok]
    if failed:
        top.scatter([r.send_s for r in failed], [0] * len(failed), marker="x", color="red", label="failed")
    top.set_ylabel("TTFT (ms)")
    bottom.set_ylabel("TPOT (ms)")
    bottom.set_xlabel("send time (s from start)")
    if offered:
        rate_axis = top.twinx()
        rate_axis.step([t for t, _ in offered], [r for _, r in offered], where="post", color="gray", linestyle=":", label="offered req/s")
        rate_axis.set_ylabel("offered load (req/s)")
    for ax in (top, bottom):
        for i, (t, label) in enumerate(events):
            ax.axvline(t, color=f"C{i + 2}", linestyle="--", label=f"{label} ({t:.1f}s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def plot_gap_timeline(groups: dict[str, list[RequestRecord]], path: Path, windows: dict[str, tuple[float, float] | None], title: str = "") -> Path:
    """Per group, over time: every inter-chunk gap of every stream and every request's TTFT,
    with the shaded window in which a marked request (the long prompt) was being prefilled."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(groups), 1, figsize=(10, 2.8 * len(groups)), sharex=True, squeeze=False)
    for ax, (label, records) in zip(axes[:, 0], groups.items()):
        done = [r for r in records if r.ok]
        gaps = [(b, (b - a) * 1000) for r in done for a, b in zip(r.chunk_s, r.chunk_s[1:])]
        ax.scatter([t for t, _ in gaps], [g for _, g in gaps], s=4, label="ITL (gap ends at x)")
        ax.scatter([r.send_s for r in done], [ttft_ms(r) for r in done], s=18, marker="^", color="tab:orange", label="TTFT (sent at x)")
        window = windows.get(label)
        if window is not None:
            ax.axvspan(window[0], window[1], color="tab:red", alpha=0.12, label="long prompt until its first token")
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="upper right")
    axes[-1, 0].set_xlabel("time (s from start)")
    if title:
        fig.suptitle(title)
    return _save(fig, path)
