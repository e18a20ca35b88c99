"""The decode actor: reserves blocks for incoming KV, admits sequences, batches decode.

A disaggregated request's life here:
1. ``reserve`` (from the router) allocates the prompt's blocks in the engine and registers
   them with the KV agent under a lease; the returned ``KVDestination`` goes to a prefill
   actor, which writes the prompt's KV into those blocks chunk by chunk.
   While the prompt waits in a prefill queue the router renews the lease (``renew_leases``),
   so no time spent waiting can void the reservation.
2. The transfer pump polls the agent on its own thread, also while a step computes, and
   wakes the engine thread when something landed. When every block has landed, the first
   token has come with the last write's notification, and the sequence joins the running
   batch; its first token is published at once. (``start``, the router's relay of the same
   token, is the fallback and a no-op once the sequence is admitted.)
3. Each step publishes one batch of ``SeqOutput`` (new tokens of every sequence); the router
   collects them with ``poll_outputs``, which also reports how many blocks a new
   reservation could take now, so the router queues requests instead of asking in vain.
   The last output of a request carries its timing.
4. Abort: blocks that a write may still target are freed only after the writer's quiesce
   report (``confirm_quiesced``) or the lease's end; the rest are freed at once.
5. Several routers may share this actor. Each request is named by its router
   ("<router id>/<request id>") and its outputs go to that router's ``poll_outputs`` only.
   A router not heard from for its ``router_lease_s`` is taken for dead: its requests are
   aborted as in 4, so a router that crashed leaves no blocks behind.
A local request (``add_local``: conditional disaggregation or aggregated mode) is prefilled
here with chunked prefill and then decodes like the others.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field

from decode_workers.messages import (
    DecodeAbortedError,
    DecodeCapacityError,
    DecodeReport,
    DecodeRequest,
    DecodeStatus,
    DecodeTiming,
    PrefixCachingOffError,
    PrefixNotHeldError,
    SeqOutput,
)
from decode_workers.scheduler import DecodeScheduler
from engine.config import EngineConfig
from engine.parallel.group import RankFailedError
from engine.sequence import FinishReason, Sequence, TokenLogprob, sampled_token_from_json
from engine.stats import WorkerState, engine_stats
from kvtransfer.activations import ArrivedChunk
from kvtransfer.agent import KVTransferConfig
from kvtransfer.handshake import HandshakeOffer
from kvtransfer.leases import RecentKeys
from kvtransfer.messages import ActivationSlots, KVDestination
from workers.base import EngineWorker
from workers.pipeline import PipelineStage, StageChunk, inbox_chunks

logger = logging.getLogger(__name__)

# Gathering several steps' outputs into one answer (a router's stream_interval) waits at most
# this long beyond the first output: slow steps never hold tokens for long.
GATHER_LIMIT_S = 0.25
# A local prompt sent on the promise of a cached prefix (DecodeRequest.only_if_cached) may leave
# this many blocks to compute: its last partial block, and the one its last token may complete
# (a prefix-cache hit stops before the last token).
CACHED_PROMISE_SLACK_BLOCKS = 2


@dataclass(slots=True)
class _Tracked:
    """The decode actor's view of one request, beyond the engine's sequence."""

    seq: Sequence
    arrival: float
    remote: bool
    dest_block_ids: list[int]
    kv_ready_at: float | None = None
    first_token: tuple[int, TokenLogprob | None] | None = None
    last_token_at: float | None = None
    attempt: int = 0
    router_id: str = ""
    # The last stage of a pipelined prefill, computed here (``DecodeRequest.stage``): the
    # reservation's token, and the previous stage's activations by the first token they cover.
    stage: PipelineStage | None = None
    token: int = 0
    stage_inbox: dict[int, StageChunk | ArrivedChunk] = field(default_factory=dict)
    stage_compute_s: float = 0.0
    timing_sent: bool = False  # its first output carried the timing so far (a stop string may end it at the router)


class OutputBox:
    """Outputs from the engine thread, per router, collected by an async ``take`` on the actor's loop.

    A router streaming several tokens per message (``RouterConfig.stream_interval``) asks
    ``take`` to gather that many steps' outputs into one answer: each answer costs both sides a
    Ray call, which at one call per step was most of what a streamed token cost the router.
    A request's first output and its last are never held: they answer at once.
    """

    def __init__(self) -> None:
        self._items: dict[str, list[SeqOutput]] = {}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: dict[str, asyncio.Event] = {}
        self._streaming: dict[str, set[str]] = {}  # per router: requests that already had an output
        self._urgent: set[str] = set()  # routers with a first or last output waiting

    def put(self, router_id: str, items: list[SeqOutput]) -> None:
        if not items:
            return
        with self._lock:
            self._items.setdefault(router_id, []).extend(items)
            streaming = self._streaming.setdefault(router_id, set())
            for item in items:
                if item.finished:
                    streaming.discard(item.req_id)
                    self._urgent.add(router_id)
                elif item.req_id not in streaming:
                    streaming.add(item.req_id)
                    self._urgent.add(router_id)
            loop, event = self._loop, self._events.get(router_id)
        if loop is not None and event is not None:
            loop.call_soon_threadsafe(event.set)

    async def take(self, router_id: str, timeout_s: float, gather_steps: int = 1, gather_limit_s: float = GATHER_LIMIT_S) -> list[SeqOutput]:
        """This router's outputs, waiting up to ``timeout_s`` for the first; then, unless a
        first or last output is among them, up to ``gather_steps`` - 1 more steps' worth (at
        most ``gather_limit_s`` more)."""
        with self._lock:
            self._loop = asyncio.get_running_loop()
            event = self._events.setdefault(router_id, asyncio.Event())
            waiting = not self._items.get(router_id)
        if waiting:
            await self._wait(event, timeout_s)
        if gather_steps > 1:
            deadline = time.monotonic() + gather_limit_s
            for _ in range(gather_steps - 1):
                with self._lock:
                    if router_id in self._urgent or not self._items.get(router_id):
                        break
                event.clear()
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not await self._wait(event, remaining):
                    break
        event.clear()
        with self._lock:
            self._urgent.discard(router_id)
            return self._items.pop(router_id, [])

    @staticmethod
    async def _wait(event: asyncio.Event, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    def done(self, router_id: str, req_id: str) -> None:
        """A request ended without a last output (aborted): it streams no more."""
        with self._lock:
            self._streaming.get(router_id, set()).discard(req_id)

    def forget(self, router_id: str) -> None:
        """Drop a router that is gone, with whatever it did not collect."""
        with self._lock:
            self._items.pop(router_id, None)
            self._events.pop(router_id, None)
            self._streaming.pop(router_id, None)
            self._urgent.discard(router_id)


class DecodeWorker(EngineWorker):
    """Hosted by Ray as an async actor (see ``cluster``); plain Python otherwise."""

    role = "decode"

    def __init__(self, worker_id: str, model_path: str, engine_config: EngineConfig, transfer_config: KVTransferConfig | None = None,
                 adapter_files: dict | None = None):
        super().__init__(worker_id, model_path, engine_config, transfer_config, DecodeScheduler, adapter_files)
        self.scheduler: DecodeScheduler
        self._tracked: dict[str, _Tracked] = {}
        self._aborted_attempts = RecentKeys()  # (req_id, attempt) aborted before it arrived: refused when it does
        self._outputs = OutputBox()
        # When each router was last heard from, and how long its silence may last.
        self._router_heard: dict[str, float] = {}
        self._router_lease_s: dict[str, float] = {}
        self._router_watch: asyncio.Task | None = None
        self._num_orphans_aborted = 0
        self._run_engine()

    # -- calls from the router (each runs on the engine thread) -------------------------

    async def handshake_offer(self) -> HandshakeOffer:
        return self.agent.handshake_offer()

    async def reserve(self, request: DecodeRequest) -> KVDestination:
        """Reserve blocks for a prompt another actor prefills; raise DecodeCapacityError if full."""
        self._heard_from(request.router_id, request.router_lease_s)
        await self._prepare_grammar(request.params)
        return await self._call(self._reserve, request)

    async def start(self, req_id: str, first_token_id: int, first_logprob: TokenLogprob | None = None) -> None:
        """The prefill actor finished: this is the first token; admit once every block landed."""
        await self._call(self._set_first_token, req_id, first_token_id, first_logprob)

    async def is_admitted(self, req_id: str) -> bool:
        """Whether the request's KV and first token arrived and it is decoding (or done)."""
        return await self._call(self._is_admitted, req_id)

    async def stage_activations(self, chunk: StageChunk) -> None:
        """The previous stage's activations for one chunk of a prompt whose last stage runs here.
        Kept without waiting for the engine thread (a step may be running): a dict store is
        atomic, and the thread is woken."""
        tracked = self._tracked.get(chunk.req_id)
        if tracked is None or tracked.stage is None or tracked.token != chunk.token:
            return  # aborted or failed meanwhile: the router knows
        tracked.stage_inbox[chunk.start] = chunk
        self._thread.wake()

    async def open_stage_inbox(self, req_id: str) -> ActivationSlots | None:
        """Where the previous stage writes the activations of a prompt whose last stage runs
        here, over NIXL (None: over Ray)."""
        return await self._call(self._open_stage_inbox, req_id)

    def _open_stage_inbox(self, req_id: str) -> ActivationSlots | None:
        tracked = self._tracked.get(req_id)
        if tracked is None or tracked.stage is None or self.activations is None:
            return None
        num_chunks = inbox_chunks(tracked.seq.num_prompt_tokens, tracked.stage.chunk_tokens)
        return self.activations.open_inbox(req_id, tracked.token, num_chunks)

    async def add_local(self, request: DecodeRequest) -> None:
        """Prefill and decode here (conditional disaggregation, aggregated mode)."""
        self._heard_from(request.router_id, request.router_lease_s)
        await self._prepare_grammar(request.params)
        await self._call(self._add_local, request)

    async def abort(self, req_id: str, attempt: int | None = None, given_up: bool = False) -> bool:
        """Stop a request (only its ``attempt``, if given); remotely written blocks wait for
        ``confirm_quiesced`` or the lease. An attempt not here yet is refused when it comes.
        ``given_up``: the request is placed again, so only a confirm naming this reservation's
        token frees those blocks (``KVReceiver.abort``)."""
        return await self._call(self._abort, req_id, attempt, given_up)

    async def confirm_quiesced(self, req_id: str, token: int | None = None) -> int:
        """The writer reported no write in flight for this request (or died): free its blocks
        (with ``token``, that reservation's only: the request may hold a newer one here)."""
        return await self._call(self._confirm_quiesced, req_id, token)

    async def renew_leases(self, req_ids: list[str], lease_s: float) -> list[KVDestination]:
        """Extend the leases of these reservations that still wait for KV (the rest are skipped)."""
        # The agent is thread-safe: no need to wait for the engine thread to finish a step.
        return self.agent.renew_leases(req_ids, lease_s)

    async def poll_outputs(self, timeout_s: float = 0.05, router_id: str = "", gather_steps: int = 1) -> DecodeReport:
        """This router's outputs since its last call (waiting up to ``timeout_s`` for the first
        one; with ``gather_steps`` > 1, gathering that many steps' worth, see ``OutputBox``), and capacity."""
        self._heard_from(router_id)
        outputs = await self._outputs.take(router_id, timeout_s, gather_steps)
        # A worker that is not ready grants no room (reserve refuses it): reported free, it was
        # granted the head of the queue again at every poll until the router's next health round.
        free = self.scheduler.num_reservable_blocks() if self.state is WorkerState.READY else 0
        return DecodeReport(outputs, free, self.scheduler.allocator.num_blocks)

    def _heard_from(self, router_id: str, lease_s: float | None = None) -> None:
        self._router_heard[router_id] = time.monotonic()
        if lease_s is not None:
            self._router_lease_s[router_id] = lease_s
            if self._router_watch is None or self._router_watch.done():
                self._router_watch = asyncio.get_running_loop().create_task(self._watch_routers())

    async def _watch_routers(self) -> None:
        """Abort the requests of routers that fell silent (crashed); runs while any router
        with a lease has requests here, a check every few seconds."""
        while self._router_lease_s:
            await asyncio.sleep(min(5.0, min(self._router_lease_s.values()) / 4))
            now = time.monotonic()
            for router_id, lease_s in list(self._router_lease_s.items()):
                heard = self._router_heard.get(router_id, now)
                if now - heard > lease_s:
                    num_aborted = await self._call(self._release_router, router_id)
                    if num_aborted:
                        logger.warning(
                            "%s: router %s silent for over %.0fs; aborted its %d requests", self.worker_id, router_id, lease_s, num_aborted
                        )
                    if self._router_heard.get(router_id, heard) > heard:
                        continue  # it spoke while its requests were released (a new reservation): watched on
                    self._router_lease_s.pop(router_id, None)
                    self._router_heard.pop(router_id, None)
                    self._outputs.forget(router_id)

    async def status(self) -> DecodeStatus:
        return await self._call(self._status)


    # -- engine-thread side -------------------------------------------------------------

    def _check_accepting(self) -> None:
        if self.state is not WorkerState.READY:
            raise DecodeCapacityError(f"decode worker {self.worker_id} is {self.state.value}")

    def _check_attempt(self, request: DecodeRequest) -> None:
        if (request.req_id, request.attempt) in self._aborted_attempts:
            raise DecodeAbortedError(f"req {request.req_id}: attempt {request.attempt} was aborted before it arrived")
        tracked = self._tracked.get(request.req_id)
        if tracked is not None and tracked.attempt < request.attempt:
            # A newer attempt: the router gave this one up, but its abort did not arrive (the
            # actor was unreachable a moment). It ends here, as given up, so that the new one
            # is not refused as "already running" (the client's error for a server hiccup).
            self._abort(request.req_id, tracked.attempt, given_up=True)

    def _release_router(self, router_id: str) -> int:
        """Abort every request of ``router_id``; reserved blocks come back as after any abort."""
        req_ids = [req_id for req_id, tracked in self._tracked.items() if tracked.router_id == router_id]
        for req_id in req_ids:
            self._abort(req_id)
        self._num_orphans_aborted += len(req_ids)
        return len(req_ids)

    def _reserve(self, request: DecodeRequest) -> KVDestination:
        self._check_accepting()
        self._check_attempt(request)
        seq = self.engine.make_sequence(request.req_id, request.prompt_token_ids, request.params, request.priority)
        remote = self.scheduler.reserve(seq)
        if remote is None:
            raise DecodeCapacityError(
                f"decode worker {self.worker_id}: {self.scheduler.num_reservable_blocks()} KV blocks free for "
                f"new requests, request {request.req_id} needs {self.scheduler.blocks_for_remote(seq)}"
            )
        try:
            dest = self.agent.reserve(request.req_id, remote.block_ids, request.lease_s, remote.num_cached_blocks, request.num_writers)
        except Exception:
            self.scheduler.abort(request.req_id)  # nothing can write into blocks never handed out
            raise
        self._tracked[request.req_id] = _Tracked(
            seq, time.monotonic(), remote=True, dest_block_ids=remote.block_ids, attempt=request.attempt, router_id=request.router_id,
            stage=request.stage, token=dest.token,
        )
        if request.stage is not None:
            # The last stage computes from the end of the prefix this cache holds (every layer of
            # it is here); the stages before it from no later, and they write the rest.
            seq.num_computed_tokens = remote.num_cached_blocks * self.engine.kv_cache.block_size
        self.pump.kick()
        logger.debug("req %s: reserved %d blocks, %d held already", request.req_id, len(remote.block_ids), remote.num_cached_blocks)
        return dest

    def _set_first_token(self, req_id: str, token_id: int, logprob: TokenLogprob | None) -> None:
        tracked = self._tracked.get(req_id)
        if tracked is None or req_id not in self.scheduler.awaiting_kv:
            return  # already admitted with the token the last write carried (or gone)
        tracked.first_token = (token_id, logprob)
        self._admit_if_ready(req_id, tracked)

    def _is_admitted(self, req_id: str) -> bool:
        self._poll_transfers()  # a last write that already landed counts: admit it first
        tracked = self._tracked.get(req_id)
        if tracked is None:
            return True  # finished already: its outputs are on their way to the router
        return req_id not in self.scheduler.awaiting_kv

    def _add_local(self, request: DecodeRequest) -> None:
        self._check_accepting()
        self._check_attempt(request)
        seq = self.engine.make_sequence(request.req_id, request.prompt_token_ids, request.params, request.priority)
        if request.only_if_cached:
            if not self.engine.allocator.enable_prefix_caching:
                raise PrefixCachingOffError(f"req {request.req_id}: {self.worker_id} keeps no prefix cache")
            uncached = seq.num_prompt_tokens - self.engine.num_cached_prefix_tokens(seq)
            if uncached > CACHED_PROMISE_SLACK_BLOCKS * self.engine.kv_cache.block_size:
                raise PrefixNotHeldError(f"req {request.req_id}: {self.worker_id}'s prefix cache lacks {uncached} of its {seq.num_prompt_tokens} prompt tokens")
        self.engine.scheduler.add(seq)
        self._tracked[request.req_id] = _Tracked(
            seq, time.monotonic(), remote=False, dest_block_ids=[], attempt=request.attempt, router_id=request.router_id
        )

    def _abort(self, req_id: str, attempt: int | None = None, given_up: bool = False) -> bool:
        tracked = self._tracked.get(req_id)
        if tracked is None or (attempt is not None and tracked.attempt != attempt):
            if attempt is not None:
                self._aborted_attempts.add((req_id, attempt))
            return False
        del self._tracked[req_id]
        # No last output comes for it: its router's streaming set kept its id for that router's
        # life (every request a stop string, a cancel or a migration ended).
        self._outputs.done(tracked.router_id, req_id)
        if self.activations is not None:
            self.activations.close_inbox(req_id)
        if req_id in self.scheduler.awaiting_kv:
            self._drop_reservation(req_id, tracked, given_up)
        else:
            self.engine.abort_request(req_id)
        self.pump.discard_receive_events(req_id)
        logger.info("req %s: aborted on %s", req_id, self.worker_id)
        return True

    def _drop_reservation(self, req_id: str, tracked: _Tracked, given_up: bool = False) -> None:
        """Free what no write can reach now; the agent hands back the rest later."""
        safe_now = set(self.agent.abort(req_id, given_up))
        self.scheduler.detach_remote(req_id, still_targeted=set(tracked.dest_block_ids) - safe_now)
        self.pump.kick()  # the rest come back through the pump: the writer's report or the lease

    def _confirm_quiesced(self, req_id: str, token: int | None = None) -> int:
        tracked = self._tracked.get(req_id)
        if tracked is not None and token in (None, tracked.token) and req_id in self.scheduler.awaiting_kv:
            # Confirmed before any abort ended the reservation here (the receiver, too, takes
            # that as the end of it): end it first, so that its blocks are detached from the
            # request before they are freed. Else the request would keep them, waiting for KV
            # that no writer sends, with no lease left to end it.
            self._abort(req_id)
        block_ids = self.agent.confirm_quiesced(req_id, token)
        self.scheduler.release_detached(block_ids)
        return len(block_ids)

    def _admit_if_ready(self, req_id: str, tracked: _Tracked) -> None:
        if tracked.first_token is None or tracked.kv_ready_at is None:
            return
        self.agent.complete(req_id)
        token_id, logprob = tracked.first_token
        seq = self.scheduler.admit_remote(req_id, token_id, logprob)
        now = time.monotonic()
        seq.first_token_time = now
        tracked.last_token_at = now
        self._outputs.put(tracked.router_id, [self._output(tracked, [token_id], [logprob] if logprob else [])])
        if seq.is_finished:
            self._tracked.pop(req_id, None)

    def _iterate(self) -> bool:
        busy = self._poll_transfers()
        return self._take_turns(self._run_step) or busy

    def _run_stage_chunk(self) -> bool:
        """One chunk of the oldest prompt whose last pipeline stage runs here and whose next
        activations arrived: its layers into the reservation; the chunk that ends the prompt
        samples the first token, and the sequence is admitted once every stage's writes landed."""
        if self.activations is not None:
            for arrived in self.activations.take_arrivals():
                tracked = self._tracked.get(arrived.req_id)
                if tracked is not None and tracked.stage is not None and tracked.token == arrived.token:
                    tracked.stage_inbox[arrived.start] = arrived
        for req_id in list(self.scheduler.awaiting_kv):  # not every request: this runs between decode steps
            tracked = self._tracked.get(req_id)
            if tracked is None or tracked.stage is None or tracked.first_token is not None:
                continue
            seq = tracked.seq
            chunk = tracked.stage_inbox.pop(seq.num_computed_tokens, None)
            if chunk is None:
                if self.activations is not None:
                    self.activations.expect()
                continue
            started = time.perf_counter()
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            try:
                sample = self.engine.run_reserved_stage(seq, chunk.num_tokens, tracked.stage.layers, chunk.activations(self.engine.config.device))
            except RankFailedError:
                raise
            except Exception as exc:
                logger.error("req %s: stage %d on %s failed", req_id, tracked.stage.index, self.worker_id, exc_info=True)
                self._fail(req_id, f"computing this request failed: {type(exc).__name__}: {exc}")
                return True
            tracked.stage_compute_s += time.perf_counter() - started
            self._pause_after_step()
            if sample is not None:
                if self.activations is not None:
                    self.activations.close_inbox(req_id, finished=True)
                logger.info("req %s: last stage (layers %s) on %s computed in %.2fs of %.2fs since its first chunk", req_id,
                            tracked.stage.layers, self.worker_id, tracked.stage_compute_s, time.monotonic() - seq.first_scheduled_time)
                tracked.first_token = sample
                self._admit_if_ready(req_id, tracked)
            return True
        return False

    def _run_step(self) -> bool:
        """One decode step of the running batch (and chunks of locally prefilled prompts)."""
        if not self.engine.has_unfinished_requests():
            return False
        started = time.perf_counter()
        steps_before = self.engine.num_steps
        # With overlapped steps (EngineConfig.async_scheduling) the outputs are the step before's.
        engine_outputs = self.engine.step()
        ran = self.engine.num_steps > steps_before
        if not ran and not engine_outputs:
            return False
        outputs: dict[str, list[SeqOutput]] = {}
        for out in engine_outputs:
            tracked = self._tracked.get(out.req_id)
            if tracked is None:
                continue
            tracked.last_token_at = time.monotonic()
            output = self._output(tracked, out.new_token_ids, out.new_logprobs)
            output.error, output.error_field = out.error, out.error_field  # set where computing this request failed (FinishReason.ERROR)
            output.prompt_logprobs = out.prompt_logprobs
            outputs.setdefault(tracked.router_id, []).append(output)
            if out.finished:
                del self._tracked[out.req_id]
        if ran:
            # Logged before its tokens leave: a client that has its last token and then reads
            # the log (the planner's sweep, a test) finds the step that made it (CI once read
            # the log between the two and missed it).
            self.step_log.record(self.engine.last_shape, time.perf_counter() - started)
        for router_id, items in outputs.items():
            self._outputs.put(router_id, items)
        if ran:
            self._pause_after_step()
        return True

    def _poll_transfers(self) -> bool:
        events = self.pump.take_receive_events()
        if not events:
            return False
        now = time.monotonic()
        try:
            for req_id in events.ready:
                tracked = self._tracked.get(req_id)
                if tracked is not None:
                    tracked.kv_ready_at = now
                    payload = self.agent.payload(req_id)
                    if payload and tracked.first_token is None:
                        tracked.first_token = sampled_token_from_json(payload)
                    self._admit_if_ready(req_id, tracked)
            for failure in events.failed:
                self._fail(failure.req_id, str(failure))
        finally:
            # Freed blocks last, whatever raised above: the receiver has forgotten them, so they
            # must not stay detached for good; and not first, since a lease that ran out gives a
            # failure and then, once its grace has passed, the free of the same blocks, and an
            # engine thread slower than the grace takes both at once: its blocks are detached
            # from the request by its failure (freed first, they were still the request's, and
            # the free raised on the engine thread, which ended the actor).
            for freed in events.freed:
                self.scheduler.release_detached(freed.block_ids)
        return True

    def _fail(self, req_id: str, message: str) -> None:
        tracked = self._tracked.pop(req_id, None)
        if tracked is None:
            return
        logger.warning("req %s: failed on %s: %s", req_id, self.worker_id, message)
        if self.activations is not None:
            self.activations.close_inbox(req_id)
        if req_id in self.scheduler.awaiting_kv:
            self._drop_reservation(req_id, tracked)
        self._outputs.put(tracked.router_id, [SeqOutput(
            req_id, [], finished=True, finish_reason=FinishReason.ERROR.value, error=message, attempt=tracked.attempt
        )])

    def _output(self, tracked: _Tracked, token_ids: list[int], logprobs: list[TokenLogprob]) -> SeqOutput:
        seq = tracked.seq
        out = SeqOutput(seq.req_id, token_ids, logprobs, finished=seq.is_finished, attempt=tracked.attempt)
        if seq.is_finished:
            out.finish_reason = seq.finish_reason.value if seq.finish_reason else None
        if seq.is_finished or not tracked.timing_sent:
            # The first output too: a request the router ends on a stop string (aborting it
            # here) gets no last one, and its usage would lose the prompt's cached tokens.
            out.timing = self._timing(tracked)
            tracked.timing_sent = True
        return out

    def _timing(self, tracked: _Tracked) -> DecodeTiming:
        seq = tracked.seq
        now = time.monotonic()
        first_token = seq.first_token_time or now
        cached = seq.num_cached_tokens or 0
        timing = DecodeTiming(
            decode_ms=_ms(now - first_token),
            num_cached_tokens=cached,
            num_decode_steps=seq.num_decode_steps,
            num_draft_tokens=seq.num_draft_tokens,
            num_accepted_draft_tokens=seq.num_accepted_draft_tokens,
        )
        if tracked.remote:
            timing.decode_queue_ms = _ms(first_token - (tracked.kv_ready_at or first_token))
        else:
            scheduled = seq.first_scheduled_time or first_token
            timing.decode_queue_ms = _ms(scheduled - tracked.arrival)
            timing.local_prefill_ms = _ms(first_token - scheduled)
        return timing

    def _status(self) -> DecodeStatus:
        return DecodeStatus(
            worker_id=self.worker_id,
            state=self.state,
            epoch=self.agent.ref.epoch,
            node=self.node,
            rank_nodes=self.rank_nodes,
            engine=engine_stats(self.engine),
            num_awaiting_kv=len(self.scheduler.awaiting_kv),
            num_active_requests=len(self._tracked),
            num_orphans_aborted=self._num_orphans_aborted,
        )



def _ms(seconds: float) -> float:
    return max(0.0, seconds * 1000.0)
