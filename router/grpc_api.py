"""The router's gRPC front end (grpc.aio): Generation, health and reflection on one listener;
Admin (``router/admin.py``) on its own.

A Generate call's life here: the request is read into the core's neutral input and validated
(INVALID_ARGUMENT naming the field on any problem), a ``GenerationSession`` (router/session.py)
admits it (RESOURCE_EXHAUSTED beyond the queue limit), waits until the deployment is ready
(UNAVAILABLE past ``ready_wait_s``), dispatches it and relays its output chunks, which this
module renders as GenerateResponse messages. However the call ends (finished, stop string,
client cancel, deadline, error) the session releases what it holds on every worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from router.admin import SERVICE as ADMIN_SERVICE
from router.admin import AdminOperations, AdminService, worker_state_to_proto
from router.addresses import host_port
from router.api.pdserve.v1 import generation_pb2 as pb
from router.api.pdserve.v1 import generation_pb2_grpc as pb_grpc
from engine.sampling_params import TokenLogprob
from engine.stats import WorkerState
from router.core import Router
from router.errors import abort_with, cannot_listen
from router.grpc_chat import ChatAnswer, read_chat_prompt
from router.openai_api.chat_format import ChatFormat
from router.output_stream import OutputChunk, TimingBreakdown, end_failure
from router.pool import Role
from router.request_bytes import tolerant
from router.security import BearerTokenInterceptor, server_credentials
from router.read_ahead import read_ahead
from router.session import GenerationSession
from router.validation import input_from_proto

logger = logging.getLogger(__name__)

_ROLES = {Role.PREFILL: pb.WORKER_ROLE_PREFILL, Role.DECODE: pb.WORKER_ROLE_DECODE}
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

# GetClusterStatus answers from status reports at most this old (callers at the same moment
# share one round of status calls).
CLUSTER_STATUS_MAX_AGE_S = 0.05
# How long GetClusterStatus waits for a restarted controller to adopt the running workers (it
# pings each, up to a health timeout apiece); past it, it answers with those adopted so far.
ADOPTION_WAIT_S = 20.0


_FINISH_REASONS = {
    "length": pb.FINISH_REASON_LENGTH,
    "stop": pb.FINISH_REASON_STOP,
    "eos": pb.FINISH_REASON_EOS,
    "abort": pb.FINISH_REASON_ABORT,
    "error": pb.FINISH_REASON_ERROR,
}


def _token_logprobs(entry: TokenLogprob) -> pb.TokenLogprobs:
    top = [pb.TopLogprob(token_id=t, logprob=lp) for t, lp in entry.top]
    return pb.TokenLogprobs(logprob=entry.logprob, top=top, token_id=entry.token_id, rank=entry.rank)


def generate_response(req_id: str, chunk: OutputChunk, answer: ChatAnswer | None = None) -> pb.GenerateResponse:
    """One session chunk as the GenerateResponse message that carries it (``answer``: a chat's,
    which splits its text into thinking, answer and tool calls)."""
    response = pb.GenerateResponse(request_id=req_id, token_ids=chunk.token_ids)
    if answer is None:
        response.text = chunk.text
    else:
        response.text, response.reasoning_text = answer.take(chunk)
    if chunk.logprobs:
        response.logprobs.extend(_token_logprobs(e) for e in chunk.logprobs)
    if chunk.prompt_logprobs:
        response.prompt_logprobs.extend(_token_logprobs(e) for e in chunk.prompt_logprobs)
    end = chunk.end
    if end is not None:
        response.finish_reason = _FINISH_REASONS[end.reason]
        response.matched_stop_string = end.matched_stop
        if end.matched_stop_token_id is not None:
            response.matched_stop_token_id = end.matched_stop_token_id
        response.finish_detail = f"{end.error_field}: {end.detail}" if end.error_field else end.detail  # the field first, as a refusal names it
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
        if answer is not None:
            answer.fill_end(response, end)
    return response


def _fill_timing(out: pb.Timing, timing: TimingBreakdown) -> None:
    for name in TimingBreakdown.__slots__:
        setattr(out, name, getattr(timing, name))


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(self, router: "Router", chat: ChatFormat):
        self.router = router
        self.chat = chat

    async def Generate(self, request, context):
        router = self.router
        answer = None
        try:
            generate_input = input_from_proto(request)
            if request.HasField("chat"):
                given = request.sampling.HasField("skip_special_tokens")
                answer = ChatAnswer(read_chat_prompt(request.chat, self.chat, generate_input, given), self.chat)
            validated = await router.validate_input(generate_input, context.time_remaining())
            session = await GenerationSession.open(router, validated, client_gone=context.cancelled)
        except Exception as exc:
            await abort_with(context, exc)
        failure = None
        try:
            async with contextlib.aclosing(read_ahead(session)) as chunks:
                first = True
                async for chunk in chunks:
                    if first and chunk.end is not None and chunk.end.reason == "error" and not chunk.token_ids:
                        # Failed before any output (the decode actor refused it as it prefilled
                        # it): a real status, as the HTTP front ends answer, not a message saying
                        # ERROR (which means failed after output started).
                        failure = end_failure(chunk.end, 0)
                        break
                    first = False
                    yield generate_response(validated.req_id, chunk, answer)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await abort_with(context, exc)
        finally:
            await session.close()
        if failure is not None:
            await abort_with(context, failure)

    async def GetModelInfo(self, request, context):
        info = self.router.model_info
        return pb.GetModelInfoResponse(
            model_name=info.name,
            architecture=info.architecture,
            max_context_len=info.max_context_len,
            vocab_size=info.vocab_size,
            eos_token_ids=info.eos_token_ids,
            block_size=info.block_size,
            lora_adapters=list(info.lora_adapters),
        )

    async def GetClusterStatus(self, request, context):
        return pb.GetClusterStatusResponse(workers=await worker_statuses(self.router))


class HealthPublisher:
    """Mirrors the core's readiness into the gRPC health servicer, for the overall service
    ("") and each named one."""

    def __init__(self, health_servicer, services: Iterable[str]):
        self._health = health_servicer
        self._services = ["", *services]

    async def __call__(self, ready: bool) -> None:
        status = _SERVING if ready else _NOT_SERVING
        for service in self._services:
            result = self._health.set(service, status)
            if asyncio.iscoroutine(result):  # grpc.aio's servicer is async, the sync one is not
                await result


class GrpcFrontEnd:
    """The Generation listener (with health and reflection) and, unless off, Admin's own."""

    def __init__(self, router: Router, reuse_port: bool = False, admin: bool = True, chat: ChatFormat | None = None):
        self.router = router
        self.chat = chat or ChatFormat.of(router)
        self.config = router.config
        self.reuse_port = reuse_port  # replicas of the router share one port (SO_REUSEPORT)
        self.admin = admin and self.config.admin_port is not None
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        self._health_publisher: HealthPublisher | None = None
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.admin_server: grpc.aio.Server | None = None
        self.admin_port: int | None = None

    async def start(self, port: int | None = None) -> int:
        """Start listening (on ``port``, else the configured one); return the Generation port."""
        generation = pb.DESCRIPTOR.services_by_name["Generation"].full_name
        self.server = self._new_server(self.reuse_port)
        # Through ``tolerant``: malformed request bytes get INVALID_ARGUMENT and one log line.
        pb_grpc.add_GenerationServicer_to_server(GenerationService(self.router, self.chat), tolerant(self.server))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection([generation, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        self.port = self._listen(self.server, "port", self.config.host, self.config.port if port is None else port)
        self._health_publisher = HealthPublisher(self.health, [generation])
        await self.router.readiness.add_listener(self._health_publisher)
        await self.server.start()
        if self.admin:
            self.admin_server = self._new_server(reuse_port=False)
            pb_grpc.add_AdminServicer_to_server(AdminService(AdminOperations(self.router)), tolerant(self.admin_server))
            reflection.enable_server_reflection([ADMIN_SERVICE, reflection.SERVICE_NAME], self.admin_server)
            self.admin_port = self._listen(self.admin_server, "admin_port", self.config.admin_host, self.config.admin_port)
            await self.admin_server.start()
            logger.info("admin listening on %s:%d", self.config.admin_host, self.admin_port)
        return self.port

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._health_publisher is not None:
            self.router.readiness.remove_listener(self._health_publisher)
        if self.admin_server is not None:
            await self.admin_server.stop(grace_s)
        if self.server is not None:
            await self.server.stop(grace_s)

    def _new_server(self, reuse_port: bool) -> grpc.aio.Server:
        interceptors = [BearerTokenInterceptor(self.config.auth_token)] if self.config.auth_token else []
        # SO_REUSEPORT only among the router's own replicas: otherwise another process binding
        # the same port would silently receive part of the calls.
        return grpc.aio.server(interceptors=interceptors, options=[("grpc.so_reuseport", 1 if reuse_port else 0)])

    def _credentials(self) -> grpc.ServerCredentials | None:
        if self.config.tls_cert_file is None:
            return None
        return server_credentials(self.config.tls_cert_file, self.config.tls_key_file)

    def _listen(self, server: grpc.aio.Server, field: str, host: str, port: int) -> int:
        """Bind ``host:port``; a failure names the config field, since grpc's own message names neither
        the field nor the cause (newer grpc raises RuntimeError, older returns port 0)."""
        address = host_port(host, port)
        credentials = self._credentials()
        try:
            bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
        except RuntimeError:
            bound = 0
        if bound == 0:
            raise OSError(cannot_listen(field, host, port))
        return bound


async def worker_statuses(router: Router) -> list[pb.WorkerStatus]:
    """Every worker's status for GetClusterStatus, from status reports at most CLUSTER_STATUS_MAX_AGE_S
    old; a restarted controller answers once it has adopted the running workers (or after
    ADOPTION_WAIT_S, with those it has)."""
    if router.pool_manager is not None:
        try:
            await asyncio.wait_for(router.pool_manager.adopted(), ADOPTION_WAIT_S)
        except asyncio.TimeoutError:
            pass
    reports = await router.status_monitor.reports(max_age_s=CLUSTER_STATUS_MAX_AGE_S)
    statuses = []
    for record in list(router.pool.workers.values()):
        report = reports.get(record.worker_id)
        if report is None:  # joined after the shared round began: its own report
            report = await router.status_monitor.report(record, CLUSTER_STATUS_MAX_AGE_S)
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

