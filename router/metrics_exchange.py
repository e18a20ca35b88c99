"""``/metrics`` on the shared HTTP port of a deployment whose routers have replicas.

With ``router.replicas`` above 1 the routers listen on the same ports (SO_REUSEPORT), and a
scrape of ``/metrics`` there (vLLM's endpoint, where its dashboards and autoscalers read) reached
whichever router the kernel gave the connection: one router's registry at one scrape, another's
at the next, so every counter jumped back and forth (Prometheus reads each drop as a reset, and a
rate over them is noise), and a replica without a metrics port of its own answered nothing.

Here every router publishes its registry's exposition to the deployment's exchange actor every
``PUBLISH_S``; ``/metrics`` on the shared port answers its own registry, read then, beside the
others' latest, every sample labelled with its router (``router="router-1"``): each series comes
from one router, so it only ever grows, and ``sum`` over the label is the deployment's. A router
that stops publishing (it died, or the deployment runs fewer now) is left out after ``STALE_S``;
Ray restarts a dead replica under the same name, and its counters start again from zero (a reset
Prometheus handles). Each router's own metrics port (``metrics_port``) keeps serving its own series
unlabelled, for scraping every router as a target of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from router.shared_actors import find_shared, start_shared

logger = logging.getLogger(__name__)

PUBLISH_S = 1.0  # how often each router publishes its registry
STALE_S = 10.0  # a router that has not published for this long is left out
CALL_TIMEOUT_S = 2.0  # a scrape or a stop waits no longer for the exchange (Ray may be restarting it)
ROUTER_LABEL = "router"


class MetricsExchange:
    """The routers' latest expositions, by router name (a Ray actor of the deployment)."""

    def __init__(self, stale_s: float = STALE_S):
        self.stale_s = stale_s
        self._texts: dict[str, tuple[float, bytes]] = {}  # router -> (when it published, its exposition)

    async def publish(self, router: str, text: bytes) -> None:
        self._texts[router] = (time.monotonic(), text)

    async def forget(self, router: str) -> None:
        """The router stops (its series leave at once, not after ``stale_s``)."""
        self._texts.pop(router, None)

    async def collect(self) -> dict[str, bytes]:
        oldest = time.monotonic() - self.stale_s
        self._texts = {router: entry for router, entry in self._texts.items() if entry[0] >= oldest}
        return {router: text for router, (_, text) in self._texts.items()}


class SharedMetrics:
    """A router's side of the exchange: it publishes its registry, and answers the shared
    port's ``/metrics`` with every router's series."""

    def __init__(self, handle, router_name: str, metrics, publish_s: float = PUBLISH_S):
        self.handle = handle
        self.router_name = router_name
        self.metrics = metrics  # router.metrics.Metrics (None: this router keeps none)
        self.publish_s = publish_s
        self._publisher: asyncio.Task | None = None

    def start(self) -> None:
        if self._publisher is None and self.metrics is not None:
            self._publisher = asyncio.create_task(self._publish_forever(), name=f"metrics-publisher-{self.router_name}")

    async def close(self) -> None:
        if self._publisher is not None:
            self._publisher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._publisher
            self._publisher = None
        with contextlib.suppress(Exception):  # the exchange may be gone first (the deployment stops)
            await asyncio.wait_for(self.handle.forget.remote(self.router_name), CALL_TIMEOUT_S)

    async def exposition(self) -> bytes:
        """Every router's series, each sample labelled with its router; this router's as they
        stand now. The others' that cannot be read (the exchange restarting) are left out."""
        try:
            texts = await asyncio.wait_for(self.handle.collect.remote(), CALL_TIMEOUT_S)
        except Exception:
            logger.warning("%s: the other routers' metrics could not be read", self.router_name, exc_info=True)
            texts = {}
        if self.metrics is not None:
            texts[self.router_name] = generate_latest(self.metrics.registry)
        return merged_exposition(texts)

    async def _publish_forever(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self.handle.publish.remote(self.router_name, generate_latest(self.metrics.registry)), CALL_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception:  # Ray restarts the exchange; the next round publishes again
                logger.warning("%s: publishing its metrics failed", self.router_name, exc_info=True)
            await asyncio.sleep(self.publish_s)


class _Families:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def merged_exposition(texts: dict[str, bytes]) -> bytes:
    """The routers' expositions as one (Prometheus text format): each family once, its samples
    from every router, labelled ``router`` with the router's name."""
    families: dict[str, Metric] = {}
    for router in sorted(texts):
        for family in text_string_to_metric_families(texts[router].decode()):
            into = families.get(family.name)
            if into is None:
                into = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                into.add_sample(sample.name, {**sample.labels, ROUTER_LABEL: router}, sample.value, sample.timestamp)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


def exchange_name(deployment_name: str) -> str:
    return f"{deployment_name}/metrics"


def start_exchange(deployment_name: str, detached: bool):
    """The deployment's exchange actor (the one running already, if any: a restarted controller
    finds it by name), on this node. Ray restarts it if its process dies (the routers publish
    again within ``PUBLISH_S``)."""
    # Async: every router's publish and every scrape's collect at once.
    return start_shared(MetricsExchange, exchange_name(deployment_name), max_concurrency=1000, detached=detached)


def find_exchange(deployment_name: str):
    """The deployment's exchange actor, or None."""
    return find_shared(exchange_name(deployment_name))
