"""A running pdserve deployment: prefill and decode actor pools plus the router.

``Deployment.start`` creates the actors on the current Ray cluster, waits until each has
loaded its model, starts the router (its gRPC server on a background event loop of this
process) and hands it the workers. Pools can be resized while traffic flows: new actors
join the router's pool once ready; removed ones are drained first and killed only when
the router holds no request on them.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray

from decode_workers.worker import DecodeWorker
from engine.config import EngineConfig
from engine.default_model_path import DEFAULT_MODEL_PATH
from engine.loader import _generation_eos_ids
from kvtransfer.agent import KVTransferConfig
from prefill_workers.worker import PrefillWorker
from router.config import RouterConfig
from router.pool import Role, WorkerRecord
from router.runner import LoopThread
from router.server import ModelInfo, Router

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class DeploymentSpec:
    model_path: Path = DEFAULT_MODEL_PATH
    num_prefill: int = 1
    num_decode: int = 1
    prefill_engine: EngineConfig = field(default_factory=lambda: EngineConfig(max_num_batched_tokens=512, long_prefill_chunk=512))
    decode_engine: EngineConfig = field(default_factory=lambda: EngineConfig(max_num_batched_tokens=512, long_prefill_chunk=256))
    router: RouterConfig = field(default_factory=RouterConfig)
    transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    actor_num_cpus: float = 1.0
    actor_num_gpus: float = 0.0
    startup_timeout_s: float = 300.0


class Deployment:
    def __init__(self, spec: DeploymentSpec):
        self.spec = spec
        self._ids = {Role.PREFILL: itertools.count(), Role.DECODE: itertools.count()}
        self._loop: LoopThread | None = None
        self.router: Router | None = None
        self.handles: dict[str, object] = {}

    @property
    def address(self) -> str:
        return f"{self.spec.router.host}:{self.router.port}"

    def start(self) -> str:
        """Create both pools and the router; return the gRPC address once all are ready."""
        spec = self.spec
        block_size = spec.decode_engine.block_size
        if spec.prefill_engine.block_size != block_size:
            raise ValueError(f"prefill_engine.block_size: {spec.prefill_engine.block_size} != decode {block_size}")
        model_info = ModelInfo.from_model_dir(
            Path(spec.model_path), block_size, spec.decode_engine.max_model_len, _generation_eos_ids(Path(spec.model_path))
        )
        self._loop = LoopThread()
        self.router = Router(Path(spec.model_path), model_info, spec.router)
        self._loop.run(self.router.start())
        pending = [self._create(Role.PREFILL) for _ in range(spec.num_prefill)]
        pending += [self._create(Role.DECODE) for _ in range(spec.num_decode)]
        for role, worker_id, handle in pending:
            self._join(role, worker_id, handle)
        logger.info("deployment ready at %s: %d prefill, %d decode", self.address, spec.num_prefill, spec.num_decode)
        return self.address

    def stop(self) -> None:
        if self.router is not None and self._loop is not None:
            self._loop.run(self.router.stop(), timeout_s=10)
        for handle in self.handles.values():
            ray.kill(handle)
        self.handles.clear()
        if self._loop is not None:
            self._loop.stop()

    # -- workers ----------------------------------------------------------------------------

    def _create(self, role: Role):
        spec = self.spec
        worker_id = f"{role.value}-{next(self._ids[role])}"
        cls = PrefillWorker if role is Role.PREFILL else DecodeWorker
        engine_config = spec.prefill_engine if role is Role.PREFILL else spec.decode_engine
        handle = (
            ray.remote(cls)
            .options(num_cpus=spec.actor_num_cpus, num_gpus=spec.actor_num_gpus, max_restarts=0, max_concurrency=1000)
            .remote(worker_id, str(spec.model_path), engine_config, spec.transfer)
        )
        self.handles[worker_id] = handle
        return role, worker_id, handle

    def _join(self, role: Role, worker_id: str, handle) -> WorkerRecord:
        deadline = time.monotonic() + self.spec.startup_timeout_s
        ray.get(handle.ping.remote(), timeout=max(1.0, deadline - time.monotonic()))
        return self._loop.run(self.router.add_worker(role, worker_id, handle))

    def kill_worker(self, worker_id: str) -> None:
        """Kill a worker's process outright (tests, and replacing a hung worker)."""
        ray.kill(self.handles[worker_id], no_restart=True)

    def workers(self, role: Role) -> list[str]:
        return [w.worker_id for w in self.router.pool.of_role(role)]
