"""Load: a burst of long prompts against a short lease, a slow prefill and a small decode cache.

Before the lease keeper and the transfer pump, every one of these conditions failed
requests: prompts that waited in the prefill queue longer than the lease ("lease ends in
less than the write timeout"), writes that were not checked while a long step computed
("write not done after ..."), and a full decode cache ("no decode worker has room").
Now none may fail, and every output must still equal transformers'.
"""

from __future__ import annotations

import concurrent.futures
import time

import ray

from kvtransfer.agent import KVTransferConfig
from kvtransfer.leases import LeasePolicy
from router.config import Disaggregation, RouterConfig
from tests.checkpoints import hf_greedy, random_prompts
from tests.serving import Client, engine_config, running_deployment

LEASE_S = 1.5
WRITE_TIMEOUT_S = 0.3
STEP_DELAY_S = 0.4  # each prefill step sleeps longer than the write timeout


def test_a_burst_that_waits_longer_than_the_lease_loses_no_request(ray_cluster, e2e_model):
    lengths = [150 + 17 * i for i in range(14)]  # 150..371 tokens, 3.6k in all
    prompts = random_prompts(lengths, e2e_model.vocab_size, seed=41)
    expected = [hf_greedy(e2e_model.hf_model, p, 3) for p in prompts]
    router = RouterConfig(disaggregation=Disaggregation.ALWAYS, kv_lease_s=LEASE_S, admission_ttft_budget_s=None)
    transfer = KVTransferConfig(lease=LeasePolicy(lease_s=LEASE_S, write_timeout_s=WRITE_TIMEOUT_S, grace_s=0.2))
    # The decode cache holds about seven of these prompts at once: the rest wait for room.
    decode = engine_config(num_kv_blocks=160)
    prefill = engine_config(max_num_batched_tokens=256, long_prefill_chunk=128)
    with running_deployment(
        e2e_model, 1, 1, router, prefill_engine=prefill, decode_engine=decode, transfer=transfer
    ) as deployment:
        ray.get(deployment.handles["prefill-0"].set_step_delay.remote(STEP_DELAY_S))
        client = Client(deployment.address)
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            futures = [
                pool.submit(client.generate, timeout=180, prompt_token_ids=p, max_tokens=3, temperature=0.0, ignore_eos=True)
                for p in prompts
            ]
            streams = [f.result(timeout=200) for f in futures]
        elapsed = time.monotonic() - start
        for stream, want in zip(streams, expected):
            assert stream.token_ids == want
            assert stream.last.finish_reason != 0
        # The burst really outlasted the lease many times over, and waited for decode room.
        assert elapsed > 4 * LEASE_S
        timings = [s.last.timing for s in streams]
        held_ms = [t.prefill_queue_ms + t.prefill_compute_ms for t in timings]
        assert max(held_ms) > 1000 * LEASE_S, f"some reservation outlived its first lease: {held_ms}"
        router_wait_ms = [t.router_queue_ms for t in timings]
        assert max(router_wait_ms) > 1000, f"some request waited at the router for decode room: {router_wait_ms}"
        workers = client.wait_until_idle()
        assert all(w.num_kv_blocks_used == 0 for w in workers)
        client.close()


def test_a_prompt_that_waits_behind_one_long_step_keeps_its_lease(ray_cluster, e2e_model):
    """The prefill actor's engine thread is in one step for longer than a lease: a prompt whose
    submit waits for that step to end (not yet queued in the engine) must not lose its
    reservation meanwhile. The router's renewals reach the actor before the prompt does; they
    are kept and applied when it arrives."""
    prompts = random_prompts([120, 90], e2e_model.vocab_size, seed=43)
    expected = [hf_greedy(e2e_model.hf_model, p, 3) for p in prompts]
    router = RouterConfig(disaggregation=Disaggregation.ALWAYS, kv_lease_s=LEASE_S, admission_ttft_budget_s=None)
    transfer = KVTransferConfig(lease=LeasePolicy(lease_s=LEASE_S, write_timeout_s=WRITE_TIMEOUT_S, grace_s=0.2))
    prefill = engine_config(max_num_batched_tokens=256, long_prefill_chunk=256)
    with running_deployment(e2e_model, 1, 1, router, prefill_engine=prefill, transfer=transfer) as deployment:
        # One step of the first prompt, then a pause four leases long on the engine thread; the
        # second prompt arrives during it, and its own step (no pause) pushes at once after it.
        prefill_actor = deployment.handles["prefill-0"]
        ray.get(prefill_actor.set_step_delay.remote(4 * LEASE_S))
        client = Client(deployment.address)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(client.generate, timeout=60, prompt_token_ids=prompts[0], max_tokens=3, temperature=0.0, ignore_eos=True)
            time.sleep(0.5)  # the first prompt's step has run; the pause has begun
            second = pool.submit(client.generate, timeout=60, prompt_token_ids=prompts[1], max_tokens=3, temperature=0.0, ignore_eos=True)
            time.sleep(0.5)
            ray.get(prefill_actor.set_step_delay.remote(0.0))  # answered by the event loop during the pause
            streams = [first.result(timeout=90), second.result(timeout=90)]
        assert [s.token_ids for s in streams] == expected
        waited_ms = streams[1].last.timing.time_to_first_token_ms
        assert waited_ms > 2000 * LEASE_S, f"the second prompt waited behind the long step: {waited_ms} ms"
        assert all(w.num_kv_blocks_used == 0 for w in client.wait_until_idle())
        client.close()
