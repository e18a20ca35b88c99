"""Readiness: health says NOT_SERVING and Generate waits (bounded) until the pools can serve."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.pools import DeploymentSpec, PoolManager, PoolSpec
from engine.stats import WorkerState
from router.config import Disaggregation, RouterConfig
from router.pool import Role, WorkerRecord
from tests.checkpoints import hf_greedy
from tests.serving import Client, HostedRouter, engine_config

SERVICES = ("", "pdserve.v1.Generation")


def _health(address: str) -> dict[str, str]:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return {
            service: health_pb2.HealthCheckResponse.ServingStatus.Name(
                stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
            )
            for service in SERVICES
        }


@pytest.fixture
def hosted(request, ray_cluster, e2e_model):
    router = RouterConfig(disaggregation=Disaggregation.NEVER, **getattr(request, "param", {}))
    spec = DeploymentSpec(
        model_path=e2e_model.path,
        prefill=PoolSpec(0, engine_config(), num_cpus=0.5),
        decode=PoolSpec(1, engine_config(), num_cpus=0.5),
        router=router,
    )
    hosted = HostedRouter(spec)
    yield hosted
    hosted.close()


def test_not_serving_until_a_decode_actor_is_up_and_an_early_request_waits_for_it(ray_cluster, e2e_model, hosted):
    assert _health(hosted.address) == {s: "NOT_SERVING" for s in SERVICES}
    client = Client(hosted.address)
    prompt = [5, 17, 42, 99, 7]
    result: dict = {}

    def send():
        try:
            result["stream"] = client.generate(prompt_token_ids=prompt, max_tokens=6, temperature=0.0, ignore_eos=True)
        except Exception as exc:
            result["error"] = exc

    sender = threading.Thread(target=send)
    sender.start()
    time.sleep(0.5)
    assert sender.is_alive() and not result, "the request waits while no worker is up"

    hosted.start_pools()
    assert _health(hosted.address) == {s: "SERVING" for s in SERVICES}
    sender.join(60)
    client.close()
    assert "error" not in result, result.get("error")
    assert result["stream"].token_ids == hf_greedy(e2e_model.hf_model, prompt, 6)


@pytest.mark.parametrize("hosted", [{"ready_wait_s": 0.5}], indirect=True)
def test_a_request_past_the_ready_wait_is_unavailable_naming_the_reason(hosted):
    client = Client(hosted.address)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as failure:
        client.generate(prompt_token_ids=[1, 2, 3], max_tokens=2)
    client.close()
    assert failure.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "still starting" in failure.value.details()
    assert time.monotonic() - started < 10


def test_losing_the_last_decode_actor_flips_health_and_a_new_one_restores_it(hosted):
    """Prefill losses do not matter; no routable decode actor does (checked without Ray)."""
    pools = PoolManager(hosted.spec, hosted.router)
    hosted.router.pool_manager = pools
    pools._started = True  # start-up done, as after PoolManager.start
    pool = hosted.router.pool
    pool.add(WorkerRecord("prefill-0", Role.PREFILL, handle=None))
    pool.add(WorkerRecord("decode-0", Role.DECODE, handle=None))
    hosted.loop.run(pools.refresh_readiness())
    assert _health(hosted.address) == {s: "SERVING" for s in SERVICES}

    pool.workers["prefill-0"].state = WorkerState.DEAD
    hosted.loop.run(pools.refresh_readiness())
    assert _health(hosted.address) == {s: "SERVING" for s in SERVICES}

    pool.workers["decode-0"].state = WorkerState.DEAD
    hosted.loop.run(pools.refresh_readiness())
    assert _health(hosted.address) == {s: "NOT_SERVING" for s in SERVICES}

    pool.add(WorkerRecord("decode-1", Role.DECODE, handle=None))
    hosted.loop.run(pools.refresh_readiness())
    assert _health(hosted.address) == {s: "SERVING" for s in SERVICES}


def test_cluster_status_read_while_a_restarted_controller_adopts_lists_the_adopted_workers(hosted):
    """A restarted controller serves its API while it adopts the running workers: a status read
    then waits for the adoption instead of answering with no worker (checked without Ray: the
    adoption is finished by hand; a worker without a handle reports as unhealthy)."""
    from router.api.pdserve.v1 import generation_pb2 as pb
    from router.api.pdserve.v1 import generation_pb2_grpc as pb_grpc

    pools = PoolManager(hosted.spec, hosted.router)  # its start, which adopts, has not finished
    hosted.router.pool_manager = pools
    answer: dict = {}

    def read_status():
        with grpc.insecure_channel(hosted.address) as channel:
            answer["workers"] = pb_grpc.GenerationStub(channel).GetClusterStatus(pb.GetClusterStatusRequest(), timeout=30).workers

    reader = threading.Thread(target=read_status)
    reader.start()
    time.sleep(1.0)
    assert reader.is_alive(), "the status was answered before the adoption finished"

    async def adopt():
        hosted.router.pool.add(WorkerRecord("decode-0", Role.DECODE, handle=None))
        pools._first_adoption.set()

    hosted.loop.run(adopt())
    reader.join(15)
    assert [(w.worker_id, w.state) for w in answer["workers"]] == [("decode-0", pb.WORKER_STATE_UNHEALTHY)]
