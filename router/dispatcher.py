"""A request's path through the workers: reserve, prefill, relay, retry, abort.

A request's life here (disaggregated path):
1. ``dispatch`` picks a decode actor D (least loaded), waiting at the router while every D is
   full, and asks D to ``reserve`` blocks for the prompt. Short prompts, a busy prefill pool
   or an empty one send the prompt to D instead (``add_local``).
2. A background task submits the prompt to a prefill actor P with D's destination. P pushes
   the KV chunk by chunk and returns the first token; the task relays it to D (``start``).
   If P dies, D's reservation is dropped (a dead writer writes nothing more) and the prompt
   goes to another P, a bounded number of times.
3. One collector task per D long-polls its outputs and routes them to each request's queue.
   If D dies, its requests that have sent no token yet are dispatched again elsewhere; the
   others end with UNAVAILABLE.
4. ``finish`` runs when the stream ends for any reason. If the request did not end on D by
   itself, it is aborted on D and cancelled on P, and D frees its reserved blocks only after
   P's report that no write is still in flight.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from decode_workers.messages import DecodeRequest, SeqOutput
from decode_workers.worker import DecodeCapacityError
from kvtransfer.messages import KVDestination
from engine.stats import WorkerState
from prefill_workers.messages import PrefillRequest
from router.config import Disaggregation, RouterConfig
from router.errors import DeadlineExceededError, InvalidArgumentError, ResourceExhaustedError, UnavailableError
from router.output_stream import OutputAssembler
from router.pool import Role, WorkerPool, WorkerRecord
from router.validation import ValidatedRequest

logger = logging.getLogger(__name__)

WORKER_GONE = (ActorDiedError, ActorUnavailableError, RayActorError)


@dataclass(slots=True)
class Restart:
    """A worker died before this request produced a token: dispatch it again."""

    reason: str
    prefill_failed: bool = False  # the prefill actor died (else the decode actor did)


@dataclass(slots=True)
class Failure:
    """The request cannot go on; ``error`` is what the client is told."""

    error: Exception


@dataclass(slots=True)
class ActiveRequest:
    request: ValidatedRequest
    assembler: OutputAssembler
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    decode: WorkerRecord | None = None
    prefill: WorkerRecord | None = None
    prefill_task: asyncio.Task | None = None
    destination: KVDestination | None = None  # the decode reservation the current prefill writes into
    decode_finished: bool = False
    num_restarts: int = 0
    num_prefill_retries: int = 0
    last_message_at: float | None = None  # for inter-token latency

    @property
    def req_id(self) -> str:
        return self.request.req_id


class Dispatcher:
    def __init__(self, pool: WorkerPool, config: RouterConfig, metrics=None):
        self.pool = pool
        self.config = config
        self.metrics = metrics
        self.active: dict[str, ActiveRequest] = {}
        self._collectors: dict[str, asyncio.Task] = {}

    @property
    def num_queued(self) -> int:
        """Requests admitted that have not produced a token yet."""
        return sum(1 for a in self.active.values() if not a.assembler.has_sent_tokens)

    def admit(self, active: ActiveRequest) -> None:
        if active.req_id in self.active:
            raise InvalidArgumentError("request_id", f"{active.req_id!r} is already in flight")
        if self.num_queued >= self.config.max_queued_requests:
            raise ResourceExhaustedError(
                f"{self.num_queued} requests are already waiting for their first token "
                f"(limit {self.config.max_queued_requests}); retry later"
            )
        self.active[active.req_id] = active

    # -- dispatch -------------------------------------------------------------------------

    async def dispatch(self, active: ActiveRequest) -> None:
        """Place the request on a decode actor (and a prefill actor), waiting for capacity."""
        request = active.request
        give_up_at = time.monotonic() + self.config.capacity_wait_s
        if request.deadline is not None:
            give_up_at = min(give_up_at, request.deadline)
        tried: set[str] = set()
        while True:
            decode = self.pool.pick(Role.DECODE, exclude=tried) or self.pool.pick(Role.DECODE)
            if decode is None:
                raise UnavailableError("no decode worker is available")
            local = self._prefill_locally(request)
            decode_request = DecodeRequest(
                request.req_id, request.prompt_token_ids, request.sampling_params, request.priority, self.config.kv_lease_s
            )
            # Bound before the call: the collector may see this request's first output before
            # the call returns (a short local prefill), and must route it here.
            active.decode = decode
            active.decode_finished = False
            self.pool.assign(decode, request.req_id)
            try:
                if local:
                    await decode.handle.add_local.remote(decode_request)
                    destination = None
                else:
                    destination = await decode.handle.reserve.remote(decode_request)
                break
            except DecodeCapacityError as exc:
                self.pool.release(decode, request.req_id)
                tried.add(decode.worker_id)
                if len(tried) >= len(self.pool.routable(Role.DECODE)):
                    tried.clear()
                    if time.monotonic() >= give_up_at:
                        raise _capacity_error(request, exc) from None
                    await asyncio.sleep(0.01)
            except WORKER_GONE:
                self.pool.release(decode, request.req_id)
                self.on_worker_died(decode)
            except BaseException:
                self.pool.release(decode, request.req_id)
                raise
        active.assembler.decode_worker_id = decode.worker_id
        active.assembler.prefill_worker_id = ""
        self._ensure_collector(decode)
        active.assembler.timing.dispatched = time.monotonic()
        if destination is not None:
            active.prefill_task = asyncio.create_task(self._prefill(active, destination))

    def _prefill_locally(self, request: ValidatedRequest) -> bool:
        mode = self.config.disaggregation
        if mode is Disaggregation.NEVER or not self.pool.routable(Role.PREFILL):
            return True
        if mode is Disaggregation.ALWAYS:
            return False
        num_tokens = len(request.prompt_token_ids)
        if num_tokens <= self.config.local_prefill_max_tokens:
            return True
        backlog = self.pool.min_prefill_backlog() or 0
        return backlog >= self.config.prefill_busy_tokens and num_tokens <= self.config.busy_local_prefill_max_tokens

    async def _prefill(self, active: ActiveRequest, destination: KVDestination) -> None:
        request, decode = active.request, active.decode
        prefill = self.pool.pick(Role.PREFILL)
        if prefill is None:
            active.outputs.put_nowait(Restart("no prefill worker is available", prefill_failed=True))
            return
        num_tokens = len(request.prompt_token_ids)
        active.prefill = prefill
        active.destination = destination
        active.assembler.prefill_worker_id = prefill.worker_id
        self.pool.assign(prefill, request.req_id, num_tokens)
        try:
            result = await prefill.handle.submit.remote(
                PrefillRequest(request.req_id, request.prompt_token_ids, request.sampling_params, destination, decode.handshake_offer, request.priority)
            )
        except WORKER_GONE:
            logger.warning("req %s: prefill worker %s died", request.req_id, prefill.worker_id)
            self.on_worker_died(prefill)
            try:
                # The last write carries the first token: the decode actor may already be
                # decoding this request, and then the prefill worker's death changes nothing.
                if await decode.handle.is_admitted.remote(request.req_id):
                    return
            except WORKER_GONE:
                return  # the collector reports the decode actor's death
            active.outputs.put_nowait(Restart(f"prefill worker {prefill.worker_id} died", prefill_failed=True))
            return
        except Exception as exc:
            logger.warning("req %s: prefill on %s failed: %s", request.req_id, prefill.worker_id, _reason(exc))
            active.outputs.put_nowait(Failure(UnavailableError(f"prefill failed on {prefill.worker_id}: {_reason(exc)}")))
            return
        finally:
            self.pool.release(prefill, request.req_id, num_tokens)
        active.assembler.timing.prefill = result.timing
        if self.metrics is not None:
            self.metrics.observe_prefill(result.timing.num_bytes, result.timing.transfer_ms)
        try:
            await decode.handle.start.remote(request.req_id, result.first_token_id, result.first_logprob)
        except WORKER_GONE:
            pass  # the collector reports the decode actor's death

    async def restart(self, active: ActiveRequest, reason: Restart) -> None:
        """Dispatch again after a worker died, within the retry bounds; raise UNAVAILABLE beyond them."""
        if reason.prefill_failed:
            active.num_prefill_retries += 1
            if active.num_prefill_retries > self.config.max_prefill_retries:
                raise UnavailableError(f"{reason.reason}; gave up after {self.config.max_prefill_retries} retries")
        else:
            active.num_restarts += 1
        if self.metrics is not None:
            self.metrics.retries.labels("prefill" if reason.prefill_failed else "decode").inc()
        logger.warning("req %s: dispatching again (%s)", active.req_id, reason.reason)
        if reason.prefill_failed and active.decode is not None and active.decode.state is not WorkerState.DEAD:
            # A dead writer writes nothing more: the reservation can be freed right away.
            self.pool.release(active.decode, active.req_id)
            try:
                await active.decode.handle.abort.remote(active.req_id)
                await active.decode.handle.confirm_quiesced.remote(active.req_id)
            except WORKER_GONE:
                pass
        await self.cancel_prefill(active)
        await self.dispatch(active)

    async def cancel_prefill(self, active: ActiveRequest) -> None:
        """Stop a prefill whose decode actor is gone (before the request is dispatched again)."""
        if active.prefill_task is not None and not active.prefill_task.done():
            active.prefill_task.cancel()
        prefill, active.prefill, active.prefill_task = active.prefill, None, None
        if prefill is None or prefill.state is WorkerState.DEAD:
            return
        try:
            await prefill.handle.cancel.remote(active.req_id, active.destination.token)
        except WORKER_GONE:
            pass

    # -- outputs --------------------------------------------------------------------------

    def _ensure_collector(self, decode: WorkerRecord) -> None:
        task = self._collectors.get(decode.worker_id)
        if task is None or task.done():
            self._collectors[decode.worker_id] = asyncio.create_task(self._collect(decode))

    async def _collect(self, decode: WorkerRecord) -> None:
        while decode.req_ids:
            try:
                outputs: list[SeqOutput] = await decode.handle.poll_outputs.remote(self.config.output_poll_s)
            except WORKER_GONE:
                self.on_worker_died(decode)
                return
            except Exception:
                logger.exception("output collection from %s failed", decode.worker_id)
                await asyncio.sleep(0.1)
                continue
            for out in outputs:
                active = self.active.get(out.req_id)
                if active is not None and active.decode is decode:
                    if out.finished:
                        active.decode_finished = True
                        self.pool.release(decode, out.req_id)
                    active.outputs.put_nowait(out)

    def on_worker_died(self, record: WorkerRecord) -> None:
        """Stop routing to a dead worker and tell its decode requests what that means."""
        if record.state is WorkerState.DEAD:
            return
        record.state = WorkerState.DEAD
        logger.warning("worker %s (%s) is dead", record.worker_id, record.role.value)
        if record.role is not Role.DECODE:
            return
        for req_id in list(record.req_ids):
            self.pool.release(record, req_id)
            active = self.active.get(req_id)
            if active is None or active.decode is not record:
                continue
            if active.prefill_task is not None:
                active.prefill_task.cancel()
            if not active.assembler.has_sent_tokens and active.num_restarts < self.config.max_decode_restarts:
                active.outputs.put_nowait(Restart(f"decode worker {record.worker_id} died"))
            else:
                active.outputs.put_nowait(Failure(UnavailableError(f"decode worker {record.worker_id} died mid-stream")))

    # -- the end --------------------------------------------------------------------------

    async def finish(self, active: ActiveRequest) -> None:
        """Release everything the request holds; abort it on its workers if it did not end there."""
        self.active.pop(active.req_id, None)
        decode = active.decode
        if active.prefill_task is not None and not active.prefill_task.done():
            active.prefill_task.cancel()
        if decode is None or active.decode_finished:
            return
        self.pool.release(decode, active.req_id)
        await self._abort_on_workers(active)

    async def _abort_on_workers(self, active: ActiveRequest) -> None:
        req_id, decode, prefill = active.req_id, active.decode, active.prefill
        try:
            await decode.handle.abort.remote(req_id)
        except WORKER_GONE:
            return
        if prefill is None:
            return
        try:
            report = await prefill.handle.cancel.remote(req_id, active.destination.token)
            for _ in range(200):  # bounded: the lease frees the blocks if the writer never confirms
                if report.quiesced:
                    break
                await asyncio.sleep(0.01)
                report = await prefill.handle.quiesce_report.remote(req_id, active.destination.token)
            if not report.quiesced:
                logger.warning("req %s: %s never quiesced; the lease will free the blocks", req_id, prefill.worker_id)
                return
        except WORKER_GONE:
            pass  # a dead writer has nothing in flight
        try:
            await decode.handle.confirm_quiesced.remote(req_id)
        except WORKER_GONE:
            pass

    async def close(self) -> None:
        for task in self._collectors.values():
            task.cancel()


def _capacity_error(request: ValidatedRequest, exc: Exception) -> Exception:
    if request.deadline is not None and time.monotonic() >= request.deadline:
        return DeadlineExceededError("the deadline passed while waiting for decode capacity")
    return ResourceExhaustedError(f"no decode worker has room for this request: {_reason(exc)}")


def _reason(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)
    return str(cause if cause is not None else exc).strip().splitlines()[-1]

