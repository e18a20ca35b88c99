"""A pdserve deployment hosted in this process: the router on a background event loop,
the prefill and decode pools as Ray actors managed from that loop.

Used by ``pdserve up`` in the foreground (through the controller actor it is the same
code on the actor's loop), by the benchmarks and by the tests, which reach into
``router`` to observe routing state.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path

import ray

from cluster.pools import DeploymentSpec, PoolManager, PoolSpec
from engine.config import ModelConfig
from engine.loader import _generation_eos_ids
from engine.sampling_params import SamplingDefaults
from cluster.router_replica import ReplicaInfo, ReplicaSpec, start_replicas, stop_replicas, wait_started
from router.addresses import host_port
from router.core import ModelInfo, Router
from router.front_ends import FrontEnds, ListenPorts
from router.metrics_exchange import SharedMetrics, start_exchange
from router.pool import Role
from router.responses_api.board import SharedBoard, start_shared_board
from router.runner import LoopThread

logger = logging.getLogger(__name__)

__all__ = ["Deployment", "DeploymentSpec", "PoolSpec", "build_router", "model_info"]

STOP_PART_TIMEOUT_S = 25.0  # each part of a stop (router replicas, router, front ends, pools)
STOP_TIMEOUT_S = 60.0  # the whole stop


def model_info(spec: DeploymentSpec) -> ModelInfo:
    """What the router needs to know of ``spec``'s model, read from its directory here, so that
    the router itself never loads the engine's model code."""
    block_size = spec.decode.engine.block_size
    if spec.prefill.engine.block_size != block_size:
        raise ValueError(f"prefill.block_size: {spec.prefill.engine.block_size} differs from decode's {block_size}")
    model_dir = Path(spec.model_path)
    config = ModelConfig.from_model_dir(model_dir)
    limit = config.max_position_embeddings
    if spec.decode.engine.max_model_len is not None:
        limit = min(limit, spec.decode.engine.max_model_len)
    return ModelInfo(
        model_dir.name, config.architecture, limit, config.vocab_size, _generation_eos_ids(model_dir) or config.eos_token_ids,
        block_size, SamplingDefaults.from_model_dir(model_dir), config.num_layers, dict(spec.decode.engine.lora_adapters),
    )


def build_router(spec: DeploymentSpec, metrics=None, info: ModelInfo | None = None) -> Router:
    """The deployment's managing router core for ``spec``'s model (call on the loop that will serve it)."""
    router = Router(Path(spec.model_path), info or model_info(spec), spec.router, metrics=metrics)
    router.deployment_routers = spec.router_replicas
    return router


def share_responses_board(spec: DeploymentSpec, router: Router, detached: bool):
    """With replicas, the deployment's routers keep /v1/responses on one board actor (so any of
    them answers for a response another created): start it (or find it, after a restart) and
    give ``router`` its client. Returns the actor handle; None without replicas."""
    if spec.router_replicas <= 1:
        return None
    handle = start_shared_board(spec.name, spec.router, detached)
    router.responses_board = SharedBoard(handle)
    return handle


async def stop_responses_board(handle) -> None:
    if handle is not None:
        ray.kill(handle, no_restart=True)


def share_router_metrics(spec: DeploymentSpec, router: Router, detached: bool):
    """With replicas, the deployment's routers publish their metrics to one exchange actor, so
    that /metrics on the shared HTTP port answers every router's series whichever router takes
    the scrape (router/metrics_exchange.py): start it (or find it, after a restart) and start
    ``router``'s side. Returns the actor handle; None without replicas."""
    if spec.router_replicas <= 1:
        return None
    handle = start_exchange(spec.name, detached)
    router.shared_metrics = SharedMetrics(handle, router.board_name, router.metrics)
    router.shared_metrics.start()
    return handle


async def stop_metrics_exchange(handle) -> None:
    if handle is not None:
        ray.kill(handle, no_restart=True)


async def start_router_replicas(spec: DeploymentSpec, router: Router, front_ends: FrontEnds, metrics_host: str | None, detached: bool):
    """Start ``spec.router_replicas - 1`` replicas of ``router`` on its ports; return their
    handles and, once each serves, their infos."""
    ports = ListenPorts(grpc=front_ends.port, http=front_ends.http_port)
    specs = [
        ReplicaSpec(
            index, spec.name, str(spec.model_path), router.model_info, dataclasses.replace(spec.router), ports,
            spec.health_interval_s, spec.health_timeout_s, metrics_host,
        )
        for index in range(1, spec.router_replicas)
    ]
    handles = start_replicas(specs, detached)
    try:
        infos = await wait_started(handles)
    except BaseException:
        await stop_replicas(handles)
        raise
    for info in infos:
        logger.info("router replica %d serving on %s:%d", info.index, info.node_ip, info.grpc_port)
    return handles, infos


class Deployment:
    def __init__(self, spec: DeploymentSpec, metrics=None):
        self.spec = spec
        self.metrics = metrics
        self._loop: LoopThread | None = None
        self.router: Router | None = None
        self.front_ends: FrontEnds | None = None
        self.pools: PoolManager | None = None
        self.replicas: list = []  # router replicas' actor handles (spec.router_replicas - 1)
        self.responses_board = None  # with replicas: the board actor the routers share
        self.metrics_exchange = None  # with replicas: where the routers publish their metrics
        self.replica_infos: list[ReplicaInfo] = []

    @property
    def address(self) -> str:
        return host_port(self.spec.router.host, self.front_ends.port)

    @property
    def admin_address(self) -> str | None:
        return None if self.front_ends.admin_port is None else host_port(self.spec.router.admin_host, self.front_ends.admin_port)

    @property
    def http_port(self) -> int | None:
        return self.front_ends.http_port

    @property
    def handles(self) -> dict[str, object]:
        return self.pools.handles

    def start(self) -> str:
        """Start the router and both pools; return the gRPC address once every worker is ready."""
        self._loop = LoopThread()
        self._loop.run(self._start())
        logger.info("deployment ready at %s", self.address)
        return self.address

    async def _start(self) -> None:
        self.router = build_router(self.spec, self.metrics)
        self.pools = PoolManager(self.spec, self.router, self.metrics)
        self.router.pool_manager = self.pools
        self.responses_board = share_responses_board(self.spec, self.router, detached=False)
        self.metrics_exchange = share_router_metrics(self.spec, self.router, detached=False)
        self.front_ends = FrontEnds(self.router, reuse_port=self.spec.router_replicas > 1)
        await self.front_ends.start()
        await self.pools.start()
        if self.spec.router_replicas > 1:
            self.replicas, self.replica_infos = await start_router_replicas(self.spec, self.router, self.front_ends, None, detached=False)

    def crash(self) -> None:
        """Stop the router's event loop where it stands, as if its process died: no stream is
        ended, nothing is released on the workers, no worker is stopped (tests use this)."""
        self._loop.stop()
        self._loop = None

    def stop(self) -> None:
        if self._loop is None:
            return
        if self.router is not None:
            self._loop.run(self._stop(), timeout_s=STOP_TIMEOUT_S)
        self._loop.stop()
        self._loop = None

    async def _stop(self) -> None:
        # Each part in turn, so that one that hangs is named (CI once saw the whole stop run
        # past its 30 s, once in many runs, with nothing to say which part held it).
        parts = [("router replicas", lambda: stop_replicas(self.replicas)), ("router", self.router.stop)]
        parts.append(("responses board", lambda: stop_responses_board(self.responses_board)))
        parts.append(("metrics exchange", lambda: stop_metrics_exchange(self.metrics_exchange)))
        if self.front_ends is not None:
            parts.append(("front ends", self.front_ends.stop))
        if self.pools is not None:
            parts.append(("pools", self.pools.stop))
        for name, stop in parts:
            try:
                await asyncio.wait_for(stop(), STOP_PART_TIMEOUT_S)
            except asyncio.TimeoutError:
                raise TimeoutError(f"stopping the deployment: the {name} did not stop within {STOP_PART_TIMEOUT_S:.0f} s") from None
        self.replicas = []

    def scale(self, role: Role, replicas: int) -> int:
        return self._loop.run(self.pools.scale(role, replicas))

    def kill_worker(self, worker_id: str) -> None:
        """Kill a worker's process outright, as a crash would."""
        ray.kill(self.pools.handles[worker_id], no_restart=True)

    def workers(self, role: Role) -> list[str]:
        return [w.worker_id for w in self.router.pool.of_role(role)]
