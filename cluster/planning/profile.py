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
simulator extrapolates from them. Workers sharing a machine slow each other: the sum is
multiplied by ``1 + contention`` for the share of the step other workers computed, per kind
of step they ran (``StepTimeModel.crowding``), fitted together with the terms.

A KV write after a prefill step costs ``transfer_s = intercept + per_byte * bytes +
per_descriptor * descriptors``. ``ttft_overhead_s`` is what a client sees beyond the steps
and the transfer (router, Ray calls, the gRPC stream), measured on isolated requests.
"""

from __future__ import annotations

import bisect
import json
import math
import operator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

PROFILE_FORMAT = "pdserve-profile/1"

# Per-token terms, in this order, after the two role intercepts.
TERMS = ("prefill_token_s", "prefill_attention_s", "prefill_seq_s", "decode_row_s", "decode_kv_s")
ROLES = ("prefill", "decode")
_TERMS_OF = operator.itemgetter(*TERMS)  # a role_terms entry's values in TERMS order
COMPANY = ("prefill", "decode")  # what a step beside this one computes: prompt tokens, or decode rows only


@dataclass(slots=True)
class StepTimeModel:
    intercept_s: dict[str, float]  # per role
    prefill_token_s: float = 0.0
    prefill_attention_s: float = 0.0  # per token x context token
    prefill_seq_s: float = 0.0  # per prompt chunk in the step
    decode_row_s: float = 0.0
    decode_kv_s: float = 0.0  # per KV token a decode row reads
    fit: dict[str, float] = field(default_factory=dict)  # quality of the fit, per role
    # Per role, then per kind of step the company ran (COMPANY: with prompt tokens, or decode
    # rows only): how much slower a step is while other workers on its machine compute; its
    # duration x (1 + sum over kinds of contention x the share of the step they ran that kind).
    # What 2 CPU actors sharing cores and memory bandwidth see, and a GPU per actor does not:
    # measured here, a decode step beside another decode step +25%, beside a prefill step +12%
    # (both stream the weights from memory; a prefill step reuses them across its tokens).
    contention: dict[str, dict[str, float]] = field(default_factory=dict)
    # Per role: measured / predicted duration of the profiled steps at the quantiles
    # RESIDUAL_QUANTILES (decode: steps without prompt tokens). Steps scatter around the model
    # (the machine's noise, partial overlaps); a per-step figure such as ITL has that scatter in
    # its percentiles, which the simulator adds back (``LogHistogram.spread``).
    residuals: dict[str, list[float]] = field(default_factory=dict)
    # Per role, terms of its own in place of the ones above (a profile combined from two,
    # ``combine_profiles``: the prefill pool's steps from one deployment, the decode pool's from
    # another); a role without an entry uses the ones above.
    role_terms: dict[str, dict[str, float]] = field(default_factory=dict)

    def step_s(self, role: str, prefill_tokens: int = 0, prefill_attention: float = 0.0, prefill_seqs: int = 0,
               decode_rows: int = 0, decode_kv_tokens: int = 0) -> float:
        terms = self.role_terms.get(role) if self.role_terms else None
        token, attention, seq, row, kv = (
            _TERMS_OF(terms) if terms is not None
            else (self.prefill_token_s, self.prefill_attention_s, self.prefill_seq_s, self.decode_row_s, self.decode_kv_s)
        )
        return (
            self.intercept_s[role] + token * prefill_tokens + attention * prefill_attention + seq * prefill_seqs
            + row * decode_rows + kv * decode_kv_tokens
        )

    def crowding(self, role: str, company: tuple[float, float]) -> float:
        """A step's slow-down for its company: the shares of it during which other workers on its
        machine ran steps of each COMPANY kind (counts of busy workers / others, in the simulator)."""
        factors = self.contention.get(role)
        if not factors:
            return 1.0
        return 1.0 + sum(factors.get(kind, 0.0) * share for kind, share in zip(COMPANY, company))


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
    # Per role, the ranks (devices) of each of its workers: a worker costs that many devices.
    # bytes_per_block counts every rank's share of a block (what a prefill worker's ranks push).
    tensor_parallel_size: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROLES, 1))
    # The model's layers (a pipelined prefill has at most that many stages; 0: not recorded, in
    # profiles before pipelines were simulated) and the bytes of activations one token's rows
    # take from one stage to the next (hidden and residual).
    num_layers: int = 0
    activation_bytes_per_token: int = 0


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
                step=StepTimeModel(**{**data["step"], "contention": _contention_of(data["step"].get("contention", {}))}),
                transfer=TransferModel(**data["transfer"]),
                facts=DeploymentFacts(**_facts_of(data["facts"])),
                ttft_overhead_s=dict(data["ttft_overhead_s"]),
                source=dict(data.get("source", {})),
                samples=dict(data.get("samples", {})),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"profile: {path} is incomplete or malformed: {exc}") from None


def _facts_of(saved: dict) -> dict:
    """A saved profile's facts; one tensor-parallel size (or none, before them) is both pools'."""
    ranks = saved.get("tensor_parallel_size", 1)
    return {**saved, "tensor_parallel_size": dict(ranks) if isinstance(ranks, dict) else dict.fromkeys(ROLES, int(ranks))}


def combine_profiles(prefill: Profile, decode: Profile) -> Profile:
    """A deployment whose prefill pool is ``prefill``'s and decode pool ``decode``'s (each profiled
    with both pools alike, typically at different tensor-parallel sizes): prefill steps, the KV
    write and a remote prompt's overhead as ``prefill`` measured them; decode steps (with the
    prompts decode workers prefill themselves), their KV room and a local prompt's overhead as
    ``decode`` did. The write between two sizes is taken as the prefill side's between its own
    (the same bytes; NIXL's descriptors per block differ by at most two). ValueError where the
    two are not of one model (block size, block bytes)."""
    if (prefill.facts.block_size, prefill.facts.bytes_per_block) != (decode.facts.block_size, decode.facts.bytes_per_block):
        raise ValueError(
            f"profile: the profiles are not of one model (blocks of {prefill.facts.block_size} tokens, {prefill.facts.bytes_per_block} bytes "
            f"against {decode.facts.block_size}, {decode.facts.bytes_per_block})"
        )
    p, d = prefill.step, decode.step
    step = replace(
        d,
        intercept_s=_prefill_entry_from(p.intercept_s, d.intercept_s),
        fit=_prefill_entry_from(p.fit, d.fit),
        contention=_prefill_entry_from(p.contention, d.contention),
        residuals=_prefill_entry_from(p.residuals, d.residuals),
        role_terms={"prefill": {name: getattr(p, name) for name in TERMS}},
    )
    facts = replace(
        decode.facts,
        token_budget=_prefill_entry_from(prefill.facts.token_budget, decode.facts.token_budget),
        chunk_size=_prefill_entry_from(prefill.facts.chunk_size, decode.facts.chunk_size),
        tensor_parallel_size=_prefill_entry_from(prefill.facts.tensor_parallel_size, decode.facts.tensor_parallel_size),
    )
    overheads = {"remote": prefill.ttft_overhead_s["remote"], "local": decode.ttft_overhead_s["local"]}
    return Profile(step, prefill.transfer, facts, overheads, {"prefill_from": prefill.source, "decode_from": decode.source})


def _prefill_entry_from(of_prefill: dict, of_decode: dict) -> dict:
    """A per-role field of a combined profile: the decode side's, with the prefill role's entry
    from the prefill side (where it has one)."""
    return {**of_decode, **({"prefill": of_prefill["prefill"]} if "prefill" in of_prefill else {})}


def _contention_of(saved: dict) -> dict[str, dict[str, float]]:
    """A saved profile's contention; one factor per role (profiles before COMPANY) applies to both kinds."""
    return {role: dict(value) if isinstance(value, dict) else dict.fromkeys(COMPANY, float(value)) for role, value in saved.items()}


def fit_step_model(steps_by_role: dict[str, list[tuple]], overlaps_by_role: dict[str, list[float]] | None = None) -> StepTimeModel:
    """Fit the joint model to steps in ``engine.step_profile.STEP_FIELDS`` order, per role.

    ``overlaps_by_role``: per step, the shares of it during which other workers on its machine
    ran steps of each COMPANY kind (``step_overlaps``). A step's duration is modelled as
    ``terms x crowding`` (``StepTimeModel.crowding``) and both are fitted together on every
    step, alternating until they settle: the terms by non-negative least squares with the
    contention fixed, then each role's contention per kind by least squares with the terms fixed
    (a kind its steps met too rarely takes the factor fitted over both). Errors are relative
    (each step weighs 1 / its predicted duration, from the round before), so 40 ms decode steps
    count as much as 2 s prefill steps, and a step's scatter around the model averages out
    (weighing by 1 / its measured duration instead would fit 2.6% low under +-20% scatter).

    Fitting the terms on the steps that ran alone (what this did first) fails where few do:
    two decode workers sharing a machine decode side by side nearly all the time; 145 of 2,404
    profiled steps ran alone, all small batches, and the terms fitted on them put the steps of a
    later run 9% above the prediction.
    """
    rows, targets, roles, overlaps = [], [], [], []
    for role, steps in steps_by_role.items():
        if role not in ROLES:
            raise ValueError(f"steps: unknown role {role!r}")
        shares = (overlaps_by_role or {}).get(role) or [(0.0, 0.0)] * len(steps)
        for step, share in zip(steps, shares):
            prefill_tokens, attention, seqs, decode_rows, kv_tokens, duration = step[:6]
            rows.append([role == "prefill", role == "decode", prefill_tokens, attention, seqs, decode_rows, kv_tokens])
            targets.append(duration)
            roles.append(role)
            overlaps.append(tuple(share))
    if len(rows) < 2 * len(TERMS):
        raise ValueError(f"steps: {len(rows)} recorded steps are too few to fit a step-time model")
    features = np.asarray(rows, dtype=np.float64)
    durations = np.asarray(targets, dtype=np.float64)
    shares = np.asarray(overlaps, dtype=np.float64).reshape(len(rows), len(COMPANY))
    roles_array = np.asarray(roles)
    weights = 1.0 / np.maximum(durations, 1e-9)
    contention = {role: dict.fromkeys(COMPANY, 0.0) for role in ROLES}

    def crowding() -> np.ndarray:
        factors = np.array([[contention[r][kind] for kind in COMPANY] for r in roles])
        return 1.0 + np.sum(factors * shares, axis=1)

    for _ in range(_CONTENTION_ROUNDS):
        coefficients = _nonnegative_fit(features * (crowding() * weights)[:, None], durations * weights)
        base = features @ np.asarray(coefficients)
        previous = {role: dict(factors) for role, factors in contention.items()}
        for role in ROLES:
            mine = roles_array == role
            contention[role] = _fit_contention(shares[mine], base[mine] * weights[mine], (durations[mine] - base[mine]) * weights[mine])
        predicted = base * crowding()
        new_weights = np.where(predicted > 0, 1.0 / np.maximum(predicted, 1e-9), weights)
        settled = np.max(np.abs((new_weights - weights) * durations)) < 1e-3
        weights = new_weights
        if settled and all(abs(contention[r][k] - previous[r][k]) < 1e-4 for r in ROLES for k in COMPANY):
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


def _fit_contention(shares: np.ndarray, base: np.ndarray, excess: np.ndarray) -> dict[str, float]:
    """One role's factors per COMPANY kind: ``excess = sum(factor x share x base)`` by least
    squares, each in [0, 3]; a kind with fewer than 5 steps mostly in its company shares the
    factor fitted over both kinds (none at all: 0)."""
    columns = shares * base[:, None]
    seen = [int(np.sum(shares[:, k] >= _CROWDED)) >= 5 for k in range(len(COMPANY))]
    if all(seen):
        factors, *_ = np.linalg.lstsq(columns, excess, rcond=None)
        if factors.min() < 0:  # the other kind alone explains the excess
            keep = int(np.argmax(factors))
            factors = np.zeros(len(COMPANY))
            column = columns[:, keep]
            factors[keep] = column @ excess / (column @ column)
        return {kind: float(np.clip(f, 0.0, 3.0)) for kind, f in zip(COMPANY, factors)}
    if not any(seen) and int(np.sum(shares.sum(axis=1) >= _CROWDED)) < 5:
        return dict.fromkeys(COMPANY, 0.0)
    column = columns.sum(axis=1)
    pooled = float(np.clip(column @ excess / (column @ column), 0.0, 3.0))
    factors = dict.fromkeys(COMPANY, pooled)
    if any(seen):  # the kind it did see gets its own fit; the other keeps the pooled one
        k = seen.index(True)
        column = columns[:, k]
        factors[COMPANY[k]] = float(np.clip(column @ excess / (column @ column), 0.0, 3.0))
    return factors


def step_overlaps(batches: list) -> dict[int, list[tuple[float, float]]]:
    """For each worker's step log (index in ``batches``), per step the shares of its interval
    during which other workers on the same node ran steps of each COMPANY kind (with prompt
    tokens; decode rows only)."""
    intervals: dict[int, list[tuple[float, float, int]]] = {
        i: [(step[6] - step[5], step[6], 0 if step[0] > 0 else 1) for step in batch.steps] for i, batch in enumerate(batches)
    }
    shares: dict[int, list[tuple[float, float]]] = {}
    for i, batch in enumerate(batches):
        company = [iv for j, other in enumerate(batches) if j != i and other.node == batch.node for iv in intervals[j]]
        per_kind = [_covered_shares(intervals[i], [(a, b) for a, b, kind in company if kind == k]) for k in range(len(COMPANY))]
        shares[i] = list(zip(*per_kind))
    return shares


def _covered_shares(steps: list[tuple[float, float, int]], others: list[tuple[float, float]]) -> list[float]:
    """For each step (start, end, _), the share of it covered by the union of ``others``."""
    merged: list[list[float]] = []
    for start, end in sorted(others):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    starts = [m[0] for m in merged]
    result = []
    for start, end, _ in steps:
        covered = 0.0
        k = max(0, bisect.bisect_right(starts, start) - 1)
        while k < len(merged) and merged[k][0] < end:
            covered += max(0.0, min(end, merged[k][1]) - max(start, merged[k][0]))
            k += 1
        result.append(covered / (end - start) if end > start else 0.0)
    return result


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
