"""The router's gRPC servers (grpc.aio): Generation, health and reflection on one listener;
Admin (``router/admin.py``) on its own.

A Generate call's life here: validate and tokenize (INVALID_ARGUMENT naming the field on
any problem), then a ``GenerationSession`` (router/session.py) admits it (RESOURCE_EXHAUSTED
beyond the queue limit), waits until the deployment is ready (bounded by ``ready_wait_s``;
UNAVAILABLE past it), dispatches it to workers and relays decode outputs as they arrive,
detokenized and cut at stop strings; this module renders them as GenerateResponse messages.
However the call ends (finished, stop string, client cancel, deadline, error) the session
releases what it holds on every worker.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.config import ModelConfig, SamplingDefaults
from engine.stats import WorkerState
from router.api.pdserve.v1 import generation_pb2 as pb
from router.api.pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.admin import SERVICE as ADMIN_SERVICE
from router.admin import AdminOperations, AdminService, worker_state_to_proto
from router.config import RouterConfig
from router.dispatcher import WORKER_GONE, Dispatcher
from router.errors import abort_with
from router.output_stream import OutputChunk, TimingBreakdown
from router.pool import Role, RoutingPolicy, WorkerPool, WorkerRecord
from router.pool_control import PoolControl
from router.prefix_index import PrefixFeed, PrefixIndex
from router.readiness import Readiness
from router.request_bytes import tolerant
from router.routing import make_selector
from router.openai_api.server import OpenAIServer
from router.security import BearerTokenInterceptor, server_credentials, server_ssl_context
from router.session import GenerationSession
from router.status_monitor import StatusMonitor
from router.traffic import TrafficWindow
from router.tokenizer import Tokenizer
from router.validation import (
    GenerateInput,
    RequestLimits,
    ValidatedRequest,
    input_from_proto,
    validate_input,
)

logger = logging.getLogger(__name__)

_ROLES = {Role.PREFILL: pb.WORKER_ROLE_PREFILL, Role.DECODE: pb.WORKER_ROLE_DECODE}


@dataclass(slots=True)
class ModelInfo:
    name: str
    architecture: str
    max_context_len: int
    vocab_size: int
    eos_token_ids: list[int]
    block_size: int
    sampling_defaults: SamplingDefaults = SamplingDefaults()
    num_layers: int = 0  # decoder layers (a pipelined prefill cuts them into stages; 0: never)

    @classmethod
    def from_model_dir(cls, model_dir: Path, block_size: int, max_model_len: int | None, eos_token_ids: list[int]) -> "ModelInfo":
        config = ModelConfig.from_model_dir(model_dir)
        limit = config.max_position_embeddings
        if max_model_len is not None:
            limit = min(limit, max_model_len)
        return cls(
            Path(model_dir).name, config.architecture, limit, config.vocab_size, eos_token_ids or config.eos_token_ids,
            block_size, SamplingDefaults.from_model_dir(model_dir), config.num_layers,
        )


# GetClusterStatus answers from status reports at most this old (callers at the same moment
# share one round of status calls).
CLUSTER_STATUS_MAX_AGE_S = 0.05
# Text prompts longer than this are tokenized on a thread (about 1 ms of tokenizing inline).
INLINE_TOKENIZE_CHARS = 4096


_FINISH_REASONS = {
    "length": pb.FINISH_REASON_LENGTH,
    "stop": pb.FINISH_REASON_STOP,
    "eos": pb.FINISH_REASON_EOS,
    "abort": pb.FINISH_REASON_ABORT,
    "error": pb.FINISH_REASON_ERROR,
}


def generate_response(req_id: str, chunk: OutputChunk) -> pb.GenerateResponse:
    """One session chunk as the GenerateResponse message that carries it."""
    response = pb.GenerateResponse(request_id=req_id, token_ids=chunk.token_ids, text=chunk.text)
    if chunk.logprobs:
        response.logprobs.extend(
            pb.TokenLogprobs(logprob=e.logprob, top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in e.top]) for e in chunk.logprobs
        )
    end = chunk.end
    if end is not None:
        response.finish_reason = _FINISH_REASONS[end.reason]
        response.matched_stop_string = end.matched_stop
        if end.matched_stop_token_id is not None:
            response.matched_stop_token_id = end.matched_stop_token_id
        response.finish_detail = end.detail
        response.usage.prompt_tokens = end.prompt_tokens
        response.usage.completion_tokens = end.completion_tokens
        response.usage.cached_prompt_tokens = end.cached_prompt_tokens
        response.prefill_worker_id = end.prefill_worker_id
        response.decode_worker_id = end.decode_worker_id
        _fill_timing(response.timing, end.timing)
        if end.speculation is not None:
            spec = end.speculation
            response.speculation.decode_steps = spec.decode_steps
            response.speculation.draft_tokens = spec.draft_tokens
            response.speculation.accepted_draft_tokens = spec.accepted_draft_tokens
            response.speculation.acceptance_rate = spec.acceptance_rate
            response.speculation.tokens_per_step = spec.tokens_per_step
    return response


def _fill_timing(out: pb.Timing, timing: TimingBreakdown) -> None:
    for name in TimingBreakdown.__slots__:
        setattr(out, name, getattr(timing, name))


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(self, router: "Router"):
        self.router = router

    async def Generate(self, request, context):
        router = self.router
        try:
            validated = await router.validate(request, context.time_remaining())
            session = await GenerationSession.open(router, validated, client_gone=context.cancelled)
        except Exception as exc:
            await abort_with(context, exc)
        try:
            async with contextlib.aclosing(session.chunks()) as chunks:
                async for chunk in chunks:
                    yield generate_response(validated.req_id, chunk)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await abort_with(context, exc)
        finally:
            await session.close()

    async def GetModelInfo(self, request, context):
        info = self.router.model_info
        return pb.GetModelInfoResponse(
            model_name=info.name,
            architecture=info.architecture,
            max_context_len=info.max_context_len,
            vocab_size=info.vocab_size,
            eos_token_ids=info.eos_token_ids,
            block_size=info.block_size,
        )

    async def GetClusterStatus(self, request, context):
        return pb.GetClusterStatusResponse(workers=await self.router.worker_statuses())


class Router:
    """Owns the pool, the dispatcher and the gRPC server of one deployment."""

    def __init__(self, model_dir: Path, model_info: ModelInfo, config: RouterConfig | None = None, pool_manager: PoolControl | None = None, max_replicas: int = 64, metrics=None):
        self.config = config or RouterConfig()
        self.config.validate()
        self.model_info = model_info
        self.tokenizer = Tokenizer.from_model_dir(model_dir)
        defaults = model_info.sampling_defaults if self.config.model_sampling_defaults else SamplingDefaults()
        if defaults != SamplingDefaults():
            logger.info("sampling defaults from the model's generation_config.json, for fields a request leaves unset: %s", defaults)
        self.limits = RequestLimits(vocab_size=model_info.vocab_size, max_context_len=model_info.max_context_len, defaults=defaults)
        # One thread: long prompts are tokenized one at a time, off the event loop.
        self._tokenize_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        # KV-aware routing: an index of every worker's prefix cache, fed by their own events.
        self.prefix_index = PrefixIndex(model_info.block_size) if self.config.routing_policy is RoutingPolicy.KV_AWARE else None
        self.pool = WorkerPool(make_selector(self.config.routing_policy, self.prefix_index, self.config.kv_overlap_weight))
        self.prefix_feed = None if self.prefix_index is None else PrefixFeed(self.pool, self.prefix_index, self.config.status_timeout_s)
        # The one reader of worker status (GetClusterStatus, metrics, the pool manager).
        self.status_monitor = StatusMonitor(self.pool, self.config.status_timeout_s)
        self.dispatcher = Dispatcher(
            self.pool, self.config, metrics, block_size=model_info.block_size, decode_ready=self.wait_ready, prefix_feed=self.prefix_feed,
            num_layers=model_info.num_layers,
        )
        self.pool_manager: PoolControl | None = pool_manager  # set by whoever runs the pools
        self.metrics = metrics
        self.traffic = TrafficWindow()  # recent arrivals, sizes and queue times (the autoscaler's input)
        self.background_tasks: set[asyncio.Task] = set()
        self.max_replicas = max_replicas
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        # NOT_SERVING until the pool manager says the pools can serve.
        self.readiness = Readiness(self.health)
        self.port: int | None = None
        self.admin_server: grpc.aio.Server | None = None
        self.admin_port: int | None = None
        self.http_server: OpenAIServer | None = None
        self.http_port: int | None = None

    async def validate(self, request: pb.GenerateRequest, timeout_s: float | None) -> ValidatedRequest:
        """Validate and tokenize; a long text prompt is tokenized off the event loop.

        Tokenizing megabytes of text takes seconds, during which every other stream on this
        loop would stall. Short prompts stay inline: a thread hop costs more than they do.
        """
        return await self.validate_input(input_from_proto(request), timeout_s)

    async def validate_input(self, request: GenerateInput, timeout_s: float | None = None) -> ValidatedRequest:
        """``validate`` for a request an API edge has read into the neutral input."""
        validate = functools.partial(validate_input, request, self.limits, self.tokenizer.encode, timeout_s=timeout_s)
        if request.prompt_text is not None and len(request.prompt_text) > INLINE_TOKENIZE_CHARS:
            return await asyncio.get_running_loop().run_in_executor(self._tokenize_thread, validate)
        return validate()

    async def start(self) -> int:
        """Start the Generation listener (and Admin's own, unless it is off); return its port."""
        generation = pb.DESCRIPTOR.services_by_name["Generation"].full_name
        self.server = self._new_server()
        # Through ``tolerant``: malformed request bytes get INVALID_ARGUMENT and one log line.
        pb_grpc.add_GenerationServicer_to_server(GenerationService(self), tolerant(self.server))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection([generation, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        self.port = self._listen(self.server, "port", self.config.host, self.config.port)
        self.readiness.add_services([generation])
        await self.readiness.publish()
        await self.server.start()
        if self.config.admin_port is not None:
            self.admin_server = self._new_server()
            pb_grpc.add_AdminServicer_to_server(AdminService(AdminOperations(self)), tolerant(self.admin_server))
            reflection.enable_server_reflection([ADMIN_SERVICE, reflection.SERVICE_NAME], self.admin_server)
            self.admin_port = self._listen(self.admin_server, "admin_port", self.config.admin_host, self.config.admin_port)
            await self.admin_server.start()
            logger.info("admin listening on %s:%d", self.config.admin_host, self.admin_port)
        if self.config.http_port is not None:
            names = self.config.served_model_names or [self.model_info.name]
            ssl_context = None
            if self.config.tls_cert_file is not None:
                ssl_context = server_ssl_context(self.config.tls_cert_file, self.config.tls_key_file)
            self.http_server = OpenAIServer(self, self.config.http_host, self.config.http_port, names, self.config.auth_token, ssl_context)
            self.http_port = await self.http_server.start()
        logger.info(
            "router listening on %s:%d (%s; %s, %s)", self.config.host, self.port,
            "ready" if self.readiness.is_ready else "not ready yet",
            "bearer token required" if self.config.auth_token else "no authentication",
            "TLS" if self.config.tls_cert_file else "plaintext",
        )
        return self.port

    def _new_server(self) -> grpc.aio.Server:
        interceptors = [BearerTokenInterceptor(self.config.auth_token)] if self.config.auth_token else []
        # No SO_REUSEPORT: another process binding the same port would receive part of its calls.
        return grpc.aio.server(interceptors=interceptors, options=[("grpc.so_reuseport", 0)])

    def _credentials(self) -> grpc.ServerCredentials | None:
        if self.config.tls_cert_file is None:
            return None
        return server_credentials(self.config.tls_cert_file, self.config.tls_key_file)

    def _listen(self, server: grpc.aio.Server, field: str, host: str, port: int) -> int:
        """Bind ``host:port``; a failure names the config field, since grpc's own message names neither
        the field nor the cause (newer grpc raises RuntimeError, older returns port 0)."""
        address = f"{host}:{port}"
        credentials = self._credentials()
        try:
            bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
        except RuntimeError:
            bound = 0
        if bound == 0:
            raise OSError(f"router.{field}: cannot listen on {address} (the port is in use, or the host is not "
                          f"an address of this machine); give another port, or 0 for any free one")
        return bound

    async def wait_ready(self) -> None:
        """Wait, at most ``ready_wait_s``, until the pools can serve; else UnavailableError."""
        if self.readiness.is_ready and not self.pool.routable(Role.DECODE):
            # A decode death the pool manager has not seen yet: wait for it to bring one back.
            await self.readiness.set_not_ready("no decode worker is ready")
        await self.readiness.wait(self.config.ready_wait_s)

    async def stop(self, grace_s: float = 1.0) -> None:
        await self.dispatcher.close()
        if self.prefix_feed is not None:
            await self.prefix_feed.stop()
        if self.http_server is not None:
            await self.http_server.stop()
        if self.admin_server is not None:
            await self.admin_server.stop(grace_s)
        if self.server is not None:
            await self.server.stop(grace_s)
        self._tokenize_thread.shutdown(wait=False, cancel_futures=True)

    async def add_worker(self, role: Role, worker_id: str, handle) -> WorkerRecord:
        """Route to a started worker from now on (its handshake offer is fetched once)."""
        epoch = await handle.ping.remote()
        record = WorkerRecord(worker_id, role, handle, epoch=epoch)
        if role is Role.DECODE:
            record.handshake_offer = await handle.handshake_offer.remote()
        self.pool.add(record)
        return record

    def worker_died(self, record: WorkerRecord) -> None:
        self.dispatcher.on_worker_died(record)

    async def drain(self, record: WorkerRecord) -> None:
        """No new requests for this worker; it finishes what it has."""
        record.state = WorkerState.DRAINING
        try:
            await record.handle.drain.remote()
        except WORKER_GONE:
            self.dispatcher.on_worker_died(record)

    async def worker_statuses(self) -> list[pb.WorkerStatus]:
        reports = await self.status_monitor.reports(max_age_s=CLUSTER_STATUS_MAX_AGE_S)
        statuses = []
        for record in list(self.pool.workers.values()):
            report = reports.get(record.worker_id)
            if report is None:
                continue  # joined after the round: in the next answer
            status = pb.WorkerStatus(worker_id=record.worker_id, role=_ROLES[record.role], epoch=record.epoch)
            result = report.status
            if result is None:
                status.state = pb.WORKER_STATE_DEAD if report.gone else pb.WORKER_STATE_UNHEALTHY
            else:
                engine = result.engine
                # The router's view wins for draining/dead; the worker's for everything else.
                status.state = worker_state_to_proto(record.state if record.state is not WorkerState.READY else result.state)
                status.queue_depth = engine.num_waiting + getattr(result, "num_awaiting_kv", 0)
                status.num_queued_prefill_tokens = engine.num_queued_prefill_tokens
                status.num_kv_blocks_used = engine.num_used_blocks
                status.num_kv_blocks_free = engine.num_free_blocks
                status.num_running_seqs = engine.num_running
                status.epoch = result.epoch
                status.node = result.node
                status.rank_nodes.extend(result.rank_nodes)
            statuses.append(status)
        return statuses

