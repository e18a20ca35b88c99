"""Whether the deployment can serve: the gate a Generate call waits at, and the health status.

The router starts NOT_SERVING. The pool manager says ``set_ready`` once every worker it was
asked to start is up (at least one decode actor among them), and ``set_not_ready`` when no
decode actor is left to route to; losing prefill actors does not flip it (decode actors
prefill locally). While not ready, a Generate call waits here, bounded, instead of failing
with "no decode worker is available", and the front ends that listen here say so: the gRPC
health service answers NOT_SERVING for the overall service ("") and each named one
(router/grpc_api.py), the HTTP /health 503.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from router.errors import UnavailableError

logger = logging.getLogger(__name__)

STARTING = "the deployment is still starting (its workers are loading the model)"


class Readiness:
    """An event plus the listeners that mirror it; lives on the router's event loop."""

    def __init__(self):
        self._listeners: list[Callable[[bool], Awaitable[None]]] = []
        self._ready = asyncio.Event()
        self.reason = STARTING

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set()

    async def add_listener(self, listener: Callable[[bool], Awaitable[None]]) -> None:
        """Tell ``listener`` the current state now and every change from now on."""
        self._listeners.append(listener)
        await listener(self.is_ready)

    def remove_listener(self, listener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    async def publish(self) -> None:
        for listener in list(self._listeners):
            await listener(self.is_ready)

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
