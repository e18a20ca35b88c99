"""Planning against a real deployment: step logs, the profiling sweep, and the autoscaler acting on the pools."""

from __future__ import annotations

import asyncio
import time

import pytest

from cluster.autoscaler import AutoscalerConfig
from cluster.planning.profile import Profile
from cluster.planning.profiler import SweepPlan, predicted_prefill_s, run_sweep
from router.config import Disaggregation, RouterConfig
from router.pool import Role
from tests.checkpoints import random_prompts
from tests.serving import Client, engine_config, running_deployment


def _step_logs(deployment) -> dict[str, object]:
    import ray

    return {worker_id: ray.get(handle.step_profile.remote()) for worker_id, handle in deployment.handles.items()}


def test_workers_log_every_step_with_the_work_it_did(ray_cluster, e2e_model):
    router = RouterConfig(disaggregation=Disaggregation.AUTO, local_prefill_max_tokens=16)
    with running_deployment(e2e_model, 1, 1, router) as deployment:
        client = Client(deployment.address)
        remote = random_prompts([40, 75], e2e_model.vocab_size, seed=3)
        local = random_prompts([10], e2e_model.vocab_size, seed=4)
        for prompt in remote + local:
            client.generate(prompt_token_ids=prompt, max_tokens=6, ignore_eos=True)
        client.close()
        logs = _step_logs(deployment)
    prefill = next(b for b in logs.values() if b.role == "prefill")
    decode = next(b for b in logs.values() if b.role == "decode")
    # Every prompt token was computed once, on the worker that prefilled it, in chunks of at most the chunk size.
    assert sum(s[0] for s in prefill.steps) == sum(len(p) for p in remote)
    assert sum(s[0] for s in decode.steps) == sum(len(p) for p in local)
    assert all(s[0] <= 32 for s in prefill.steps)  # tests' engine config: chunks of 32
    # Each request decoded its last 5 tokens one per step (the first came with the prefill), each row reading its context.
    assert sum(s[3] for s in decode.steps) == 3 * 5
    assert sum(s[4] for s in decode.steps) == sum(len(p) * 5 + sum(range(1, 6)) for p in remote + local)
    assert all(s[5] > 0 for s in prefill.steps + decode.steps)
    # The prefill worker logged each KV write with its bytes.
    assert sum(t.num_bytes for t in prefill.transfers) == sum(-(-len(p) // 16) for p in remote) * prefill.engine["bytes_per_block"]
    assert prefill.engine["chunk_size"] == 32 and decode.engine["num_blocks"] == 256


@pytest.mark.alone
def test_profile_sweep_fits_a_model_that_predicts_a_lone_request(ray_cluster, e2e_model, tmp_path):
    router = RouterConfig(disaggregation=Disaggregation.AUTO)
    engines = dict(prefill_engine=engine_config(max_num_batched_tokens=128, long_prefill_chunk=None),
                   decode_engine=engine_config(max_num_batched_tokens=128, long_prefill_chunk=None))
    with running_deployment(e2e_model, 1, 1, router, **engines) as deployment:
        profile = asyncio.run(run_sweep(deployment.address, deployment.handles, SweepPlan.quick(), router.local_prefill_max_tokens))
        path = profile.save(tmp_path / "profile.json")
        # A request alone after the sweep: the profile's prediction of its TTFT is close. Five
        # different prompts: a repeated one would hit the prefix caches (CI once measured the hit,
        # prefilled on the decode actor in 5 ms, against the 19 ms predicted for a whole prompt).
        client = Client(deployment.address)
        ttfts = []
        for prompt in random_prompts([150] * 5, e2e_model.vocab_size, seed=9):
            started = time.monotonic()
            stream = client.generate(prompt_token_ids=prompt, max_tokens=2, ignore_eos=True)
            ttfts.append(stream.arrival_times[0] - started)
        client.close()
    loaded = Profile.load(path)
    assert loaded.samples["prefill"] and loaded.samples["decode"] and loaded.samples["transfers"]
    assert loaded.facts.token_budget == {"prefill": 128, "decode": 128} and loaded.facts.decode_num_blocks == 256
    # What a pipelined prefill's stages cost in the simulator: the model's layers, and a token's
    # hidden and residual rows (float32) from one stage to the next.
    config = e2e_model.hf_model.config
    assert loaded.facts.num_layers == config.num_hidden_layers and loaded.facts.activation_bytes_per_token == 2 * config.hidden_size * 4
    step = loaded.step
    # Longer prompts cost more (four chunks against one). Bigger decode batches are not asserted to:
    # on this tiny model a decode row costs less than the steps' scatter, and the fit may rightly
    # put that term at zero (CI saw it); tests/cluster/test_planning.py checks the fit recovers
    # per-row and per-token terms where they exist.
    assert predicted_prefill_s(400, False, step, loaded.transfer, loaded.facts) > predicted_prefill_s(20, False, step, loaded.transfer, loaded.facts)
    # The fastest of the five: the profile predicts a request alone on its workers. The test is
    # marked `alone`: under two test processes the other's tests shared the 2 cores in the sweep
    # or in these requests (CI measured a median of 219 ms against 33 ms predicted, and a
    # fastest of 28 ms against 124 ms predicted).
    measured = min(ttfts)
    predicted = predicted_prefill_s(150, False, step, loaded.transfer, loaded.facts) + loaded.ttft_overhead_s["remote"]
    # Generous: steps of a few ms on a shared 2-core machine, where per-step Python costs and
    # the other actor's work move each step; what matters is the order of magnitude of each term.
    assert measured / 3 <= predicted <= 3 * measured, (predicted, measured)
    # The tiny model's decode steps last 1-2.5 ms and one shape's steps vary 2x: on an AVX2 host
    # the fit's median error stayed under 60%, on an AVX-512 EPYC it is 62% (the same before and
    # after tensor parallelism). The bound says the fit is the right size, not that it is sharp.
    assert step.fit["decode"]["median_abs_error_pct"] < 100


def test_autoscaler_drains_a_prefill_pool_the_plan_does_not_need(ray_cluster, e2e_model, tmp_path):
    # Profile this deployment, then let the autoscaler watch a trickle of requests: the cheapest
    # shape that meets a loose SLO has no prefill worker, so it drains the one there is, and
    # requests keep being served throughout (prefilled by the decode worker).
    router = RouterConfig(disaggregation=Disaggregation.AUTO)
    with running_deployment(e2e_model, 1, 1, router) as deployment:
        profile = asyncio.run(run_sweep(deployment.address, deployment.handles, SweepPlan.quick(), router.local_prefill_max_tokens))
        path = profile.save(tmp_path / "profile.json")
    config = AutoscalerConfig(path, slo_ttft_ms=5000.0, slo_tpot_ms=1000.0, interval_s=0.5, window_s=4.0, max_workers=3,
                              scale_down_delay_s=1.0, min_arrivals=3)
    with running_deployment(e2e_model, 1, 1, router, autoscaler=config) as deployment:
        client = Client(deployment.address)
        prompts = random_prompts([48] * 40, e2e_model.vocab_size, seed=11)
        outputs = []
        deadline = time.monotonic() + 60
        for prompt in prompts:
            outputs.append(client.generate(prompt_token_ids=prompt, max_tokens=4, ignore_eos=True))
            if not deployment.workers(Role.PREFILL) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        client.close()
        decisions = deployment.pools.autoscaler.decisions
        assert deployment.workers(Role.PREFILL) == []
        assert len(deployment.workers(Role.DECODE)) == 1
    assert all(len(s.token_ids) == 4 for s in outputs)
    applied = [d for d in decisions if d.applied is not None]
    assert applied and applied[0].applied == (0, 1)
    assert applied[0].rate > 0
