"""A fitted step-time model of one deployment: what ``pdserve profile`` writes and the simulator reads.

An engine step's duration is modelled as a sum of linear terms in what it computes:

    step_s = intercept[role] + prefill_token_s * prefill tokens + prefill_attention_s * sum(tokens x context)
             + prefill_seq_s * prefill chunks + decode_row_s * decode rows + decode_kv_s * KV tokens read

Both roles run the same engine code on the same hardware, so the per-token terms are fitted
jointly over the steps of prefill and decode workers; each role has its own intercept (a
prefill worker's turn also pushes KV, a decode worker's publishes tokens). A decode worker
that prefills locally (conditional or no disaggregation) mixes both kinds of terms in one
step, which is what the aggregated pool shapes run. Coefficients are fitted by non-negative
least squares: a negative cost per token would be an artefact of collinear sweeps, and the
simulator extrapolates from them.

A KV write after a prefill step costs ``transfer_s = intercept + per_byte * bytes +
per_descriptor * descriptors``. ``ttft_overhead_s`` is what a client sees beyond the steps
and the transfer (router, Ray calls, the gRPC stream), measured on isolated requests.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

PROFILE_FORMAT = "pdserve-profile/1"

# Per-token terms, in this order, after the two role intercepts.
TERMS = ("prefill_token_s", "prefill_attention_s", "prefill_seq_s", "decode_row_s", "decode_kv_s")
ROLES = ("prefill", "decode")


@dataclass(slots=True)
class StepTimeModel:
    intercept_s: dict[str, float]  # per role
    prefill_token_s: float = 0.0
    prefill_attention_s: float = 0.0  # per token x context token
    prefill_seq_s: float = 0.0  # per prompt chunk in the step
    decode_row_s: float = 0.0
    decode_kv_s: float = 0.0  # per KV token a decode row reads
    fit: dict[str, float] = field(default_factory=dict)  # quality of the fit, per role
    # Per role: how much slower a step is while the other workers on its machine compute (its
    # duration x (1 + contention x the share of the step they were busy)); what 2 CPU actors
    # sharing cores and memory bandwidth see, and a GPU per actor does not.
    contention: dict[str, float] = field(default_factory=dict)
    # Per role: measured / predicted duration of the profiled steps at the quantiles
    # RESIDUAL_QUANTILES (decode: steps without prompt tokens). Steps scatter around the model
    # (the machine's noise, partial overlaps); a per-step figure such as ITL has that scatter in
    # its percentiles, which the simulator adds back (``LogHistogram.spread``).
    residuals: dict[str, list[float]] = field(default_factory=dict)

    def step_s(self, role: str, prefill_tokens: int = 0, prefill_attention: float = 0.0, prefill_seqs: int = 0,
               decode_rows: int = 0, decode_kv_tokens: int = 0) -> float:
        return (
            self.intercept_s[role] + self.prefill_token_s * prefill_tokens + self.prefill_attention_s * prefill_attention
            + self.prefill_seq_s * prefill_seqs + self.decode_row_s * decode_rows + self.decode_kv_s * decode_kv_tokens
        )


@dataclass(slots=True)
class TransferModel:
    intercept_s: float = 0.0
    per_byte_s: float = 0.0
    per_descriptor_s: float = 0.0
    fit: dict[str, float] = field(default_factory=dict)

    def transfer_s(self, num_bytes: int, num_descriptors: int = 1) -> float:
        return self.intercept_s + self.per_byte_s * num_bytes + self.per_descriptor_s * num_descriptors


@dataclass(slots=True)
class DeploymentFacts:
    """What the simulated workers and router do, as the profiled deployment did it."""

    block_size: int
    bytes_per_block: int
    decode_num_blocks: int  # KV blocks of one decode worker
    token_budget: dict[str, int]  # per role: tokens per step
    chunk_size: dict[str, int | None]  # per role: most tokens of one prompt per step
    max_num_seqs: int  # of a decode worker's batch
    local_prefill_max_tokens: int  # prompts up to this length prefill on the decode worker (auto mode)
    max_model_len: int


@dataclass(slots=True)
class Profile:
    step: StepTimeModel
    transfer: TransferModel
    facts: DeploymentFacts
    ttft_overhead_s: dict[str, float]  # "remote": prefilled on a prefill worker, "local": on the decode worker
    source: dict[str, object] = field(default_factory=dict)  # model, machine, when, how many steps were fitted
    # What was fitted, kept so a profile can be refitted or inspected: per role the steps in
    # engine.step_profile.STEP_FIELDS order, and the KV writes as [bytes, descriptors, seconds].
    samples: dict[str, list] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"format": PROFILE_FORMAT, **asdict(self)}

    def save(self, path: Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: Path) -> "Profile":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"profile: cannot read {path}: {exc}") from None
        if data.get("format") != PROFILE_FORMAT:
            raise ValueError(f"profile: {path} is not a pdserve profile (format {data.get('format')!r}, expected {PROFILE_FORMAT!r})")
        try:
            return cls(
                step=StepTimeModel(**data["step"]),
                transfer=TransferModel(**data["transfer"]),
                facts=DeploymentFacts(**data["facts"]),
                ttft_overhead_s=dict(data["ttft_overhead_s"]),
                source=dict(data.get("source", {})),
                samples=dict(data.get("samples", {})),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"profile: {path} is incomplete or malformed: {exc}") from None


def fit_step_model(steps_by_role: dict[str, list[tuple]], overlaps_by_role: dict[str, list[float]] | None = None) -> StepTimeModel:
    """Fit the joint model to steps in ``engine.step_profile.STEP_FIELDS`` order, per role.

    ``overlaps_by_role``: per step, the share of it during which other workers on its machine
    were computing. A step's duration is modelled as ``terms x (1 + contention[role] x share)``
    and both are fitted together on every step, alternating until the contention settles: the
    terms by non-negative least squares with the contention fixed, then each role's contention
    by least squares with the terms fixed. Errors are relative (each step weighs 1 / its
    predicted duration, from the round before), so 40 ms decode steps count as much as 2 s
    prefill steps, and a step's scatter around the model averages out (weighing by 1 / its
    measured duration instead would fit 2.6% low under +-20% scatter).

    Fitting the terms on the steps that ran alone (what this did first) fails where few do:
    two decode workers sharing a machine decode side by side nearly all the time; 145 of 2,404
    profiled steps ran alone, all small batches, and the terms fitted on them put the steps of a
    later run 9% above the prediction (this joint fit: 2% below).
    """
    rows, targets, roles, overlaps = [], [], [], []
    for role, steps in steps_by_role.items():
        if role not in ROLES:
            raise ValueError(f"steps: unknown role {role!r}")
        shares = (overlaps_by_role or {}).get(role) or [0.0] * len(steps)
        for step, share in zip(steps, shares):
            prefill_tokens, attention, seqs, decode_rows, kv_tokens, duration = step[:6]
            rows.append([role == "prefill", role == "decode", prefill_tokens, attention, seqs, decode_rows, kv_tokens])
            targets.append(duration)
            roles.append(role)
            overlaps.append(share)
    if len(rows) < 2 * len(TERMS):
        raise ValueError(f"steps: {len(rows)} recorded steps are too few to fit a step-time model")
    features = np.asarray(rows, dtype=np.float64)
    durations = np.asarray(targets, dtype=np.float64)
    shares = np.asarray(overlaps, dtype=np.float64)
    roles_array = np.asarray(roles)
    weights = 1.0 / np.maximum(durations, 1e-9)
    contention = dict.fromkeys(ROLES, 0.0)
    for _ in range(_CONTENTION_ROUNDS):
        factor = 1 + np.array([contention[r] for r in roles]) * shares
        coefficients = _nonnegative_fit(features * (factor * weights)[:, None], durations * weights)
        base = features @ np.asarray(coefficients)
        previous = dict(contention)
        for role in ROLES:
            mine = roles_array == role
            # Relative excess over the terms = contention x share, by least squares.
            x = shares[mine] * base[mine] * weights[mine]
            y = (durations[mine] - base[mine]) * weights[mine]
            contention[role] = float(np.clip(x @ y / (x @ x), 0.0, 3.0)) if np.sum(shares[mine] >= _CROWDED) >= 5 else 0.0
        predicted = base * (1 + np.array([contention[r] for r in roles]) * shares)
        new_weights = 1.0 / np.maximum(predicted, 1e-9)
        settled = np.max(np.abs(new_weights * durations - weights * durations)) < 1e-3
        weights = np.where(predicted > 0, new_weights, weights)
        if settled and all(abs(contention[r] - previous[r]) < 1e-4 for r in ROLES):
            break
    model = StepTimeModel(intercept_s={"prefill": coefficients[0], "decode": coefficients[1]}, **dict(zip(TERMS, coefficients[2:])))
    model.contention = contention
    for role in ROLES:
        mask = roles_array == role
        if mask.any():
            model.fit[role] = _fit_quality(predicted[mask], durations[mask])
        scatter = mask & (predicted > 0) & ((features[:, 2] == 0) if role == "decode" else True)
        if np.sum(scatter) >= len(RESIDUAL_QUANTILES):
            model.residuals[role] = [float(v) for v in np.percentile(durations[scatter] / predicted[scatter], RESIDUAL_QUANTILES)]
    return model


RESIDUAL_QUANTILES = [2.5 + 5 * i for i in range(20)]  # equally likely: each stands for 5% of the steps


_CONTENTION_ROUNDS = 50
_CROWDED = 0.6


def step_overlaps(batches: list) -> dict[int, list[float]]:
    """For each worker's step log (index in ``batches``), the share of each step's interval during
    which another worker on the same node was running a step."""
    intervals: dict[int, list[tuple[float, float]]] = {
        i: [(step[6] - step[5], step[6]) for step in batch.steps] for i, batch in enumerate(batches)
    }
    shares: dict[int, list[float]] = {}
    for i, batch in enumerate(batches):
        others = sorted(iv for j, other in enumerate(batches) if j != i and other.node == batch.node for iv in intervals[j])
        merged: list[list[float]] = []
        for start, end in others:
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        starts = [m[0] for m in merged]
        result = []
        for start, end in intervals[i]:
            covered = 0.0
            k = max(0, bisect.bisect_right(starts, start) - 1)
            while k < len(merged) and merged[k][0] < end:
                covered += max(0.0, min(end, merged[k][1]) - max(start, merged[k][0]))
                k += 1
            result.append(covered / (end - start) if end > start else 0.0)
        shares[i] = result
    return shares


def fit_transfer_model(records: list) -> TransferModel:
    """Fit KV-write durations (``engine.step_profile.TransferRecord``) to bytes and descriptors."""
    if len(records) < 3:
        return TransferModel(fit={"num_writes": float(len(records))})
    features = np.asarray([[1.0, r.num_bytes, r.num_descriptors] for r in records])
    durations = np.asarray([r.duration_s for r in records])
    coefficients = _nonnegative_fit(features, durations)
    return TransferModel(*coefficients, fit=_fit_quality(features @ coefficients, durations))


def _nonnegative_fit(features: np.ndarray, targets: np.ndarray) -> list[float]:
    """Least squares with every coefficient >= 0, on columns scaled to unit size (the terms
    differ by six orders of magnitude: tokens against tokens x context).

    Fits the free columns, drops the most negative coefficient's column and fits again, until
    none is negative: for a handful of columns this reaches the non-negative optimum in as
    many rounds as there are columns to drop.
    """
    scale = np.abs(features).max(axis=0)
    scale[scale == 0] = 1.0
    scaled = features / scale
    free = [j for j in range(scaled.shape[1]) if np.any(scaled[:, j])]
    solution = np.zeros(scaled.shape[1])
    while free:
        coefficients, *_ = np.linalg.lstsq(scaled[:, free], targets, rcond=None)
        if coefficients.min() >= 0:
            solution[free] = coefficients
            break
        free.pop(int(np.argmin(coefficients)))
    return [float(c) for c in solution / scale]


def _fit_quality(predicted: np.ndarray, measured: np.ndarray) -> dict[str, float]:
    residual = measured - predicted
    total = float(((measured - measured.mean()) ** 2).sum())
    relative = np.abs(residual) / np.maximum(measured, 1e-9)
    return {
        "num_samples": float(len(measured)),
        "r2": 1.0 - float((residual ** 2).sum()) / total if total > 0 else math.nan,
        "median_abs_error_pct": float(np.median(relative) * 100),
        "p90_abs_error_pct": float(np.percentile(relative, 90) * 100),
    }
