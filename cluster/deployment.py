"""A pdserve deployment hosted in this process: the router on a background event loop,
the prefill and decode pools as Ray actors managed from that loop.

Used by ``pdserve up`` in the foreground (through the controller actor it is the same
code on the actor's loop), by the benchmarks and by the tests, which reach into
``router`` to observe routing state.
"""

from __future__ import annotations

import logging
from pathlib import Path

import ray

from cluster.pools import DeploymentSpec, PoolManager, PoolSpec
from engine.loader import _generation_eos_ids
from router.pool import Role
from router.runner import LoopThread
from router.server import ModelInfo, Router

logger = logging.getLogger(__name__)

__all__ = ["Deployment", "DeploymentSpec", "PoolSpec", "build_router"]


def build_router(spec: DeploymentSpec, metrics=None) -> Router:
    """The router for ``spec``'s model (call on the loop that will serve it)."""
    block_size = spec.decode.engine.block_size
    if spec.prefill.engine.block_size != block_size:
        raise ValueError(f"prefill.block_size: {spec.prefill.engine.block_size} differs from decode's {block_size}")
    model_dir = Path(spec.model_path)
    info = ModelInfo.from_model_dir(model_dir, block_size, spec.decode.engine.max_model_len, _generation_eos_ids(model_dir))
    return Router(model_dir, info, spec.router, metrics=metrics)


class Deployment:
    def __init__(self, spec: DeploymentSpec, metrics=None):
        self.spec = spec
        self.metrics = metrics
        self._loop: LoopThread | None = None
        self.router: Router | None = None
        self.pools: PoolManager | None = None

    @property
    def address(self) -> str:
        return f"{self.spec.router.host}:{self.router.port}"

    @property
    def admin_address(self) -> str | None:
        return None if self.router.admin_port is None else f"{self.spec.router.admin_host}:{self.router.admin_port}"

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
        await self.router.start()
        await self.pools.start()

    def crash(self) -> None:
        """Stop the router's event loop where it stands, as if its process died: no stream is
        ended, nothing is released on the workers, no worker is stopped (tests use this)."""
        self._loop.stop()
        self._loop = None

    def stop(self) -> None:
        if self._loop is None:
            return
        if self.router is not None:
            self._loop.run(self._stop(), timeout_s=30)
        self._loop.stop()
        self._loop = None

    async def _stop(self) -> None:
        await self.router.stop()
        if self.pools is not None:
            await self.pools.stop()

    def scale(self, role: Role, replicas: int) -> int:
        return self._loop.run(self.pools.scale(role, replicas))

    def kill_worker(self, worker_id: str) -> None:
        """Kill a worker's process outright, as a crash would."""
        ray.kill(self.pools.handles[worker_id], no_restart=True)

    def workers(self, role: Role) -> list[str]:
        return [w.worker_id for w in self.router.pool.of_role(role)]
