"""Tensor-parallel workers end to end: real Ray actors in placement groups, gloo groups, NIXL
between ranks of pools with different TP sizes, and a gRPC client; outputs equal transformers'."""

from __future__ import annotations

import time

import pytest
import ray

from router.api.pdserve.v1 import generation_pb2 as pb
from router.config import Disaggregation, RouterConfig
from router.pool import RoutingPolicy
from tests.checkpoints import hf_greedy, random_prompts
from tests.e2e.test_failures import ParallelStreams, _slow_down, _wait_until_every_stream_sent_tokens
from tests.serving import Client, engine_config, kill_during_greedy_burst, running_deployment

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 2), (2, 1), (2, 2)])  # (1, 1): every other e2e test
def test_every_tp_pair_serves_what_transformers_computes(ray_cluster, e2e_model, prefill_tp, decode_tp):
    prompts = random_prompts([90, 37, 5], e2e_model.vocab_size, seed=40 + 10 * prefill_tp + decode_tp)
    expected = [hf_greedy(e2e_model.hf_model, p, 8) for p in prompts]
    router = RouterConfig(disaggregation=Disaggregation.ALWAYS)
    with running_deployment(
        e2e_model, 1, 1, router,
        prefill_engine=engine_config(tensor_parallel_size=prefill_tp),
        decode_engine=engine_config(tensor_parallel_size=decode_tp),
    ) as deployment:
        client = Client(deployment.address)
        for prompt, want in zip(prompts, expected):
            stream = client.generate(prompt_token_ids=prompt, max_tokens=8, temperature=0.0, ignore_eos=True)
            assert stream.token_ids == want, (prefill_tp, decode_tp, len(prompt))
            assert stream.last.prefill_worker_id == "prefill-0"  # the prompt's KV crossed between the pools
        statuses = {w.worker_id: w for w in client.wait_until_idle()}
        assert len(statuses["prefill-0"].rank_nodes) == prefill_tp and len(statuses["decode-0"].rank_nodes) == decode_tp
        # One placement group per worker packs its ranks on one node.
        assert all(len(set(w.rank_nodes)) == 1 and w.rank_nodes[0] == w.node for w in statuses.values())
        assert all(w.num_kv_blocks_used == 0 for w in statuses.values())
        client.close()
        # What the planner's profile reads (cluster/planning/profiler.fit_profile): each worker
        # says its size and one rank's share of a block; its KV writes count every rank's.
        log = ray.get(deployment.handles["prefill-0"].step_profile.remote())
        assert log.engine["tensor_parallel_size"] == prefill_tp
        if prefill_tp == decode_tp:
            blocks = sum(-(-len(p) // 16) for p in prompts)
            assert sum(t.num_bytes for t in log.transfers) == blocks * log.engine["bytes_per_block"] * prefill_tp


def test_a_rank_killed_mid_stream_loses_no_request(ray_cluster, e2e_model):
    """Rank 1 of decode-0 dies while decode-0 streams: the whole worker goes (its rank 0 sees
    the broken group and ends), its streams migrate to decode-1, every output is transformers'
    greedy continuation, and the pool replaces decode-0 with a new worker of two ranks."""
    router = RouterConfig(disaggregation=Disaggregation.ALWAYS, routing_policy=RoutingPolicy.ROUND_ROBIN)
    prompts = random_prompts([40, 60, 80, 100], e2e_model.vocab_size, seed=52)
    num_tokens = 120
    expected = [hf_greedy(e2e_model.hf_model, p, num_tokens) for p in prompts]
    with running_deployment(e2e_model, 1, 2, router, decode_engine=engine_config(tensor_parallel_size=2)) as deployment:
        client = Client(deployment.address)
        _slow_down(deployment, "decode-0")  # its streams are decoding when the rank dies
        requests = [dict(prompt_token_ids=p, max_tokens=num_tokens, temperature=0.0, ignore_eos=True) for p in prompts]
        streams = ParallelStreams(client, requests)
        _wait_until_every_stream_sent_tokens(deployment, len(requests))
        on_victim = {a.req_id for a in deployment.router.dispatcher.active.values() if a.decode.worker_id == "decode-0"}
        victim = deployment.pools.handles["decode-0"]
        (rank_1,) = ray.get(victim.rank_handles.remote())
        ray.kill(rank_1, no_restart=True)
        results = streams.join()
        assert on_victim, "round robin put streams on decode-0"
        assert not [r for r in results if not hasattr(r, "token_ids")], "no stream failed"
        for stream, want in zip(results, expected):
            assert stream.token_ids == want, "no token lost, repeated or changed"
            assert stream.last.finish_reason == pb.FINISH_REASON_LENGTH
        migrated = [s for s in results if s.messages[0].request_id in on_victim]
        assert migrated and all(s.last.decode_worker_id == "decode-1" for s in migrated)
        # The whole worker is replaced: a new decode worker with two ranks serves.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            workers = {w.worker_id: w for w in client.status()}
            fresh = [w for w in workers.values() if w.worker_id not in ("decode-0", "decode-1") and w.role == pb.WORKER_ROLE_DECODE]
            if fresh and fresh[0].state == pb.WORKER_STATE_READY:
                break
            time.sleep(0.2)
        else:
            raise AssertionError("decode-0 was not replaced")
        assert len(fresh[0].rank_nodes) == 2
        survivors = [w for w in client.wait_until_idle() if w.worker_id != "decode-0"]
        assert all(w.num_kv_blocks_used == 0 for w in survivors)
        client.close()


def test_a_prefill_rank_killed_during_a_burst_loses_no_request(ray_cluster, e2e_model):
    """Rank 1 of prefill-0 dies while prefill-0 has prompts in progress: prefill-0 goes whole, its
    prompts are prefilled again on prefill-1 (also of two ranks), every output is transformers'."""
    prompts = random_prompts([700, 650, 600, 550, 500, 450], e2e_model.vocab_size, seed=61)
    expected = [hf_greedy(e2e_model.hf_model, p, 6) for p in prompts]
    router = RouterConfig(disaggregation=Disaggregation.ALWAYS)
    with running_deployment(e2e_model, 2, 1, router, prefill_engine=engine_config(tensor_parallel_size=2)) as deployment:
        client = Client(deployment.address)
        _slow_down(deployment, "prefill-0", 0.05)  # its prompts are in prefill when the rank dies

        def kill_rank_1() -> None:
            (rank_1,) = ray.get(deployment.pools.handles["prefill-0"].rank_handles.remote())
            ray.kill(rank_1, no_restart=True)

        streams, in_progress = kill_during_greedy_burst(client, deployment, prompts, kill_rank_1)
        assert in_progress >= 1000, "the prefill worker whose rank died had prompts in progress"
        for stream, want in zip(streams, expected):
            assert stream.token_ids == want
        assert all(s.last.prefill_worker_id != "prefill-0" for s in streams), "retried on a live worker"
        survivors = [w for w in client.wait_until_idle() if w.worker_id != "prefill-0"]
        assert all(w.num_kv_blocks_used == 0 for w in survivors)
        client.close()
