"""The Admin service (ScalePool, DrainWorker), served on its own listener.

Admin changes the deployment, so it never shares the Generate port: exposing Generate to
other machines does not expose it. The router starts a second grpc.aio server on
``admin_host:admin_port`` (loopback by default) with this service alone.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from engine.stats import WorkerState
from router.api.pdserve.v1 import generation_pb2 as pb
from router.api.pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.errors import FailedPreconditionError, NotFoundError, UnavailableError, abort_with
from router.pool import Role
from router.validation import validate_drain_worker_request, validate_scale_pool_request

if TYPE_CHECKING:
    from router.core import Router

logger = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["Admin"].full_name
_STATES = {
    "starting": pb.WORKER_STATE_STARTING,
    "ready": pb.WORKER_STATE_READY,
    "draining": pb.WORKER_STATE_DRAINING,
    "unhealthy": pb.WORKER_STATE_UNHEALTHY,
    "dead": pb.WORKER_STATE_DEAD,
}


def worker_state_to_proto(state: WorkerState) -> int:
    return _STATES[state.value]


class AdminOperations:
    """What Admin does; coroutines on the router's event loop."""

    def __init__(self, router: "Router"):
        self.router = router

    async def scale_pool(self, request: pb.ScalePoolRequest) -> pb.ScalePoolResponse:
        validate_scale_pool_request(request, self.router.max_replicas)
        if self.router.pool_manager is None:
            raise UnavailableError("this router was started without a pool manager; scaling is not possible")
        if not self.router.pool_manager.manage:
            raise FailedPreconditionError("this router follows pools another router manages; scale through that one")
        role = Role.PREFILL if request.role == pb.WORKER_ROLE_PREFILL else Role.DECODE
        if role is Role.DECODE and request.replicas == 0 and not request.force:
            raise FailedPreconditionError(
                "replicas: 0 decode workers leave nothing that can serve requests; set force to do it anyway"
            )
        await self.router.pool_manager.check_resources(role, request.replicas)
        previous = await self.router.pool_manager.scale(role, request.replicas)
        return pb.ScalePoolResponse(role=request.role, previous_replicas=previous, replicas=request.replicas)

    async def drain_worker(self, request: pb.DrainWorkerRequest) -> pb.DrainWorkerResponse:
        validate_drain_worker_request(request)
        if self.router.pool_manager is not None and not self.router.pool_manager.manage:
            raise FailedPreconditionError("this router follows pools another router manages; drain through that one")
        record = self.router.pool.workers.get(request.worker_id)
        if record is None:
            raise NotFoundError(f"no worker {request.worker_id!r}")
        others = [w for w in self.router.pool.routable(Role.DECODE) if w is not record]
        if record.role is Role.DECODE and not others and not request.force:
            raise FailedPreconditionError(
                f"worker_id: {record.worker_id} is the only ready decode worker; draining it leaves nothing "
                "that can serve requests; set force to do it anyway"
            )
        if self.router.pool_manager is None:
            await self.router.drain(record)
        else:
            # Drained, then removed once it holds nothing; the pool does not replace it: retire
            # lowers the pool's size before it drains (drained first, a health round in between
            # found the pool a worker short and launched one, to be trimmed again when it landed).
            task = asyncio.create_task(self.router.pool_manager.retire(record))
            self.router.background_tasks.add(task)
            task.add_done_callback(_retired)
            task.add_done_callback(self.router.background_tasks.discard)
            await asyncio.sleep(0)  # it has begun: the worker is draining
        return pb.DrainWorkerResponse(worker_id=record.worker_id, state=worker_state_to_proto(record.state))


def _retired(task: asyncio.Task) -> None:
    """A retirement asked for by DrainWorker that failed is logged (its caller was answered)."""
    if not task.cancelled() and task.exception() is not None:
        logger.warning("retiring a drained worker failed: %r", task.exception())


class AdminService(pb_grpc.AdminServicer):
    """The gRPC face of ``AdminOperations``: errors become statuses that name the problem."""

    def __init__(self, operations: AdminOperations):
        self.operations = operations

    async def ScalePool(self, request, context):
        try:
            return await self.operations.scale_pool(request)
        except Exception as exc:
            await abort_with(context, exc)

    async def DrainWorker(self, request, context):
        try:
            return await self.operations.drain_worker(request)
        except Exception as exc:
            await abort_with(context, exc)
