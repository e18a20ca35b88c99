"""Prefix caching through the whole disaggregated path (real actors, NIXL, gRPC).

A prompt that repeats a prefix is computed only past what the prefill actor's cache holds,
and only the blocks the decode actor's cache lacks are pushed; the output is still
transformers' token for token, and usage and timing say what was saved.
"""

from __future__ import annotations

import time
import urllib.request

import pytest

from router.config import Disaggregation, RouterConfig
from router.metrics import Metrics
from tests.checkpoints import hf_greedy, random_prompts
from tests.serving import Client, engine_config, running_deployment

BLOCK = 16
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def prompts(e2e_model):
    base, s1, s2 = random_prompts([100, 10, 12], e2e_model.vocab_size, seed=77)
    first, second = base + s1, base + s2  # 110 and 112 tokens: 7 blocks each, 6 of them shared
    return [(p, hf_greedy(e2e_model.hf_model, p, MAX_TOKENS)) for p in (first, second)]


@pytest.mark.parametrize("prefill_cache, decode_cache", [(True, True), (False, True), (True, False)])
def test_a_repeated_prefix_is_computed_and_pushed_only_where_a_cache_lacks_it(ray_cluster, e2e_model, prompts, prefill_cache, decode_cache):
    router = RouterConfig(disaggregation=Disaggregation.ALWAYS)
    metrics = Metrics("tiny")
    with running_deployment(
        e2e_model, 1, 1, router, metrics=metrics, health_interval_s=0.2,
        prefill_engine=engine_config(enable_prefix_caching=prefill_cache),
        decode_engine=engine_config(enable_prefix_caching=decode_cache),
    ) as deployment:
        port = metrics.serve(0)
        client = Client(deployment.address)
        (first, want1), (second, want2) = prompts
        one = client.generate(prompt_token_ids=first, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        two = client.generate(prompt_token_ids=second, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        assert one.token_ids == want1 and two.token_ids == want2
        assert one.last.prefill_worker_id and two.last.prefill_worker_id, "both went through the prefill actor"

        assert one.last.usage.cached_prompt_tokens == 0
        assert one.last.timing.prompt_tokens_computed == len(first)
        block_bytes = one.last.timing.kv_bytes_transferred // 7
        assert block_bytes > 0 and one.last.timing.kv_bytes_transferred == 7 * block_bytes

        shared = 6 * BLOCK
        assert two.last.usage.cached_prompt_tokens == (shared if prefill_cache else 0)
        assert two.last.timing.prompt_tokens_computed == len(second) - (shared if prefill_cache else 0)
        assert two.last.timing.kv_bytes_transferred == (1 if decode_cache else 7) * block_bytes

        for worker in client.wait_until_idle():
            assert worker.num_kv_blocks_used == 0, f"{worker.worker_id} leaked KV blocks"
        time.sleep(0.6)  # a health-loop refresh of the per-worker series
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        client.close()
    for role, cached in (("prefill", prefill_cache), ("decode", decode_cache)):
        labels = f'model_name="tiny",role="{role}",worker_id="{role}-0"'
        hits = _value(text, f"pdserve:prefix_cache_hits_total{{{labels}}}")
        queries = _value(text, f"pdserve:prefix_cache_queries_total{{{labels}}}")
        assert hits == (shared if cached else 0), role
        assert queries == (len(first) + len(second) if cached else 0), role
        if cached:
            assert _value(text, f"pdserve:prefix_cache_hit_rate{{{labels}}}") == pytest.approx(shared / queries)


def _value(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rpartition(" ")[2])
    raise AssertionError(f"{series} not in the scrape")


@pytest.mark.parametrize("policy", ["kv_aware", "least_loaded"])
def test_kv_aware_routing_sends_a_repeated_prefix_to_the_decode_actor_that_holds_it(ray_cluster, e2e_model, prompts, policy):
    """Two decode actors, equally loaded by one long stream each; the decode actor that served
    a prefix gets the next prompt with it under kv_aware (one block pushed, not seven), while
    least_loaded takes the first of the tie."""
    import concurrent.futures

    import ray

    from router.pool import Role, RoutingPolicy

    router = RouterConfig(disaggregation=Disaggregation.ALWAYS, routing_policy=RoutingPolicy(policy))
    (first, want1), (second, want2) = prompts
    hog_prompts = random_prompts([10, 10], e2e_model.vocab_size, seed=78)
    with running_deployment(e2e_model, 1, 2, router) as deployment:
        client = Client(deployment.address)
        # In a tie the selectors take the first decode actor in the pool's order (the order
        # the actors came up in): "busy" gets the first stream, "holder" the prefix.
        busy, holder = deployment.workers(Role.DECODE)
        for decode in (busy, holder):
            ray.get(deployment.handles[decode].set_step_delay.remote(0.02))
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            hog = lambda p: client.generate(prompt_token_ids=p, max_tokens=200, temperature=0.0, ignore_eos=True)  # noqa: E731
            hog0 = pool.submit(hog, hog_prompts[0])
            _wait_for(lambda: _running(client, busy) == 1)
            one = client.generate(prompt_token_ids=first, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            assert one.last.decode_worker_id == holder, "the other one was busier"
            hog1 = pool.submit(hog, hog_prompts[1])
            _wait_for(lambda: _running(client, holder) == 1)
            # Both decode actors now run one stream of 10 prompt tokens: equal load.
            two = client.generate(prompt_token_ids=second, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            hog0.result(timeout=60), hog1.result(timeout=60)
        assert one.token_ids == want1 and two.token_ids == want2
        block_bytes = one.last.timing.kv_bytes_transferred // 7
        if policy == "kv_aware":
            assert two.last.decode_worker_id == holder
            assert two.last.timing.kv_bytes_transferred == block_bytes, "only the block the holder lacked"
        else:
            assert two.last.decode_worker_id == busy
            assert two.last.timing.kv_bytes_transferred == 7 * block_bytes
        assert two.last.usage.cached_prompt_tokens == 6 * BLOCK  # the prefill actor's own cache either way
        for worker in client.wait_until_idle():
            assert worker.num_kv_blocks_used == 0, f"{worker.worker_id} leaked KV blocks"
        client.close()


def _running(client: Client, worker_id: str) -> int:
    return next(w.num_running_seqs for w in client.status() if w.worker_id == worker_id)


def _wait_for(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.02)
