"""The driver of the multi-node test, run inside the head node's network namespace.

``python -m tests.e2e.multinode_driver PLAN.json`` joins the namespaced Ray cluster, starts a
deployment whose pools spread over the worker nodes (KV over UCX's TCP transport on their
``eth-pd`` interfaces), and then, talking to the test over stdin/stdout in JSON lines:

1. streams the plan's prompts one at a time and reports tokens, the workers' nodes and the
   exported ``pdserve:kv_transfer_path_*`` series (``{"phase": "serve", ...}``);
2. starts a burst, says which node to kill once every stream has its first token
   (``{"kill": ip}``), waits for the test's ``killed`` line, and reports the burst's outputs,
   the pools rebuilt on the surviving nodes and the KV blocks left in use
   (``{"phase": "node-kill", ...}``).
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
import time
from pathlib import Path

import ray

from cluster.deployment import Deployment, DeploymentSpec, PoolSpec
from kvtransfer.agent import KVTransferConfig
from router.api.pdserve.v1 import generation_pb2 as pb
from router.config import Disaggregation, RouterConfig
from router.metrics import PREFIX, Metrics
from router.pool import Role
from cluster.netns import DEVICE
from tests.serving import Client, engine_config


MARK = "@pdserve-test "  # Ray prints its own cluster messages to this stdout too


def say(message: dict) -> None:
    print(MARK + json.dumps(message), flush=True)


def node_ips() -> dict[str, str]:
    """Ray node id prefix (as workers name their node) -> node IP."""
    return {n["NodeID"][:8]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}


def worker_ips(client: Client) -> dict[str, str]:
    ips = node_ips()
    return {w.worker_id: ips.get(w.node.rsplit(":", 1)[-1], "gone") for w in client.status() if w.state != pb.WORKER_STATE_DEAD}


def path_series(metrics: Metrics) -> list[dict]:
    found = []
    for family in metrics.registry.collect():
        if not family.name.startswith(PREFIX + "kv_transfer_path_"):
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                found.append({"name": sample.name, "value": sample.value, **sample.labels})
    return found


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    ray.init(address=plan["ray_address"], log_to_driver=False)
    pool_resources = {"pd_worker": 1}
    spec = DeploymentSpec(
        model_path=plan["model"],
        prefill=PoolSpec(1, engine_config(), num_cpus=0.5, resources=pool_resources),
        decode=PoolSpec(2, engine_config(), num_cpus=0.5, resources=pool_resources),
        router=RouterConfig(host=plan["router_host"], disaggregation=Disaggregation.ALWAYS, admin_port=None, http_port=None),
        transfer=KVTransferConfig(network_devices=DEVICE, transports="tcp"),
        health_interval_s=0.5,
        health_timeout_s=3.0,
    )
    metrics = Metrics("multinode")
    deployment = Deployment(spec, metrics)
    deployment.start()
    client = Client(deployment.address)
    try:
        served = [client.generate(prompt_token_ids=p, max_tokens=plan["max_tokens"], temperature=0.0, ignore_eos=True) for p in plan["prompts"]]
        deployment._loop.run(metrics.refresh(deployment.router, 0.0))
        say({
            "phase": "serve",
            "tokens": [s.token_ids for s in served],
            "decode_workers": [s.last.decode_worker_id for s in served],
            "prefill_workers": [s.last.prefill_worker_id for s in served],
            "kv_bytes": [s.last.timing.kv_bytes_transferred for s in served],
            "worker_ips": worker_ips(client),
            "paths": path_series(metrics),
        })

        # A burst, then a whole node dies under it.
        before = worker_ips(client)
        prefill_ip = before["prefill-0"]
        decode_ips = [ip for worker, ip in before.items() if worker.startswith("decode-")]
        target = next((ip for ip in decode_ips if ip != prefill_ip), decode_ips[0])
        started = [0]

        def stream(prompt):
            return Client(deployment.address).generate(prompt_token_ids=prompt, max_tokens=plan["burst_tokens"], temperature=0.0, ignore_eos=True, timeout=240)

        with concurrent.futures.ThreadPoolExecutor(len(plan["burst"])) as pool:
            jobs = [pool.submit(stream, p) for p in plan["burst"]]
            deadline = time.monotonic() + 60
            # Killed while requests are on the doomed node's workers.
            on_target = lambda: sum(r.num_assigned for r in deployment.router.pool.of_role(Role.DECODE) if before.get(r.worker_id) == target)
            while time.monotonic() < deadline and on_target() < 2:
                time.sleep(0.005)
            started[0] = on_target()
            say({"kill": target})
            assert sys.stdin.readline().strip() == "killed"
            killed_at = time.monotonic()
            results = []
            for job in jobs:
                try:
                    results.append({"tokens": job.result(timeout=300).token_ids})
                except Exception as exc:
                    results.append({"error": repr(exc)})
        # The pools are back at their sizes, on the nodes that are left.
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            ips = worker_ips(client)
            ready = [w for w in client.status() if w.state == pb.WORKER_STATE_READY]
            if len([w for w in ready if w.worker_id.startswith("decode-")]) == 2 and any(w.worker_id.startswith("prefill-") for w in ready) \
                    and target not in ips.values():
                break
            time.sleep(0.2)
        rebuilt_s = time.monotonic() - killed_at
        idle = client.wait_until_idle(timeout_s=60)
        say({
            "phase": "node-kill",
            "killed": target,
            "in_flight_at_kill": started[0],
            "results": results,
            "worker_ips": worker_ips(client),
            "rebuilt_s": rebuilt_s,
            "blocks_used": {w.worker_id: w.num_kv_blocks_used for w in idle},
            "replaced": deployment.pools.num_replaced,
        })
    finally:
        client.close()
        deployment.stop()
        ray.shutdown()


if __name__ == "__main__":
    main()
