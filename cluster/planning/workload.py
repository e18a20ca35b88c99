"""What the simulator and the planner are asked to serve: arrivals and request lengths.

A workload file (YAML or JSON) describes either a synthetic load or a trace:

    rate: 2.0               # requests per second (Poisson with burstiness 1)
    burstiness: 1.0         # gamma shape of the gaps, as ``pdserve bench``
    duration_s: 120         # or num_requests: 500
    input_len: 256          # prompt tokens; uniform in [len (1 - range_ratio), len (1 + range_ratio)]
    output_len: 64
    range_ratio: 0.5
    long_fraction: 0.0      # a share of prompts of long_input_len tokens instead (the "mixed" workload)
    long_input_len: 1024
    diurnal:                # optional: the rate follows a day (cosine between trough and peak)
      trough_rate: 0.5
      peak_rate: 8.0
      period_s: 86400
      peak_at_s: 50400      # 14:00

or ``trace: [[offset_s, prompt_tokens, output_tokens], ...]`` (what a benchmark sent, replayed).
``lengths: [[prompt_tokens, output_tokens], ...]`` in place of input_len and output_len draws
each request's lengths from those (a trace planned for at other rates: its mix).
Arrivals are generated lazily in blocks, so a day of a 100-worker cluster's traffic (millions
of requests) never sits in memory at once.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import yaml

_BLOCK = 4096  # arrivals drawn per numpy call


@dataclass(slots=True)
class Diurnal:
    trough_rate: float
    peak_rate: float
    period_s: float = 86_400.0
    peak_at_s: float = 50_400.0

    def rate_at(self, t: float) -> float:
        phase = 2 * math.pi * (t - self.peak_at_s) / self.period_s
        return self.trough_rate + (self.peak_rate - self.trough_rate) * (1 + math.cos(phase)) / 2

    def validate(self) -> None:
        if not 0 <= self.trough_rate <= self.peak_rate or self.peak_rate <= 0:
            raise ValueError(f"workload.diurnal: need 0 <= trough_rate <= peak_rate and peak_rate > 0, got {self.trough_rate}, {self.peak_rate}")
        if self.period_s <= 0:
            raise ValueError(f"workload.diurnal.period_s: must be > 0, got {self.period_s}")


@dataclass(slots=True)
class WorkloadModel:
    rate: float = 1.0
    burstiness: float = 1.0
    duration_s: float | None = None
    num_requests: int | None = None
    input_len: int = 256
    output_len: int = 64
    range_ratio: float = 0.0
    long_fraction: float = 0.0
    long_input_len: int = 1024
    diurnal: Diurnal | None = None
    trace: list[tuple[float, int, int]] | None = None
    # A trace's requests as a mix: each synthetic request takes the (prompt, output) lengths of one
    # drawn from them (what the planner sweeps a trace's mix at other rates with).
    lengths: list[tuple[int, int]] | None = None
    seed: int = 0
    extra: dict = field(default_factory=dict)  # fields a caller keeps alongside (ignored here)

    @classmethod
    def load(cls, path: Path) -> "WorkloadModel":
        try:
            data = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"workload: cannot read {path}: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"workload: {path} must hold a mapping of fields")
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict) -> "WorkloadModel":
        known = {f.name for f in fields(cls)} - {"extra"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"workload.{unknown[0]}: unknown field (known: {', '.join(sorted(known))})")
        values = dict(data)
        if values.get("diurnal") is not None:
            if not isinstance(values["diurnal"], dict):
                raise ValueError("workload.diurnal: must be a mapping (trough_rate, peak_rate, period_s, peak_at_s)")
            try:
                values["diurnal"] = Diurnal(**values["diurnal"])
            except TypeError as exc:
                raise ValueError(f"workload.diurnal: {exc}") from None
        if values.get("trace") is not None:
            try:
                values["trace"] = [(float(t), int(p), int(o)) for t, p, o in values["trace"]]
            except (TypeError, ValueError):
                raise ValueError("workload.trace: must be a list of [offset_s, prompt_tokens, output_tokens]") from None
        if values.get("lengths") is not None:
            try:
                values["lengths"] = [(int(p), int(o)) for p, o in values["lengths"]]
            except (TypeError, ValueError):
                raise ValueError("workload.lengths: must be a list of [prompt_tokens, output_tokens]") from None
            if not values["lengths"] or any(p < 1 or o < 1 for p, o in values["lengths"]):
                raise ValueError("workload.lengths: needs requests, each with >= 1 prompt and >= 1 output token")
        model = cls(**values)
        model.validate()
        return model

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        if self.diurnal is not None:
            out["diurnal"] = {f.name: getattr(self.diurnal, f.name) for f in fields(Diurnal)}
        if self.trace is not None:
            out["trace"] = [list(r) for r in self.trace]
        if self.lengths is not None:
            out["lengths"] = [list(r) for r in self.lengths]
        return out

    def validate(self) -> None:
        if self.trace is not None:
            if any(p < 1 or o < 1 for _, p, o in self.trace):
                raise ValueError("workload.trace: every request needs >= 1 prompt and >= 1 output token")
            return
        if not self.rate > 0:
            raise ValueError(f"workload.rate: must be > 0, got {self.rate}")
        if not self.burstiness > 0:
            raise ValueError(f"workload.burstiness: must be > 0, got {self.burstiness}")
        if (self.duration_s is None) == (self.num_requests is None):
            raise ValueError("workload: give exactly one of duration_s and num_requests")
        for name in ("input_len", "output_len", "long_input_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"workload.{name}: must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"workload.range_ratio: must be in [0, 1), got {self.range_ratio}")
        if not 0 <= self.long_fraction <= 1:
            raise ValueError(f"workload.long_fraction: must be in [0, 1], got {self.long_fraction}")
        if self.diurnal is not None:
            self.diurnal.validate()

    def with_rate(self, rate: float) -> "WorkloadModel":
        """The same request mix at another constant rate (what the planner sweeps); a trace's
        mix is its requests' lengths, drawn at random (it lost them: a trace was planned for as
        256-token prompts, or refused for giving no duration)."""
        data = self.to_dict()
        data.update(rate=rate, diurnal=None, trace=None)
        if self.trace is not None:
            data.update(lengths=[[p, o] for _, p, o in self.trace], duration_s=None, num_requests=max(1, len(self.trace)))
        return WorkloadModel.from_dict(data)

    @property
    def trace_rate(self) -> float | None:
        """A trace's own rate: its requests over the span of their arrivals (None: no trace, or
        too short to tell)."""
        if not self.trace or len(self.trace) < 2:
            return None
        offsets = [t for t, _, _ in self.trace]
        span = max(offsets) - min(offsets)
        return (len(self.trace) - 1) / span if span > 0 else None

    @property
    def mean_input_len(self) -> float:
        if self.trace is not None:
            return float(np.mean([p for _, p, _ in self.trace])) if self.trace else 0.0
        if self.lengths is not None:
            return float(np.mean([p for p, _ in self.lengths]))
        return (1 - self.long_fraction) * self.input_len + self.long_fraction * self.long_input_len

    @property
    def mean_output_len(self) -> float:
        if self.trace is not None:
            return float(np.mean([o for _, _, o in self.trace])) if self.trace else 0.0
        if self.lengths is not None:
            return float(np.mean([o for _, o in self.lengths]))
        return float(self.output_len)

    def requests(self) -> Iterator[tuple[float, int, int]]:
        """(arrival offset s, prompt tokens, output tokens), in arrival order."""
        if self.trace is not None:
            yield from sorted(self.trace)
            return
        rng = np.random.default_rng(self.seed)
        peak = self.diurnal.peak_rate if self.diurnal is not None else self.rate
        t, sent = 0.0, 0
        limit = self.num_requests if self.num_requests is not None else math.inf
        end = self.duration_s if self.duration_s is not None else math.inf
        first = True
        while True:
            gaps = rng.gamma(self.burstiness, 1.0 / (peak * self.burstiness), _BLOCK)
            if first:
                gaps[0] = 0.0  # the run starts with a request, as ``pdserve bench`` does
                first = False
            times = t + np.cumsum(gaps)
            t = float(times[-1])
            if self.diurnal is not None:  # thinning: keep an arrival with probability rate(t) / peak
                d = self.diurnal
                rates = d.trough_rate + (d.peak_rate - d.trough_rate) * (1 + np.cos(2 * np.pi * (times - d.peak_at_s) / d.period_s)) / 2
                keep = rng.random(_BLOCK) * peak <= rates
                times = times[keep]
            inputs, outputs = self._lengths(rng, len(times))
            for when, prompt, output in zip(times.tolist(), inputs, outputs):
                if when >= end or sent >= limit:
                    return
                sent += 1
                yield when, prompt, output

    def _lengths(self, rng: np.random.Generator, n: int) -> tuple[list[int], list[int]]:
        if self.lengths is not None:
            drawn = np.asarray(self.lengths)[rng.integers(0, len(self.lengths), n)]
            return drawn[:, 0].tolist(), drawn[:, 1].tolist()

        def spread(length: int) -> np.ndarray:
            low = max(1, int(length * (1 - self.range_ratio)))
            high = max(low, int(length * (1 + self.range_ratio)))
            return rng.integers(low, high + 1, n)

        inputs = spread(self.input_len)
        if self.long_fraction > 0:
            inputs = np.where(rng.random(n) < self.long_fraction, self.long_input_len, inputs)
        return inputs.tolist(), spread(self.output_len).tolist()
