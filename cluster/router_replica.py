"""Router replicas: more routers serving one deployment, each in its own process.

One router is a Python process, and streaming costs it tens of microseconds of CPU per token
(gRPC and HTTP framing, detokenizing, a wake-up per stream), so a deployment of many decode
actors needs several. ``router.replicas: N`` runs the deployment's own router (in the
controller, which also manages the pools) and N - 1 replicas, Ray actors spread over the
nodes. A replica's life: it builds its own router core from plain data (``ReplicaSpec``: no
engine code is loaded in its process), follows the pools (``cluster/pool_follower.py``: it
adopts the durable workers by name and health-checks them, never launches or kills), and
listens on the same gRPC and HTTP ports as the first router with SO_REUSEPORT: on a host, the
kernel spreads new connections over the routers listening there; on every other node, the
replica placed there answers on the same port. Each replica keeps its own leases with the
workers (its requests are named "<router id>/<request id>" there, and its outputs come only
to it), so a replica that dies loses only its own streams, and Ray restarts it. Admin
(scaling, draining) stays with the managing router.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import ray

from cluster.pool_follower import PoolFollower
from router.config import RouterConfig
from router.core import ModelInfo, Router
from router.front_ends import FrontEnds, ListenPorts
from router.metrics_exchange import SharedMetrics, find_exchange
from router.responses_api.board import SharedBoard, find_shared_board, router_name

logger = logging.getLogger(__name__)

REPLICA_NAMESPACE = "pdserve"
# A replica answers ``start`` within this (it loads a tokenizer and adopts the workers).
REPLICA_START_TIMEOUT_S = 120.0


@dataclass(slots=True)
class ReplicaSpec:
    """What a router replica is built from: plain data, so its process loads no engine code."""

    index: int  # 1..N-1 (0 is the managing router)
    deployment_name: str
    model_dir: str
    model_info: ModelInfo
    router: RouterConfig
    ports: ListenPorts  # the managing router's bound ports, shared through SO_REUSEPORT
    health_interval_s: float = 1.0
    health_timeout_s: float = 10.0
    metrics_host: str | None = None  # set: the replica serves its own /metrics on a free port there


@dataclass(slots=True)
class ReplicaInfo:
    index: int
    node_ip: str
    pid: int
    grpc_port: int
    http_port: int | None
    metrics_port: int | None


class RouterReplica:
    """A router that follows the pools and shares the first router's ports."""

    def __init__(self, spec: ReplicaSpec) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.spec = spec
        self.router: Router | None = None
        self.front_ends: FrontEnds | None = None
        self.pools: PoolFollower | None = None
        self.metrics = None
        self.metrics_port: int | None = None
        self._starting: asyncio.Task | None = None
        # It starts itself, as the controller does: after Ray restarted it, nobody else would.
        ray.get_runtime_context().current_actor.start.remote()

    async def start(self) -> ReplicaInfo:
        """Start (once; later calls wait for the same start) and say where it listens."""
        if self._starting is None:
            self._starting = asyncio.create_task(self._start())
        await asyncio.shield(self._starting)
        return self.info()

    async def _start(self) -> None:
        spec = self.spec
        from router.metrics import Metrics

        # Kept always: /metrics on the shared HTTP port answers every router's (through the
        # exchange); served on a port of its own only with metrics_host.
        self.metrics = Metrics((spec.router.served_model_names or [spec.model_info.name])[0], spec.router.metrics_prefix)
        if spec.metrics_host is not None:
            self.metrics_port = self.metrics.serve(0, spec.metrics_host)
        config = spec.router
        config.admin_port = None  # Admin stays with the managing router
        self.router = Router(Path(spec.model_dir), spec.model_info, config, metrics=self.metrics)
        # /v1/responses: the board every router of the deployment shares (the managing one started it).
        board = find_shared_board(spec.deployment_name)
        if board is None:
            raise RuntimeError(f"{spec.deployment_name}: the routers' responses board is not running")
        self.router.responses_board = SharedBoard(board)
        self.router.board_name = router_name(spec.index)  # restarted by Ray, it takes back what it left in progress
        exchange = find_exchange(spec.deployment_name)
        if exchange is not None:
            self.router.shared_metrics = SharedMetrics(exchange, self.router.board_name, self.metrics)
            self.router.shared_metrics.start()
        self.router.deployment_routers = None  # what removed replicas left is the managing router's
        self.pools = PoolFollower(spec.deployment_name, self.router, spec.health_interval_s, spec.health_timeout_s, self.metrics)
        self.router.pool_manager = self.pools
        self.front_ends = FrontEnds(self.router, reuse_port=True, admin=False)
        await self.front_ends.start(spec.ports)
        await self.pools.start()
        logger.info("router replica %d serving on port %d (pid %d)", spec.index, self.front_ends.port, os.getpid())

    def info(self) -> ReplicaInfo:
        return ReplicaInfo(
            self.spec.index, ray.util.get_node_ip_address(), os.getpid(), self.front_ends.port, self.front_ends.http_port, self.metrics_port
        )

    async def served(self) -> tuple[int, int]:
        """Requests this replica took and output tokens it streamed, since it started."""
        traffic = self.router.traffic
        return traffic.total_arrivals, traffic.total_output_tokens

    async def stop(self) -> None:
        if self.router is not None:
            await self.router.stop()
        if self.front_ends is not None:
            await self.front_ends.stop()
        if self.pools is not None:
            await self.pools.stop()


def replica_name(deployment_name: str, index: int) -> str:
    return f"{deployment_name}/{router_name(index)}"


def start_replicas(specs: list[ReplicaSpec], detached: bool) -> list:
    """Create the replica actors, spread over the nodes; Ray restarts one whose process dies.
    Returns their handles (``start`` on each says when it serves)."""
    handles = []
    for spec in specs:
        options = dict(
            name=replica_name(spec.deployment_name, spec.index),
            namespace=REPLICA_NAMESPACE,
            num_cpus=0,
            max_concurrency=1000,
            max_restarts=-1,
            max_task_retries=-1,
            scheduling_strategy="SPREAD",
            get_if_exists=True,  # a restarted controller finds the replicas it started before
        )
        if detached:
            options["lifetime"] = "detached"
        handles.append(ray.remote(RouterReplica).options(**options).remote(spec))
    return handles


async def wait_started(handles: list, timeout_s: float = REPLICA_START_TIMEOUT_S) -> list[ReplicaInfo]:
    """Every replica's info once it serves; raises if one does not start within ``timeout_s``."""
    return list(await asyncio.wait_for(asyncio.gather(*(h.start.remote() for h in handles)), timeout_s))


async def stop_replicas(handles: list) -> None:
    """Stop every replica and end its actor."""
    for handle in handles:
        try:
            await asyncio.wait_for(handle.stop.remote(), 10)
        except Exception:
            logger.warning("a router replica did not stop cleanly; killing it", exc_info=True)
        ray.kill(handle, no_restart=True)


def find_replicas(deployment_name: str, max_replicas: int = 256) -> list:
    """The running replicas of a deployment (for ``pdserve down``)."""
    found = []
    for index in range(1, max_replicas):
        try:
            found.append(ray.get_actor(replica_name(deployment_name, index), namespace=REPLICA_NAMESPACE))
        except ValueError:
            break
    return found
