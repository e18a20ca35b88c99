"""The load generator: sends requests to a router on an arrival schedule and records each stream.

A request's life here: its task sleeps until its scheduled offset, waits for a slot under the
concurrency cap (so under a cap the send time can trail the scheduled time, and latencies
are measured from the send, as vLLM's benchmark does), sends Generate, and timestamps every
streamed message that carries tokens. The final message's usage, finish reason and per-stage
timing go into the record. Errors are recorded, never raised: a failed request is a data point.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from cluster.bench.workloads import BenchRequest, ModelLimits
from router.api.pdserve.v1 import generation_pb2 as pb
from router.api.pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.output_stream import TimingBreakdown
from router.security import AUTH_TOKEN_ENV, client_token_metadata

logger = logging.getLogger(__name__)

# The router's per-request timing breakdown (the last message's Timing), in ms: the same
# fields as the router's own record of it.
ServerTiming = TimingBreakdown
STAGE_FIELDS = tuple(name for name in TimingBreakdown.__slots__ if name.endswith("_ms"))
FINISHED_OK = ("length", "stop", "eos")


@dataclass(slots=True)
class RequestRecord:
    """What one request did, as seen by the client. Times are seconds from the run's start."""

    index: int
    req_id: str
    tag: str
    prompt_len: int  # tokens: the router's count once finished, else the workload's
    max_tokens: int
    scheduled_s: float  # when the arrival process released it
    send_s: float = math.nan  # when Generate was called
    chunk_s: list[float] = field(default_factory=list)  # receipt of every message carrying tokens
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each of those messages
    token_ids: list[int] = field(default_factory=list)  # every token received, in order
    end_s: float = math.nan  # receipt of the last message (or of the error)
    usage_completion_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens a prefix cache held (the router's usage)
    finish_reason: str = ""  # length, stop, eos, abort, error; "" if the stream broke off
    error: str = ""  # "CODE: details" of a failed RPC
    timing: ServerTiming | None = None
    prefill_worker_id: str = ""
    decode_worker_id: str = ""
    num_draft_tokens: int = 0  # speculative decoding on the decode actor: tokens proposed
    num_accepted_draft_tokens: int = 0  # and confirmed

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ok(self) -> bool:
        return not self.error and self.finish_reason in FINISHED_OK and bool(self.chunk_s)


@dataclass(slots=True)
class RunResult:
    records: list[RequestRecord]
    duration_s: float  # from the first scheduled send to the end of the last request


@dataclass(slots=True)
class ScaleOutcome:
    role: str
    replicas: int
    requested_s: float  # seconds from the run's start
    done_s: float = math.nan
    previous_replicas: int | None = None
    error: str = ""  # why scaling did not happen (e.g. the router has no pool manager)


@dataclass(slots=True)
class ClientConfig:
    address: str
    max_concurrency: int | None = None  # None: no cap
    temperature: float = 0.0
    ignore_eos: bool = True
    timeout_s: float = 600.0  # per request
    request_id_prefix: str = "bench"
    n: int = 1  # choices per request (OpenAI's n; the OpenAI client only): each choice's tokens count
    admin_address: str | None = None  # Admin's own host:port (for scaling scenarios)
    # Wait (up to timeout_s) for an unreachable router instead of failing at once, as a client
    # that rides out a router restart does.
    wait_for_ready: bool = False
    auth_token: str | None = field(default_factory=lambda: os.environ.get(AUTH_TOKEN_ENV) or None, repr=False)


class BenchClient:
    """One grpc.aio channel to a router, used for the whole benchmark."""

    def __init__(self, config: ClientConfig):
        if config.max_concurrency is not None and config.max_concurrency < 1:
            raise ValueError(f"max_concurrency: must be >= 1, got {config.max_concurrency}")
        self.config = config
        self._channel: grpc.aio.Channel | None = None
        self._admin_channel: grpc.aio.Channel | None = None
        self._metadata = client_token_metadata(config.auth_token)
        self._t0 = time.perf_counter()

    async def __aenter__(self) -> "BenchClient":
        self._channel = grpc.aio.insecure_channel(self.config.address)
        self.stub = pb_grpc.GenerationStub(self._channel)
        if self.config.admin_address is not None:
            self._admin_channel = grpc.aio.insecure_channel(self.config.admin_address)
            self.admin = pb_grpc.AdminStub(self._admin_channel)
        return self

    async def __aexit__(self, *exc) -> None:
        await self._channel.close()
        if self._admin_channel is not None:
            await self._admin_channel.close()

    def now_s(self) -> float:
        """Seconds since the current run started (or since the client was made)."""
        return time.perf_counter() - self._t0

    async def model_limits(self, timeout_s: float = 30.0) -> ModelLimits:
        info = await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout_s, wait_for_ready=True, metadata=self._metadata)
        return ModelLimits(vocab_size=info.vocab_size, max_context_len=info.max_context_len, eos_token_ids=tuple(info.eos_token_ids))

    def _slots(self):
        """What a request holds while in flight: one of ``max_concurrency`` slots (no cap: nothing)."""
        cap = self.config.max_concurrency
        return asyncio.Semaphore(cap) if cap else contextlib.nullcontext()

    async def warm_up(self, requests: list[BenchRequest]) -> None:
        """Send ``requests`` concurrently, at most ``max_concurrency`` at a time (as vLLM's warm-up
        goes through its semaphore), and wait for them; nothing is recorded."""
        slots = self._slots()

        async def one(index: int, request: BenchRequest) -> RequestRecord:
            async with slots:
                return await self._send(index, request, 0.0, f"{self.config.request_id_prefix}-warmup-{index}")

        records = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        failed = [r for r in records if not r.ok]
        if failed:
            logger.warning("%d of %d warm-up requests failed, first: %s", len(failed), len(records), failed[0].error or failed[0].finish_reason)

    async def run(self, requests: list[BenchRequest], offsets: list[float], on_done: Callable[[RequestRecord], None] | None = None) -> RunResult:
        """Send every request at its offset (seconds from now); return the records in request order."""
        if len(offsets) != len(requests):
            raise ValueError(f"offsets: {len(offsets)} given for {len(requests)} requests")
        slots = self._slots()
        self._t0 = time.perf_counter()

        async def one(index: int, request: BenchRequest, offset: float) -> RequestRecord:
            delay = offset - self.now_s()
            if delay > 0:
                await asyncio.sleep(delay)
            async with slots:
                record = await self._send(index, request, offset)
            if on_done is not None:
                on_done(record)
            return record

        records = await asyncio.gather(*(one(i, r, o) for i, (r, o) in enumerate(zip(requests, offsets))))
        return RunResult(list(records), self.now_s())

    async def send(self, request: BenchRequest, req_id: str) -> RequestRecord:
        """Send one request now under ``req_id`` (beside whatever ``run`` is sending)."""
        return await self._send(0, request, self.now_s(), req_id)

    async def _send(self, index: int, request: BenchRequest, scheduled_s: float, req_id: str | None = None) -> RequestRecord:
        req_id = req_id or f"{self.config.request_id_prefix}-{index}"
        record = RequestRecord(index=index, req_id=req_id, tag=request.tag, prompt_len=request.prompt_len, max_tokens=request.max_tokens, scheduled_s=scheduled_s)
        message = pb.GenerateRequest(request_id=req_id, sampling=pb.SamplingParams(max_tokens=request.max_tokens, temperature=self.config.temperature, ignore_eos=self.config.ignore_eos))
        if request.prompt_token_ids is not None:
            message.prompt_token_ids.extend(request.prompt_token_ids)
        else:
            message.prompt_text = request.prompt_text
        record.send_s = self.now_s()
        last = None
        try:
            call = self.stub.Generate(message, timeout=self.config.timeout_s, metadata=self._metadata, wait_for_ready=self.config.wait_for_ready)
            async for response in call:
                received = self.now_s()
                if response.token_ids:
                    record.chunk_s.append(received)
                    record.chunk_tokens.append(len(response.token_ids))
                    record.token_ids.extend(response.token_ids)
                last = response
        except grpc.aio.AioRpcError as exc:
            record.error = f"{exc.code().name}: {exc.details()}"
            logger.debug("request %s failed: %s", req_id, record.error)
        record.end_s = self.now_s()
        if last is not None and last.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            record.finish_reason = pb.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
            record.usage_completion_tokens = last.usage.completion_tokens
            record.prompt_len = last.usage.prompt_tokens
            record.cached_prompt_tokens = last.usage.cached_prompt_tokens
            record.timing = ServerTiming(**{name: getattr(last.timing, name) for name in TimingBreakdown.__slots__})
            record.prefill_worker_id = last.prefill_worker_id
            record.decode_worker_id = last.decode_worker_id
            record.num_draft_tokens = last.speculation.draft_tokens
            record.num_accepted_draft_tokens = last.speculation.accepted_draft_tokens
            if record.finish_reason not in FINISHED_OK and not record.error:
                record.error = f"{record.finish_reason.upper()}: {last.finish_detail}"
        elif not record.error:
            record.error = "stream ended without a final message"
        return record

    async def scale_pool(self, role: str, replicas: int, timeout_s: float = 300.0) -> ScaleOutcome:
        """Admin.ScalePool; a refusal (no pool manager, unimplemented) is returned, not raised."""
        outcome = ScaleOutcome(role=role, replicas=replicas, requested_s=self.now_s())
        wire_role = pb.WORKER_ROLE_PREFILL if role == "prefill" else pb.WORKER_ROLE_DECODE
        if self._admin_channel is None:
            outcome.error = "no Admin address was given"
            outcome.done_s = self.now_s()
            return outcome
        try:
            response = await self.admin.ScalePool(pb.ScalePoolRequest(role=wire_role, replicas=replicas), timeout=timeout_s, metadata=self._metadata)
            outcome.previous_replicas = response.previous_replicas
        except grpc.aio.AioRpcError as exc:
            outcome.error = f"{exc.code().name}: {exc.details()}"
        outcome.done_s = self.now_s()
        return outcome

    async def num_workers(self, role: str) -> int:
        """Workers of ``role`` the router lists as ready."""
        wire_role = pb.WORKER_ROLE_PREFILL if role == "prefill" else pb.WORKER_ROLE_DECODE
        status = await self.stub.GetClusterStatus(pb.GetClusterStatusRequest(), timeout=30.0, metadata=self._metadata)
        return sum(1 for w in status.workers if w.role == wire_role and w.state == pb.WORKER_STATE_READY)
