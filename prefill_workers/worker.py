"""The prefill actor: chunked prefill under a token budget, KV pushed after every chunk.

A request's life here:
1. ``submit`` (from the router) brings the prompt, the decode actor's reserved blocks and
   its handshake offer (connected once per decode epoch). The prompt joins the engine's
   priority queue; the call returns only when the request is done.
2. Each engine step prefills chunks of several prompts (split-fuse). Right after the step
   (on a GPU, once the step's kernels have finished writing the KV), every block a chunk
   completed is pushed to the decode actor: adjacent blocks merge into one descriptor, and
   the transfer pump drives the write on its own thread while the next step computes.
   While the prompt waits, the router relays the decode actor's lease renewals
   (``extend_leases``), so a long queue never voids the reservation.
3. The last chunk samples the first token, which rides in the notification of the last
   write. Once that write has completed, the prompt's local blocks are freed and ``submit``
   returns the first token and the timing.
4. ``cancel`` stops a request wherever it is and reports whether writes are still in
   flight; the router relays the quiesced report to the decode actor.

A pipelined prompt (distributed split-fuse) is prefilled by several of these actors at once,
each a contiguous range of layers (``PipelineStage``). ``open_stage`` takes the prompt's blocks
and says how much of it this stage's prefix cache holds; ``start_stage`` (once the router knows
where the whole pipeline starts) lets its chunks run: stage 0 cuts the prompt into chunks, every
later stage computes a chunk when the previous stage's activations for it arrive
(``stage_activations``), and hands its own to the next. Stage steps alternate with the actor's
ordinary batches, so a pipeline never holds other prompts back beyond its own steps. After each
chunk a stage pushes its layers of the blocks the chunk completed into the decode actor's
reservation (which expects one writer per stage); the last stage samples the first token and
its last write carries it. A stage answers only once its writes landed and the next stage has
every chunk of its activations (their NIXL writes completed, their Ray calls returned): a stage
that answered and died before its last chunk reached the next one left that stage waiting for
good (the router renews its lease while the request is in flight), where a death before the
answer is a failed stage call, and the router places the request again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from engine.block_allocator import OutOfBlocksError
from engine.config import EngineConfig
from engine.errors import InvalidRequestError, RequestFailedError
from engine.model import StageActivations
from engine.parallel.group import RankFailedError
from engine.scheduler import ScheduledBatch, ScheduledSlice
from engine.sequence import Sequence, sampled_token_to_json
from engine.step_profile import TransferRecord
from engine.stats import WorkerState, engine_stats
from kvtransfer.activations import ArrivedChunk, FailedSend
from kvtransfer.agent import KVTransferConfig
from kvtransfer.errors import KVTransferError
from kvtransfer.leases import RecentKeys
from kvtransfer.messages import ActivationSlots, KVDestination, QuiesceReport
from prefill_workers.messages import PrefillRequest, PrefillResult, PrefillStatus, PrefillTiming, PrefillUnavailableError
from prefill_workers.scheduler import PrefillScheduler
from workers.base import EngineWorker
from workers.pipeline import PipelineStage, StageChunk, StageOpened, inbox_chunks

logger = logging.getLogger(__name__)


class PrefillCancelledError(RuntimeError):
    """The request was cancelled before its prefill finished."""


@dataclass(slots=True)
class _Job:
    request: PrefillRequest
    seq: Sequence
    done: Future
    arrival: float
    num_pushed_blocks: int  # of the prompt's blocks, counted from its first (held ones included)
    num_chunks: int = 0
    prefilled_at: float | None = None
    num_bytes: int = 0
    writes_in_flight: set[int] = field(default_factory=set)
    # Per write in flight: when it was pushed, its bytes and descriptors (the step profile's transfer records).
    write_shapes: dict[int, tuple[float, int, int]] = field(default_factory=dict)
    # A pipeline stage's: started once the router said where the pipeline starts; the previous
    # stage's activations by the first token they cover.
    started: bool = False
    # Where the next stage computes from (its own cached prefix may reach further than this
    # stage's): no activations go to it for tokens before that.
    next_start: int = 0
    next_inbox: ActivationSlots | None = None  # where the next stage takes activations over NIXL (None: Ray)
    num_chunks_sent: int = 0  # each chunk's slot in that inbox is its number
    num_chunks_over_ray: int = 0
    inbox: dict[int, StageChunk | ArrivedChunk] = field(default_factory=dict)
    compute_s: float = 0.0  # a stage's time in its own steps (the rest it waited for activations or shared the actor)
    # Its chunks handed on over Ray whose calls have not returned (the next stage has them once they have).
    ray_sends: list[Future] = field(default_factory=list)
    handing_on: bool = False  # its KV all landed: it answers once the next stage has every chunk

    @property
    def stage(self) -> PipelineStage | None:
        return self.request.stage

    @property
    def all_pushed(self) -> bool:
        return self.num_pushed_blocks == self.request.destination.num_blocks

    @property
    def samples(self) -> bool:
        """Whether this actor samples the request's first token (not a stage before the last)."""
        return self.stage is None or self.stage.is_last


class PrefillWorker(EngineWorker):
    """Hosted by Ray as an async actor (see ``cluster``); plain Python otherwise."""

    role = "prefill"

    def __init__(self, worker_id: str, model_path: str, engine_config: EngineConfig, transfer_config: KVTransferConfig | None = None,
                 adapter_files: dict | None = None):
        super().__init__(worker_id, model_path, engine_config, transfer_config, PrefillScheduler, adapter_files)
        self.scheduler: PrefillScheduler
        self.block_size = self.engine.kv_cache.block_size
        self._answer_delay_s = 0.0
        self._jobs: dict[str, _Job] = {}
        # Reservation tokens cancelled before their request arrived (an async actor may run a
        # cancel ahead of the submit it follows): that submit is refused.
        self._cancelled_tokens = RecentKeys()
        # Renewals for requests whose submit is still waiting for the engine thread (a long step
        # runs): applied when the request arrives, or its lease would run out in that wait.
        self._early_renewals: dict[str, KVDestination] = {}
        self._num_stage_chunks_over_nixl = 0
        self._num_stage_chunks_over_ray = 0
        self._run_engine()

    # -- calls from the router ----------------------------------------------------------

    async def submit(self, request: PrefillRequest) -> PrefillResult:
        """Prefill the prompt, push its KV, return the first token once every write landed."""
        await self._prepare_grammar(request.params)
        done: Future = await asyncio.wrap_future(self._thread.call(self._enqueue, request))
        result = await asyncio.wrap_future(done)
        if self._answer_delay_s:
            await asyncio.sleep(self._answer_delay_s)  # fault injection: a death between the last write and the answer
        return result

    async def set_answer_delay(self, seconds: float) -> None:
        """Fault injection for tests and drills: answer a prefill this long after its last write landed."""
        self._answer_delay_s = max(0.0, float(seconds))

    async def open_stage(self, request: PrefillRequest) -> StageOpened:
        """Take one stage (``request.stage``) of a pipelined prefill: the prompt's blocks, now.
        Says how many prompt tokens this stage's prefix cache holds (the pipeline starts at the
        fewest any stage holds) and, after the first stage, where the previous one writes its
        activations; nothing runs before ``start_stage``."""
        await self._prepare_grammar(request.params)
        return await self._call(self._open_stage, request)

    async def start_stage(
        self, req_id: str, token: int, start: int, next_start: int | None = None, next_inbox: ActivationSlots | None = None
    ) -> PrefillResult:
        """Run this stage of the prompt from token ``start``, handing the next stage activations
        from token ``next_start`` (default ``start``) on, into ``next_inbox`` over NIXL where
        given; returns once its writes all landed (with the first token from the last stage)."""
        done: Future = await self._call(self._start_stage, req_id, token, start, start if next_start is None else next_start, next_inbox)
        result = await asyncio.wrap_future(done)
        if self._answer_delay_s:
            await asyncio.sleep(self._answer_delay_s)  # fault injection, as submit's
        return result

    async def stage_activations(self, chunk: StageChunk) -> None:
        """The previous stage's activations for one chunk. Kept without waiting for the engine
        thread (a step may be running): a dict store is atomic, and the thread is woken."""
        job = self._jobs.get(chunk.req_id)
        if job is None or job.request.destination.token != chunk.token:
            return  # cancelled or failed meanwhile: the router knows
        job.inbox[chunk.start] = chunk
        self._thread.wake()

    async def cancel(self, req_id: str, token: int | None = None) -> QuiesceReport:
        """Stop the request (its attempt into reservation ``token``, if given) and report writes in flight."""
        return await asyncio.wrap_future(self._thread.call(self._cancel, req_id, token))

    async def wait_quiesced(self, req_id: str, token: int | None, timeout_s: float) -> QuiesceReport:
        """After ``cancel``: the report once no write of the request is in flight, or after
        ``timeout_s`` whatever it says. Woken by the transfer pump's events, not by polling;
        runs on the actor's event loop (the agent is thread-safe), so a long step does not delay it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            events = self.transfer_events.arm()
            report = self.agent.quiesce_report(req_id, token)
            left = deadline - loop.time()
            if report.quiesced or left <= 0:
                return report
            try:
                await asyncio.wait_for(events.wait(), left)
            except asyncio.TimeoutError:
                pass

    async def extend_leases(self, destinations: list[KVDestination]) -> int:
        """The decode actors renewed these reservations: writes into them may go on longer.

        Runs on the actor's event loop, not the engine thread: a renewal must not wait for a
        long step to end. Returns how many of them belong to requests held here.
        """
        num_held = 0
        now = time.time()
        for key, early in list(self._early_renewals.items()):  # a snapshot: the engine thread pops too
            if early.lease_deadline < now:
                self._early_renewals.pop(key, None)
        for renewed in destinations:
            job = self._jobs.get(renewed.req_id)
            dest = job.request.destination if job is not None else None
            if job is None:
                self._early_renewals[renewed.req_id] = renewed  # its submit may be on its way
                continue
            if dest.token != renewed.token:
                continue
            # A float store is atomic; the engine thread only ever reads this deadline.
            dest.lease_deadline = max(dest.lease_deadline, renewed.lease_deadline)
            self.agent.extend_lease(renewed.req_id, renewed.token, renewed.lease_deadline)
            num_held += 1
        return num_held

    async def disconnect_peer(self, peer_name: str, reason: str) -> list[str]:
        """A decode actor is gone: drop it as a NIXL peer (its remote agent, its prepared
        descriptors) and fail the writes to it; returns the ids of the requests that failed.

        Runs on the actor's event loop, not the engine thread: the agent is thread-safe, and
        the failures reach the jobs through the pump's events.
        """
        failed = self.agent.disconnect(peer_name, reason)
        self.pump.kick()
        return failed

    async def peers(self) -> list[str]:
        """Names of the decode actors this prefill actor can write to."""
        return [peer.name for peer in self.agent.peers()]

    async def status(self) -> PrefillStatus:
        return await self._call(self._status)

    # -- engine-thread side -------------------------------------------------------------

    def _enqueue(self, request: PrefillRequest) -> Future:
        self._check_accepting(request)
        self._replace_earlier_attempt(request)
        seq = self.engine.add_request(request.req_id, request.prompt_token_ids, request.params, request.priority)
        return self._add_job(request, seq).done

    def _replace_earlier_attempt(self, request: PrefillRequest) -> None:
        """An attempt the router gave up, whose cancel did not reach this actor (it was briefly
        unreachable): the newer attempt takes its place, as on a decode actor. It was refused as
        "already running", which the client got as its own bad request."""
        earlier = self._jobs.get(request.req_id)
        if earlier is not None and earlier.request.destination.token != request.destination.token:
            self._cancel(request.req_id, earlier.request.destination.token)

    def _check_accepting(self, request: PrefillRequest) -> None:
        if self.state is not WorkerState.READY:
            raise PrefillUnavailableError(f"prefill worker {self.worker_id} is {self.state.value}")
        if request.destination.token in self._cancelled_tokens:
            raise PrefillCancelledError(f"req {request.req_id}: cancelled before it arrived on {self.worker_id}")
        if not self.agent.is_connected(request.destination.peer):
            self.agent.connect(request.decode_offer)

    def _add_job(self, request: PrefillRequest, seq: Sequence) -> _Job:
        expected = -(-seq.num_prompt_tokens // self.block_size)
        dest = request.destination
        if expected != dest.num_blocks or not dest.block_ids:
            self.engine.abort_request(request.req_id)
            raise ValueError(
                f"req {request.req_id}: destination covers {dest.num_blocks} blocks ({dest.num_cached_blocks} held "
                f"there), the prompt fills {expected} and its last one must be written"
            )
        renewed = self._early_renewals.pop(request.req_id, None)
        if renewed is not None and renewed.token == dest.token:
            dest.lease_deadline = max(dest.lease_deadline, renewed.lease_deadline)
        # Blocks the decode actor holds already are never pushed (this actor may still have to
        # compute them: the rest of the prompt attends to them).
        job = _Job(request, seq, Future(), time.monotonic(), num_pushed_blocks=dest.num_cached_blocks)
        self._jobs[request.req_id] = job
        return job

    def _open_stage(self, request: PrefillRequest) -> StageOpened:
        self._check_accepting(request)
        self._replace_earlier_attempt(request)
        seq = self.engine.make_sequence(request.req_id, request.prompt_token_ids, request.params, request.priority)
        try:
            self.scheduler.add_stage(seq, request.stage.salt)
        except OutOfBlocksError as exc:
            raise PrefillUnavailableError(f"prefill worker {self.worker_id}: {exc}") from None
        self._add_job(request, seq)
        inbox = None
        if not request.stage.is_first and self.activations is not None:
            num_chunks = inbox_chunks(seq.num_prompt_tokens, request.stage.chunk_tokens)
            inbox = self.activations.open_inbox(request.req_id, request.destination.token, num_chunks)
        return StageOpened(seq.num_computed_tokens, inbox)

    def _start_stage(self, req_id: str, token: int, start: int, next_start: int, next_inbox: ActivationSlots | None) -> Future:
        job = self._jobs.get(req_id)
        if job is None or job.request.destination.token != token or job.stage is None:
            raise PrefillCancelledError(f"req {req_id}: its stage on {self.worker_id} was cancelled")
        if next_start < start:
            raise ValueError(f"next_start: {next_start} is before this stage's start {start} (the next stage would wait for tokens never computed)")
        try:
            self.scheduler.start_stage_at(job.seq, start)
        except OutOfBlocksError as exc:  # the pipeline is refused: the prompt goes to one prefill actor
            raise PrefillUnavailableError(f"prefill worker {self.worker_id}: {exc}") from None
        job.started, job.next_start, job.next_inbox = True, next_start, next_inbox
        return job.done

    def _cancel(self, req_id: str, token: int | None) -> QuiesceReport:
        report = self.agent.cancel(req_id, token)
        job = self._jobs.get(req_id)
        if token is not None and (job is None or job.request.destination.token != token):
            self._cancelled_tokens.add(token)  # its submit, if still to come, is refused
        if job is not None and token is not None and job.request.destination.token != token:
            return report  # a newer attempt of the same request: leave it alone
        self._jobs.pop(req_id, None)
        if self.activations is not None:
            self.activations.close_inbox(req_id)
        if job is not None:
            self.engine.abort_request(req_id)
            job.done.set_exception(PrefillCancelledError(f"req {req_id}: cancelled on {self.worker_id}"))
            logger.info("req %s: cancelled on %s (%d writes in flight)", req_id, self.worker_id, report.num_in_flight)
        return report

    def _iterate(self) -> bool:
        busy = self._poll_sends()
        for job in [job for job in self._jobs.values() if job.handing_on]:
            busy = self._finish_if_done(job) or busy
        return self._take_turns(self._run_batch) or busy

    def _run_batch(self) -> bool:
        """One ordinary step: chunks of queued prompts under the token budget (split-fuse)."""
        if not self.engine.has_unfinished_requests():
            return False
        started = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch.slices:
            return False
        for out in self.engine.run_batch(batch):
            if out.error is not None and (job := self._jobs.get(out.req_id)) is not None:
                # That request alone; its blocks are free. A field named: the client's values.
                failure = InvalidRequestError(out.error_field, out.error) if out.error_field else RequestFailedError(out.error)
                self._finish_job(job, failure)
        computed = time.perf_counter()
        self._after_step(computed, started, [self._jobs.get(piece.seq.req_id) for piece in batch.slices])
        return True

    def _after_step(self, computed: float, started: float, jobs: list[_Job | None], log_step: bool = True) -> None:
        """Pause (fault injection), then push what the step completed of each job, and log the
        step (not a stage's: the step-time model fits steps of every layer)."""
        self._pause_after_step()
        paused = time.perf_counter() - computed
        if self.engine.kv_cache.tensor.is_cuda:
            # Kernels run asynchronously: NIXL must not read blocks the step is still writing.
            done = torch.cuda.Event()
            done.record()
            done.synchronize()
        for job in jobs:
            if job is not None:
                job.num_chunks += 1
                self._push_completed_blocks(job)
        if log_step:
            self.step_log.record(self.engine.last_shape, time.perf_counter() - started - paused)

    def _run_stage_chunk(self) -> bool:
        """One chunk of the oldest pipeline stage that has one ready: stage 0's next chunk, or a
        later stage's whose activations arrived. Its activations go on to the next stage."""
        if self.activations is not None:
            for arrived in self.activations.take_arrivals():
                job = self._jobs.get(arrived.req_id)
                if job is not None and job.request.destination.token == arrived.token:
                    job.inbox[arrived.start] = arrived
            for failed in self.activations.take_failed_sends():
                self._resend(failed)
        for job in list(self._jobs.values()):
            stage, seq = job.stage, job.seq
            if stage is None or seq.req_id not in self.scheduler.staged:
                continue
            start = seq.num_computed_tokens
            if not job.started or (not stage.is_first and start not in job.inbox):
                if time.time() > job.request.destination.lease_deadline:
                    # Waiting past its lease: the router renews the leases of every stage of a
                    # request in flight, so its router is gone (it died before starting the
                    # stage, or with the stage before this one ended): nothing will come.
                    waited_for = "its start" if not job.started else f"the activations from token {start}"
                    self._finish_job(job, PrefillCancelledError(f"req {seq.req_id}: its lease ran out waiting for {waited_for}"))
                elif job.started and self.activations is not None:
                    self.activations.expect()
                continue
            chunk = None
            if stage.is_first:
                num_tokens = min(stage.chunk_tokens, seq.num_prompt_tokens - start)
            else:
                chunk = job.inbox.pop(start)
                num_tokens = chunk.num_tokens
            return self._compute_stage_chunk(job, start, num_tokens, chunk)
        return False

    def _compute_stage_chunk(self, job: _Job, start: int, num_tokens: int, chunk: StageChunk | ArrivedChunk | None) -> bool:
        """``chunk``: the activations the stage before handed on (None for the first stage)."""
        stage, seq = job.stage, job.seq
        started = time.perf_counter()
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.monotonic()
        try:
            # Inside: moving the activations to the device can fail too (out of memory), and
            # that is this request's failure, not the actor's.
            incoming = chunk.activations(self.engine.config.device) if chunk is not None else None
            out = self.engine.run_stage(ScheduledBatch([ScheduledSlice(seq, num_tokens)]), stage.layers, incoming)
            skip = job.next_start - start  # tokens of this chunk the next stage holds cached
            if not stage.is_last and skip < num_tokens:
                # Inside: a chunk that cannot be handed on fails its request, not this actor.
                self._hand_on(job, start, out, max(0, skip))
        except RankFailedError:
            raise
        except Exception as exc:
            logger.error("req %s: stage %d on %s failed", seq.req_id, stage.index, self.worker_id, exc_info=True)
            self._finish_job(job, RequestFailedError(f"computing this request failed: {type(exc).__name__}: {exc}"))
            return True
        job.compute_s += time.perf_counter() - started
        self._after_step(time.perf_counter(), started, [job], log_step=False)
        if seq.num_computed_tokens >= seq.num_prompt_tokens:
            logger.info("req %s: stage %d of %d (layers %s) on %s computed its %d chunks in %.2fs of %.2fs since its first; "
                        "%d of %d handed on over Ray", seq.req_id, stage.index, stage.num_stages, stage.layers, self.worker_id, job.num_chunks,
                        job.compute_s, time.monotonic() - seq.first_scheduled_time, job.num_chunks_over_ray, job.num_chunks_sent)
        return True

    def _hand_on(self, job: _Job, start: int, out: StageActivations, skip: int) -> None:
        """The chunk's activations (less the ``skip`` tokens the next stage holds) to the next
        stage: written into its inbox over NIXL, or over Ray where it has none or it is full."""
        index, token = job.num_chunks_sent, job.request.destination.token
        job.num_chunks_sent += 1
        if skip:
            out = StageActivations(out.hidden[skip:], out.residual[skip:] if out.residual is not None else None)
        if job.next_inbox is not None and self.activations is not None:
            if self.activations.send(job.next_inbox, index, job.seq.req_id, token, start + skip, out):
                self._num_stage_chunks_over_nixl += 1
                return
        self._send_over_ray(job, start + skip, out)

    def _resend(self, failed: FailedSend) -> None:
        """A chunk whose activation write failed after it was posted, over Ray (its stage is
        still here: a stage ends only once every chunk reached the next one; nobody waits for
        an attempt cancelled or failed here)."""
        job = self._jobs.get(failed.req_id)
        if job is None or job.request.destination.token != failed.token:
            return
        try:
            self._send_over_ray(job, failed.start, failed.activations)
        except Exception as exc:
            self._finish_job(job, RequestFailedError(f"handing on the activations from token {failed.start} failed: {exc}"))

    def _send_over_ray(self, job: _Job, start: int, out: StageActivations) -> None:
        """A chunk's activations (tokens from ``start``) to the next stage in a Ray call (the
        router hears if that actor is gone); the stage answers once the call returned."""
        self._num_stage_chunks_over_ray += 1
        job.num_chunks_over_ray += 1
        ref = job.stage.next_stage.stage_activations.remote(StageChunk.of(job.seq.req_id, job.request.destination.token, start, out))
        returned = ref.future()
        job.ray_sends.append(returned)
        returned.add_done_callback(lambda _: self._thread.wake())  # a stage waiting to answer looks again

    def _handed_on(self, job: _Job) -> bool:
        """Whether the next stage has every chunk this stage computed (a stage before the last;
        any other job hands nothing on). A Ray call that raised counts as returned: the next
        stage is gone, and the router, waiting for its call too, places the request again."""
        if job.stage is None or job.stage.is_last:
            return True
        job.ray_sends = [returned for returned in job.ray_sends if not returned.done()]
        if job.ray_sends:
            return False
        return self.activations is None or self.activations.num_sends_in_flight(job.seq.req_id, job.request.destination.token) == 0

    def _finish_if_done(self, job: _Job) -> bool:
        """Answer the job if it is done: its prompt computed, its KV all landed, and (a stage)
        its activations all at the next stage. Whether it answered."""
        if not (job.all_pushed and not job.writes_in_flight and job.prefilled_at is not None):
            return False
        if not self._handed_on(job):
            job.handing_on = True
            if time.time() > job.request.destination.lease_deadline:
                # The router renews every stage's lease while the request is in flight: it is
                # gone, and a write that never completes (a hung peer) would hold the prompt's
                # blocks here for good.
                self._finish_job(job, PrefillCancelledError(f"req {job.request.req_id}: its lease ran out handing its activations on"))
                return True
            if self.activations is not None:
                self.activations.expect()  # its writes' completions are looked for soon, not after the poller's back-off
            return False
        self._finish_job(job, None)
        return True

    def _push_completed_blocks(self, job: _Job) -> None:
        seq = job.seq
        prompt_done = seq.num_computed_tokens >= seq.num_prompt_tokens
        if prompt_done and job.prefilled_at is None:
            job.prefilled_at = time.monotonic()
        num_ready = -(-seq.num_computed_tokens // self.block_size) if prompt_done else seq.num_computed_tokens // self.block_size
        if num_ready <= job.num_pushed_blocks:
            return
        start, dest = job.num_pushed_blocks, job.request.destination
        held = dest.num_cached_blocks  # prompt block i lands in dest.block_ids[i - held]
        payload = ""
        if prompt_done and num_ready == dest.num_blocks and job.samples:
            # The last write carries the first token: the decode actor can start the moment
            # the blocks land, without waiting for a message through the router.
            first_logprob = seq.output_logprobs[0] if seq.output_logprobs else None
            payload = sampled_token_to_json(seq.token_ids[seq.num_prompt_tokens], first_logprob)
        layers = job.stage.layers if job.stage is not None else None  # a stage writes its layers only
        src_blocks, dst_blocks = seq.block_table[start:num_ready], dest.block_ids[start - held : num_ready - held]
        try:
            write = self.agent.push(seq.req_id, dest, src_blocks, dst_blocks, num_ready - held, payload, layers)
        except KVTransferError as exc:
            self._finish_job(job, exc)
            return
        self.pump.kick()
        # Every rank's heads of the blocks (tensor parallelism), in the descriptors that moved them.
        num_bytes, num_descriptors = self.agent.write_cost(dest, src_blocks, dst_blocks, layers)
        job.write_shapes[write] = (time.perf_counter(), num_bytes, num_descriptors)
        job.writes_in_flight.add(write)
        job.num_pushed_blocks = num_ready
        job.num_bytes += num_bytes

    def _poll_sends(self) -> bool:
        events = self.pump.take_send_events()
        for event in events:
            job = self._jobs.get(event.req_id)
            if job is None or event.token not in (None, job.request.destination.token):
                continue  # gone, or an event of an earlier attempt (into a reservation given up)
            if event.error is not None:
                self._finish_job(job, event.error)
                continue
            job.writes_in_flight.discard(event.seq)
            pushed = job.write_shapes.pop(event.seq, None)
            if pushed is not None:
                done = event.seen_at or time.perf_counter()
                self.step_log.record_transfer(TransferRecord(pushed[1], pushed[2], done - pushed[0]))
            self._finish_if_done(job)
        return bool(events)

    def _finish_job(self, job: _Job, error: Exception | None) -> None:
        req_id = job.request.req_id
        self._jobs.pop(req_id, None)
        if self.activations is not None:
            self.activations.close_inbox(req_id, finished=error is None)
        if error is not None:
            self.agent.cancel(req_id, job.request.destination.token)
            self.engine.abort_request(req_id)
            logger.warning("req %s: prefill on %s failed: %s", req_id, self.worker_id, error)
            job.done.set_exception(error)
            return
        self.scheduler.release(req_id)
        now = time.monotonic()
        seq = job.seq
        scheduled = seq.first_scheduled_time or job.arrival
        timing = PrefillTiming(
            queue_ms=(scheduled - job.arrival) * 1000,
            compute_ms=(job.prefilled_at - scheduled) * 1000,
            transfer_ms=(now - job.prefilled_at) * 1000,
            num_chunks=job.num_chunks,
            num_bytes=job.num_bytes,
            num_cached_tokens=seq.num_cached_tokens or 0,
        )
        if not job.samples:
            job.done.set_result(PrefillResult(req_id, None, None, timing))
            return
        first_logprob = seq.output_logprobs[0] if seq.output_logprobs else None
        job.done.set_result(PrefillResult(req_id, seq.token_ids[seq.num_prompt_tokens], first_logprob, timing, seq.prompt_logprobs))

    def _status(self) -> PrefillStatus:
        return PrefillStatus(
            worker_id=self.worker_id,
            state=self.state,
            epoch=self.agent.ref.epoch,
            node=self.node,
            rank_nodes=self.rank_nodes,
            engine=engine_stats(self.engine),
            num_transfers_in_flight=self.agent.num_in_flight(),
            num_stage_chunks_over_nixl=self._num_stage_chunks_over_nixl,
            num_stage_chunks_over_ray=self._num_stage_chunks_over_ray,
            transfer_paths=self.agent.path_stats(),
        )

