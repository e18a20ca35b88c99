"""When each request is sent: offsets in seconds from the start of the measured run.

Inter-arrival gaps are gamma-distributed with shape ``burstiness`` and mean ``1 / rate``:
shape 1 is a Poisson process, a smaller shape bunches requests into bursts, a larger one
spaces them more evenly, an infinite one spaces them exactly ``1 / rate`` apart. As vLLM's
``bench serve`` draws them: a gap before every request, the first included, then all scaled
so that the last goes out at exactly ``num_requests / rate`` (unscaled, the sum strays from
it by a seed's luck: 12% at 200 requests, and the offered load, and with it the measured
throughput, strayed as much). An infinite rate sends every request at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class ArrivalSpec:
    rate: float = math.inf  # requests per second; inf: all at once
    burstiness: float = 1.0  # gamma shape; 1.0 = Poisson
    seed: int = 0

    def validate(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"request_rate: must be > 0 (inf for all at once), got {self.rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness: must be > 0, got {self.burstiness}")


def arrival_offsets(num_requests: int, spec: ArrivalSpec) -> list[float]:
    """Send offsets of ``num_requests`` requests, non-decreasing, the last at ``num_requests / rate``."""
    spec.validate()
    if num_requests <= 0:
        return []
    if math.isinf(spec.rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(spec.seed)
    offsets = np.cumsum(_gaps(rng, num_requests, spec.rate, spec.burstiness))
    if offsets[-1] > 0:
        offsets *= (num_requests / spec.rate) / offsets[-1]
    return offsets.tolist()


def phased_offsets(phases: list[tuple[float, float]], burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Offsets for a load that changes: ``phases`` is [(duration_s, rate), ...] back to back.

    Within a phase arrivals follow the gamma process at that phase's rate; a phase with rate
    0 is a pause. Used for offered load that rises during a run.
    """
    rng = np.random.default_rng(seed)
    offsets: list[float] = []
    phase_start = 0.0
    for duration_s, rate in phases:
        if duration_s < 0 or rate < 0:
            raise ValueError(f"phases: duration and rate must be >= 0, got ({duration_s}, {rate})")
        phase_end = phase_start + duration_s
        if rate > 0:
            t = phase_start
            if not offsets:
                offsets.append(t)  # the run starts with a request
            while (t := t + float(_gaps(rng, 1, rate, burstiness)[0])) < phase_end:
                offsets.append(t)
        phase_start = phase_end
    return offsets


def _gaps(rng: np.random.Generator, count: int, rate: float, burstiness: float) -> np.ndarray:
    if math.isinf(burstiness):  # the limit: no spread at all (a gamma of shape inf is NaN)
        return np.full(count, 1.0 / rate)
    # Gamma(shape=k, scale=1/(rate*k)) has mean 1/rate whatever k is.
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=count)
