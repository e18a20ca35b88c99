"""The controller actor: hosts the router and the pool manager inside the Ray cluster.

``pdserve up`` creates it (named, detached with ``--detach``) on the node the command runs
on; its event loop serves the gRPC API and the Prometheus endpoint, creates and replaces
workers, scales and drains pools. ``pdserve down`` stops it and its workers.

It is not a single point of failure: Ray restarts it if its process dies, and the new one
starts itself with the same deployment and adopts the running workers (they are durable:
detached and named, see ``cluster/pools.py``). Only the streams in flight through the dead
router are lost; the workers drop those requests once that router falls silent.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster import desired_sizes
from cluster.deployment import (
    build_router, share_responses_board, share_router_metrics, start_router_replicas, stop_metrics_exchange, stop_responses_board,
)
from cluster.pools import DeploymentSpec, PoolManager
from cluster.router_replica import stop_replicas
from router.addresses import host_port, is_wildcard
from router.front_ends import FrontEnds
from router.metrics import Metrics
from router.pool import Role

logger = logging.getLogger(__name__)

CONTROLLER_NAME = "pdserve-controller"
NAMESPACE = "pdserve"


@dataclass(slots=True)
class ControllerInfo:
    router_address: str
    admin_address: str | None  # None: Admin is off
    http_address: str | None  # the OpenAI API; None: off
    metrics_address: str | None
    prefill_replicas: int
    decode_replicas: int
    router_replicas: list[str] = field(default_factory=list)  # "node:port" of each router replica beside this one


class Controller:
    def __init__(self, spec: DeploymentSpec, metrics_port: int | None = None, metrics_host: str = "127.0.0.1") -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.spec = spec
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host
        self.router = None
        self.front_ends: FrontEnds | None = None
        self.pools: PoolManager | None = None
        self.replicas: list = []  # router replica actors (spec.router_replicas - 1)
        self.responses_board = None  # with replicas: the board actor the routers share
        self.metrics_exchange = None  # with replicas: where the routers publish their metrics
        self.replica_infos: list = []
        self.metrics = Metrics(spec.served_model_name, spec.router.metrics_prefix)
        self.metrics_address: str | None = None
        self._starting: asyncio.Task | None = None
        # It starts itself (the call runs once this constructor has returned): after Ray
        # restarted it, nobody else would. ``start`` from the CLI waits for the same start.
        # While a restarted actor is still constructing, Ray answers this call "restarting":
        # it is retried (max_task_retries) until the actor takes it.
        ray.get_runtime_context().current_actor.start.remote()

    async def start(self) -> ControllerInfo:
        """Start the router and the pools (once; later calls wait for the same start)."""
        if self._starting is None:
            self._starting = asyncio.create_task(self._start())
        await asyncio.shield(self._starting)
        return await self.info()

    async def _start(self) -> None:
        if self.metrics_port is not None:
            port = self.metrics.serve(self.metrics_port, self.metrics_host)
            self.metrics_address = _advertised(self.metrics_host, port)
        self.router = build_router(self.spec, self.metrics)
        self.pools = PoolManager(self.spec, self.router, self.metrics)
        self.router.pool_manager = self.pools
        # Detached with the workers, like the replicas: a restarted controller finds it by name.
        self.responses_board = share_responses_board(self.spec, self.router, detached=self.spec.durable_workers)
        self.metrics_exchange = share_router_metrics(self.spec, self.router, detached=self.spec.durable_workers)
        self.front_ends = FrontEnds(self.router, reuse_port=self.spec.router_replicas > 1)
        await self.front_ends.start()
        await self.pools.start()
        if self.spec.router_replicas > 1:
            # Detached with the workers: a restarted controller finds the same replicas by name.
            metrics_host = self.metrics_host if self.metrics_port is not None else None
            self.replicas, self.replica_infos = await start_router_replicas(
                self.spec, self.router, self.front_ends, metrics_host, detached=self.spec.durable_workers
            )

    async def info(self) -> ControllerInfo:
        return ControllerInfo(
            router_address=_advertised(self.spec.router.host, self.front_ends.port),
            admin_address=None if self.front_ends.admin_port is None else _advertised(self.spec.router.admin_host, self.front_ends.admin_port),
            http_address=None if self.front_ends.http_port is None else _advertised(self.spec.router.http_host, self.front_ends.http_port),
            metrics_address=self.metrics_address,
            prefill_replicas=self.pools.size(Role.PREFILL),
            decode_replicas=self.pools.size(Role.DECODE),
            router_replicas=[host_port(info.node_ip, info.grpc_port) for info in self.replica_infos],
        )

    async def stop(self) -> None:
        await stop_replicas(self.replicas)
        self.replicas = []
        await stop_responses_board(self.responses_board)
        await stop_metrics_exchange(self.metrics_exchange)
        if self.router is not None:
            await self.router.stop()
        if self.front_ends is not None:
            await self.front_ends.stop()
        if self.pools is not None:
            await self.pools.stop()


def create_controller(spec: DeploymentSpec, metrics_port: int | None, metrics_host: str, detached: bool):
    """The controller actor, pinned to this node (where the CLI printed its address); Ray
    restarts it, as often as needed, if its process dies."""
    node_id = ray.get_runtime_context().get_node_id()
    # A new deployment starts from its configuration, not from sizes recorded by one whose
    # controller died without `pdserve down` (a restart by Ray does not come through here).
    desired_sizes.forget(spec.name)
    options = dict(
        name=CONTROLLER_NAME,
        namespace=NAMESPACE,
        num_cpus=0,
        max_concurrency=1000,
        max_restarts=-1,
        max_task_retries=-1,  # calls that meet a restarting controller wait for the new one
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    )
    if detached:
        options["lifetime"] = "detached"
    return ray.remote(Controller).options(**options).remote(spec, metrics_port, metrics_host)


def find_controller():
    """The running controller, or None."""
    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
    except ValueError:
        return None


def _advertised(host: str, port: int) -> str:
    """Where clients reach a listener bound to ``host``: this node's address for a wildcard."""
    return host_port(ray.util.get_node_ip_address() if is_wildcard(host) else host, port)
