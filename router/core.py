"""The router's core for one deployment, with no wire format: the worker pool, the
dispatcher, admission, readiness, validation and tokenization.

A request's life through the core: an API edge (router/grpc_api.py, router/openai_api/)
reads its message into a ``GenerateInput``; ``validate_input`` checks and tokenizes it (long
text off the event loop); a ``GenerationSession`` (router/session.py) admits it, waits for a
ready deployment (``wait_ready``), dispatches it and yields its output chunks, which the edge
renders. The front ends (router/front_ends.py) are started beside the core by whoever hosts
it (cluster/deployment.py, the controller, a router replica). This module, like every module
the router process loads, imports no torch and no model code.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from engine.sampling_params import SamplingDefaults
from engine.stats import WorkerState
from router.config import MAX_POOL_REPLICAS, RouterConfig
from router.dispatcher import WORKER_GONE, Dispatcher
from router.pool import Role, RoutingPolicy, WorkerPool, WorkerRecord, within
from router.lora_adapters import LoraAdapters
from router.pool_control import PoolControl
from router.prefix_index import PrefixFeed, PrefixIndex
from router.readiness import Readiness
from router.responses_api.board import router_name
from router.routing import make_selector
from router.status_monitor import StatusMonitor
from router.tokenizer import Tokenizer
from router.traffic import TrafficWindow
from router.validation import GenerateInput, RequestLimits, ValidatedRequest, validate_input

logger = logging.getLogger(__name__)

# Text prompts longer than this are tokenized on a thread (about 1 ms of tokenizing inline).
INLINE_TOKENIZE_CHARS = 4096
# How long a worker being added may take to answer each of its first calls.
ADD_WORKER_TIMEOUT_S = 60.0


@dataclass(slots=True)
class ModelInfo:
    """What the router knows of the model (read from its directory by the deployment)."""

    name: str
    architecture: str
    max_context_len: int
    vocab_size: int
    eos_token_ids: list[int]
    block_size: int
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    num_layers: int = 0  # decoder layers (a pipelined prefill cuts them into stages; 0: never)
    # LoRA adapters every worker serves beside the model (engine.lora): name -> adapter directory.
    lora_adapters: dict[str, str] = field(default_factory=dict)


class Router:
    """Owns the pool, the dispatcher and the readiness of one deployment's router."""

    def __init__(self, model_dir: Path, model_info: ModelInfo, config: RouterConfig | None = None, pool_manager: PoolControl | None = None, max_replicas: int = MAX_POOL_REPLICAS, metrics=None):
        self.config = config or RouterConfig()
        self.config.validate()
        self.model_info = model_info
        self.model_dir = Path(model_dir)
        self.tokenizer = Tokenizer.from_model_dir(model_dir)
        defaults = model_info.sampling_defaults if self.config.model_sampling_defaults else SamplingDefaults()
        if defaults != SamplingDefaults():
            logger.info("sampling defaults from the model's generation_config.json, for fields a request leaves unset: %s", defaults)
        self.limits = RequestLimits(
            vocab_size=model_info.vocab_size, max_context_len=model_info.max_context_len, defaults=defaults,
            lora_names=frozenset(model_info.lora_adapters),
        )
        # One thread: long prompts are tokenized one at a time, off the event loop.
        self._tokenize_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        # KV-aware routing: an index of every worker's prefix cache, fed by their own events.
        self.prefix_index = PrefixIndex(model_info.block_size) if self.config.routing_policy is RoutingPolicy.KV_AWARE else None
        self.pool = WorkerPool(make_selector(self.config.routing_policy, self.prefix_index, self.config.kv_overlap_weight))
        # The LoRA adapters served (router.lora_adapters): the model info's list, which runtime
        # loads and unloads change.
        self.lora = LoraAdapters(model_info.lora_adapters, self.pool, self._lora_changed, self._computes_with,
                                 runtime_updates=self.config.allow_runtime_lora_updating)
        self.prefix_feed = None if self.prefix_index is None else PrefixFeed(self.pool, self.prefix_index, self.config.status_timeout_s)
        # The one reader of worker status (GetClusterStatus, metrics, the pool manager).
        self.status_monitor = StatusMonitor(self.pool, self.config.status_timeout_s)
        self.dispatcher = Dispatcher(
            self.pool, self.config, metrics, block_size=model_info.block_size, decode_ready=self.wait_ready, prefix_feed=self.prefix_feed,
            num_layers=model_info.num_layers, prefix_salt=self.lora.salt,
        )
        self.pool_manager: PoolControl | None = pool_manager  # set by whoever runs the pools
        # /v1/responses' board (router/responses_api/board.py) shared by a deployment's routers,
        # set before the front ends start by whoever runs replicas; None: the router keeps its own.
        self.responses_board = None
        # Its name on the board, the same across its restarts (replica i: "router-i"): a router
        # that starts runs again the background responses its earlier life left in progress.
        self.board_name = router_name(0)
        # The managing router's (None on a replica): how many routers the deployment runs. It also
        # runs again what routers beyond them left in progress (replicas no longer started).
        self.deployment_routers: int | None = 1
        self.metrics = metrics
        # With replicas: where the deployment's routers publish their metrics, for /metrics on the
        # shared HTTP port (router/metrics_exchange.py); set by whoever runs replicas.
        self.shared_metrics = None
        self.traffic = TrafficWindow()  # recent arrivals, sizes and queue times (the autoscaler's input)
        self.background_tasks: set[asyncio.Task] = set()
        self.max_replicas = max_replicas
        # Not ready until the pool manager says the pools can serve; the front ends mirror it
        # (gRPC health NOT_SERVING, HTTP /health 503).
        self.readiness = Readiness()

    async def validate_input(
        self, request: GenerateInput, timeout_s: float | None = None, encode: Callable[..., list[int]] | None = None
    ) -> ValidatedRequest:
        """Validate and tokenize; a long text prompt is tokenized, and an output constraint's
        grammar compiled, off the event loop.

        Tokenizing megabytes of text takes seconds, and a large schema's grammar can take
        hundreds of milliseconds, during which every other stream on this loop would stall.
        Short prompts stay inline: a thread hop costs more than they do. ``encode``: the
        tokenizer's, or one that remembers (the choices of one call share their prompts).
        """
        validate = functools.partial(validate_input, request, self.limits, encode or self.tokenizer.encode, timeout_s=timeout_s)
        text_chars = (len(request.prompt_text) if request.prompt_text is not None else 0) + sum(map(len, request.bad_words))
        if text_chars > INLINE_TOKENIZE_CHARS or request.structured is not None:
            validated = await asyncio.get_running_loop().run_in_executor(self._tokenize_thread, validate)
        else:
            validated = validate()
        # Every worker of the request computes with the version its adapter names now.
        validated.sampling_params.lora_digest = self.lora.pin(validated.sampling_params.lora_name, validated.req_id)
        return validated

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """``text``'s token ids, tokenized off the event loop where it is long (as validate_input)."""
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        encode = functools.partial(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_thread, encode)

    async def wait_ready(self) -> None:
        """Wait, at most ``ready_wait_s``, until the pools can serve; else UnavailableError."""
        if self.readiness.is_ready and not self.pool.routable(Role.DECODE):
            # A decode death the pool manager has not seen yet: wait for it to bring one back.
            await self.readiness.set_not_ready("no decode worker is ready")
        await self.readiness.wait(self.config.ready_wait_s)

    async def stop(self) -> None:
        """Stop dispatching (the front ends are stopped by whoever started them)."""
        await self.dispatcher.close()
        if self.shared_metrics is not None:
            await self.shared_metrics.close()
        await self.lora.close()  # after: bounded, but a hung worker must not hold the releases up
        if self.prefix_feed is not None:
            await self.prefix_feed.stop()
        self._tokenize_thread.shutdown(wait=False, cancel_futures=True)

    async def add_worker(self, role: Role, worker_id: str, handle, adopted: bool = False) -> WorkerRecord:
        """Route to a started worker from now on (its handshake offer is fetched once).
        ``adopted``: a worker found running as this router started (durable workers). Its
        answers are bounded (``ADD_WORKER_TIMEOUT_S``, well past a loaded host's slowest): a
        worker that hangs held up the health round adopting it, and with it every other worker's
        check (asyncio.TimeoutError then)."""
        timeout_s = ADD_WORKER_TIMEOUT_S
        epoch = await within(handle.ping.remote(), timeout_s)
        record = WorkerRecord(worker_id, role, handle, epoch=epoch)
        if role is Role.DECODE:
            record.handshake_offer = await within(handle.handshake_offer.remote(), timeout_s)
        status = await within(handle.status.remote(), timeout_s)
        record.node = status.node  # prefill and decode pair on one node where they can
        if status.state is WorkerState.DRAINING:
            # Adopted mid-drain (its manager died while retiring it): it refuses new work, so
            # it is not routed to, and its new manager finishes retiring it.
            record.state = WorkerState.DRAINING
        if self.model_info.lora_adapters or self.config.allow_runtime_lora_updating:
            await self.lora.catch_up(worker_id, handle, adopt=adopted)
        self.pool.add(record)
        return record

    def _lora_changed(self) -> None:
        self.limits = dataclasses.replace(self.limits, lora_names=frozenset(self.model_info.lora_adapters))

    def _computes_with(self, digest: str) -> bool:
        """Whether a request this router admitted computes with this LoRA adapter version."""
        return any(active.request.sampling_params.lora_digest == digest for active in self.dispatcher.active.values())

    def worker_died(self, record: WorkerRecord) -> None:
        self.dispatcher.on_worker_died(record)

    async def drain(self, record: WorkerRecord) -> None:
        """No new requests for this worker; it finishes what it has."""
        record.state = WorkerState.DRAINING
        try:
            await record.handle.drain.remote()
        except WORKER_GONE:
            self.dispatcher.on_worker_died(record)
