"""Whether the deployment can serve: the gate a Generate call waits at, and the health status.

The router starts NOT_SERVING. The pool manager says ``set_ready`` once every worker it was
asked to start is up (at least one decode actor among them), and ``set_not_ready`` when no
decode actor is left to route to; losing prefill actors does not flip it (decode actors
prefill locally). While not ready, the gRPC health service answers NOT_SERVING for the
overall service ("") and for each named one, and a Generate call waits here, bounded, instead
of failing with "no decode worker is available".
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from grpc_health.v1 import health_pb2

from router.errors import UnavailableError

logger = logging.getLogger(__name__)

STARTING = "the deployment is still starting (its workers are loading the model)"

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Readiness:
    """An event plus the health statuses that mirror it; lives on the router's event loop."""

    def __init__(self, health_servicer, services: Iterable[str] = ("",)):
        self._health = health_servicer
        self._services = list(services)
        self._ready = asyncio.Event()
        self.reason = STARTING

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set()

    def add_services(self, services: Iterable[str]) -> None:
        """Services whose health follows readiness from now on (the server knows them at start)."""
        self._services += [s for s in services if s not in self._services]

    async def publish(self) -> None:
        """Write the current status for every service (the server calls this once it is up)."""
        status = _SERVING if self.is_ready else _NOT_SERVING
        for service in self._services:
            result = self._health.set(service, status)
            if asyncio.iscoroutine(result):  # grpc.aio's servicer is async, the sync one is not
                await result

    async def set_ready(self) -> None:
        if self.is_ready:
            return
        self._ready.set()
        self.reason = ""
        logger.info("deployment ready: health SERVING")
        await self.publish()

    async def set_not_ready(self, reason: str) -> None:
        if not self.is_ready and self.reason == reason:
            return
        self._ready.clear()
        self.reason = reason
        logger.warning("deployment not ready (%s): health NOT_SERVING", reason)
        await self.publish()

    async def wait(self, timeout_s: float | None) -> None:
        """Return once ready; raise UnavailableError naming the reason after ``timeout_s``."""
        if self.is_ready:
            return
        try:
            await asyncio.wait_for(self._ready.wait(), timeout_s)
        except asyncio.TimeoutError:
            raise UnavailableError(f"{self.reason}; not ready after waiting {timeout_s:g}s; retry later") from None
