"""No single point of failure: durable workers outlive their router, a new router adopts them,
and two routers can share one set of workers, each seeing only its own requests' outputs."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import shutil
import signal
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
import ray

from cluster.deployment import Deployment
from cluster.pools import DeploymentSpec, PoolSpec
from router.api.pdserve.v1 import generation_pb2 as pb
from router.config import Disaggregation, RouterConfig
from router.responses_api.board import find_shared_board
from tests.checkpoints import build_lora_adapter, hf_greedy, random_prompts
from tests.serving import Client, HostedRouter, engine_config


def _durable_spec(e2e_model, name: str, **router_fields) -> DeploymentSpec:
    return DeploymentSpec(
        model_path=e2e_model.path,
        prefill=PoolSpec(1, engine_config(), num_cpus=0.5),
        decode=PoolSpec(1, engine_config(), num_cpus=0.5),
        router=RouterConfig(disaggregation=Disaggregation.ALWAYS, **router_fields),
        name=name,
        durable_workers=True,
        health_interval_s=0.3,
    )


def _epochs(client: Client) -> dict[str, str]:
    return {w.worker_id: w.epoch for w in client.status()}


def test_two_routers_side_by_side_each_receive_only_their_own_outputs(ray_cluster, e2e_model):
    """A second router follows the first one's pools (adopts its durable workers, never launches
    or kills). Both send the same request ids at the same time, with different prompts: every
    stream gets exactly its own prompt's continuation."""
    spec = _durable_spec(e2e_model, "side-by-side")
    first = Deployment(spec)
    first.start()
    second = HostedRouter(dataclasses.replace(spec, router=dataclasses.replace(spec.router)))
    try:
        second.start_pools(manage=False)
        one, two = Client(first.address), Client(second.address)
        assert _epochs(one) == _epochs(two), "the second router routes to the first one's workers"
        prompts = random_prompts([40, 90, 25, 60, 120, 33], e2e_model.vocab_size, seed=41)
        expected = [hf_greedy(e2e_model.hf_model, p, 24) for p in prompts]
        jobs = []
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            for index, prompt in enumerate(prompts):
                client = one if index % 2 == 0 else two
                request_id = f"same-id-{index // 2}"  # each id is in flight on both routers at once
                jobs.append(pool.submit(
                    client.generate, request_id=request_id, prompt_token_ids=prompt, max_tokens=24, temperature=0.0, ignore_eos=True
                ))
            streams = [job.result(timeout=120) for job in jobs]
        for stream, want in zip(streams, expected):
            assert stream.token_ids == want
        with pytest.raises(grpc.RpcError) as refused:
            Client(second.address, second.admin_address).admin.DrainWorker(pb.DrainWorkerRequest(worker_id="decode-0"))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, "only the managing router changes pools"
        assert all(w.num_kv_blocks_used == 0 for w in one.wait_until_idle())
        one.close()
        two.close()
    finally:
        second.close()
        first.stop()


def test_a_router_that_dies_loses_only_its_streams_and_a_new_one_adopts_its_workers(ray_cluster, e2e_model):
    spec = _durable_spec(e2e_model, "router-restart", router_lease_s=2.0)
    (prompt,) = random_prompts([50], e2e_model.vocab_size, seed=42)
    first = Deployment(spec)
    first.start()
    client = Client(first.address)
    epochs = _epochs(client)
    # Slow decoding: the stream would need 19 s or more to run to its end, far beyond the 2 s
    # after which the decode actor gives up on its silent router.
    ray.get(first.handles["decode-0"].set_step_delay.remote(0.01))
    outcome: dict = {}

    def stream() -> None:
        try:
            outcome["stream"] = client.generate(timeout=6, prompt_token_ids=prompt, max_tokens=1900, temperature=0.0, ignore_eos=True)
        except grpc.RpcError as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=stream)
    thread.start()
    active = first.router.dispatcher.active
    deadline = time.monotonic() + 30
    while not any(a.assembler.has_sent_tokens for a in list(active.values())):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    first.crash()  # the router's process is gone: nothing of it cleans up
    second = Deployment(spec)
    try:
        second.start()
        again = Client(second.address)
        assert _epochs(again) == epochs, "the same workers, adopted, none launched"
        thread.join(30)
        assert "error" in outcome, "the dead router's stream ended without its last message"
        # The dead router's request still held blocks on the decode actor; they are freed once
        # that router has been silent for its router_lease_s.
        assert all(w.num_kv_blocks_used == 0 for w in again.wait_until_idle(timeout_s=30))
        decode = ray.get(second.handles["decode-0"].status.remote())
        assert decode.num_orphans_aborted == 1, "dropped for its silent router, not left to run to its end"
        stream = again.generate(prompt_token_ids=prompt, max_tokens=8, temperature=0.0, ignore_eos=True)
        assert stream.token_ids == hf_greedy(e2e_model.hf_model, prompt, 8)
        again.close()
    finally:
        second.stop()  # kills the workers it adopted
    client.close()


def test_adapters_loaded_at_runtime_outlive_the_router_that_loaded_them(ray_cluster, e2e_model, tmp_path):
    """An RL trainer's policy loaded through one router: the router dies, a new one adopts the
    durable workers and serves the policy, the same version, though the trainer has since
    written its next one where the loaded one was; a prefill worker that joins afterwards is
    given that version too (from the files a worker kept). Before, the new router unloaded it."""
    spec = _durable_spec(e2e_model, "lora-restart", http_port=0, allow_runtime_lora_updating=True)
    # A configured adapter too, whose directory is also rewritten while no controller runs.
    build_lora_adapter(e2e_model.hf_model, tmp_path / "configured", seed=54)
    for pool in (spec.prefill, spec.decode):
        pool.engine = dataclasses.replace(pool.engine, lora_adapters={"configured": str(tmp_path / "configured")})
    policy = build_lora_adapter(e2e_model.hf_model, tmp_path / "policy", seed=51)
    (prompt,) = random_prompts([40], e2e_model.vocab_size, seed=52)
    want = hf_greedy(policy, prompt, 8)
    first = Deployment(spec)
    first.start()
    second = None
    try:
        status, body = _post(f"http://127.0.0.1:{first.http_port}/v1/load_lora_adapter", {"lora_name": "policy", "lora_path": str(tmp_path / "policy")})
        assert status == 200, body
        client = Client(first.address)
        assert client.generate(lora_name="policy", prompt_token_ids=prompt, max_tokens=8, temperature=0.0, ignore_eos=True).token_ids == want
        client.close()
        loaded = ray.get(first.handles["decode-0"].lora_adapters.remote())
        first.crash()
        for name, seed in (("policy", 53), ("configured", 55)):  # the trainer's next versions, not loaded
            shutil.rmtree(tmp_path / name)
            build_lora_adapter(e2e_model.hf_model, tmp_path / name, seed=seed)

        second = Deployment(spec)
        second.start()
        again = Client(second.address, second.admin_address)
        assert again.generate(lora_name="policy", prompt_token_ids=prompt, max_tokens=8, temperature=0.0, ignore_eos=True).token_ids == want
        again.admin.ScalePool(pb.ScalePoolRequest(role=pb.WORKER_ROLE_PREFILL, replicas=2))
        # Every worker, the one that joined too, serves the versions that were running.
        assert {name: ray.get(h.lora_adapters.remote()) for name, h in second.handles.items()} == dict.fromkeys(second.handles, loaded)
        models = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{second.http_port}/v1/models", timeout=30).read())
        assert {"id": "policy", "root": str(tmp_path / "policy")}.items() <= next(m for m in models["data"] if m["id"] == "policy").items()
        again.close()
    finally:
        if second is not None:
            second.stop()  # kills the workers it adopted
        else:
            first.stop()


def _post(url: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _finished_by_router(http_port: int) -> dict[str, int]:
    """Finished requests by router, as /metrics on the shared HTTP port says."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10).read().decode()
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pdserve:request_success_total":
                router = sample.labels["router"]
                counts[router] = counts.get(router, 0) + int(sample.value)
    return counts


def test_router_replicas_share_one_port_and_a_dead_replica_loses_only_its_own_streams(ray_cluster, e2e_model):
    """router.replicas: 2 — a replica actor beside the managing router, listening on the same
    gRPC and HTTP ports (SO_REUSEPORT). Connections spread over both; every stream equals
    transformers; a replica whose process dies is restarted by Ray on the same port, and the
    streams of the other router are untouched. ``/metrics`` on the shared HTTP port answers both
    routers' series whichever takes the scrape (one router's at a time, its counters jumped
    between the two; a replica answered nothing)."""
    from router.metrics import Metrics

    spec = _durable_spec(e2e_model, "replicas")
    spec.router_replicas = 2
    deployment = Deployment(spec, metrics=Metrics("tiny"))
    deployment.start()
    try:
        (info,) = deployment.replica_infos
        assert info.grpc_port == deployment.front_ends.port and info.http_port == deployment.http_port
        assert find_shared_board(spec.name) is not None  # /v1/responses: one board for both routers
        prompts = random_prompts([30, 50, 20, 70, 40, 60, 25, 35], e2e_model.vocab_size, seed=43)
        expected = [hf_greedy(e2e_model.hf_model, p, 12) for p in prompts]
        # One connection per request: the kernel picks a router for each new connection.
        streams = []
        for prompt in prompts:
            client = Client(deployment.address, own_connection=True)
            streams.append(client.generate(prompt_token_ids=prompt, max_tokens=12, temperature=0.0, ignore_eos=True))
            client.close()
        assert [s.token_ids for s in streams] == expected
        # The kernel hashes each connection to a listener: all 8 on one side happens (1 in 128),
        # so more short connections are opened until both routers took one (2^-40 to fail).
        sent = len(prompts)
        taken_by_replica, _ = ray.get(deployment.replicas[0].served.remote())
        while taken_by_replica in (0, sent) and sent < len(prompts) + 32:
            client = Client(deployment.address, own_connection=True)
            assert client.generate(prompt_token_ids=prompts[0], max_tokens=2, temperature=0.0, ignore_eos=True).token_ids == expected[0][:2]
            client.close()
            sent += 1
            taken_by_replica, _ = ray.get(deployment.replicas[0].served.remote())
        assert 0 < taken_by_replica < sent, f"the replica took {taken_by_replica} of {sent} connections"
        deadline = time.monotonic() + 15  # every scrape (a new connection each: either router) sees both
        scrapes = 0
        while scrapes < 6:
            finished = _finished_by_router(deployment.http_port)
            if finished == {"router-0": sent - taken_by_replica, "router-1": taken_by_replica}:
                scrapes += 1
            else:  # the replica publishes every second
                assert time.monotonic() < deadline, f"/metrics on the shared port: {finished} of {sent} requests"
                time.sleep(0.2)

        os.kill(info.pid, signal.SIGKILL)  # its process dies; Ray restarts it, and it starts itself
        deadline = time.monotonic() + 120
        while (restarted := ray.get(deployment.replicas[0].start.remote(), timeout=120)).pid == info.pid:
            assert time.monotonic() < deadline, "the replica was not restarted"
            time.sleep(0.2)
        assert restarted.grpc_port == info.grpc_port
        again = []
        for prompt in prompts[:4]:
            client = Client(deployment.address, own_connection=True)
            again.append(client.generate(prompt_token_ids=prompt, max_tokens=12, temperature=0.0, ignore_eos=True).token_ids)
            client.close()
        assert again == expected[:4]
        assert all(w.num_kv_blocks_used == 0 for w in Client(deployment.address).wait_until_idle())
    finally:
        deployment.stop()
    deadline = time.monotonic() + 10  # ray.kill returns before the name is released
    while find_shared_board(spec.name) is not None:
        assert time.monotonic() < deadline, "the deployment's stop ends its responses board"
        time.sleep(0.1)


def test_a_metrics_exchange_that_dies_is_restarted_and_the_routers_publish_to_it_again(ray_cluster):
    """The exchange behind /metrics on a shared port is a process that can die: a scrape while
    Ray restarts it still answers (this router's own series, within the call's timeout), and
    the other routers' series come back once they publish to the new one."""
    import asyncio
    import os
    import signal

    from router.metrics import Metrics
    from router.metrics_exchange import SharedMetrics, start_exchange

    handle = start_exchange("exchange-death-test", detached=False)
    replica_metrics = Metrics("m")
    replica_metrics.observe_finished("stop", 0.1, 0.5, 4)
    replica = SharedMetrics(handle, "router-1", replica_metrics, publish_s=0.1)
    managing = SharedMetrics(handle, "router-0", Metrics("m"), publish_s=0.1)

    async def routers_seen(deadline_s: float) -> set[str]:
        deadline = time.monotonic() + deadline_s
        while True:
            text = (await managing.exposition()).decode()
            seen = {name for name in ("router-0", "router-1") if f'router="{name}"' in text}
            if seen == {"router-0", "router-1"} or time.monotonic() > deadline:
                return seen
            await asyncio.sleep(0.1)

    async def scenario():
        replica.start()
        assert await routers_seen(30) == {"router-0", "router-1"}
        pid = ray.get(handle.__ray_call__.remote(lambda exchange: os.getpid()))
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        assert "router-0" in await routers_seen(0), "a scrape while it restarts answers this router's series"
        assert time.monotonic() - started < 10
        assert await routers_seen(60) == {"router-0", "router-1"}, "the replica publishes to the restarted exchange"
        await replica.close()
        await managing.close()

    try:
        asyncio.run(scenario())
    finally:
        ray.kill(handle, no_restart=True)
