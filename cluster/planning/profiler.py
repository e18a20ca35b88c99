"""``pdserve profile``: a profiling sweep against a running deployment, fitted into a ``Profile``.

The sweep sends, through the router's gRPC API like any client:
1. isolated prompts of growing length, one at a time (prefill steps, KV writes of every
   size, and the client-visible overhead beyond the steps: router, Ray calls, streaming);
2. groups of prompts at once (steps that prefill several prompts);
3. batches of concurrent generations of growing size and context (decode steps);
4. short prompts that prefill on the decode worker while it decodes (mixed steps).
Then it reads every worker's step log (``engine.step_profile``) from the start of the sweep
and fits the step-time and transfer models (``cluster.planning.profile``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import platform
import random
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from cluster.bench.client import BenchClient, ClientConfig, RequestRecord
from cluster.bench.metrics import tpot_ms, ttft_ms
from cluster.bench.workloads import BenchRequest, random_token_ids
from cluster.planning.profile import (
    DeploymentFacts, Profile, StepTimeModel, TransferModel, fit_step_model, fit_transfer_model, step_overlaps,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SweepPlan:
    prefill_lengths: list[int] = field(default_factory=lambda: [16, 64, 128, 256, 512, 1024, 1536])
    repeats: int = 3  # isolated prompts per length
    prefill_groups: list[tuple[int, int]] = field(default_factory=lambda: [(8, 64), (4, 256), (2, 768)])  # (prompts at once, length)
    decode_batches: list[int] = field(default_factory=lambda: [1, 8, 20, 32])
    decode_prompt_lens: list[int] = field(default_factory=lambda: [48, 160, 480])  # cycled through a batch
    decode_output_len: int = 48
    mixed_batch: int = 16  # decoding sequences while short prompts prefill beside them
    seed: int = 0

    @classmethod
    def quick(cls) -> "SweepPlan":
        """A small sweep (tests, tiny models): fewer points, shorter prompts."""
        return cls([16, 48, 96, 192], 2, [(4, 48)], [1, 4, 12], [24, 96], 24, 6)


async def run_sweep(address: str, handles: dict[str, object], plan: SweepPlan, local_prefill_max_tokens: int,
                    max_queued_requests: int = 256, source: dict | None = None) -> Profile:
    """Sweep the deployment at ``address`` whose workers are ``handles`` (worker id -> Ray actor)."""
    started_s = time.perf_counter()
    rng = random.Random(plan.seed)
    async with BenchClient(ClientConfig(address, request_id_prefix="profile")) as client:
        limits = await client.model_limits()
        longest = limits.max_context_len - plan.decode_output_len - 2
        lengths = [n for n in plan.prefill_lengths if n <= longest]

        def prompt(length: int, tag: str, max_tokens: int = 2) -> BenchRequest:
            return BenchRequest(max_tokens, random_token_ids(rng, limits, min(length, longest)), tag=tag, prompt_len=min(length, longest))

        await client.warm_up([prompt(32, "warmup", 4), prompt(max(lengths), "warmup", 4)])
        started = await log_positions(handles)  # the warm-up's first steps (lazy inits) are not fitted
        isolated: list[RequestRecord] = []
        for length in lengths:
            for _ in range(plan.repeats):
                result = await client.run([prompt(length, "isolated")], [0.0])
                isolated.extend(result.records)
        for count, length in plan.prefill_groups:
            await client.run([prompt(length, "group") for _ in range(count)], [0.0] * count)
        # A batch's prompts are prefilled one after another: the earlier ones generate longer,
        # so that the whole batch decodes together for decode_output_len steps at the end.
        prefill_s = _prefill_seconds(isolated)
        step_s = None
        for batch in plan.decode_batches:
            lengths = [plan.decode_prompt_lens[i % len(plan.decode_prompt_lens)] for i in range(batch)]
            waits = [sum(prefill_s(n) for n in lengths[i + 1:]) for i in range(batch)]
            outputs = [plan.decode_output_len + (math.ceil(w / step_s) if step_s else 0) for w in waits]
            result = await client.run([prompt(n, "decode", o) for n, o in zip(lengths, outputs)], [0.0] * batch)
            if step_s is None:  # the first batch (of one, by default) measures a decode step
                measured = [v for r in result.records if (v := tpot_ms(r)) is not None]
                step_s = statistics.median(measured) / 1000 if measured else None
        if local_prefill_max_tokens > 0 and plan.mixed_batch > 0:
            decoding = [prompt(plan.decode_prompt_lens[0], "decode", plan.decode_output_len * 2) for _ in range(plan.mixed_batch)]
            short = [prompt(max(1, local_prefill_max_tokens), "mixed") for _ in range(plan.mixed_batch)]
            # The short prompts arrive while the batch decodes, a few steps apart.
            offsets = [0.0] * len(decoding) + [0.5 + 0.3 * i for i in range(len(short))]
            await client.run(decoding + short, offsets)
    failed = [r for r in isolated if not r.ok]
    if failed:
        raise RuntimeError(f"profile: {len(failed)} isolated requests failed, first: {failed[0].error or failed[0].finish_reason}")
    batches = await step_logs_since(handles, started)
    return fit_profile(batches, isolated, local_prefill_max_tokens, max_queued_requests,
                       {**(source or {}), "sweep_s": round(time.perf_counter() - started_s, 1)})


def _prefill_seconds(isolated: list[RequestRecord]):
    """Client TTFT of a prompt alone, as a line fitted to the isolated requests (seconds)."""
    points = [(r.prompt_len, ttft / 1000) for r in isolated if (ttft := ttft_ms(r)) is not None]
    if len(points) < 2:
        return lambda n: 0.0
    slope, intercept = np.polyfit([p for p, _ in points], [t for _, t in points], 1)
    return lambda n: max(0.0, intercept + slope * n)


async def log_positions(handles: dict[str, object]) -> dict[str, tuple[int, int]]:
    """Per worker, how many steps and KV writes its log holds so far (where a reader starts)."""
    batches = await asyncio.gather(*(handle.step_profile.remote(1 << 62, 1 << 62) for handle in handles.values()))
    return {worker_id: (b.num_steps, b.num_transfers) for worker_id, b in zip(handles, batches)}


async def step_logs_since(handles: dict[str, object], positions: dict[str, tuple[int, int]]) -> list:
    """Every worker's ``StepProfileBatch`` of the steps and KV writes after ``positions``."""
    return list(await asyncio.gather(*(handle.step_profile.remote(*positions[worker_id]) for worker_id, handle in handles.items())))


def step_model_check(step: StepTimeModel, batches: list) -> dict[str, dict[str, float]]:
    """How well ``step`` describes steps the workers ran later (their logs, ``batches``): per role,
    the median and 10th/90th percentiles of measured / predicted duration, contention included.

    A profile fits the machine as it was while profiled; a ratio away from 1 on a later run is
    the machine's speed having moved since (shared hosts drift by tens of percent).
    """
    ratios: dict[str, list[float]] = {}
    for batch, shares in zip(batches, step_overlaps(batches).values()):
        for row, company in zip(batch.steps, shares):
            predicted = step.step_s(batch.role, *row[:5]) * step.crowding(batch.role, company)
            if predicted > 0:
                ratios.setdefault(batch.role, []).append(row[5] / predicted)
    return {
        role: {"num_steps": float(len(values)), "median": float(np.median(values)),
               "p10": float(np.percentile(values, 10)), "p90": float(np.percentile(values, 90))}
        for role, values in ratios.items()
    }


def fit_profile(batches: list, isolated: list[RequestRecord], local_prefill_max_tokens: int, max_queued_requests: int = 256,
                source: dict | None = None) -> Profile:
    """Fit the step logs (``StepProfileBatch`` per worker) and the isolated requests' TTFTs."""
    steps: dict[str, list[tuple]] = {"prefill": [], "decode": []}
    overlaps: dict[str, list[tuple[float, float]]] = {"prefill": [], "decode": []}
    transfers = []
    engines: dict[str, dict] = {}
    for batch, shares in zip(batches, step_overlaps(batches).values()):
        steps[batch.role].extend(batch.steps)
        overlaps[batch.role].extend(shares)
        transfers.extend(batch.transfers)
        engines.setdefault(batch.role, batch.engine)
    if "decode" not in engines:
        raise ValueError("profile: the deployment has no decode worker")
    step = fit_step_model({role: s for role, s in steps.items() if s}, overlaps)
    if not steps["prefill"]:
        step.intercept_s["prefill"] = step.intercept_s["decode"]  # no prefill pool: never used
    transfer = fit_transfer_model(transfers)
    decode = engines["decode"]
    prefill = engines.get("prefill", decode)
    # One step-time model fits both pools' steps: their workers must be alike (ranks included).
    ranks = {role: engine.get("tensor_parallel_size", 1) for role, engine in engines.items()}
    if len(set(ranks.values())) > 1:
        raise ValueError(
            f"profile: the pools' workers differ in tensor_parallel_size ({ranks}); profile each size with both pools alike "
            "(`pdserve plan` combines profiles: one pool's from each)"
        )
    facts = DeploymentFacts(
        block_size=decode["block_size"],
        bytes_per_block=decode["bytes_per_block"] * ranks["decode"],
        decode_num_blocks=decode["num_blocks"],
        token_budget={"prefill": prefill["token_budget"], "decode": decode["token_budget"]},
        chunk_size={"prefill": prefill["chunk_size"], "decode": decode["chunk_size"]},
        max_num_seqs=decode["max_num_seqs"],
        local_prefill_max_tokens=local_prefill_max_tokens if "prefill" in engines else 1 << 30,
        max_model_len=decode["max_model_len"],
        tensor_parallel_size=dict.fromkeys(("prefill", "decode"), ranks["decode"]),
        num_layers=decode.get("num_layers", 0),
        activation_bytes_per_token=decode.get("activation_bytes_per_token", 0),
    )
    overheads = ttft_overheads(isolated, step, transfer, facts)
    info = {
        **(source or {}),
        "machine": platform.processor() or platform.machine(),
        "profiled_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "num_steps": {role: len(s) for role, s in steps.items()},
        "num_transfers": len(transfers),
        "num_isolated_requests": len(isolated),
    }
    samples = {**{role: [list(row) for row in rows] for role, rows in steps.items()},
               "overlaps": overlaps,
               "isolated": [[r.prompt_len, not r.prefill_worker_id, ttft_ms(r), r.timing.prefill_compute_ms if r.timing else None]
                            for r in isolated],
               "transfers": [[t.num_bytes, t.num_descriptors, t.duration_s] for t in transfers]}
    return Profile(step, transfer, facts, overheads, info, samples)


def predicted_prefill_s(prompt_len: int, local: bool, step: StepTimeModel, transfer: TransferModel, facts: DeploymentFacts) -> float:
    """An isolated prompt's prefill as the models predict it: its chunks' steps, then (on a
    prefill worker) the write of the blocks the last chunk completed."""
    role = "decode" if local else "prefill"
    per_step = min(facts.token_budget[role], facts.chunk_size[role] or facts.token_budget[role])
    total, computed = 0.0, 0
    while computed < prompt_len:
        chunk = min(per_step, prompt_len - computed)
        total += step.step_s(role, chunk, chunk * (computed + chunk / 2), 1)
        start, computed = computed, computed + chunk
    if not local:
        blocks = -(-prompt_len // facts.block_size) - start // facts.block_size
        total += transfer.transfer_s(blocks * facts.bytes_per_block, 1)
    return total


def ttft_overheads(isolated: list[RequestRecord], step: StepTimeModel, transfer: TransferModel, facts: DeploymentFacts) -> dict[str, float]:
    """What a client waits for a first token beyond the workers' stages, per path, for requests
    that ran alone: client TTFT less the stages the workers timed (prefill queue and compute,
    transfer, decode queue), so the figure does not depend on how well the step model fits.
    Without the workers' timing, less the model's prediction of the prefill."""
    residuals: dict[str, list[float]] = {"remote": [], "local": []}
    for record in isolated:
        measured = ttft_ms(record)
        if measured is None:
            continue
        local = not record.prefill_worker_id
        timing = record.timing
        if timing is not None and timing.prefill_compute_ms > 0:
            stages = timing.prefill_queue_ms + timing.prefill_compute_ms + timing.kv_transfer_ms + timing.decode_queue_ms
            residuals["local" if local else "remote"].append((measured - stages) / 1000)
        else:
            predicted = predicted_prefill_s(record.prompt_len, local, step, transfer, facts)
            residuals["local" if local else "remote"].append(measured / 1000 - predicted)
    medians = {path: max(0.0, statistics.median(values)) for path, values in residuals.items() if values}
    fallback = next(iter(medians.values()), 0.0)
    return {path: medians.get(path, fallback) for path in ("remote", "local")}

