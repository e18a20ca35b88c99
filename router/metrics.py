"""Prometheus metrics of one deployment, served over HTTP by the process hosting the router.

Names and labels follow vLLM's (``vllm:time_to_first_token_seconds`` is
``pdserve:time_to_first_token_seconds`` here; ``router.metrics_prefix: "vllm:"`` exports them
under vLLM's own prefix, for a vLLM dashboard or an autoscaler that reads it): every series has a
``model_name`` label, tokens are counted as ``prompt_tokens_total`` and
``generation_tokens_total`` as they stream, finished requests as ``request_success_total`` by
vLLM's ``finished_reason`` (stop, length, abort, error), preemptions as a counter, latencies in
seconds with buckets up to vLLM's largest. pdserve's own series (KV transfer, retries, per-worker
KV blocks) sit beside them under the same prefix.

Per-request latencies are observed by the router as it streams; pool gauges (queue depths,
KV blocks, preemptions, prefill tokens per step) are refreshed from the workers' status
reports by the pool manager's health loop. Each deployment has its own registry, so
several can live in one process (tests) without clashing.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from router.addresses import bare_host

if TYPE_CHECKING:
    from router.output_stream import TimingBreakdown

logger = logging.getLogger(__name__)

# Fine below a second (a GPU's decode steps take milliseconds), then up to vLLM's largest buckets:
# a request of minutes (a long generation, a long queue) is counted where it falls, not in +Inf.
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
    160.0, 320.0, 640.0, 1280.0, 2560.0, 7680.0,
)
PREFIX = "pdserve:"
METRICS_PREFIXES = ("pdserve:", "vllm:")
_SIZE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000, 200_000, 500_000, 1_000_000)
# vLLM's finished_reason values; an end of sequence is a "stop" there.
FINISHED_REASONS = ("stop", "length", "abort", "error")
# Series of one worker, dropped when it leaves the pool.
_PER_WORKER = (
    "num_requests_running", "kv_cache_usage_perc", "kv_blocks_used", "kv_blocks_free", "num_preemptions", "engine_steps", "engine_step_seconds",
    "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_hit_rate",
    "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
)
# Series of one writer's transfer path (its worker, peer, transport, device), dropped with the writer.
_PER_PATH = ("kv_transfer_path_bytes", "kv_transfer_path_writes", "kv_transfer_path_failures", "kv_transfer_path_write_seconds")



class Metrics:
    def __init__(self, model_name: str = "", prefix: str = PREFIX) -> None:
        if prefix not in METRICS_PREFIXES:
            raise ValueError(f"metrics_prefix: one of {', '.join(METRICS_PREFIXES)}, got {prefix!r}")
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._families: dict[str, object] = {}

        def metric(kind, name: str, doc: str, labels: tuple[str, ...] = (), **kwargs):
            family = kind(prefix + name, doc, ["model_name", *labels], registry=self.registry, **kwargs)
            self._families[name] = family
            # Unlabelled beyond the model: the series itself; else a function of the other labels.
            return family.labels(model_name) if not labels else (lambda *values: family.labels(model_name, *values))

        latency = {"buckets": _LATENCY_BUCKETS}
        self.ttft = metric(Histogram, "time_to_first_token_seconds", "Arrival at the router to the first token sent", **latency)
        self.tpot = metric(Histogram, "time_per_output_token_seconds", "(E2E - TTFT) / (output tokens - 1)", **latency)
        self.itl = metric(Histogram, "inter_token_latency_seconds", "Gap between consecutive streamed chunks with tokens", **latency)
        self.e2e = metric(Histogram, "e2e_request_latency_seconds", "Arrival to the last chunk", **latency)
        # vLLM's per-request phases (a finished request's TimingBreakdown) and sizes.
        self.request_tpot = metric(Histogram, "request_time_per_output_token_seconds", "Per request: (E2E - TTFT) / (output tokens - 1)", **latency)
        self.queue_time = metric(Histogram, "request_queue_time_seconds", "Waiting in queues (the router's, a prefill actor's, a decode actor's) before computing", **latency)
        self.prefill_time = metric(Histogram, "request_prefill_time_seconds", "Computing the prompt and moving its KV to the decode actor", **latency)
        self.decode_time = metric(Histogram, "request_decode_time_seconds", "First token to the last", **latency)
        self.inference_time = metric(Histogram, "request_inference_time_seconds", "Prefill and decode time", **latency)
        sizes = {"buckets": _SIZE_BUCKETS}
        self.request_prompt_tokens = metric(Histogram, "request_prompt_tokens", "Per finished request: prompt tokens", **sizes)
        self.request_generation_tokens = metric(Histogram, "request_generation_tokens", "Per finished request: tokens generated", **sizes)
        self.request_max_tokens = metric(Histogram, "request_params_max_tokens", "Per finished request: its max_tokens", **sizes)
        self._requests = metric(Counter, "request_success", "Finished requests by finish reason", ("finished_reason",))
        for reason in FINISHED_REASONS:
            self._requests(reason)  # every reason's series from the start, at 0, as vLLM's
        self.prompt_tokens = metric(Counter, "prompt_tokens", "Prompt tokens of requests that got a first token (or ended)")
        self.generation_tokens = metric(Counter, "generation_tokens", "Tokens generated, counted as they are sent")
        self.retries = metric(Counter, "request_retries", "Requests dispatched again after a worker died", ("kind",))
        self.poisoned = metric(Counter, "requests_refused_poison", "Requests refused after being in flight on workers that died")
        self.kv_transfer_bytes = metric(Counter, "kv_transfer_bytes", "KV bytes pushed from prefill to decode actors")
        self.kv_transfer_time = metric(Histogram, "kv_transfer_seconds", "Transfer time left after the last prefill chunk", **latency)
        self.router_queued = metric(
            Gauge, "num_requests_waiting",
            "Requests waiting to be computed: for room at the router, and in the workers' queues (as vLLM's scheduler's waiting queue)",
        )
        self.queue_depth = metric(Gauge, "queue_depth", "Requests queued on the workers of a pool", ("role",))
        self.running = metric(Gauge, "num_requests_running", "Sequences in a worker's batch", ("worker_id", "role"))
        self.kv_usage = metric(Gauge, "kv_cache_usage_perc", "Share of a worker's KV blocks in use (0 to 1)", ("worker_id", "role"))
        self.kv_blocks_used = metric(Gauge, "kv_blocks_used", "KV blocks in use", ("worker_id", "role"))
        self.kv_blocks_free = metric(Gauge, "kv_blocks_free", "KV blocks free", ("worker_id", "role"))
        self.prefill_tokens_per_step = metric(Gauge, "prefill_tokens_per_step", "Mean tokens per engine step over the last refresh", ("worker_id",))
        self.preemptions = metric(Counter, "num_preemptions", "Sequences preempted (KV freed, recomputed later)", ("worker_id", "role"))
        self.prefix_queries = metric(Counter, "prefix_cache_queries", "Prompt tokens looked up in a worker's prefix cache", ("worker_id", "role"))
        self.prefix_hits = metric(Counter, "prefix_cache_hits", "Prompt tokens a worker's prefix cache held", ("worker_id", "role"))
        self.prefix_hit_rate = metric(Gauge, "prefix_cache_hit_rate", "Prefix cache hits / queries since the worker started", ("worker_id", "role"))
        self.engine_steps = metric(Counter, "engine_steps", "Engine steps a worker ran", ("worker_id", "role"))
        self.engine_step_seconds = metric(
            Counter, "engine_step_seconds", "Wall time a worker spent inside engine steps (per step: / engine_steps; busy share: its rate)",
            ("worker_id", "role"),
        )
        self._worker_counters = {
            "num_steps": self.engine_steps,
            "step_seconds": self.engine_step_seconds,
            "num_preemptions": self.preemptions,
            "num_prefix_query_tokens": self.prefix_queries,
            "num_prefix_hit_tokens": self.prefix_hits,
        }
        self.spec_draft_tokens = metric(Counter, "spec_decode_num_draft_tokens", "Speculative tokens a decode worker proposed", ("worker_id", "role"))
        self.spec_accepted_tokens = metric(Counter, "spec_decode_num_accepted_tokens", "Speculative tokens the model confirmed", ("worker_id", "role"))
        self._worker_counters["num_draft_tokens"] = self.spec_draft_tokens
        self._worker_counters["num_accepted_draft_tokens"] = self.spec_accepted_tokens
        self.spec_acceptance = metric(Histogram, "spec_decode_acceptance_rate", "Per request: accepted / proposed speculative tokens",
                                      buckets=tuple(i / 10 for i in range(11)))
        self.spec_tokens_per_step = metric(Histogram, "spec_decode_tokens_per_step", "Per request: tokens a decode step emitted",
                                           buckets=(1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0))
        self.workers_replaced = metric(Counter, "workers_replaced", "Workers replaced after failing health checks", ("role",))
        # Per prefill->decode pair, by the way its KV goes (kvtransfer.path): shm, rdma or tcp,
        # and the local device; from the prefill workers' running totals.
        pair = ("prefill_worker_id", "decode_worker_id", "transport", "device")
        self.kv_path_bytes = metric(Counter, "kv_transfer_path_bytes", "KV bytes written from a prefill to a decode worker, per transport", pair)
        self.kv_path_writes = metric(Counter, "kv_transfer_path_writes", "KV writes completed, per pair and transport", pair)
        self.kv_path_failures = metric(Counter, "kv_transfer_path_failures", "KV writes failed or timed out (each retry counts)", pair)
        self.kv_path_seconds = metric(
            Counter, "kv_transfer_path_write_seconds", "Post-to-completion time of completed KV writes, summed (mean: / writes)", pair
        )
        self._path_counters = {
            "num_bytes": self.kv_path_bytes, "num_writes": self.kv_path_writes,
            "num_failures": self.kv_path_failures, "write_seconds": self.kv_path_seconds,
        }
        # vLLM's lora_requests_info, per worker: the labels name the adapters its computing and
        # waiting requests go through (comma-separated) and how many it holds; the value is when
        # that was read. Only a worker's latest label set is kept.
        self.lora_requests_info = metric(
            Gauge, "lora_requests_info", "A worker's LoRA adapters in use (labels) as of the value's Unix time",
            ("worker_id", "role", "max_lora", "running_lora_adapters", "waiting_lora_adapters"),
        )
        self._lora_labels: dict[str, tuple[str, ...]] = {}  # worker -> its current label values
        self._last_steps: dict[str, tuple[int, int]] = {}
        self._path_labels: dict[str, set[tuple[str, ...]]] = {}  # worker -> its transfer paths' label values
        self._last_totals: dict[tuple[str, str], float] = {}  # (worker, EngineStats field) -> last total
        self._known_workers: set[str] = set()
        self._last_queued: dict[str, int] = {}  # worker -> its queue's length when it last answered

    def _set_lora_info(self, worker: str, role: str, engine) -> None:
        labels = (worker, role, str(engine.num_lora_adapters), ",".join(engine.running_lora_adapters), ",".join(engine.waiting_lora_adapters))
        if self._lora_labels.get(worker) != labels:
            self._drop_lora_info(worker)
            self._lora_labels[worker] = labels
        self.lora_requests_info(*labels).set(time.time())

    def _drop_lora_info(self, worker: str) -> None:
        labels = self._lora_labels.pop(worker, None)
        if labels is not None:
            self._families["lora_requests_info"].remove(self.model_name, *labels)

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Expose /metrics over HTTP; return the port actually bound."""
        server, _ = start_http_server(port, addr=bare_host(host), registry=self.registry)
        return server.server_address[1]

    # -- per request --------------------------------------------------------------------

    def requests(self, finish_reason: str):
        """The finished-requests counter of a reason (router/output_stream.py's), as vLLM names it."""
        return self._requests("stop" if finish_reason == "eos" else finish_reason)

    def observe_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        """A request's first tokens went out: its time to them, and its prompt's tokens (counted
        now, not when it ends: an abandoned request's are counted too, and a long one's do not
        come in a burst at its end)."""
        self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(num_prompt_tokens)

    def observe_finished(
        self, finish_reason: str, ttft_s: float | None, e2e_s: float, num_output_tokens: int,
        timing: TimingBreakdown | None = None, num_prompt_tokens: int = 0, max_tokens: int | None = None,
    ) -> None:
        self.requests(finish_reason).inc()
        self.e2e.observe(e2e_s)
        if ttft_s is not None and num_output_tokens > 1:
            tpot = (e2e_s - ttft_s) / (num_output_tokens - 1)
            self.tpot.observe(tpot)
            self.request_tpot.observe(tpot)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_output_tokens)
        if max_tokens is not None:
            self.request_max_tokens.observe(max_tokens)
        if timing is not None:
            queue_s = (timing.router_queue_ms + timing.prefill_queue_ms + timing.decode_queue_ms) / 1000
            prefill_s = (timing.prefill_compute_ms + timing.kv_transfer_ms) / 1000
            decode_s = max(e2e_s - ttft_s, 0.0) if ttft_s is not None else 0.0
            self.queue_time.observe(queue_s)
            self.prefill_time.observe(prefill_s)
            self.decode_time.observe(decode_s)
            self.inference_time.observe(prefill_s + decode_s)

    def observe_speculation(self, acceptance_rate: float, tokens_per_step: float) -> None:
        self.spec_acceptance.observe(acceptance_rate)
        self.spec_tokens_per_step.observe(tokens_per_step)

    def observe_prefill(self, num_bytes: int, transfer_ms: float) -> None:
        self.kv_transfer_bytes.inc(num_bytes)
        self.kv_transfer_time.observe(transfer_ms / 1000)

    # -- pool gauges --------------------------------------------------------------------

    async def refresh(self, router, max_age_s: float = 1.0, pools: bool = True) -> None:
        """Read every worker's load report (none older than ``max_age_s``) into the gauges.
        ``pools`` False (a router that follows pools another manages): this router's own gauges
        only; the workers' series come from the managing router (each router exporting them
        counted every worker's steps, prefix hits and transfers once per router)."""
        # vLLM's gauge is its scheduler's waiting queue (what autoscalers scale on): here the
        # requests waiting for decode room at the router, plus the workers' queues. It counted
        # every request without a first token, prefills and transfers under way included.
        waiting_for_room = router.dispatcher.capacity.num_waiting
        self.router_queued.set(waiting_for_room)
        if not pools:
            return
        records = list(router.pool.workers.values())
        reports = await router.status_monitor.reports(max_age_s)
        depth = {"prefill": 0, "decode": 0}
        queued = 0  # requests in the workers' queues (not those computing, nor those awaiting KV: counted where they queue)
        seen = set()
        for record in records:
            report = reports.get(record.worker_id)
            status = report.status if report is not None else None
            if status is None:
                # No answer in time (a busy worker): its queue as last read, not none.
                queued += self._last_queued.get(record.worker_id, 0)
                continue
            worker, role = record.worker_id, record.role.value
            seen.add(worker)
            engine = status.engine
            depth[role] += engine.num_waiting + getattr(status, "num_awaiting_kv", 0)
            queued += engine.num_waiting
            self._last_queued[worker] = engine.num_waiting
            self.kv_blocks_used(worker, role).set(engine.num_used_blocks)
            self.kv_blocks_free(worker, role).set(engine.num_free_blocks)
            total_blocks = engine.num_used_blocks + engine.num_free_blocks
            self.kv_usage(worker, role).set(engine.num_used_blocks / total_blocks if total_blocks else 0.0)
            self.running(worker, role).set(engine.num_running)
            # Workers report a running total; the counter grows by what is new (a replaced
            # worker starts again from 0).
            for field_name, counter in self._worker_counters.items():
                total = getattr(engine, field_name)
                counter(worker, role).inc(max(0, total - self._last_totals.get((worker, field_name), 0)))
                self._last_totals[(worker, field_name)] = total
            if engine.num_prefix_query_tokens:
                self.prefix_hit_rate(worker, role).set(engine.num_prefix_hit_tokens / engine.num_prefix_query_tokens)
            if engine.num_lora_adapters or worker in self._lora_labels:
                self._set_lora_info(worker, role, engine)
            for path in getattr(status, "transfer_paths", ()):
                labels = (worker, path.peer, path.transport, path.device)
                self._path_labels.setdefault(worker, set()).add(labels)
                for field_name, counter in self._path_counters.items():
                    key = (f"{worker}>{path.peer}>{status.epoch}", field_name)  # a restarted writer counts from 0
                    total = getattr(path, field_name)
                    counter(*labels).inc(max(0, total - self._last_totals.get(key, 0)))
                    self._last_totals[key] = total
            if role == "prefill":
                steps, tokens = self._last_steps.get(worker, (0, 0))
                if engine.num_steps > steps:
                    self.prefill_tokens_per_step(worker).set((engine.num_scheduled_tokens - tokens) / (engine.num_steps - steps))
                self._last_steps[worker] = (engine.num_steps, engine.num_scheduled_tokens)
        for role, value in depth.items():
            self.queue_depth(role).set(value)
        self.router_queued.set(waiting_for_room + queued)
        for gone in self._known_workers - seen - {r.worker_id for r in records}:
            for field_name in self._worker_counters:
                self._last_totals.pop((gone, field_name), None)
            self._drop_lora_info(gone)
            self._last_queued.pop(gone, None)
            # Its tokens per step and transfer paths too: a retired worker's last values were
            # exported for good, and their running totals kept (each epoch's) without bound.
            self._last_steps.pop(gone, None)
            with contextlib.suppress(KeyError):
                self._families["prefill_tokens_per_step"].remove(self.model_name, gone)
            for labels in self._path_labels.pop(gone, ()):
                for name in _PER_PATH:
                    with contextlib.suppress(KeyError):
                        self._families[name].remove(self.model_name, *labels)
            for key in [key for key in self._last_totals if key[0].startswith(f"{gone}>")]:
                del self._last_totals[key]
            for name in _PER_WORKER:
                for role in ("prefill", "decode"):
                    try:
                        self._families[name].remove(self.model_name, gone, role)
                    except KeyError:
                        pass
        self._known_workers = seen | (self._known_workers & {r.worker_id for r in records})

