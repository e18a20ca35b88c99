"""Prometheus metrics of one deployment, served over HTTP by the process hosting the router.

Per-request latencies are observed by the router as it streams; pool gauges (queue depths,
KV blocks, preemptions, prefill tokens per step) are refreshed from the workers' status
reports by the pool manager's health loop. Each deployment has its own registry, so
several can live in one process (tests) without clashing.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "Arrival at the router to the first token sent", buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("pdserve_time_per_output_token_seconds", "(E2E - TTFT) / (output tokens - 1)", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdserve_inter_token_latency_seconds", "Gap between consecutive streamed messages with tokens", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "Arrival to the last message", buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter("pdserve_requests", "Finished requests by finish reason", ["finish_reason"], registry=r)
        self.retries = Counter("pdserve_request_retries", "Requests dispatched again after a worker died", ["kind"], registry=r)
        self.poisoned = Counter(
            "pdserve_requests_refused_poison", "Requests refused after being in flight on workers that died", registry=r
        )
        self.kv_transfer_bytes = Counter("pdserve_kv_transfer_bytes", "KV bytes pushed from prefill to decode actors", registry=r)
        self.kv_transfer_time = Histogram("pdserve_kv_transfer_seconds", "Transfer time left after the last prefill chunk", buckets=_LATENCY_BUCKETS, registry=r)
        self.router_queued = Gauge("pdserve_router_queued_requests", "Requests admitted without a first token yet", registry=r)
        self.queue_depth = Gauge("pdserve_queue_depth", "Requests queued on the workers of a pool", ["role"], registry=r)
        self.kv_blocks_used = Gauge("pdserve_kv_blocks_used", "KV blocks in use", ["worker_id", "role"], registry=r)
        self.kv_blocks_free = Gauge("pdserve_kv_blocks_free", "KV blocks free", ["worker_id", "role"], registry=r)
        self.running = Gauge("pdserve_running_sequences", "Sequences in a worker's batch", ["worker_id", "role"], registry=r)
        self.prefill_tokens_per_step = Gauge("pdserve_prefill_tokens_per_step", "Mean tokens per engine step over the last refresh", ["worker_id"], registry=r)
        self.preemptions = Gauge("pdserve_preemptions", "Preemptions since the worker started", ["worker_id", "role"], registry=r)
        self.workers_replaced = Counter("pdserve_workers_replaced", "Workers replaced after failing health checks", ["role"], registry=r)
        self._last_steps: dict[str, tuple[int, int]] = {}
        self._known_workers: set[str] = set()

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Expose /metrics over HTTP; return the port actually bound."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_address[1]

    # -- per request --------------------------------------------------------------------

    def observe_finished(self, finish_reason: str, ttft_s: float | None, e2e_s: float, num_output_tokens: int) -> None:
        self.requests.labels(finish_reason).inc()
        self.e2e.observe(e2e_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            if num_output_tokens > 1:
                self.tpot.observe((e2e_s - ttft_s) / (num_output_tokens - 1))

    def observe_prefill(self, num_bytes: int, transfer_ms: float) -> None:
        self.kv_transfer_bytes.inc(num_bytes)
        self.kv_transfer_time.observe(transfer_ms / 1000)

    # -- pool gauges --------------------------------------------------------------------

    async def refresh(self, router, max_age_s: float = 1.0) -> None:
        """Read every worker's load report (none older than ``max_age_s``) into the gauges."""
        records = list(router.pool.workers.values())
        reports = await router.status_monitor.reports(max_age_s)
        depth = {"prefill": 0, "decode": 0}
        seen = set()
        for record in records:
            report = reports.get(record.worker_id)
            status = report.status if report is not None else None
            if status is None:
                continue
            worker, role = record.worker_id, record.role.value
            seen.add(worker)
            engine = status.engine
            depth[role] += engine.num_waiting + getattr(status, "num_awaiting_kv", 0)
            self.kv_blocks_used.labels(worker, role).set(engine.num_used_blocks)
            self.kv_blocks_free.labels(worker, role).set(engine.num_free_blocks)
            self.running.labels(worker, role).set(engine.num_running)
            self.preemptions.labels(worker, role).set(engine.num_preemptions)
            if role == "prefill":
                steps, tokens = self._last_steps.get(worker, (0, 0))
                if engine.num_steps > steps:
                    self.prefill_tokens_per_step.labels(worker).set((engine.num_scheduled_tokens - tokens) / (engine.num_steps - steps))
                self._last_steps[worker] = (engine.num_steps, engine.num_scheduled_tokens)
        for role, value in depth.items():
            self.queue_depth.labels(role).set(value)
        self.router_queued.set(router.dispatcher.num_queued)
        for gone in self._known_workers - seen - {r.worker_id for r in records}:
            for gauge in (self.kv_blocks_used, self.kv_blocks_free, self.running, self.preemptions):
                for role in ("prefill", "decode"):
                    try:
                        gauge.remove(gone, role)
                    except KeyError:
                        pass
        self._known_workers = seen | (self._known_workers & {r.worker_id for r in records})

