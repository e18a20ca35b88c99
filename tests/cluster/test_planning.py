"""The planning stack without a cluster: fitting, the simulator, the planner, the autoscaler.

The simulator is checked against closed forms (a request alone: its prefill steps, transfer
and decode steps add up; a saturated stage: throughput is its capacity), against itself with
the decode-run shortcut turned off (one event per decode step), and against invariants (every
request completes, every KV block returns).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
from dataclasses import asdict
from dataclasses import replace as dataclasses_replace
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest

from cluster.autoscaler import Autoscaler, AutoscalerConfig, plan_target
from cluster.planning.planner import SLO, Plan, Planner, cheapest
from cluster.planning.profile import DeploymentFacts, Profile, StepTimeModel, TransferModel, combine_profiles, fit_step_model, fit_transfer_model
from cluster.planning.profiler import fit_profile, step_model_check
from cluster.planning.simulator import LogHistogram, PipelineSettings, PoolChange, Simulation, simulate
from cluster.planning.workload import WorkloadModel
from engine.step_profile import StepLog, StepShape, TransferRecord
from router.pipeline import PipelineMode
from router.traffic import TrafficSnapshot, TrafficWindow

BLOCK = 16
TP2 = {"prefill": 2, "decode": 2}


@pytest.fixture
def pdserve_main():
    """``pdserve``'s entry point, called in this process, with the environment restored after:
    where this host holds a Ray token it sets RAY_AUTH_MODE=token for the Ray clients it makes,
    and a Ray instance this test process started later would launch its GCS with token auth
    that its driver, which read the mode when Ray was imported, does not present (CI: every
    later test of the process failed to start Ray with InvalidAuthToken)."""
    from cluster.cli import main

    with mock.patch.dict(os.environ):
        yield main


def make_profile(**facts) -> Profile:
    step = StepTimeModel(
        intercept_s={"prefill": 0.004, "decode": 0.006}, prefill_token_s=0.0012, prefill_attention_s=2e-8, prefill_seq_s=0.0005,
        decode_row_s=0.0008, decode_kv_s=1.5e-6,
    )
    defaults = dict(
        block_size=BLOCK, bytes_per_block=100_000, decode_num_blocks=4000, token_budget={"prefill": 512, "decode": 512},
        chunk_size={"prefill": None, "decode": None}, max_num_seqs=64, local_prefill_max_tokens=32, max_model_len=4096,
    )
    defaults.update(facts)
    return Profile(step, TransferModel(0.002, 1e-9, 5e-6), DeploymentFacts(**defaults), {"remote": 0.010, "local": 0.008})


# -- fitting ------------------------------------------------------------------------------


def test_fit_recovers_the_step_time_model_it_was_generated_from():
    truth = make_profile().step
    rng = random.Random(0)
    steps = {"prefill": [], "decode": []}
    for _ in range(300):
        tokens = rng.randint(1, 512)
        start = rng.randint(0, 2048)
        seqs = rng.randint(1, 4)
        attention = tokens * (start + tokens / 2)
        duration = truth.step_s("prefill", tokens, attention, seqs) * rng.uniform(0.98, 1.02)
        steps["prefill"].append((tokens, attention, seqs, 0, 0, duration))
        rows = rng.randint(1, 64)
        kv = rows * rng.randint(16, 2048)
        local = rng.choice([0, 0, 32])
        local_attention = local * local / 2
        duration = truth.step_s("decode", local, local_attention, 1 if local else 0, rows, kv) * rng.uniform(0.98, 1.02)
        steps["decode"].append((local, local_attention, 1 if local else 0, rows, kv, duration))
    fitted = fit_step_model(steps)
    for name in ("prefill_token_s", "decode_row_s", "decode_kv_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.1), name
    assert fitted.intercept_s["decode"] == pytest.approx(truth.intercept_s["decode"], rel=0.15)
    assert fitted.fit["decode"]["median_abs_error_pct"] < 2.0
    assert all(getattr(fitted, name) >= 0 for name in ("prefill_token_s", "prefill_attention_s", "prefill_seq_s", "decode_row_s", "decode_kv_s"))


def test_fit_separates_contention_by_company_from_the_terms():
    # A decode step beside another worker's decode step took 30% longer, beside its prefill step
    # 10%; a prefill step 40% longer beside either. Steps overlap their company by any share;
    # the terms and the factors are fitted together.
    truth = make_profile().step
    rng = random.Random(1)
    steps, overlaps = {"prefill": [], "decode": []}, {"prefill": [], "decode": []}
    for _ in range(400):
        company = rng.choice([(0.0, 0.0), (1.0, 0.0), (0.0, 1.0), (rng.random(), 0.0), (0.0, rng.random())])
        tokens, start = rng.randint(1, 512), rng.randint(0, 1024)
        attention = tokens * (start + tokens / 2)
        crowding = 1 + 0.4 * sum(company)
        steps["prefill"].append((tokens, attention, 1, 0, 0, truth.step_s("prefill", tokens, attention, 1) * crowding))
        overlaps["prefill"].append(company)
        rows, kv = rng.randint(1, 32), rng.randint(16, 40_000)
        crowding = 1 + 0.1 * company[0] + 0.3 * company[1]
        steps["decode"].append((0, 0.0, 0, rows, kv, truth.step_s("decode", 0, 0, 0, rows, kv) * crowding))
        overlaps["decode"].append(company)
    fitted = fit_step_model(steps, overlaps)
    assert fitted.contention["prefill"] == pytest.approx({"prefill": 0.4, "decode": 0.4}, abs=0.02)
    assert fitted.contention["decode"] == pytest.approx({"prefill": 0.1, "decode": 0.3}, abs=0.02)
    assert fitted.prefill_token_s == pytest.approx(truth.prefill_token_s, rel=0.05)
    assert fitted.fit["decode"]["median_abs_error_pct"] < 1.0
    # Decode steps that only ever ran beside prefill steps: the decode-company factor is the pooled one.
    only_prefill = {role: [c if c[1] == 0 else (0.0, 0.0) for c in companies] for role, companies in overlaps.items()}
    fitted = fit_step_model(steps, only_prefill)
    assert fitted.contention["decode"]["decode"] == pytest.approx(fitted.contention["decode"]["prefill"], rel=1e-9)


def test_profiles_saved_with_one_factor_per_role_still_load(tmp_path):
    profile = make_profile()
    data = profile.to_json()
    data["step"]["contention"] = {"prefill": 0.2, "decode": 0.3}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    assert Profile.load(path).step.contention == {"prefill": {"prefill": 0.2, "decode": 0.2}, "decode": {"prefill": 0.3, "decode": 0.3}}


def test_colocated_workers_slow_each_other_by_the_contention_factor():
    profile = make_profile()
    profile.step.contention = {"prefill": {"prefill": 0.5, "decode": 0.5}, "decode": {"prefill": 0.5, "decode": 0.1}}
    # A decodes while the prefill worker computes B's long prompt: every step of A's runs beside it.
    trace = [(0.0, 64, 30), (0.01, 2000, 2)]

    def tpot_of_first(colocated: bool) -> float:
        simulation = Simulation(profile, 1, 1, colocated=colocated, keep_requests=True)
        simulation.run(trace)
        first = simulation.kept[0]
        assert first.finished < simulation.kept[1].first_token  # A was done before B's prefill ended
        return (first.finished - first.first_token) / (first.output_len - 1)

    assert tpot_of_first(True) == pytest.approx(1.5 * tpot_of_first(False), rel=1e-6)
    # Two decode workers decoding side by side (no prefill pool; short prompts arriving together):
    # their decode steps are slower by the decode-beside-decode factor (the one step of each
    # that overlaps the other's prompt step, by the prefill factor).
    pair = [(0.0, 16, 30), (0.0, 16, 30)]
    side_by_side = Simulation(profile, 0, 2, colocated=True).run(pair)
    apart = Simulation(profile, 0, 2).run(pair)
    assert side_by_side.itl.percentile(50) == pytest.approx(1.1 * apart.itl.percentile(50), rel=0.006)
    assert side_by_side.itl.max == pytest.approx(1.5 * apart.itl.max, rel=0.006)
    # Alone, a request's decode steps see no contention even on a shared machine.
    alone = Simulation(profile, 1, 1, colocated=True).run([(0.0, 64, 20)])
    assert alone.tpot.mean == pytest.approx(simulate(profile, WorkloadModel(trace=[(0.0, 64, 20)]), 1, 1).tpot.mean, rel=0.006)


def test_step_model_check_reports_how_far_the_machine_moved_since_profiling():
    # Decode steps ran 30% slower than profiled. Each prefill step ran inside a decode step on
    # the same node and took what the profile says with its contention: its ratio is 1.
    step = make_profile().step
    step.contention = {"prefill": {"prefill": 0.0, "decode": 0.4}, "decode": {"prefill": 0.0, "decode": 0.0}}
    decode_steps, prefill_steps = [], []
    for i in range(40):
        rows, kv = 32, 32 * (1000 + i)
        decode_s = step.step_s("decode", 0, 0.0, 0, rows, kv) * 1.3
        decode_steps.append((0, 0.0, 0, rows, kv, decode_s, 100.0 + i))
        prefill_s = step.step_s("prefill", 8, 32.0, 1) * 1.4
        assert prefill_s < decode_s / 2
        prefill_steps.append((8, 32.0, 1, 0, 0, prefill_s, 100.0 + i - decode_s / 4))
    batches = [SimpleNamespace(role="decode", node="n1", steps=decode_steps), SimpleNamespace(role="prefill", node="n1", steps=prefill_steps)]
    check = step_model_check(step, batches)
    assert check["decode"]["median"] == pytest.approx(1.3, rel=1e-6)
    assert check["decode"]["num_steps"] == 40
    assert check["prefill"]["median"] == pytest.approx(1.0, rel=1e-6)
    # On another node the prefill steps had no company: predicted without contention, they read 40% slow.
    batches[1].node = "n2"
    assert step_model_check(step, batches)["prefill"]["median"] == pytest.approx(1.4, rel=1e-6)


def test_fit_keeps_the_scatter_of_steps_around_the_model():
    # Decode steps scatter uniformly within +-20% of the model: the fitted residual quantiles say so.
    truth = make_profile().step
    rng = random.Random(2)
    steps = {"prefill": [], "decode": []}
    for _ in range(2000):
        tokens, rows, kv = rng.randint(16, 512), rng.randint(1, 32), rng.randint(100, 30_000)
        steps["prefill"].append((tokens, tokens * tokens / 2, 1, 0, 0, truth.step_s("prefill", tokens, tokens * tokens / 2, 1)))
        steps["decode"].append((0, 0.0, 0, rows, kv, truth.step_s("decode", 0, 0.0, 0, rows, kv) * rng.uniform(0.8, 1.2)))
    fitted = fit_step_model(steps)
    quantiles = fitted.residuals["decode"]
    assert len(quantiles) == 20
    assert quantiles[0] == pytest.approx(0.81, abs=0.02) and quantiles[-1] == pytest.approx(1.19, abs=0.02)
    assert quantiles[10] == pytest.approx(1.01, abs=0.02)
    assert fitted.residuals["prefill"][0] == pytest.approx(1.0, abs=0.01)  # exact steps: no scatter


def test_spread_histogram_is_the_values_times_the_noise():
    rng = random.Random(3)
    values = [rng.uniform(10, 100) for _ in range(5000)]
    factors = [0.8, 0.9, 1.0, 1.1, 1.3]
    histogram = LogHistogram()
    for v in values:
        histogram.add(v)
    spread = histogram.spread(factors)
    exact = np.array([v * f for v in values for f in factors])
    for q in (1, 50, 90, 99):
        assert spread.percentile(q) == pytest.approx(np.percentile(exact, q), rel=0.01)
    assert spread.total == histogram.total
    assert spread.mean == pytest.approx(exact.mean(), rel=1e-6)
    assert histogram.spread([]).percentile(50) == histogram.percentile(50)


def test_step_scatter_widens_itl_percentiles_but_not_tpot():
    profile = make_profile()
    trace = [(0.1 * i, 64, 40) for i in range(50)]
    plain = simulate(profile, WorkloadModel(trace=trace), 1, 2)
    profile.step.residuals = {"decode": [0.8] * 2 + [1.0] * 16 + [1.5] * 2}
    noisy = simulate(profile, WorkloadModel(trace=trace), 1, 2)
    assert noisy.itl.percentile(99) == pytest.approx(1.5 * plain.itl.percentile(99), rel=0.02)
    assert noisy.itl.percentile(50) == pytest.approx(plain.itl.percentile(50), rel=0.01)
    assert noisy.tpot.percentile(99) == plain.tpot.percentile(99)


def test_fit_never_returns_a_negative_cost():
    # Durations that fall with the token count: unconstrained least squares gives a negative
    # per-token cost, which the simulator would extrapolate into negative step times.
    steps = {"prefill": [(n, 0.0, 1, 0, 0, 0.05 - n * 1e-5) for n in range(10, 400, 10)], "decode": [(0, 0.0, 0, 1, 100, 0.01)] * 5}
    fitted = fit_step_model(steps)
    assert fitted.prefill_token_s >= 0
    assert fitted.step_s("prefill", 4000, 0.0, 1) > 0


def test_transfer_fit_and_too_few_steps():
    records = [TransferRecord(n * 100_000, 1 + n % 3, 0.001 + n * 100_000 * 2e-9 + (1 + n % 3) * 1e-5) for n in range(1, 40)]
    model = fit_transfer_model(records)
    assert model.per_byte_s == pytest.approx(2e-9, rel=0.05)
    assert model.transfer_s(10**7, 1) == pytest.approx(0.001 + 0.02 + 1e-5, rel=0.05)
    with pytest.raises(ValueError, match="too few"):
        fit_step_model({"decode": [(0, 0.0, 0, 1, 10, 0.01)]})


def test_profile_round_trips_and_refuses_other_files(tmp_path):
    profile = make_profile(tensor_parallel_size=TP2)
    path = profile.save(tmp_path / "p.json")
    again = Profile.load(path)
    assert again.step.step_s("decode", 0, 0, 0, 8, 800) == profile.step.step_s("decode", 0, 0, 0, 8, 800)
    assert again.facts == profile.facts
    # A profile from before tensor parallelism: one device per worker.
    saved = json.loads(path.read_text())
    del saved["facts"]["tensor_parallel_size"]
    (tmp_path / "old.json").write_text(json.dumps(saved))
    assert Profile.load(tmp_path / "old.json").facts.tensor_parallel_size == {"prefill": 1, "decode": 1}
    (tmp_path / "other.json").write_text('{"format": "something-else"}')
    with pytest.raises(ValueError, match="not a pdserve profile"):
        Profile.load(tmp_path / "other.json")


def test_step_log_keeps_the_latest_steps_and_reads_from_an_index():
    log = StepLog(capacity=4)
    for i in range(6):
        log.record(StepShape(num_prefill_tokens=i), 0.001 * i)
    assert log.num_steps == 6
    assert [s[0] for s in log.steps_since(0)] == [2, 3, 4, 5]  # the two oldest were dropped
    assert [s[0] for s in log.steps_since(4)] == [4, 5]
    assert log.steps_since(6) == []


# -- the simulator ----------------------------------------------------------------------


def test_a_request_alone_takes_its_steps_transfer_and_decode_steps():
    profile = make_profile()
    prompt, output = 1000, 20
    result = simulate(profile, WorkloadModel(trace=[(0.0, prompt, output)]), 1, 1)
    step = profile.step
    # Prefill: a 512-token chunk, then 488 tokens; then the last chunk's blocks travel.
    prefill = step.step_s("prefill", 512, 512 * 256, 1) + step.step_s("prefill", 488, 488 * (512 + 244), 1)
    blocks = math.ceil(prompt / BLOCK) - 512 // BLOCK
    transfer = profile.transfer.transfer_s(blocks * profile.facts.bytes_per_block, 1)
    ttft = profile.ttft_overhead_s["remote"] + prefill + transfer
    assert result.ttft.percentile(50) == pytest.approx(ttft * 1000, rel=0.006)
    # Decode: output - 1 steps, each reading one more KV token than the last.
    decode = sum(step.step_s("decode", 0, 0, 0, 1, prompt + 1 + j) for j in range(output - 1))
    assert result.tpot.percentile(50) == pytest.approx(decode / (output - 1) * 1000, rel=0.006)
    assert result.output_tokens == output
    assert result.completed == 1


def test_a_short_prompt_prefills_on_the_decode_worker():
    profile = make_profile()
    result = simulate(profile, WorkloadModel(trace=[(0.0, 20, 5)]), 1, 1)
    expected = profile.ttft_overhead_s["local"] + profile.step.step_s("decode", 20, 20 * 10, 1)
    assert result.ttft.percentile(50) == pytest.approx(expected * 1000, rel=0.006)


def _stepwise(profile, trace, num_prefill, num_decode):
    simulation = Simulation(profile, num_prefill, num_decode, max_queued_requests=10**6)
    simulation.max_steps_per_run = 1  # one event per decode step: no closed-form runs
    return simulation.run(trace)


@pytest.mark.parametrize("num_prefill,num_decode,num_blocks,output_len", [
    (1, 1, 4000, 40), (2, 3, 4000, 40), (0, 2, 4000, 40),
    # Caches the sequences outgrow: runs end where the blocks run out, and sequences are preempted.
    (1, 1, 300, 120), (2, 3, 150, 200), (0, 2, 200, 120),
])
def test_runs_of_decode_steps_equal_simulating_every_step(num_prefill, num_decode, num_blocks, output_len):
    profile = make_profile(decode_num_blocks=num_blocks)
    trace = list(WorkloadModel(rate=8.0, num_requests=400, input_len=200, output_len=output_len, range_ratio=0.9, seed=3).requests())
    simulation = Simulation(profile, num_prefill, num_decode, max_queued_requests=10**6)
    fast = simulation.run(trace)
    slow = _stepwise(profile, trace, num_prefill, num_decode)
    if num_prefill:  # (aggregated, most steps carry a prompt chunk and are single steps anyway)
        assert fast.num_events < slow.num_events / 3  # the shortcut is what makes days simulable
    for name in ("ttft", "tpot", "e2e"):
        a, b = getattr(fast, name), getattr(slow, name)
        assert a.mean == pytest.approx(b.mean, rel=1e-6), name
        assert a.percentile(99) == pytest.approx(b.percentile(99), rel=1e-6), name
    assert fast.output_tokens == slow.output_tokens == sum(o for _, _, o in trace)
    assert fast.preemptions == slow.preemptions
    assert (fast.preemptions > 0) == (num_blocks < 4000)
    assert all(w.free_blocks == num_blocks for w in simulation.decodes)


@pytest.mark.parametrize("prompt_len,num_prompts,output_len,num_blocks,block_size,budget,chunk", [
    (12, 8, 40, 64, 4, 48, 16),
    (20, 16, 60, 100, 4, 64, 32),
    (40, 12, 80, 120, 8, 128, 64),
])
def test_a_cache_the_batch_outgrows_takes_as_many_steps_as_the_engines_scheduler(
        tmp_path, prompt_len, num_prompts, output_len, num_blocks, block_size, budget, chunk):
    """The reference is the engine itself: its scheduler grows each sequence a block at a time
    and preempts when the blocks run out, and the simulated decode worker must take as many
    steps for the same requests (holding every request's whole length from admission, as the
    simulator did, took 1.3-1.5x as many)."""
    from engine import EngineConfig, LLMEngine, SamplingParams
    from tests.checkpoints import build_checkpoint, random_prompts

    build_checkpoint("llama", tmp_path)
    engine = LLMEngine(str(tmp_path), EngineConfig(num_kv_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=budget,
                                                   long_prefill_chunk=chunk, max_num_seqs=16))
    for i, prompt in enumerate(random_prompts([prompt_len] * num_prompts, 384, seed=3)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
    engine_steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        engine_steps += 1
    assert engine.scheduler.num_preemptions > 0, "the cache must be outgrown"

    step_s = 0.01  # every step alike: the simulated time counts steps
    facts = DeploymentFacts(block_size=block_size, bytes_per_block=1000, decode_num_blocks=num_blocks,
                            token_budget={"prefill": budget, "decode": budget}, chunk_size={"prefill": chunk, "decode": chunk},
                            max_num_seqs=16, local_prefill_max_tokens=4096, max_model_len=4096)
    profile = Profile(StepTimeModel(intercept_s={"prefill": step_s, "decode": step_s}), TransferModel(0.0, 0.0, 0.0), facts,
                      {"remote": 0.0, "local": 0.0})
    result = Simulation(profile, 0, 1).run([(0.0, prompt_len, output_len)] * num_prompts)
    assert result.preemptions > 0
    assert result.duration_s / step_s == pytest.approx(engine_steps, rel=0.08)


def test_a_decode_worker_never_stalls_on_prompts_that_hold_its_cache_part_computed():
    """Prompts part-way through (local ones, or recomputations of preempted sequences) held every
    block, none could take its next chunk, and with nothing decoding the worker waited forever:
    the engine preempts when a step would schedule nothing, and so does the simulated worker."""
    local = make_profile(decode_num_blocks=20, token_budget={"prefill": 128, "decode": 128}, chunk_size={"prefill": 64, "decode": 64},
                         local_prefill_max_tokens=4096)
    remote = make_profile(decode_num_blocks=30, token_budget={"prefill": 512, "decode": 64}, chunk_size={"prefill": None, "decode": 16},
                          local_prefill_max_tokens=0)
    for profile, trace, num_prefill in ((local, [(0.0, 200, 5)] * 2, 0), (remote, [(0.0, 150, 400)] * 6, 1)):
        simulation = Simulation(profile, num_prefill, 1)
        result = simulation.run(trace)
        assert result.completed == len(trace) and result.preemptions > 0
        assert simulation.decodes[0].free_blocks == profile.facts.decode_num_blocks


def test_max_num_seqs_bounds_the_prompts_a_decode_worker_starts():
    """As the engine's waiting queue: a prompt starts only with a seat in the batch."""
    profile = make_profile(local_prefill_max_tokens=4096)
    durations = {}
    for seats in (2, 16):
        result = Simulation(dataclasses_replace(profile, facts=dataclasses_replace(profile.facts, max_num_seqs=seats)), 0, 1).run(
            [(0.0, 30, 200)] * 24)
        assert result.completed == 24
        durations[seats] = result.duration_s
    assert durations[2] > 1.5 * durations[16]


def test_a_lone_sequence_that_fits_the_cache_is_preempted_when_others_hold_it():
    """A reservation holds the cache a short sequence grows into: the engine preempts the lone
    sequence (it recomputes once there is room); it ran on past the cache."""
    profile = make_profile(decode_num_blocks=20, local_prefill_max_tokens=0, bytes_per_block=10**8)  # the reservation's KV lands late
    simulation = Simulation(profile, 1, 1)
    result = simulation.run([(0.0, 16, 200), (0.01, 250, 5)])
    assert result.completed == 2 and result.preemptions > 0
    assert simulation.decodes[0].free_blocks == 20


def test_the_simulated_decode_admission_uses_the_decode_actors_constants():
    from cluster.planning import simulator
    from decode_workers import scheduler

    assert simulator._WATERMARK_FRACTION == scheduler.WATERMARK_FRACTION
    assert simulator._WAITING_PATIENCE_S == scheduler.WAITING_PATIENCE_S


def test_throughput_of_a_saturated_prefill_worker_is_its_capacity():
    profile = make_profile()
    # 512-token prompts: one step each on the prefill worker, far more than it can take.
    step_s = profile.step.step_s("prefill", 512, 512 * 256, 1)
    workload = WorkloadModel(rate=3.0 / step_s, num_requests=600, input_len=512, output_len=2)
    result = simulate(profile, workload, 1, 4, max_queued_requests=10**6)
    assert result.completed == 600
    assert result.request_throughput == pytest.approx(1 / step_s, rel=0.03)


def test_every_block_returns_and_overload_is_refused():
    profile = make_profile(decode_num_blocks=200)
    simulation = Simulation(profile, 1, 2, max_queued_requests=50)
    result = simulation.run(WorkloadModel(rate=200.0, num_requests=2000, input_len=300, output_len=50, range_ratio=0.5).requests())
    assert result.rejected > 0
    assert result.completed + result.rejected == result.num_requests
    assert all(w.free_blocks == 200 and w.num_assigned == 0 and not w.running for w in simulation.decodes)


def test_pool_changes_add_workers_after_startup_and_drain_removed_ones():
    profile = make_profile()
    workload = WorkloadModel(rate=2.0, duration_s=60.0, input_len=256, output_len=32)
    changes = [PoolChange(20.0, 3, 3), PoolChange(40.0, 1, 1)]
    simulation = Simulation(profile, 1, 1, window_s=10.0, worker_startup_s=5.0)
    result = simulation.run(workload.requests(), changes)
    assert result.completed == result.num_requests
    sizes = [(w.num_prefill, w.num_decode) for w in result.windows]
    assert sizes[0] == (1, 1) and sizes[3] == (3, 3) and sizes[5] == (1, 1)
    assert all(w.free_blocks == profile.facts.decode_num_blocks for w in simulation.decodes)
    assert (result.num_prefill, result.num_decode) == (3, 3)  # the largest the pools were
    # Drained workers took no request after the shrink; the new ones took some while up.
    assert len(simulation.decodes) == 3


def test_workers_still_loading_count_in_a_pool_change_that_lands_as_they_come_up():
    """A day's hour that grows decode while it shrinks prefill: the growth lands startup_s
    before the hour, the shrink at the hour, as the new worker comes up. It took the worker
    still loading for one missing and added another: 3 decode workers where the plan said 2."""
    profile = make_profile()
    workload = WorkloadModel(rate=2.0, duration_s=120.0, input_len=256, output_len=32)
    changes = [PoolChange(30.0, 2, 2), PoolChange(60.0, 1, 2), PoolChange(90.0, 1, 1)]
    simulation = Simulation(profile, 2, 1, window_s=30.0, worker_startup_s=30.0)
    result = simulation.run(workload.requests(), changes)
    assert [(w.num_prefill, w.num_decode) for w in result.windows][:4] == [(2, 1), (2, 1), (1, 2), (1, 1)]
    assert len(simulation.decodes) == 2 and result.num_decode == 2
    # A change that shrinks a pool while its new worker loads takes that one back: it never serves.
    quick = Simulation(profile, 1, 1, worker_startup_s=30.0)
    quick.run(WorkloadModel(rate=2.0, duration_s=60.0, input_len=256, output_len=32).requests(),
              [PoolChange(10.0, 1, 2), PoolChange(20.0, 1, 1)])
    assert quick.pool_sizes == (1, 1) and not quick.decodes[1].routable


# -- pipelined prefill --------------------------------------------------------------------

LAYERS = 30
PIPELINED = dict(max_model_len=16384, num_layers=LAYERS, activation_bytes_per_token=2 * 576 * 4)


def _pipeline_ttft_s(profile: Profile, prompt: int, stages: int, decode_stage: bool) -> float:
    """A lone prompt's TTFT through ``stages`` stages, worked out here from the pipeline's rules
    (the router's chunks and layer ranges; a stage computes chunk j once the previous stage's
    activations for it arrived and its own chunk j-1 is done; the KV is ready once every prefill
    stage's layers of the last chunk's blocks landed)."""
    from router.pipeline import balanced_layers, chunk_tokens

    step, transfer, facts = profile.step, profile.transfer, profile.facts
    chunk = chunk_tokens(prompt, stages, 512, facts.block_size)
    chunks = [(start, min(chunk, prompt - start)) for start in range(0, prompt, chunk)]
    shares = [len(r) / LAYERS for r in balanced_layers([1.0] * LAYERS, stages)]
    ready = [0.0] * len(chunks)  # when each chunk's input reaches the stage
    landed = 0.0
    for stage, share in enumerate(shares):
        role = "decode" if decode_stage and stage == stages - 1 else "prefill"
        done, previous = [], 0.0
        for start, tokens in chunks:
            terms = step.step_s(role, tokens, tokens * (start + tokens / 2), 1) - step.intercept_s[role]
            previous = max(previous, ready[len(done)]) + step.intercept_s[role] + share * terms
            done.append(previous)
        hop = [transfer.transfer_s(tokens * facts.activation_bytes_per_token, 1) for _, tokens in chunks]
        ready = [t + h for t, h in zip(done, hop)]
        write = 0.0
        if role == "prefill":
            blocks = -(-prompt // facts.block_size) - chunks[-1][0] // facts.block_size
            write = transfer.transfer_s(int(blocks * facts.bytes_per_block * share), 1)
        landed = max(landed, done[-1] + write)
    return profile.ttft_overhead_s["remote"] + landed


@pytest.mark.parametrize("num_prefill,decode_stage,stages", [(1, PipelineMode.AUTO, 2), (2, PipelineMode.OFF, 2), (3, PipelineMode.AUTO, 4)])
def test_a_lone_long_prompt_is_pipelined_over_the_idle_prefill_workers(num_prefill, decode_stage, stages):
    """As the router plans it: a stage per idle prefill worker (and the idle decode worker, in
    auto), the stages' steps in a pipeline, and the TTFT falling with the stages."""
    profile = make_profile(**PIPELINED)
    prompt = 8000
    simulation = Simulation(profile, num_prefill, 1, keep_requests=True, pipeline=PipelineSettings(decode_stage=decode_stage))
    result = simulation.run([(0.0, prompt, 4)])
    ttft_ms = (simulation.kept[0].first_token - simulation.kept[0].arrival) * 1000
    expected = _pipeline_ttft_s(profile, prompt, stages, decode_stage is PipelineMode.AUTO) * 1000
    assert ttft_ms == pytest.approx(expected, rel=1e-9)
    alone = simulate(profile, WorkloadModel(trace=[(0.0, prompt, 4)]), num_prefill, 1)  # no pipeline: one prefill worker
    assert ttft_ms < alone.ttft.mean * (stages + 1) / (2 * stages)  # about (chunks + stages - 1) / (stages x chunks) of it
    assert result.completed == 1 and result.output_tokens == 4
    assert all(w.queued_tokens == 0 and not w.stage_ready for w in simulation.prefills)
    assert simulation.decodes[0].free_blocks == profile.facts.decode_num_blocks


def test_a_long_prompt_arriving_during_a_pipeline_is_pipelined_behind_it():
    """Both prefill workers carry the first prompt's stages when the second arrives: it goes
    over both too, behind the first stage by stage (each worker serves its oldest stage first).
    So the first prompt's TTFT stays a lone pipeline's (the ordinary path would put the second
    whole onto one of its workers, taking turns with its stage), and the second's first token
    follows the first's by its pipelined share, well under its time on one worker."""
    profile = make_profile(**PIPELINED)
    settings = PipelineSettings(decode_stage=PipelineMode.OFF)
    simulation = Simulation(profile, 2, 1, keep_requests=True, pipeline=settings)
    assert simulation.run([(0.0, 8000, 4), (1.0, 4000, 4)]).completed == 2
    first, second = sorted(simulation.kept, key=lambda q: q.arrival)
    assert len(first.pipeline.stages) == 2 and len(second.pipeline.stages) == 2
    assert first.first_token - first.arrival == pytest.approx(_pipeline_ttft_s(profile, 8000, 2, False), rel=1e-9)
    on_one_worker = simulate(profile, WorkloadModel(trace=[(0.0, 4000, 4)]), 2, 1).ttft.mean / 1000
    assert second.first_token - first.first_token < 0.75 * on_one_worker


def test_auto_pipelines_only_long_prompts_and_every_token_and_block_comes_back():
    profile = make_profile(**PIPELINED)
    auto = PipelineSettings()
    # A prompt under two stages' worth of tokens goes to one worker, as without pipelines.
    short = [(0.0, 1000, 4)]
    assert simulate(profile, WorkloadModel(trace=short), 2, 1, pipeline=auto).ttft.mean == simulate(profile, WorkloadModel(trace=short), 2, 1).ttft.mean
    # Over a busy prefill pool many long prompts take the ordinary path; every request still
    # completes and every queued token and block is given back.
    trace = list(WorkloadModel(rate=3.0, num_requests=300, input_len=1500, output_len=16, range_ratio=0.8, seed=5).requests())
    simulation = Simulation(profile, 3, 2, pipeline=auto, keep_requests=True, max_queued_requests=10**6)
    result = simulation.run(trace)
    pipelined = [q for q in simulation.kept if q.pipeline is not None]
    assert result.completed == 300 and 0 < len(pipelined) < 300
    assert all(len(q.pipeline.stages) >= 2 for q in pipelined)
    assert all(w.queued_tokens == 0 and not w.stage_ready and w.step_stage is None for w in simulation.prefills)
    assert all(w.free_blocks == profile.facts.decode_num_blocks and not w.stage_ready for w in simulation.decodes)
    assert result.output_tokens == sum(o for _, _, o in trace)
    # ``always`` pipelines every remote prompt over the whole pool.
    always = Simulation(profile, 3, 2, pipeline=PipelineSettings(mode=PipelineMode.ALWAYS), keep_requests=True, max_queued_requests=10**6)
    assert always.run(trace).completed == 300 and all(q.pipeline is not None for q in always.kept)


def test_a_plan_counts_on_pipelines_to_meet_a_ttft_only_they_reach():
    """Long prompts, one at a time: one prefill worker per prompt cannot bring a prompt's TTFT
    under the target however many there are; pipelines over two prefill workers and the decode
    worker can (over one and the decode worker they cannot), and the plan says so."""
    profile = make_profile(**PIPELINED)
    mix = WorkloadModel(rate=0.05, num_requests=1, input_len=8000, output_len=8, burstiness=100.0)  # about 20 s apart
    lone = simulate(profile, WorkloadModel(trace=[(0.0, 8000, 8)]), 1, 1).ttft.mean
    slo = SLO(ttft_ms=0.45 * lone, tpot_ms=1000.0, percentile=90)
    common = dict(max_workers=6, min_requests=60, max_requests=60)
    assert not Planner(profile, mix, slo, pipeline=None, **common).plan(0.05).feasible
    plan = Planner(profile, mix, slo, **common).plan(0.05)
    assert plan.feasible and plan.num_prefill >= 2
    assert not Planner(profile, mix, slo, **common).evaluate(0.05, plan.num_prefill - 1, plan.num_decode)[0]


def test_pdserve_simulate_takes_the_deployments_pipeline_settings(tmp_path, capsys, pdserve_main):
    main = pdserve_main
    profile = make_profile(**PIPELINED).save(tmp_path / "p.json")
    workload = tmp_path / "long.yaml"
    workload.write_text("rate: 0.05\nnum_requests: 20\ninput_len: 6000\noutput_len: 8\nburstiness: 100\n")
    ttft = {}
    for mode in ("auto", "off"):
        out = tmp_path / f"{mode}.json"
        assert main(["simulate", "--profile", str(profile), "--workload", str(workload), "--prefill", "2", "--decode", "1",
                     "--prefill-pipeline", mode, "--json", str(out)]) == 0
        ttft[mode] = json.loads(out.read_text())["result"]["ttft_ms"]["p50"]
    assert ttft["auto"] < 0.5 * ttft["off"]  # the default, as `pdserve up`'s: three stages
    capsys.readouterr()
    assert main(["simulate", "--profile", str(profile), "--workload", str(workload), "--prefill", "2", "--decode", "1",
                 "--max-pipeline-stages", "0"]) == 2
    assert "max-pipeline-stages: must be >= 1, got 0" in capsys.readouterr().err


def test_profiles_without_layers_still_simulate_pipelines(tmp_path):
    """A profile from before pipelines were simulated has no layer count: the pool bounds the stages."""
    path = make_profile(**PIPELINED).save(tmp_path / "p.json")
    saved = json.loads(path.read_text())
    for name in ("num_layers", "activation_bytes_per_token"):
        del saved["facts"][name]
    (tmp_path / "old.json").write_text(json.dumps(saved))
    old = Profile.load(tmp_path / "old.json")
    assert (old.facts.num_layers, old.facts.activation_bytes_per_token) == (0, 0)
    simulation = Simulation(old, 2, 1, keep_requests=True, pipeline=PipelineSettings())
    assert simulation.run([(0.0, 4000, 4)]).completed == 1 and len(simulation.kept[0].pipeline.stages) == 3


# -- workloads ----------------------------------------------------------------------------


def test_diurnal_arrivals_follow_the_rate_curve():
    workload = WorkloadModel.from_dict({
        "duration_s": 86_400, "input_len": 100, "output_len": 10,
        "diurnal": {"trough_rate": 0.5, "peak_rate": 4.5, "period_s": 86_400, "peak_at_s": 43_200},
    })
    times = np.array([t for t, _, _ in workload.requests()])
    assert len(times) == pytest.approx(2.5 * 86_400, rel=0.02)  # the mean rate times the day
    night = np.sum(times < 3600)
    noon = np.sum((times >= 41_400) & (times < 45_000))
    assert night == pytest.approx(0.5 * 3600, rel=0.1)
    assert noon == pytest.approx(4.5 * 3600, rel=0.05)


def test_workload_errors_name_the_field():
    with pytest.raises(ValueError, match="workload.rates: unknown field"):
        WorkloadModel.from_dict({"rates": 1, "duration_s": 1})
    with pytest.raises(ValueError, match="workload: give exactly one of duration_s and num_requests"):
        WorkloadModel.from_dict({"rate": 1})
    with pytest.raises(ValueError, match="workload.diurnal"):
        WorkloadModel.from_dict({"duration_s": 1, "diurnal": {"trough_rate": 5, "peak_rate": 1}})


# -- the planner ----------------------------------------------------------------------------


def test_plan_is_the_cheapest_shape_that_meets_the_slo():
    profile = make_profile()
    mix = WorkloadModel(rate=1.0, num_requests=1, input_len=256, output_len=64, range_ratio=0.5)
    slo = SLO(ttft_ms=800.0, tpot_ms=40.0, percentile=90)
    planner = Planner(profile, mix, slo, max_workers=12, min_requests=800, max_requests=1500)
    low, high = planner.plan(2.0), planner.plan(20.0)
    assert low.feasible and high.feasible
    assert high.cost > low.cost
    for plan in (low, high):
        assert slo.met_by(plan.result)
        # No cheaper shape that was simulated meets the SLO.
        cheaper = [c for c in plan.candidates if c.num_prefill + c.num_decode < plan.cost]
        assert not any(c.meets_slo for c in cheaper)
        # One decode worker fewer misses it.
        if plan.num_decode > 1:
            assert not planner.evaluate(plan.rate, plan.num_prefill, plan.num_decode - 1)[0]
    # Prefill workers priced out: the decode workers prefill everything.
    pricey = Planner(profile, mix, slo, max_workers=12, prefill_cost=100.0, min_requests=800, max_requests=1500).plan(2.0)
    assert pricey.num_prefill == 0


def _scaled(profile: Profile, speedup: float, **facts) -> Profile:
    """``profile`` with every step ``speedup`` times faster and other facts (a tensor-parallel size)."""
    step = profile.step
    faster = StepTimeModel({role: s / speedup for role, s in step.intercept_s.items()},
                           *(getattr(step, name) / speedup for name in ("prefill_token_s", "prefill_attention_s", "prefill_seq_s", "decode_row_s", "decode_kv_s")))
    return Profile(faster, profile.transfer, DeploymentFacts(**{**asdict(profile.facts), **facts}), profile.ttft_overhead_s)


def test_a_tensor_parallel_worker_costs_and_counts_its_devices():
    """Workers of size 2 with the same steps: the same shape, at twice the cost and devices; a
    device budget one short of it fits no shape that meets the SLO."""
    mix = WorkloadModel(rate=1.0, num_requests=1, input_len=256, output_len=64, range_ratio=0.5)
    slo = SLO(ttft_ms=800.0, tpot_ms=40.0, percentile=90)
    bounds = dict(max_workers=12, min_requests=800, max_requests=1500)
    single = Planner(make_profile(), mix, slo, **bounds).plan(4.0)
    double = Planner(make_profile(tensor_parallel_size=TP2), mix, slo, **bounds).plan(4.0)
    assert (double.num_prefill, double.num_decode) == (single.num_prefill, single.num_decode)
    assert double.cost == 2 * single.cost and double.num_devices == 2 * single.num_devices == double.to_dict()["num_devices"]
    short = Planner(make_profile(tensor_parallel_size=TP2), mix, slo, max_devices=double.num_devices - 1, **bounds).plan(4.0)
    assert not short.feasible and all((c.num_prefill + c.num_decode) * 2 < double.num_devices for c in short.candidates)


def test_the_cheaper_profile_wins_among_tensor_parallel_sizes():
    """A size-2 worker whose steps are 3x as fast beats two single-device workers; one only
    1.2x as fast does not (each planned on its own, the cheapest plan chosen)."""
    mix = WorkloadModel(rate=1.0, num_requests=1, input_len=256, output_len=64, range_ratio=0.5)
    slo = SLO(ttft_ms=800.0, tpot_ms=40.0, percentile=90)
    bounds = dict(max_workers=24, min_requests=800, max_requests=1500)
    single = Planner(make_profile(), mix, slo, **bounds).plan(4.0)
    fast = Planner(_scaled(make_profile(), 3.0, tensor_parallel_size=TP2), mix, slo, **bounds).plan(4.0)
    slow = Planner(_scaled(make_profile(), 1.2, tensor_parallel_size=TP2), mix, slo, **bounds).plan(4.0)
    assert single.feasible and fast.feasible and slow.feasible
    assert cheapest([single, fast]) is fast and cheapest([single, slow]) is single
    assert cheapest([Plan(4.0, None, None, None, None)]) is None


def test_a_tensor_parallel_profile_counts_every_ranks_share_of_a_block():
    """Workers report one rank's share of a block and their size: the profile's block is every
    rank's (what a prefill worker's ranks push); pools of different sizes are refused."""
    truth = make_profile().step
    rng = random.Random(1)

    def batch(role: str, ranks: int, node: str) -> SimpleNamespace:
        steps, now = [], 1000.0
        for _ in range(120):
            tokens, rows = (rng.randint(16, 512), 0) if role == "prefill" else (0, rng.randint(1, 64))
            kv = rows * rng.randint(16, 2048)
            duration = truth.step_s(role, tokens, tokens * tokens / 2, 1 if tokens else 0, rows, kv)
            now += duration + 0.001
            steps.append((tokens, tokens * tokens / 2, 1 if tokens else 0, rows, kv, duration, now))
        transfers = [TransferRecord(n * 50_000, 2, 0.001 + n * 50_000 * 1e-9) for n in range(1, 30)] if role == "prefill" else []
        engine = {"block_size": BLOCK, "bytes_per_block": 50_000, "num_blocks": 4000, "max_model_len": 4096, "token_budget": 512,
                  "chunk_size": None, "max_num_seqs": 64, "tensor_parallel_size": ranks}
        return SimpleNamespace(role=role, node=node, steps=steps, transfers=transfers, engine=engine)

    profile = fit_profile([batch("prefill", 2, "a"), batch("decode", 2, "b")], [], local_prefill_max_tokens=32)
    assert profile.facts.tensor_parallel_size == TP2 and profile.facts.bytes_per_block == 100_000
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        fit_profile([batch("prefill", 2, "a"), batch("decode", 1, "b")], [], local_prefill_max_tokens=32)


def test_a_combined_profile_takes_each_pool_from_its_own():
    """Prefill steps, the KV write and a remote prompt's overhead from the prefill pool's
    profile; decode steps (local prefill inside them too), KV room and a local prompt's overhead
    from the decode pool's; each pool's size its own; profiles of two models refused."""
    slow, fast = make_profile(), _scaled(make_profile(decode_num_blocks=9000), 3.0, tensor_parallel_size=TP2)
    fast.transfer, fast.ttft_overhead_s = TransferModel(0.001, 5e-10, 1e-6), {"remote": 0.004, "local": 0.003}
    mixed = combine_profiles(fast, slow)
    assert mixed.step.step_s("prefill", 300, 300 * 150.0, 1) == fast.step.step_s("prefill", 300, 300 * 150.0, 1)
    assert mixed.step.step_s("decode", 16, 128.0, 1, 32, 32 * 500) == slow.step.step_s("decode", 16, 128.0, 1, 32, 32 * 500)
    assert mixed.transfer == fast.transfer and mixed.ttft_overhead_s == {"remote": 0.004, "local": 0.008}
    assert mixed.facts.tensor_parallel_size == {"prefill": 2, "decode": 1} and mixed.facts.decode_num_blocks == 4000
    # A prefill-heavy mix: the fast size's prefill pool beside the single-device decode pool is
    # cheaper than either profile alone (the fast size's decode workers cost 2 devices each).
    mix = WorkloadModel(rate=1.0, num_requests=1, input_len=1024, output_len=16, range_ratio=0.5)
    slo = SLO(ttft_ms=2500.0, tpot_ms=80.0, percentile=90)
    bounds = dict(max_workers=32, min_requests=800, max_requests=1500)
    plans = {name: Planner(profile, mix, slo, **bounds).plan(2.0) for name, profile in (("slow", slow), ("fast", fast), ("mixed", mixed))}
    assert all(plan.feasible for plan in plans.values())
    assert cheapest(list(plans.values())) is plans["mixed"], {name: plan.cost for name, plan in plans.items()}
    assert plans["mixed"].num_devices == 2 * plans["mixed"].num_prefill + plans["mixed"].num_decode
    with pytest.raises(ValueError, match="not of one model"):
        combine_profiles(make_profile(bytes_per_block=50_000), slow)


def test_plan_says_when_no_shape_fits():
    planner = Planner(make_profile(), WorkloadModel(rate=1.0, num_requests=1, input_len=256, output_len=64), SLO(1.0, 1.0), max_workers=3)
    assert not planner.plan(5.0).feasible


# -- the autoscaler -------------------------------------------------------------------------


class FakeLoad:
    """A simulated load change: the rate the router would observe, minute by minute."""

    def __init__(self) -> None:
        self.rate = 1.0
        self.now = 0.0
        self.sizes = (1, 1)
        self.applied: list[tuple[float, tuple[int, int]]] = []

    def observe(self, window_s: float) -> TrafficSnapshot:
        arrivals = int(self.rate * window_s)
        return TrafficSnapshot(window_s, arrivals, arrivals, self.rate, 256.0, 64.0, 0.0, 0.0, 0.0)

    async def apply(self, num_prefill: int, num_decode: int) -> None:
        self.sizes = (num_prefill, num_decode)
        self.applied.append((self.now, self.sizes))


def test_autoscaler_follows_a_load_change_with_hysteresis(tmp_path):
    profile = make_profile()
    config = AutoscalerConfig(profile.save(tmp_path / "p.json"), slo_ttft_ms=800.0, slo_tpot_ms=40.0, interval_s=30.0,
                              window_s=60.0, headroom=1.0, max_workers=12, scale_down_delay_s=300.0)
    load = FakeLoad()
    scaler = Autoscaler.from_config(config, load.observe, lambda: load.sizes, load.apply, clock=lambda: load.now)
    scaler.planner.min_requests, scaler.planner.max_requests = 800, 1500
    scaler.in_process = True  # (the controller plans in a worker process; here the fake clock must not move meanwhile)
    high_plan = scaler.planner.plan(20.0)
    low_plan = scaler.planner.plan(1.0)
    load.sizes = (low_plan.num_prefill, low_plan.num_decode)  # sized for the low load it starts with

    async def minutes(rate: float, count: int) -> None:
        load.rate = rate
        for _ in range(count):
            load.now += 30.0
            await scaler.tick()
            await scaler.settle()

    async def scenario() -> None:
        await minutes(1.0, 2)
        start = load.sizes
        await minutes(20.0, 1)  # the load rises twentyfold: grown on the first tick (a pool the plan shrinks keeps its size)
        grown = (max(high_plan.num_prefill, start[0]), max(high_plan.num_decode, start[1]))
        assert load.sizes == grown
        assert sum(load.sizes) > sum(start)
        await minutes(1.0, 4)  # a lull shorter than the delay: nothing shrinks
        await minutes(20.0, 1)
        assert load.sizes == grown
        shrink_from = load.now
        await minutes(1.0, 12)  # a lasting drop: shrunk once, after the delay, by draining
        shrinks = [(t, s) for t, s in load.applied if t > shrink_from]
        assert len(shrinks) == 1
        assert shrinks[0][0] - shrink_from >= config.scale_down_delay_s
        assert sum(load.sizes) < sum(grown)

    asyncio.run(scenario())
    assert len(load.applied) == 2  # one grow, one shrink: the lull did not make it flap


def test_the_autoscaler_plans_with_the_deployments_pipelines(tmp_path):
    """Its simulations pipeline long prompts as the deployment's router does."""
    from router.config import RouterConfig

    config = AutoscalerConfig(make_profile(**PIPELINED).save(tmp_path / "p.json"), slo_ttft_ms=800.0, slo_tpot_ms=40.0)
    load = FakeLoad()
    default = Autoscaler.from_config(config, load.observe, lambda: load.sizes, load.apply)
    assert default.planner.pipeline == PipelineSettings.of(RouterConfig())
    off = Autoscaler.from_config(config, load.observe, lambda: load.sizes, load.apply,
                                 pipeline=PipelineSettings.of(RouterConfig(prefill_pipeline=PipelineMode.OFF, max_pipeline_stages=2)))
    assert off.planner.pipeline.mode is PipelineMode.OFF and off.planner.pipeline.max_stages == 2
    long = WorkloadModel(trace=[(0.0, 8000, 4)])
    ttft = [simulate(s.planner.profile, long, 2, 1, pipeline=s.planner.pipeline).ttft.mean for s in (default, off)]
    assert ttft[0] < 0.5 * ttft[1]


def test_autoscaler_adds_a_worker_to_a_stage_whose_queue_is_long(tmp_path):
    profile = make_profile()
    config = AutoscalerConfig(profile.save(tmp_path / "p.json"), slo_ttft_ms=800.0, slo_tpot_ms=40.0, headroom=1.0)
    scaler = Autoscaler.from_config(config, None, lambda: (1, 1), None)
    scaler.planner.min_requests, scaler.planner.max_requests = 800, 1500
    quiet = TrafficSnapshot(120.0, 120, 120, 1.0, 256.0, 64.0, 0.0, 0.0, 0.0)
    (prefill, decode), _ = scaler.target(quiet, (1, 1))
    queued = TrafficSnapshot(120.0, 120, 120, 1.0, 256.0, 64.0, 0.0, 900.0, 0.0)  # prefill queue p90 beyond half the TTFT target
    (more_prefill, _), reason = scaler.target(queued, (1, 1))
    assert more_prefill == max(prefill, 2)
    assert "prefill queue" in reason
    # Too few arrivals over a whole window to measure the rate: planned for its bound (5 in 120 s),
    # so pools sized for a peak shrink through a night of light traffic (they kept their sizes).
    (light, reason) = scaler.target(TrafficSnapshot(120.0, 2, 2, 0.02, 256.0, 64.0, 0.0, 0.0, 0.0), (3, 4))
    assert light == scaler.target(TrafficSnapshot(120.0, 5, 5, 5 / 120, 256.0, 64.0, 0.0, 0.0, 0.0), (3, 4))[0]
    assert sum(light) < 7 and "at most: 2 arrivals" in reason
    # Nor do a handful of requests' queue times add a worker (one slow request's p90 is noise).
    queued_few = TrafficSnapshot(120.0, 2, 2, 0.02, 256.0, 64.0, 5000.0, 5000.0, 5000.0)
    assert scaler.target(queued_few, (3, 4)) == (light, reason)


def test_a_drain_in_progress_holds_up_no_decision_and_queue_times_are_read_once_settled(tmp_path):
    """A scale-down drains its workers for up to drain_timeout_s: the ticks go on meanwhile (a
    spike during a long drain grew nothing for minutes). A worker added for a long queue is not
    added again until a window has passed: the window's queue times were the old pools'."""
    profile = make_profile()
    config = AutoscalerConfig(profile.save(tmp_path / "p.json"), slo_ttft_ms=800.0, slo_tpot_ms=40.0, interval_s=30.0,
                              window_s=120.0, headroom=1.0, max_workers=12, scale_down_delay_s=0.0)
    now, sizes, draining = [0.0], [(1, 1)], asyncio.Event()
    queued = [0.0]

    def observe(window_s):
        return TrafficSnapshot(window_s, 120, 120, 1.0, 256.0, 64.0, queued[0], 0.0, 0.0)

    async def apply(num_prefill, num_decode):
        if (num_prefill, num_decode) < sizes[0]:
            await draining.wait()  # the drain of a worker with long streams
        sizes[0] = (num_prefill, num_decode)

    scaler = Autoscaler.from_config(config, observe, lambda: sizes[0], apply, clock=lambda: now[0])
    scaler.planner.min_requests, scaler.planner.max_requests = 800, 1500
    scaler.in_process = True
    planned, _ = scaler.target(observe(120.0), (1, 1))

    async def scenario():
        sizes[0] = (planned[0] + 1, planned[1] + 1)  # oversized: the plan shrinks it
        await scaler.tick()  # the shrink's delay starts
        await asyncio.wait_for(scaler.tick(), 5)  # the shrink, returned from while the drain runs
        assert scaler._applying and sizes[0] == (planned[0] + 1, planned[1] + 1)
        draining.set()
        await scaler.settle()
        assert sizes[0] == planned
        queued[0] = 900.0  # the router queue's p90 (waiting for decode room) beyond the budget
        grown = []
        for _ in range(4):
            now[0] += 30.0
            await scaler.tick()
            await scaler.settle()
            grown.append(sizes[0][1])
        return grown

    grown = asyncio.run(scenario())
    # The shrink at t=0 left the queue times unsettled until t=120; then one worker, and no more before t=240.
    assert grown == [planned[1], planned[1], planned[1], planned[1] + 1]


def test_no_traffic_is_judged_on_a_full_window_only():
    """A router up for less than the window (a restarted controller whose clients have not come
    back yet) has seen no traffic for that short span only: the pools keep their sizes."""
    now = [0.0]
    window = TrafficWindow(horizon_s=300.0, clock=lambda: now[0])
    now[0] = 30.0
    config = AutoscalerConfig("unused.json", slo_ttft_ms=800.0, slo_tpot_ms=40.0, window_s=120.0)
    young = window.snapshot(120.0)
    assert young.window_s == 30.0
    assert plan_target(None, config, young, (2, 3)) == ((2, 3), "0 arrivals in the window: too few to plan from")
    now[0] = 200.0
    assert plan_target(None, config, window.snapshot(120.0), (2, 3))[1] == "no traffic"


def test_traffic_window_rates_and_queue_times():
    now = [0.0]
    window = TrafficWindow(horizon_s=300.0, clock=lambda: now[0])
    for i in range(100):
        now[0] = i * 0.5  # 2 per second for 50 s
        window.on_arrival()
        window.on_finished(100 + i, 10, 0.0, float(i), 1.0)
    now[0] = 60.0
    snapshot = window.snapshot(30.0)
    assert snapshot.num_arrivals == 40  # arrivals at 30.0 .. 49.5
    assert snapshot.arrival_rate == pytest.approx(40 / 30.0)
    assert snapshot.prefill_queue_ms_p90 == pytest.approx(np.percentile(range(60, 100), 90))
    now[0] = 1000.0
    assert window.snapshot(30.0).num_arrivals == 0  # forgotten past the horizon


def test_simulated_percentiles_are_taken_like_the_measured_ones():
    # 35 requests, one of them far slower: the scenario's simulated TPOT p99 interpolates between
    # the two largest as the measured one does, instead of the histogram's nearest rank (the largest).
    from cluster.bench.metrics import percentile
    from cluster.bench.scenarios.simulator import simulated_figures

    profile = make_profile()
    trace = [(2.0 * i, 64, 40) for i in range(34)] + [(0.5, 3000, 40)]
    simulation = Simulation(profile, 1, 1, keep_requests=True)
    result = simulation.run(sorted(trace))
    figures = simulated_figures(result, simulation.kept)
    tpots = [(q.finished - q.first_token) * 1000 / (q.output_len - 1) for q in simulation.kept]
    ttfts = [(q.first_token - q.arrival) * 1000 for q in simulation.kept]
    assert figures["tpot_ms"]["p99"] == pytest.approx(percentile(tpots, 99))
    assert figures["ttft_ms"]["p99"] == pytest.approx(percentile(ttfts, 99))
    assert figures["ttft_ms"]["p99"] < 0.9 * result.ttft.percentile(99)  # nearest rank: the slow one itself


def test_pdserve_plan_takes_several_profiles_and_says_which_size_to_run(tmp_path, capsys, pdserve_main):
    main = pdserve_main
    paths = [make_profile().save(tmp_path / "tp1.json"), _scaled(make_profile(), 3.0, tensor_parallel_size=TP2).save(tmp_path / "tp2.json")]
    flags = ["--slo-ttft-ms", "800", "--slo-tpot-ms", "40", "--rate", "4", "--max-workers", "24"]
    assert main(["plan", "--profile", *map(str, paths), *flags, "--out", str(tmp_path / "plan")]) == 0
    written = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert written["decode_profile"] == str(paths[1]) and written["tensor_parallel_size"]["decode"] == 2
    sizes = written["tensor_parallel_size"]
    assert written["num_devices"] == sizes["prefill"] * written["num_prefill"] + 2 * written["num_decode"] and written["cost"] == written["num_devices"]
    out = capsys.readouterr().out
    assert "(tensor-parallel size 2)" in out and "prefill as" in out and str(paths[0]) in out, "each profile and each pairing, planned"
    # One device: no worker of size 2 fits, and one of size 1 does not meet the SLO.
    assert main(["plan", "--profile", *map(str, paths), *flags, "--max-devices", "1"]) == 1
    assert "at most 24 workers and 1 device meets" in capsys.readouterr().out
    assert main(["plan", "--profile", str(paths[0]), *flags, "--max-devices", "0"]) == 2
    assert "max_devices: must be >= 1" in capsys.readouterr().err


def test_the_autoscaler_needs_the_one_router_that_sees_all_the_traffic(tmp_path):
    """Router replicas each see only the connections they took: an autoscaler planning from the
    managing router's share under-provisioned (and with no traffic there, shrank to its minimums)."""
    from cluster.config import ConfigError, load_config

    profile = make_profile().save(tmp_path / "p.json")
    enabled = {"autoscaler.enabled": True, "autoscaler.profile": str(profile)}
    assert load_config(None, enabled).to_spec().autoscaler is not None
    with pytest.raises(ConfigError, match="autoscaler.enabled: needs router.replicas 1"):
        load_config(None, {**enabled, "router.replicas": 2})


def test_while_a_change_applies_the_pools_are_taken_at_the_size_asked_for(tmp_path):
    """A scale-up's workers become routable minutes after it was asked for (model loads). Taken at
    their routable count meanwhile, a plan that dipped below the size asked for looked like
    growth and was applied at once, draining a worker as soon as the launch landed, past
    scale_down_delay_s."""
    config = AutoscalerConfig(make_profile().save(tmp_path / "p.json"), slo_ttft_ms=800.0, slo_tpot_ms=40.0,
                              interval_s=30.0, window_s=60.0, scale_down_delay_s=300.0)
    now, ready, applied, launched = [0.0], [(1, 2)], [], asyncio.Event()

    async def apply(num_prefill, num_decode):
        applied.append((num_prefill, num_decode))
        await launched.wait()  # the new workers load their model
        ready[0] = (num_prefill, num_decode)

    traffic = TrafficSnapshot(60.0, 60, 60, 1.0, 256.0, 64.0, 0.0, 0.0, 0.0)
    scaler = Autoscaler.from_config(config, lambda window_s: traffic, lambda: ready[0], apply, clock=lambda: now[0])
    scaler.in_process = True
    plans = [(1, 4), (1, 3), (1, 3)]
    scaler.plan = lambda snapshot, current, settled: (plans[0], plans.pop(0), "test")

    async def scenario():
        await scaler.tick()  # grow to 4 decode workers: the launch takes a while
        await asyncio.sleep(0)
        now[0] += 30.0
        await scaler.tick()  # a dip to 3: a shrink (its delay starts), not growth from the 2 ready
        await asyncio.sleep(0)
        launched.set()
        await scaler.settle()
        now[0] += 30.0
        await scaler.tick()  # still within scale_down_delay_s
        await scaler.settle()

    asyncio.run(scenario())
    assert applied == [(1, 4)] and ready[0] == (1, 4)


def test_the_worker_cap_never_takes_a_pool_below_its_minimum():
    """A plan of (4, 4) with min_decode 5 and 8 workers at most: decode rose to 5, then the cap
    took it back to 4, below its minimum. Prefill gives way instead."""
    from dataclasses import dataclass

    @dataclass
    class FixedPlanner:
        mix: object = None

        def plan(self, rate):
            return SimpleNamespace(feasible=True, num_prefill=4, num_decode=4)

    config = AutoscalerConfig("unused.json", slo_ttft_ms=800.0, slo_tpot_ms=40.0, max_workers=8, min_decode=5)
    busy = TrafficSnapshot(120.0, 120, 0, 1.0, 256.0, 64.0, 0.0, 0.0, 0.0)
    assert plan_target(FixedPlanner(), config, busy, (4, 4))[0] == (3, 5)


def test_a_window_longer_than_the_routers_history_is_refused():
    """The router keeps 900 s of traffic: a 1,800 s window divided 900 s of arrivals by 1,800
    (half the rate), and the pools were planned for half the load."""
    from cluster.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="autoscaler.window_s"):
        load_config(None, {"autoscaler.window_s": 1800.0})


def test_a_request_longer_than_a_decode_cache_whose_prompt_fits_is_served_as_the_router_serves_it():
    """The router reserves a prompt's blocks (and one token's), so it admits a request whose
    answer will outgrow the cache (its cache preempts and recomputes); the simulator refused it,
    and a workload with such requests met no SLO with any number of workers."""
    profile = make_profile(decode_num_blocks=20)  # 320 tokens of KV per decode worker
    simulation = Simulation(profile, 1, 1, max_queued_requests=50)
    result = simulation.run(WorkloadModel(rate=1.0, num_requests=4, input_len=200, output_len=400).requests())
    assert (result.rejected, result.completed) == (0, 4)
    assert all(w.free_blocks == 20 for w in simulation.decodes)
    too_long = Simulation(profile, 1, 1, max_queued_requests=50).run(WorkloadModel(rate=1.0, num_requests=2, input_len=330, output_len=4).requests())
    assert too_long.rejected == 2, "a prompt no decode worker can hold is still refused"


def test_a_pool_is_not_shrunk_while_a_change_still_lands():
    """A worker the queue correction added was judged by the ticks while it still loaded (they
    plan without the correction): the shrink's delay ran from the next tick, and a worker whose
    model loaded for longer than scale_down_delay_s was drained as it arrived. The delay now
    starts once the pools have settled."""
    now = [0.0]
    config = AutoscalerConfig("unused.json", slo_ttft_ms=800.0, slo_tpot_ms=40.0, scale_down_delay_s=300.0)
    scaler = Autoscaler(config, None, None, lambda: (1, 2), None, clock=lambda: now[0])
    assert scaler._with_hysteresis((1, 1), (1, 2), settled=False) is None
    now[0] += 1000.0  # still loading, or its window not over
    assert scaler._with_hysteresis((1, 1), (1, 2), settled=False) is None
    assert scaler._with_hysteresis((1, 1), (1, 2), settled=True) is None  # the delay starts now
    now[0] += 299.0
    assert scaler._with_hysteresis((1, 1), (1, 2), settled=True) is None
    now[0] += 1.0
    assert scaler._with_hysteresis((1, 1), (1, 2), settled=True) == (1, 1)


def test_a_worker_the_queue_correction_added_stays_while_the_load_does(tmp_path):
    """The plan alone left the decode pool short (its queue long), so the correction added a
    worker; with the queue gone the plan alone asked for one fewer and drained it, the queue
    grew back, and a worker came and went every scale_down_delay_s. It stays now, until the
    load falls below the one it was added at."""
    profile = make_profile()
    config = AutoscalerConfig(profile.save(tmp_path / "p.json"), slo_ttft_ms=800.0, slo_tpot_ms=40.0, interval_s=30.0,
                              window_s=120.0, headroom=1.0, max_workers=12, scale_down_delay_s=60.0)
    now, rate, queued = [0.0], [4.0], [0.0]

    def observe(window_s):
        return TrafficSnapshot(window_s, int(rate[0] * window_s), int(rate[0] * window_s), rate[0], 256.0, 64.0, queued[0], 0.0, 0.0)

    sizes = [(0, 0)]

    async def apply(num_prefill, num_decode):
        sizes[0] = (num_prefill, num_decode)

    scaler = Autoscaler.from_config(config, observe, lambda: sizes[0], apply, clock=lambda: now[0])
    scaler.planner.min_requests, scaler.planner.max_requests = 800, 1500
    scaler.in_process = True
    busy_plan = scaler.target(observe(120.0), (0, 0))[0]
    rate[0] = 1.0
    quiet_plan = scaler.target(observe(120.0), (0, 0))[0]
    assert quiet_plan[1] < busy_plan[1]
    rate[0] = 4.0
    sizes[0] = busy_plan

    async def minutes(count: int) -> list[int]:
        seen = []
        for _ in range(count):  # a tick a minute
            now[0] += 60.0
            await scaler.tick()
            await scaler.settle()
            seen.append(sizes[0][1])
        return seen

    async def scenario():
        queued[0] = 900.0  # the router queue's p90 (waiting for decode room) beyond half the TTFT target
        await minutes(1)
        assert sizes[0][1] == busy_plan[1] + 1
        queued[0] = 0.0  # the worker it added served the queue away
        assert set(await minutes(6)) == {busy_plan[1] + 1}  # kept, at the same load
        rate[0] = 1.0
        assert (await minutes(4))[-1] == quiet_plan[1]  # a lasting drop: drained to the plan

    asyncio.run(scenario())


def test_random_small_deployments_finish_every_request_return_every_block_and_match_stepping():
    """Small caches, batches and budgets in random mixes (local and remote prompts, pipelines,
    pool changes, contention, each routing policy): every request ends, every block comes back,
    and runs of decode steps equal simulating every step."""
    from router.pool import RoutingPolicy

    rng = random.Random(7)
    for case in range(300):
        block_size, budget = rng.choice([4, 8, 16]), rng.choice([32, 64, 128, 512])
        num_blocks, chunk = rng.choice([8, 12, 20, 30, 50, 80]), rng.choice([None, 16, 32, 64])
        num_prefill, num_decode = rng.choice([0, 1, 2, 3]), rng.choice([1, 2, 3])
        contended = rng.random() < 0.3
        profile = make_profile(decode_num_blocks=num_blocks, block_size=block_size, token_budget={"prefill": budget, "decode": budget},
                               chunk_size={"prefill": chunk, "decode": chunk}, local_prefill_max_tokens=rng.choice([0, 8, 32, 64]),
                               max_num_seqs=rng.choice([2, 4, 64]), num_layers=8, activation_bytes_per_token=1000)
        if contended:
            profile.step = dataclasses_replace(profile.step, contention={"prefill": {"prefill": 0.3, "decode": 0.1}, "decode": {"prefill": 0.5, "decode": 0.2}})
        options = dict(colocated=contended, worker_startup_s=0.2, routing_policy=rng.choice(list(RoutingPolicy)),
                       pipeline=PipelineSettings(PipelineMode.AUTO, 3, 16, 16) if num_prefill >= 2 and rng.random() < 0.3 else None)
        changes = [PoolChange(rng.uniform(0, 1), rng.choice([0, 1, 2]) if num_prefill else 0, rng.choice([1, 2, 3]))] if rng.random() < 0.3 else []
        now, trace = 0.0, []
        rate, longest, outputs = rng.choice([5, 50, 500]), min(num_blocks * block_size - 1, 200), rng.choice([5, 40, 150])
        for _ in range(rng.choice([5, 20, 40])):
            now += rng.expovariate(rate)
            trace.append((now, rng.randint(1, longest), rng.randint(1, outputs)))
        results = []
        for stepping in (None, 1):
            simulation = Simulation(profile, num_prefill, num_decode, max_queued_requests=10**6, **options)
            simulation.max_steps_per_run = stepping
            result = simulation.run(trace, changes)
            assert result.completed + result.rejected == result.num_requests, case
            assert all(w.free_blocks == num_blocks for w in simulation.decodes), case
            results.append(result)
        fast, slow = results
        assert (fast.preemptions, fast.output_tokens, fast.completed) == (slow.preemptions, slow.output_tokens, slow.completed), case
        for name in ("ttft", "tpot", "e2e"):
            a, b = getattr(fast, name).mean, getattr(slow, name).mean
            assert (a is None and b is None) or a == pytest.approx(b, rel=1e-6), (case, name)


def test_a_kept_correction_is_a_size_not_an_offset_and_a_lull_lets_it_go(tmp_path):
    """From the review of the kept corrections: a pool grown from a size the hysteresis still
    held (6, where the plan said 2) kept the whole surplus as an offset (a later plan of 6 became
    11); a correction made at the pool's minimum could never go (the plan cannot get smaller
    than the minimum), not even with no traffic; and one tick's plan one smaller (the mean
    lengths it read) dropped it for good."""
    config = AutoscalerConfig(make_profile().save(tmp_path / "p.json"), slo_ttft_ms=800.0, slo_tpot_ms=40.0, max_workers=16,
                              scale_down_delay_s=300.0)
    now = [0.0]
    scaler = Autoscaler.from_config(config, None, lambda: (1, 1), None, clock=lambda: now[0])
    corrected, _ = scaler._keep_corrections((7, 1), (2, 1), "queue", rate=4.0)
    assert corrected == (7, 1)
    assert scaler._keep_corrections((6, 1), (6, 1), "plan", rate=5.0)[0] == (7, 1)
    assert scaler._keep_corrections((1, 1), (1, 1), "plan", rate=5.0)[0] == (7, 1)  # a plan one smaller (a tick's noise): kept
    assert scaler._keep_corrections((1, 1), (1, 1), "plan", rate=2.9)[0] == (1, 1)  # a quarter less traffic than at the correction
    scaler._keep_corrections((7, 1), (6, 1), "queue", rate=4.0)
    assert scaler._keep_corrections((5, 1), (5, 1), "plan", rate=4.0)[0] == (7, 1)
    # Two smaller: one tick's reading (one high, the next low) keeps it; lasting
    # scale_down_delay_s, lighter requests at that rate let it go.
    assert scaler._keep_corrections((4, 1), (4, 1), "plan", rate=4.0)[0] == (7, 1)
    now[0] += 100.0
    assert scaler._keep_corrections((5, 1), (5, 1), "plan", rate=4.0)[0] == (7, 1)
    now[0] += 100.0
    assert scaler._keep_corrections((4, 1), (4, 1), "plan", rate=4.0)[0] == (7, 1)
    # Ticks with no plan (no shape meets the SLO: heavy load) between two lighter ones: no lasting lightness.
    scaler._keep_corrections((7, 1), (6, 1), "queue", rate=4.0)
    assert scaler._keep_corrections((4, 1), (4, 1), "plan", rate=4.0)[0] == (7, 1)
    now[0] += 330.0
    assert scaler._keep_corrections((7, 1), None, "no shape meets the SLO", rate=4.0)[0] == (7, 1)
    assert scaler._keep_corrections((4, 1), (4, 1), "plan", rate=4.0)[0] == (7, 1)
    now[0] += 300.0
    assert scaler._keep_corrections((4, 1), (4, 1), "plan", rate=4.0)[0] == (4, 1)
    # Growth keeps to max_workers: current (10, 6) and a plan of (8, 8) came out 18 of 16.
    assert scaler._with_hysteresis((8, 8), (10, 6)) == (8, 8)
    at_minimum = Autoscaler.from_config(config, None, lambda: (0, 1), None, clock=lambda: now[0])
    at_minimum._keep_corrections((0, 2), (0, 1), "queue", rate=2.0)
    assert at_minimum._keep_corrections((0, 1), (0, 1), "plan", rate=1.9)[0] == (0, 2)
    assert at_minimum._keep_corrections((0, 1), (0, 1), "no traffic", rate=0.0)[0] == (0, 1)


def test_a_plan_that_moves_workers_between_pools_at_max_workers_gets_there(tmp_path):
    """At the cap, a plan growing one pool and shrinking the other: the growth's room comes from
    the pool the plan shrinks, down to its plan. It was trimmed by size ((10, 6) and a plan of
    (4, 10) within 16 gave (8, 8)), and each later tick asked (8, 8) again: decode never reached
    its plan and prefill never shrank."""
    config = AutoscalerConfig(make_profile().save(tmp_path / "p.json"), slo_ttft_ms=800.0, slo_tpot_ms=40.0,
                              max_workers=16, scale_down_delay_s=0.0)
    now = [0.0]
    scaler = Autoscaler.from_config(config, None, lambda: (10, 6), None, clock=lambda: now[0])
    assert scaler._with_hysteresis((4, 10), (10, 6), settled=False) is None  # a change still lands: no move yet
    assert scaler._with_hysteresis((4, 10), (10, 6)) == (6, 10)
    assert scaler._with_hysteresis((4, 10), (6, 10)) is None  # a shrink: after its delay
    now[0] += 1.0
    assert scaler._with_hysteresis((4, 10), (6, 10)) == (4, 10)


def test_an_overload_no_shape_meets_scales_to_the_shape_that_comes_closest(tmp_path):
    """No shape within max_workers meets the SLO at the load: the pools were kept as they were
    and grew a worker a window through the queue correction (a spike from (1, 1) took a quarter
    of an hour to reach the cap). They go to the shape the planner found closest now."""
    config = AutoscalerConfig(make_profile().save(tmp_path / "p.json"), slo_ttft_ms=800.0, slo_tpot_ms=40.0,
                              headroom=1.0, max_workers=4)
    scaler = Autoscaler.from_config(config, None, lambda: (1, 1), None)
    scaler.planner.min_requests, scaler.planner.max_requests = 400, 600
    spike = TrafficSnapshot(120.0, 6000, 6000, 50.0, 256.0, 64.0, 0.0, 0.0, 0.0)
    assert not scaler.planner.plan(50.0).feasible
    (prefill, decode), reason = scaler.target(spike, (1, 1))
    closest = scaler.planner.closest(scaler.planner.plan(50.0))
    from cluster.autoscaler import _within_cap

    assert (prefill, decode) == _within_cap(max(closest.num_prefill, 1), max(closest.num_decode, 1), config) and prefill + decode > 2
    assert "the closest" in reason
    # At the cap already, overload moves no worker between the pools (capacity lost while they load).
    assert scaler.target(spike, (2, 2))[0] == (2, 2)


def test_a_trace_is_planned_for_with_its_own_lengths_and_rate():
    """A trace given to the planner (pdserve plan --workload trace.json) lost its requests: the
    sweep's workload refused it for giving no duration, or, with num_requests, planned for the
    default 256-token prompts; --rate defaulted to 1 req/s, not the trace's."""
    trace = [(0.5 * i, 2500 if i % 2 else 1500, 8) for i in range(40)]  # 2 req/s, prompts of 1500 and 2500 tokens
    mix = WorkloadModel(trace=trace)
    assert mix.trace_rate == pytest.approx(2.0)
    planner = Planner(make_profile(), mix, SLO(800.0, 40.0), max_workers=4, min_requests=60, max_requests=60)
    swept = planner.workload_at(3.0)
    lengths = {(p, o) for _, p, o in swept.requests()}
    assert lengths == {(1500, 8), (2500, 8)}
    assert swept.mean_input_len == pytest.approx(2000.0)
    assert WorkloadModel.from_dict(swept.to_dict()).lengths == swept.lengths
    assert planner.plan(2.0).candidates  # it plans


def test_a_deployment_that_never_disaggregates_is_planned_without_prefill_workers(tmp_path):
    """router.disaggregation: never, so the decode workers prefill every prompt: the plan could
    add prefill workers, which got no prompt, and size decode as if prompts went to them."""
    config = AutoscalerConfig(make_profile().save(tmp_path / "p.json"), slo_ttft_ms=800.0, slo_tpot_ms=40.0, headroom=1.0, max_workers=8)
    scaler = Autoscaler.from_config(config, None, lambda: (1, 1), None, aggregated=True)
    scaler.planner.min_requests, scaler.planner.max_requests = 400, 600
    for rate in (1.0, 5.0, 20.0):
        plan = scaler.planner.plan(rate)
        assert all(candidate.num_prefill == 0 for candidate in plan.candidates)
        assert not plan.feasible or plan.num_prefill == 0


def test_step_log_reads_while_steps_are_recorded_return_each_step_once():
    """The engine thread records while the worker's loop reads (step_profile): successive reads
    from the index each returned must add up to every step exactly once."""
    import threading

    log = StepLog(capacity=10_000)
    total = 3_000

    def record():
        for i in range(total):
            log.record(StepShape(num_prefill_tokens=i), 0.0)

    recorder = threading.Thread(target=record)
    recorder.start()
    seen, since = [], 0
    while recorder.is_alive() or since < total:
        since, steps, _, _ = log.read(since, 0)
        seen += [s[0] for s in steps]
        threading.Event().wait(0.0005)
    recorder.join()
    assert seen == list(range(total))
