"""Operating a live deployment: scaling under traffic, replacing dead workers, metrics."""

from __future__ import annotations

import threading
import time
import urllib.request

import pytest

from router.config import Disaggregation, RouterConfig
from router.metrics import Metrics
from router.pool import Role
from tests.checkpoints import hf_greedy, random_prompts
from tests.serving import Client, running_deployment

PAUSE_BETWEEN_REQUESTS_S = 0.05


class SteadyTraffic:
    """Three client threads that each send one request after another, a short pause apart, until
    stopped; keeps every result. The pause leaves CPU to what the test does meanwhile (start or
    stop workers): back to back, the traffic took most of the 2 cores for the whole operation."""

    def __init__(self, client: Client, prompts: list[list[int]], max_tokens: int):
        self.client, self.prompts, self.max_tokens = client, prompts, max_tokens
        self.results: list[tuple[int, object]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(offset,)) for offset in range(3)]

    def _run(self, offset: int) -> None:
        index = offset
        while not self._stop.is_set() and index < 10_000:
            prompt_index = index % len(self.prompts)
            try:
                stream = self.client.generate(
                    prompt_token_ids=self.prompts[prompt_index], max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True
                )
                self.results.append((prompt_index, stream.token_ids))
            except Exception as exc:  # recorded: the test asserts there are none
                self.results.append((prompt_index, exc))
            index += 3
            self._stop.wait(PAUSE_BETWEEN_REQUESTS_S)

    def __enter__(self):
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for thread in self._threads:
            thread.join(120)


@pytest.fixture(scope="module")
def traffic_references(e2e_model):
    prompts = random_prompts([5, 50, 120, 33, 80], e2e_model.vocab_size, seed=31)
    return prompts, [hf_greedy(e2e_model.hf_model, p, 8) for p in prompts]


def _assert_all_correct(results, expected):
    errors = [r for _, r in results if isinstance(r, Exception)]
    assert not errors, f"requests failed during the operation: {errors[:3]}"
    for prompt_index, tokens in results:
        assert tokens == expected[prompt_index]


def test_scaling_each_pool_up_and_down_under_traffic_loses_nothing(ray_cluster, e2e_model, traffic_references):
    prompts, expected = traffic_references
    router = RouterConfig(disaggregation=Disaggregation.ALWAYS)
    with running_deployment(e2e_model, 1, 1, router) as deployment:
        client = Client(deployment.address)
        with SteadyTraffic(client, prompts, 8) as traffic:
            for role in (Role.PREFILL, Role.DECODE):
                assert deployment.scale(role, 2) == 1
                assert len(deployment.workers(role)) == 2
                time.sleep(0.5)
                assert deployment.scale(role, 1) == 2
                assert deployment.pools.size(role) == 1
            time.sleep(0.5)
        assert len(traffic.results) > 10
        _assert_all_correct(traffic.results, expected)
        # The survivors serve; every retired worker is gone from the status.
        workers = client.wait_until_idle()
        assert sorted(w.role for w in workers) == [1, 2]
        client.close()


def test_killed_worker_is_replaced_and_requests_keep_completing(ray_cluster, e2e_model, traffic_references):
    prompts, expected = traffic_references
    router = RouterConfig(disaggregation=Disaggregation.ALWAYS)
    with running_deployment(e2e_model, 1, 2, router, health_interval_s=0.3) as deployment:
        client = Client(deployment.address)
        epochs_before = {w.worker_id: w.epoch for w in client.status()}
        with SteadyTraffic(client, prompts, 8) as traffic:
            time.sleep(0.5)
            deployment.kill_worker("prefill-0")
            deadline = time.monotonic() + 60
            while deployment.pools.size(Role.PREFILL) < 1 or "prefill-0" in deployment.workers(Role.PREFILL):
                assert time.monotonic() < deadline, "the prefill pool did not return to its size"
                time.sleep(0.1)
            time.sleep(1.0)
        assert deployment.pools.num_replaced == 1
        _assert_all_correct(traffic.results, expected)
        workers = {w.worker_id: w for w in client.status()}
        assert "prefill-0" not in workers and "prefill-1" in workers
        assert workers["prefill-1"].epoch not in epochs_before.values(), "a replacement has a new epoch"
        # The replacement serves: a fresh request goes through it with the right output.
        stream = client.generate(prompt_token_ids=prompts[2], max_tokens=8, temperature=0.0, ignore_eos=True)
        assert stream.token_ids == expected[2] and stream.last.prefill_worker_id == "prefill-1"
        client.close()


def test_metrics_scrape_reports_sensible_values_after_traffic(ray_cluster, e2e_model, traffic_references):
    prompts, expected = traffic_references
    metrics = Metrics("tiny")
    router = RouterConfig(disaggregation=Disaggregation.ALWAYS)
    with running_deployment(e2e_model, 1, 1, router, health_interval_s=0.2, metrics=metrics) as deployment:
        port = metrics.serve(0)
        client = Client(deployment.address)
        for prompt in prompts:
            client.generate(prompt_token_ids=prompt, max_tokens=8, temperature=0.0, ignore_eos=True)
        client.generate(prompt_token_ids=prompts[0], max_tokens=30, temperature=0.0, stop_token_ids=[expected[0][3]])
        time.sleep(0.6)  # a health-loop refresh of the pool gauges
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        client.close()
    values = _parse(text)
    m = '{model_name="tiny"}'

    def series(name: str, **labels) -> float:
        text_labels = ",".join([f'{k}="{v}"' for k, v in sorted({"model_name": "tiny", **labels}.items())])
        return values[f"pdserve:{name}{{{text_labels}}}"]

    assert series("request_success_total", finished_reason="length") == 5
    assert series("request_success_total", finished_reason="stop") == 1
    assert series("prompt_tokens_total") == sum(len(p) for p in prompts) + len(prompts[0])
    assert series("generation_tokens_total") == 5 * 8 + 4
    assert values["pdserve:time_to_first_token_seconds_count" + m] == 6
    assert 0 < values["pdserve:time_to_first_token_seconds_sum" + m] / 6 < 10
    assert values["pdserve:time_per_output_token_seconds_count" + m] == 6
    assert values["pdserve:inter_token_latency_seconds_count" + m] >= 6 * 3
    assert values["pdserve:e2e_request_latency_seconds_count" + m] == 6
    # KV bytes pushed: every prompt's blocks, each 2 layers x 2 x 16 tokens x 2 heads x 16 dims x 4 bytes.
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4
    pushed_blocks = sum(-(-len(p) // 16) for p in prompts) + -(-len(prompts[0]) // 16)
    assert series("kv_transfer_bytes_total") == pushed_blocks * block_bytes
    assert values["pdserve:kv_transfer_seconds_count" + m] == 6
    assert series("kv_blocks_used", role="decode", worker_id="decode-0") == 0
    assert series("kv_cache_usage_perc", role="decode", worker_id="decode-0") == 0
    assert series("kv_blocks_free", role="prefill", worker_id="prefill-0") == 256
    assert series("queue_depth", role="prefill") == 0
    assert series("num_requests_waiting") == 0
    assert series("prefill_tokens_per_step", worker_id="prefill-0") > 1
    assert series("num_preemptions_total", role="decode", worker_id="decode-0") == 0
    # Steps: the requests ran one after another, so the decode actor ran one per token after the
    # prefilled first (7 for each 8-token request, 3 for the stopped one), the prefill actor one
    # per prompt at least; their time inside is real and within the test's wall time.
    assert series("engine_steps_total", role="decode", worker_id="decode-0") >= 5 * 7 + 3
    assert series("engine_steps_total", role="prefill", worker_id="prefill-0") >= 6
    for role in ("decode", "prefill"):
        assert 0 < series("engine_step_seconds_total", role=role, worker_id=f"{role}-0") < 60
    assert values.get('pdserve:request_retries_total{kind="prefill",model_name="tiny"}', 0) == 0


def _parse(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def test_drain_worker_finishes_its_requests_then_removes_it(ray_cluster, e2e_model, traffic_references):
    import grpc

    from router.api.pdserve.v1 import generation_pb2 as pb

    prompts, expected = traffic_references
    router = RouterConfig(disaggregation=Disaggregation.NEVER)
    with running_deployment(e2e_model, 0, 2, router) as deployment:
        client = Client(deployment.address, deployment.admin_address)
        with pytest.raises(grpc.RpcError) as info:
            client.admin.DrainWorker(pb.DrainWorkerRequest(worker_id="decode-9"))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        with SteadyTraffic(client, prompts, 8) as traffic:
            time.sleep(0.5)
            reply = client.admin.DrainWorker(pb.DrainWorkerRequest(worker_id="decode-0"))
            assert reply.state == pb.WORKER_STATE_DRAINING
            deadline = time.monotonic() + 60
            while "decode-0" in deployment.workers(Role.DECODE):
                assert time.monotonic() < deadline, "the drained worker was never removed"
                time.sleep(0.1)
            time.sleep(0.5)
        _assert_all_correct(traffic.results, expected)
        assert [w.worker_id for w in client.status()] == ["decode-1"]
        client.close()


def test_a_failed_replacement_launch_is_retried_until_the_pool_is_back(ray_cluster, e2e_model, traffic_references, monkeypatch):
    """The first two replacement launches fail (as on a node out of resources): the health loop
    launches again after a pause that doubles with each failure, and the pool returns to its
    size and serves."""
    import cluster.pools

    prompts, expected = traffic_references
    first_pause_s = 0.4
    monkeypatch.setattr(cluster.pools, "LAUNCH_RETRY_FIRST_PAUSE_S", first_pause_s)
    router = RouterConfig(disaggregation=Disaggregation.ALWAYS)
    with running_deployment(e2e_model, 1, 1, router, health_interval_s=0.1) as deployment:
        pools = deployment.pools
        real_launch = pools._launch
        attempts: list[tuple[Role, float]] = []

        async def flaky_launch(role, num_starting=1):
            attempts.append((role, time.monotonic()))
            if len(attempts) <= 2:
                raise RuntimeError("injected: no resources for the replacement")
            return await real_launch(role, num_starting)

        monkeypatch.setattr(pools, "_launch", flaky_launch)
        deployment.kill_worker("prefill-0")
        deadline = time.monotonic() + 60
        while pools.size(Role.PREFILL) < 1 or "prefill-0" in deployment.workers(Role.PREFILL):
            assert time.monotonic() < deadline, f"the prefill pool did not return to its size ({attempts})"
            time.sleep(0.1)
        assert [role for role, _ in attempts] == [Role.PREFILL] * 3, "two failed launches, then one that worked"
        (_, first), (_, second), (_, third) = attempts
        assert second - first >= first_pause_s and third - second >= 2 * first_pause_s, f"pauses {second - first:.2f}, {third - second:.2f} s"
        assert third - second < 2 * first_pause_s + 2.0, "relaunched soon after the pause, not much later"
        assert pools.desired == {Role.PREFILL: 1, Role.DECODE: 1}
        client = Client(deployment.address)
        stream = client.generate(prompt_token_ids=prompts[0], max_tokens=8, temperature=0.0, ignore_eos=True)
        assert stream.token_ids == expected[0]
        client.close()


def test_a_decode_actor_replaced_three_times_leaves_one_peer_on_the_prefill_agent(ray_cluster, e2e_model, traffic_references):
    """Each replacement comes back under a new name; the prefill agent drops each dead one as a
    NIXL peer (remote agent and descriptors) instead of keeping all four."""
    import ray

    prompts, expected = traffic_references
    router = RouterConfig(disaggregation=Disaggregation.ALWAYS)
    with running_deployment(e2e_model, 1, 1, router, health_interval_s=0.3) as deployment:
        client = Client(deployment.address)
        prefill = deployment.handles["prefill-0"]
        for _ in range(3):
            (victim,) = deployment.workers(Role.DECODE)
            stream = client.generate(prompt_token_ids=prompts[0], max_tokens=4, temperature=0.0, ignore_eos=True)
            assert stream.token_ids == expected[0][:4]
            assert victim in ray.get(prefill.peers.remote())
            deployment.kill_worker(victim)
            deadline = time.monotonic() + 60
            while deployment.workers(Role.DECODE) in ([], [victim]) or deployment.pools.size(Role.DECODE) < 1:
                assert time.monotonic() < deadline, "the decode pool did not come back"
                time.sleep(0.1)
        (live,) = deployment.workers(Role.DECODE)
        stream = client.generate(prompt_token_ids=prompts[1], max_tokens=4, temperature=0.0, ignore_eos=True)
        assert stream.token_ids == expected[1][:4]
        deadline = time.monotonic() + 10
        while ray.get(prefill.peers.remote()) != [live]:
            assert time.monotonic() < deadline, f"prefill peers: {ray.get(prefill.peers.remote())}, live decode: {live}"
            time.sleep(0.1)
        client.close()
