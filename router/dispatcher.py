"""A request's path through the workers: reserve, prefill, relay, retry, abort.

A request's life here (disaggregated path):
0. ``admit`` refuses, fast, a request whose estimated wait (from measured prefill and KV
   release rates) exceeds the TTFT budget: RESOURCE_EXHAUSTED with a retry hint.
1. ``dispatch`` takes a decode actor D with room for the prompt's blocks, by the actors' own
   capacity reports, waiting its turn in ``DecodeCapacity`` while the decode pool is full
   (never failing for having waited), and asks D to ``reserve`` them. Short prompts, a busy
   prefill pool or an empty one send the prompt to D instead (``add_local``).
2. A background task submits the prompt to a prefill actor P with D's destination. P pushes
   the KV chunk by chunk and returns the first token; the task relays it to D (``start``).
   Meanwhile the ``LeaseKeeper`` renews the reservation's lease on D and relays the new
   deadline to P, however long the prompt waits in P's queue. If P dies, D's reservation
   is dropped (a dead writer writes nothing more) and the prompt goes to another P, a
   bounded number of times.
3. One collector task per D long-polls its outputs and capacity and routes the outputs to
   each request's queue. If D dies, its requests are dispatched again elsewhere (waiting,
   bounded, for a replacement if D was the last); a stream that already sent tokens is
   migrated: its prompt plus the tokens its client has are prefilled again and it goes on
   from there, so the client sees no gap and no repeat (``ActiveRequest.resume_point``).
4. ``finish`` runs when the stream ends for any reason. If the request did not end on D by
   itself, it is aborted on D and cancelled on P, and D frees its reserved blocks only after
   P's report that no write is still in flight.

A long prompt may be prefilled by a pipeline of prefill actors (``router.pipeline``): D's
reservation then expects one writer per stage; every stage is opened (each says how much of the
prompt its own prefix cache holds), then started from the fewest, and the last one's first token
goes to D. Every stage is a P above: cancelled and quiesced before D frees a block, and if any
stage dies or fails, the others are stopped and the prompt is prefilled again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from decode_workers.messages import DecodeCapacityError, DecodeReport, DecodeRequest, PrefixCachingOffError, PrefixNotHeldError
from engine.block_allocator import cache_hash_salt
from engine.stats import WorkerState
from kvtransfer.errors import LeaseExpiredError, PeerLostError, StaleEpochError, TransferFailedError, TransferTimeoutError
from kvtransfer.messages import KVDestination
from prefill_workers.messages import PrefillRequest, PrefillResult, PrefillTiming, PrefillUnavailableError
from router.admission import WaitEstimate, WindowRate, estimate_wait
from router.capacity import DecodeCapacity, NoDecodeWorkerError
from router.config import Disaggregation, RouterConfig
from router.lease_keeper import LeaseKeeper
from router.errors import (
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    ResourceExhaustedError,
    UnavailableError,
    remote_cause,
)
from router.output_inbox import OutputInbox
from router.output_stream import OutputAssembler
from router.pipeline import PipelinePlan, decode_may_be_a_stage, plan_pipeline, stage_starts
from router.pool import Role, WorkerPool, WorkerRecord, within
from router.prefix_index import PrefixFeed
from router.routing import RouteQuery
from router.transfer_costs import TransferCosts
from router.validation import ValidatedRequest
from workers.pipeline import PipelineStage, StageOpened

logger = logging.getLogger(__name__)

WORKER_GONE = (ActorDiedError, ActorUnavailableError, RayActorError)
# A prefill's writes into its decode reservation failed for a reason outside the request.
_WRITE_FAILURES = (PeerLostError, TransferFailedError, TransferTimeoutError, LeaseExpiredError, StaleEpochError)
# How long a request waits for the previous request of its id to be released on its workers
# (bounded: that release's own waits are, and it may have lost a worker meanwhile).
RELEASE_WAIT_S = 10.0
# How long a new request waits for a previous one of its id, still in flight, to turn out
# cancelled (the cancel may reach the server just after the new request).
DUPLICATE_GRACE_S = 0.5
# How long an abort waits for the prefill actor's writes into the request's blocks to stop.
QUIESCE_WAIT_S = 2.0
# The Retry-After of a refusal that names no wait (a full queue, no room within capacity_wait_s):
# the official clients' retries wait for it instead of their own, shorter, backoff.
QUEUE_FULL_RETRY_S = 1.0


@dataclass(slots=True)
class Restart:
    """A worker died before this request produced a token: dispatch it again."""

    reason: str
    attempt: int  # the dispatch attempt it ends: stale once the request was dispatched again
    prefill_failed: bool = False  # the prefill actor died (else the decode actor did)
    dead_worker_id: str | None = None  # the worker whose death this is (None: none was available)
    pipeline_refused: bool = False  # a stage could not be opened: prefill on one actor, not counted as a retry


@dataclass(slots=True)
class Failure:
    """The request cannot go on; ``error`` is what the client is told."""

    error: Exception


@dataclass(slots=True)
class ActiveRequest:
    request: ValidatedRequest
    assembler: OutputAssembler
    outputs: OutputInbox = field(default_factory=OutputInbox)
    decode: WorkerRecord | None = None
    prefill: WorkerRecord | None = None
    stages: list[WorkerRecord] = field(default_factory=list)  # a pipelined prefill's actors, stage order
    no_pipeline: bool = False  # a pipeline was refused: this request goes through one prefill actor
    prefill_task: asyncio.Task | None = None
    destination: KVDestination | None = None  # the decode reservation the current prefill writes into
    decode_finished: bool = False
    num_restarts: int = 0
    num_prefill_retries: int = 0
    dead_workers: list[str] = field(default_factory=list)  # workers that died with this request on them
    # Each dispatch is a new attempt, numbered uniquely across the router; outputs of an older
    # one (a decode actor that admitted the request just as the router gave up on it) are
    # dropped, never streamed twice, and an abort names the attempt it ends.
    attempt: int = 0
    # The attempt its decode actor holds it under: ``attempt`` moves on when a prefill fails
    # (the old attempt's outputs are stale from then), the reservation keeps its own, and an
    # abort must name that one or the decode actor ignores it (it took it for a stale abort).
    decode_attempt: int = 0
    last_message_at: float | None = None  # for inter-token latency
    # Whether the client has gone (cancelled, deadline): its id may be taken by a new request,
    # which then waits for ``released``, set once nothing of this one is left on any worker.
    client_gone: Callable[[], bool] = lambda: False
    released: asyncio.Event = field(default_factory=asyncio.Event)
    # The request's name on the workers, "<router id>/<request id>": routers that share workers
    # never meet each other's ids, and each collects only its own outputs. Set at admission.
    key: str = ""
    # What the workers are given (named ``key``): the request itself, or after a decode actor
    # died mid-stream, ``resume_point``. (``request`` stays what the client sent.)
    work: ValidatedRequest | None = None
    # Choices of one prompt (``n``): the first is dispatched, the others follow it (``leader``)
    # once its first output came (``first_output``, also set when it ends), to its decode actor,
    # whose prefix cache holds the prompt then: the prompt is prefilled and moved once, and its
    # blocks are shared there, where each choice prefilled it and held a copy.
    leader: "ActiveRequest | None" = None
    first_output: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def req_id(self) -> str:
        return self.request.req_id

    @property
    def prefill_workers(self) -> list[WorkerRecord]:
        """Every prefill actor writing into the current reservation (a pipeline's stages, or one)."""
        if self.stages:
            return list(self.stages)
        return [self.prefill] if self.prefill is not None else []

    def resume_point(self) -> ValidatedRequest:
        """The request as it stands now: its prompt plus every token its client was sent.

        Prefilled on a new decode actor, this continues the stream exactly where the client's
        copy ends: greedy output is what an uninterrupted run gives, and a seeded draw depends
        only on its position (``SamplingParams.num_resumed_tokens``).
        """
        sent = self.assembler.completion_token_ids
        if not sent:
            return dataclasses.replace(self.request, req_id=self.key)
        return dataclasses.replace(
            self.request,
            req_id=self.key,
            prompt_token_ids=self.request.prompt_token_ids + sent,
            sampling_params=self.request.sampling_params.resumed(len(sent)),
        )


class Dispatcher:
    def __init__(
        self,
        pool: WorkerPool,
        config: RouterConfig,
        metrics=None,
        block_size: int = 16,
        decode_ready: Callable[[], Awaitable[None]] | None = None,
        router_id: str | None = None,
        prefix_feed: PrefixFeed | None = None,
        num_layers: int = 0,
        prefix_salt: Callable[[str | None], bytes] = lambda lora_name: b"",
    ):
        self.pool = pool
        self.num_layers = num_layers  # the model's decoder layers, which a pipeline's stages split
        self.prefix_feed = prefix_feed  # keeps the KV-aware selector's index current
        self.prefix_salt = prefix_salt  # a request's LoRA adapter -> its prompt's prefix-hash salt
        # Names this router's requests on the workers (``ActiveRequest.key``) and its outputs.
        self.router_id = router_id or f"r{secrets.token_hex(4)}"
        self.transfer_costs = TransferCosts()  # what a prefill on another node than its decode actor costs
        self._by_key: dict[str, ActiveRequest] = {}  # admitted requests by their key
        # Awaited when no decode actor is routable: returns once one is (a replacement is up),
        # raises UnavailableError past its bound. None: no decode actor means UNAVAILABLE now.
        self.decode_ready = decode_ready
        self.config = config
        self.metrics = metrics
        self.block_size = block_size
        self.active: dict[str, ActiveRequest] = {}
        # Ended requests still being released on their workers, by id: a new request under the
        # same id waits for that (else its reservation would meet the old one's).
        self._releasing: dict[str, ActiveRequest] = {}
        self._release_tasks: set[asyncio.Task] = set()  # ``release``'s, held until done (the loop holds tasks weakly)
        self._attempts = itertools.count(1)
        self._collectors: dict[str, asyncio.Task] = {}
        self.capacity = DecodeCapacity(pool, config.priority_max_wait_s)
        pool.on_change = self.capacity.on_report
        self.lease_keeper = LeaseKeeper(config.kv_lease_s, config.status_timeout_s, self._awaiting_kv)
        # KV blocks finished requests give back per second while requests wait for room (only then
        # does the wait estimate have a KV term; freed otherwise they say nothing of it).
        self.kv_freed = WindowRate(clock=self.capacity.short_seconds)
        # Prompt tokens of requests bound for a prefill actor that none holds yet (their decode
        # reservation is in flight): a burst decides for all its prompts within that wait, and
        # without them every prompt would see the prefill actors idle.
        self._prefill_tokens_on_the_way: dict[str, int] = {}
        # Prompt tokens of admitted requests bound for a prefill actor, not yet placed on a decode
        # actor (waiting for the pool to be ready or for room).
        self._prefill_tokens_unplaced: dict[str, int] = {}
        # Whether the decode actors keep a prefix cache, for the choices that follow a leader
        # there (False once one said it keeps none: then following only costs a wait).
        self.decode_caches_prefixes = True
        # Requests sent to a decode actor to be prefilled there, by key, until their first output.
        self._local_prefills: dict[str, tuple[WorkerRecord, int]] = {}

    @property
    def num_queued(self) -> int:
        """Requests admitted that have not produced a token yet."""
        return sum(1 for a in self.active.values() if not a.assembler.has_sent_tokens)

    async def wait_for_id(self, req_id: str) -> None:
        """Let the previous request of ``req_id`` be released first, if its client has gone.

        A client that cancels and at once sends the same id again must not be told the id is
        in flight, nor meet the old request's blocks on a worker. The server may learn of the
        cancel a moment after the new request arrives, so a previous request still in flight
        gets ``DUPLICATE_GRACE_S`` to turn out abandoned; one that does not is a true duplicate,
        which ``admit`` refuses.
        """
        previous = self._releasing.get(req_id) or self.active.get(req_id)
        if previous is None:
            return
        for wait_s in (DUPLICATE_GRACE_S, RELEASE_WAIT_S):
            try:
                await asyncio.wait_for(previous.released.wait(), wait_s)
                return
            except asyncio.TimeoutError:
                if self.active.get(req_id) is previous and not previous.client_gone():
                    return  # its client is still there: a true duplicate
        logger.warning("req %s: the previous request of this id is still being released", req_id)

    def admit(self, active: ActiveRequest) -> None:
        if active.req_id in self.active:
            raise InvalidArgumentError("request_id", f"{active.req_id!r} is already in flight")
        if self.num_queued >= self.config.max_queued_requests:
            raise ResourceExhaustedError(
                f"{self.num_queued} requests are already waiting for their first token "
                f"(limit {self.config.max_queued_requests}); retry later",
                retry_after_s=QUEUE_FULL_RETRY_S,
            )
        budget = self.config.admission_ttft_budget_s
        if budget is not None:
            estimate = self.estimate_wait(active.request)
            total, ahead = estimate.total_s, estimate.ahead_s
            # Refused only for others' work ahead of it, past what its own prompt leaves of the
            # budget but never less than half of it: its own time alone (a long prompt on a slow
            # deployment) would be refused at every retry, and a prompt taking most of the budget
            # itself by any work ahead, however little, under steady traffic for good.
            allowed = max(budget - estimate.own_s, budget / 2)
            if total is not None and ahead > allowed:
                retry_s = ahead - allowed
                raise ResourceExhaustedError(
                    f"the estimated wait for a first token is {total:.1f}s (prefill queue "
                    f"{_seconds(estimate.prefill_s)}, KV room {_seconds(estimate.kv_s)}), over the "
                    f"{budget:g}s budget; retry in {retry_s:.0f}s",
                    retry_after_s=retry_s,
                )
        self.active[active.req_id] = active
        active.key = f"{self.router_id}/{active.req_id}"
        active.work = active.resume_point()
        self._by_key[active.key] = active

    def estimate_wait(self, request: ValidatedRequest) -> WaitEstimate:
        """How long a new request would wait for its prompt to be computed, from measured rates."""
        num_tokens = len(request.prompt_token_ids)
        # The least busy prefill actor (not the selector's pick: a round-robin turn taken here
        # sent every other prompt past the actor the estimate turned to).
        prefill = min(self.pool.routable(Role.PREFILL), key=lambda w: w.num_assigned_prompt_tokens, default=None)
        queued_tokens, rate = num_tokens, None
        if prefill is not None and not self._prefill_locally(request):
            # With the prompts placed on decode actors whose prefill has not begun (a burst).
            queued_tokens += prefill.num_assigned_prompt_tokens + self._prefill_tokens_on_the_way_per_actor(unplaced=True)
            rate = prefill.prefill_rate.per_second
        reservable = self.capacity.total_reservable()
        short = 0
        if reservable is not None:
            short = self.capacity.num_blocks_waiting + self._blocks_for(num_tokens + 1) - reservable
        return estimate_wait(queued_tokens, rate, short, self.kv_freed.per_second(), own_prompt_tokens=num_tokens)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _awaiting_kv(self):
        """Requests whose decode reservation still waits for KV (their leases need renewing)."""
        return [
            a for a in self.active.values()
            if a.destination is not None and a.prefill_task is not None and not a.prefill_task.done()
        ]

    # -- dispatch -------------------------------------------------------------------------

    async def dispatch(self, active: ActiveRequest) -> None:
        """Place the request on a decode actor (and a prefill actor), waiting for room if needed."""
        request = active.work
        if self.prefix_feed is not None:
            self.prefix_feed.ensure()
        params = request.sampling_params
        query = self.pool.selector.query(request.prompt_token_ids, self.prefix_salt(params.lora_name) + cache_hash_salt(params.cache_salt))
        cached_on = await self._leaders_decode(active)
        # Until placed, its prompt counts in the estimate's prefill queue: a burst admitted while
        # the decode pool is full (or not yet ready) reaches the prefill actors only as room
        # comes, and every later arrival was judged against the queue without it.
        if cached_on is None and not self._prefill_locally(request, query):
            self._prefill_tokens_unplaced[request.req_id] = len(request.prompt_token_ids)
        try:
            decode, destination, plan = await self._place(active, query, cached_on)
        finally:
            self._prefill_tokens_unplaced.pop(request.req_id, None)
        active.assembler.decode_worker_id = decode.worker_id
        active.assembler.prefill_worker_id = ""
        self._ensure_collector(decode)
        if active.assembler.timing.dispatched is None:
            # Its first dispatch ends its wait at the router: one dispatched again after a worker
            # died counted its whole first attempt as router queue (the autoscaler's queue
            # correction read migrations as a short decode pool).
            active.assembler.timing.dispatched = time.monotonic()
        if destination is not None:
            active.destination = destination
            prefill = self._prefill(active, destination, query) if plan is None else self._prefill_pipeline(active, destination, plan)
            active.prefill_task = asyncio.create_task(prefill)
            self.lease_keeper.ensure_running()

    async def _leaders_decode(self, active: ActiveRequest) -> WorkerRecord | None:
        """A follower's first dispatch (``ActiveRequest.leader``): once its leader's first output
        came, the decode actor whose prefix cache holds their prompt now (None: none, or a
        leader that ended without output; a restarted follower is placed as any request)."""
        leader, active.leader = active.leader, None
        if leader is None or not self.decode_caches_prefixes:
            return None
        if active.assembler.timing.dispatched is None:
            # Its wait is its prompt being computed (its leader's), not a queue at the router: the
            # autoscaler reads router queue time as a short decode pool.
            active.assembler.timing.dispatched = time.monotonic()
        await leader.first_output.wait()
        decode = leader.decode
        if decode is None or not decode.routable or not leader.assembler.completion_token_ids:
            return None
        return decode

    async def _place(
        self, active: ActiveRequest, query: RouteQuery, cached_on: WorkerRecord | None = None,
    ) -> tuple[WorkerRecord, KVDestination | None, PipelinePlan | None]:
        """Put the request on a decode actor (its KV reserved there, or its prompt queued there to
        be prefilled locally), waiting for the pool and for room; return that actor, the
        reservation (None: prefilled locally) and the pipeline plan (None: one prefill actor).
        ``cached_on``: a decode actor whose prefix cache holds the prompt (a leader's), tried
        first with a local prefill of what it lacks; placed as any other if it does not hold it."""
        request = active.work
        order = self.capacity.next_order()  # its place in the capacity queue, kept across refusals
        refused_local: set[str] = set()  # workers that refused a local prompt (draining)
        while True:
            await self._wait_for_decode_pool()
            promised = cached_on is not None and cached_on.routable
            local = promised or self._prefill_locally(request, query)
            if promised:
                decode = cached_on
            elif local:
                # The decode actor queues local prompts itself, until its KV has room.
                # A worker that refused a remote reservation for want of room still queues a
                # local prompt itself: only a refusal of a local prompt (draining) excludes it.
                decode = self.pool.pick(Role.DECODE, exclude=refused_local, query=query)
                if decode is None:
                    raise UnavailableError("no decode worker is available")
            else:
                decode = await self._wait_for_room(request, order, query)
                if decode is None:
                    continue  # the decode pool emptied while it waited: wait for it (bounded)
                if decode.state is WorkerState.DEAD:
                    # Declared dead after it was granted: its death restarted nothing of this
                    # request's (placed there only below), and no collector reads a dead worker.
                    continue
            active.attempt = active.decode_attempt = next(self._attempts)
            plan = None if local else self._pipeline_plan(active, request, decode)
            if not local:
                self._prefill_tokens_on_the_way[request.req_id] = len(request.prompt_token_ids)
            params = request.sampling_params
            if not local and params.prompt_logprobs is not None:
                # The prefill actor scores the prompt; the decode actor, which never computes it,
                # must not wait on scores (its steps would never overlap, its cache go unused).
                params = dataclasses.replace(params, prompt_logprobs=None)
            decode_request = DecodeRequest(
                request.req_id, request.prompt_token_ids, params, request.priority,
                self.config.kv_lease_s, attempt=active.attempt, router_id=self.router_id,
                router_lease_s=self.config.router_lease_s, num_writers=len(plan.workers) if plan is not None else 1,
                stage=_decode_stage(plan), only_if_cached=promised,
            )
            # Bound before the call: the collector may see this request's first output before
            # the call returns (a short local prefill), and must route it here.
            active.decode = decode
            active.decode_finished = False
            # A promised prompt computes what the cache lacks, a block or two: it adds that much
            # load, and no sample of the actor's local prefill rate (a whole step for 32 tokens).
            num_to_compute = min(len(request.prompt_token_ids), 2 * self.block_size) if promised else len(request.prompt_token_ids)
            self.pool.assign(decode, request.req_id, num_to_compute)
            try:
                if local:
                    if not promised:
                        self._local_prefill_started(request.req_id, decode, num_to_compute)
                    await decode.handle.add_local.remote(decode_request)
                    destination = None
                else:
                    destination = await decode.handle.reserve.remote(decode_request)
                break
            except PrefixNotHeldError as exc:
                self._unplace(decode, request.req_id)
                logger.info("req %s: %s; placed as any other", request.req_id, exc)
                if isinstance(exc, PrefixCachingOffError):
                    self.decode_caches_prefixes = False  # (a pool's actors share their engine config)
                cached_on = None
                if not self._prefill_locally(request, query):  # it waits for room as any other now
                    self._prefill_tokens_unplaced[request.req_id] = len(request.prompt_token_ids)
            except DecodeCapacityError:
                # Draining, or its room went to someone else since its last report: the next
                # report tells the truth; the request keeps its place in the queue.
                cached_on = None  # (a refusing leader's actor stays routable until its next report)
                self._unplace(decode, request.req_id)
                if local:
                    refused_local.add(decode.worker_id)
                decode.num_reservable_blocks = 0
                self._ensure_collector(decode)
            except WORKER_GONE:
                self._unplace(decode, request.req_id)
                self.on_worker_died(decode)
            except BaseException:
                cached_on = None
                self._unplace(decode, request.req_id)
                # Its room was debited for this request: the actor's next report gives it back
                # (an actor that just joined has no collector until one is started).
                self._ensure_collector(decode)
                raise
        return decode, destination, plan

    def _unplace(self, decode: WorkerRecord, key: str) -> None:
        """The decode actor did not take the request (refused, died, the call raised): undo what
        placing it there counted."""
        self.pool.release(decode, key)
        self._prefill_tokens_on_the_way.pop(key, None)
        self._local_prefill_done(key)

    def _pipeline_plan(self, active: ActiveRequest, request: ValidatedRequest, decode: WorkerRecord) -> PipelinePlan | None:
        """The stages that prefill this prompt together (None: one prefill actor does). A prompt
        whose log-probabilities are asked for is prefilled by one actor: a pipeline's chunks
        (pipeline_chunk_tokens) would bypass the engine's bound on the rows a step scores."""
        if active.no_pipeline or not self.num_layers or request.sampling_params.prompt_logprobs is not None:
            return None
        config = self.config
        return plan_pipeline(
            config.prefill_pipeline, len(request.prompt_token_ids), self.pool.routable(Role.PREFILL),
            config.max_pipeline_stages, config.pipeline_tokens_per_stage, [1.0] * self.num_layers,
            config.pipeline_chunk_tokens, self.block_size,
            decode=decode if decode_may_be_a_stage(config.pipeline_decode_stage, decode) else None,
        )

    async def _wait_for_decode_pool(self) -> None:
        """Return once a decode actor is routable, waiting (bounded) for a replacement if need
        be; UnavailableError when none comes."""
        if self.pool.routable(Role.DECODE):
            return
        if self.decode_ready is not None:
            await self.decode_ready()
        if not self.pool.routable(Role.DECODE):
            raise UnavailableError("no decode worker is available")

    async def _wait_for_room(self, request: ValidatedRequest, order: int, query: RouteQuery) -> WorkerRecord | None:
        """A decode actor with room for the prompt's blocks; waits its turn while the pool is
        full. None when the decode pool emptied meanwhile (the caller waits for it, then queues
        again in the same place)."""
        if not self.pool.routable(Role.DECODE):
            return None
        for record in self.pool.routable(Role.DECODE):
            self._ensure_collector(record)  # their reports are what wakes the queue
        timeout = self.config.capacity_wait_s
        if request.deadline is not None:
            left = request.deadline - time.monotonic()
            timeout = left if timeout is None else min(timeout, left)
        wait = self.capacity.acquire(
            self._blocks_for(len(request.prompt_token_ids) + 1), request.priority, order, since=request.arrival_time, query=query
        )
        try:
            # (Not wait_for: on 3.11 a client's cancel that lands as room is granted was dropped,
            # and the request went on to reserve for nobody.)
            return await within(wait, timeout)
        except asyncio.TimeoutError:
            raise _capacity_error(request) from None
        except NoDecodeWorkerError:
            return None

    def _prefill_locally(self, request: ValidatedRequest, query: RouteQuery | None = None) -> bool:
        mode = self.config.disaggregation
        if mode is Disaggregation.NEVER or not self.pool.routable(Role.PREFILL):
            return True
        if mode is Disaggregation.ALWAYS:
            return False
        # Only what a decode actor would compute counts: its cached prefix costs nothing there.
        cached = max((self.pool.selector.num_cached_tokens(d, query) for d in self.pool.routable(Role.DECODE)), default=0)
        num_tokens = len(request.prompt_token_ids) - cached
        if num_tokens <= self.config.local_prefill_max_tokens:
            return True
        backlog = (self.pool.min_prefill_backlog() or 0) + self._prefill_tokens_on_the_way_per_actor()
        if backlog < self.config.prefill_busy_tokens or num_tokens > self.config.busy_local_prefill_max_tokens:
            return False
        # The queue that computes it sooner, at each side's measured rate (the decode actor's
        # slower while it decodes): in a burst both cores prefill and both queues drain together.
        decode = min(self.pool.routable(Role.DECODE), key=lambda d: d.num_local_prefill_tokens, default=None)
        if decode is None:
            return False
        prefill_rate = max((p.prefill_rate.per_second or 0.0 for p in self.pool.routable(Role.PREFILL)), default=0.0)
        local_rate = decode.prefill_rate.per_second
        if not prefill_rate or not local_rate:
            return decode.num_local_prefill_tokens + num_tokens <= backlog  # no measurements yet: the shorter queue
        return (decode.num_local_prefill_tokens + num_tokens) / local_rate <= (backlog + num_tokens) / prefill_rate

    def _local_prefill_started(self, key: str, decode: WorkerRecord, num_tokens: int) -> None:
        self._local_prefill_done(key, computed=False)
        if decode.num_local_prefill_tokens == 0:
            decode.busy_since = time.monotonic()
        self._local_prefills[key] = (decode, num_tokens)
        decode.num_local_prefill_tokens += num_tokens

    def _local_prefill_done(self, key: str, computed: bool = False) -> None:
        """The request's local prefill ended: ``computed`` (its first output came), or it ended or moved."""
        entry = self._local_prefills.pop(key, None)
        if entry is None:
            return
        decode, num_tokens = entry
        decode.num_local_prefill_tokens -= num_tokens
        if computed:
            decode.prefill_rate.done(num_tokens, decode.busy_since or time.monotonic())

    def _prefill_tokens_on_the_way_per_actor(self, unplaced: bool = False) -> int:
        """Prompt tokens placed on decode actors that no prefill actor holds yet, per prefill
        actor; ``unplaced``: also those of requests still waiting to be placed."""
        num_prefill = len(self.pool.routable(Role.PREFILL))
        on_the_way = self._prefill_tokens_on_the_way
        tokens = sum(on_the_way.values())
        if unplaced:  # (one whose reservation is in flight is on the way already)
            tokens += sum(n for key, n in self._prefill_tokens_unplaced.items() if key not in on_the_way)
        return tokens // num_prefill if num_prefill else 0

    async def _prefill(self, active: ActiveRequest, destination: KVDestination, query: RouteQuery | None = None) -> None:
        request, decode = active.work, active.decode
        self._prefill_tokens_on_the_way.pop(request.req_id, None)
        num_tokens = len(request.prompt_token_ids)
        draining: set[str] = set()
        while True:
            prefill = self.pool.pick(Role.PREFILL, exclude=draining, query=self._near(query, num_tokens, decode))
            if prefill is None:
                active.outputs.put_nowait(Restart("no prefill worker is available", active.attempt, prefill_failed=True))
                return
            active.prefill = prefill
            active.stages = []
            active.destination = destination
            active.assembler.prefill_worker_id = prefill.worker_id
            if prefill.num_assigned_prompt_tokens == 0:
                prefill.busy_since = time.monotonic()
            # Its load grows by what it will compute: the prompt less the prefix its cache holds.
            self.pool.assign(prefill, request.req_id, num_tokens - self.pool.selector.num_cached_tokens(prefill, query))
            try:
                result = await prefill.handle.submit.remote(
                    PrefillRequest(request.req_id, request.prompt_token_ids, request.sampling_params, destination, decode.handshake_offer, request.priority)
                )
                break
            except PrefillUnavailableError:
                # It began draining after the router picked it, and queued nothing: try another.
                # No request is routed to it again (a router replica learns of a drain only at
                # its next health round; until then every long prompt tried it first, and with
                # no other prefill actor failed as unavailable).
                draining.add(prefill.worker_id)
                if prefill.state is WorkerState.READY:
                    prefill.state = WorkerState.DRAINING
            except WORKER_GONE:
                logger.warning("req %s: prefill worker %s died", request.req_id, prefill.worker_id)
                self.on_worker_died(prefill)
                try:
                    # The last write carries the first token: the decode actor may already be
                    # decoding this request, and then the prefill worker's death changes nothing;
                    # unless the prompt's log-probabilities were asked for, which only its answer
                    # carried: the prompt is then prefilled again.
                    scored = request.sampling_params.prompt_logprobs is not None and len(request.prompt_token_ids) > 1
                    if not scored and await decode.handle.is_admitted.remote(request.req_id):
                        return
                except WORKER_GONE:
                    return  # the collector reports the decode actor's death
                active.attempt = next(self._attempts)  # whatever the decode actor still sends for the old one is stale now
                active.outputs.put_nowait(Restart(f"prefill worker {prefill.worker_id} died", active.attempt, prefill_failed=True, dead_worker_id=prefill.worker_id))
                return
            except Exception as exc:
                logger.warning("req %s: prefill on %s failed: %s", request.req_id, prefill.worker_id, _reason(exc))
                await self._prefill_raised(active, decode, prefill, exc)
                return
            finally:
                self.pool.release(prefill, request.req_id)
        prefill.prefill_rate.done(num_tokens - result.timing.num_cached_tokens, prefill.busy_since or time.monotonic())
        if prefill.node and decode.node and result.timing.num_bytes:
            self.transfer_costs.observe(prefill.node == decode.node, result.timing.transfer_ms)
        await self._relay_first_token(active, decode, result, result.timing)

    def _near(self, query: RouteQuery | None, num_tokens: int, decode: WorkerRecord) -> RouteQuery:
        """``query`` for a prefill actor whose KV goes to ``decode``: its node preferred, the
        measured cost of crossing nodes charged to the others."""
        base = query if query is not None else RouteQuery(num_tokens)
        return dataclasses.replace(base, near_node=decode.node, cross_node_s=self.transfer_costs.cross_node_extra_s())

    async def _prefill_pipeline(self, active: ActiveRequest, destination: KVDestination, plan: PipelinePlan) -> None:
        """Prefill the prompt over the plan's stages: open each, start each from the fewest
        tokens it and the stages after it hold cached, relay the last stage's first token to the
        decode actor (unless the decode actor computed the last stage itself)."""
        request, decode = active.work, active.decode
        self._prefill_tokens_on_the_way.pop(request.req_id, None)
        num_tokens = len(request.prompt_token_ids)
        active.prefill, active.stages, active.destination = plan.workers[0], list(plan.workers), destination
        stage_workers = [*plan.workers, decode] if plan.decode_stage else plan.workers
        active.assembler.prefill_worker_id = ",".join(w.worker_id for w in stage_workers)
        # The last prefill stage hands its activations to the decode actor where that computes the last stage.
        handles = [w.handle for w in plan.workers]
        next_handles = [*handles[1:], decode.handle if plan.decode_stage else None]
        for worker in plan.workers:
            if worker.num_assigned_prompt_tokens == 0:
                worker.busy_since = time.monotonic()
            self.pool.assign(worker, request.req_id, num_tokens // plan.num_stages)
        try:
            opens = [
                handle.open_stage.remote(PrefillRequest(
                    request.req_id, request.prompt_token_ids, request.sampling_params, destination, decode.handshake_offer, request.priority,
                    PipelineStage(index, plan.num_stages, layers.start, layers.stop, next_handles[index], plan.chunk_tokens),
                ))
                for index, (handle, layers) in enumerate(zip(handles, plan.layers))
            ]
            outcome = await _first_failure_or_all(opens)
            if not isinstance(outcome, _StageFailure):
                opened: list[StageOpened] = outcome
                cached = [o.num_cached_tokens for o in opened]
                inboxes = [o.inbox for o in opened[1:]]  # where each stage after the first takes activations over NIXL
                if plan.decode_stage:
                    cached.append(destination.num_cached_blocks * self.block_size)  # every layer of those blocks is there
                    with contextlib.suppress(*WORKER_GONE):  # a dead decode actor is the collector's to report
                        inboxes.append(await decode.handle.open_stage_inbox.remote(request.req_id))
                inboxes.append(None)  # the last stage hands nothing on
                starts = stage_starts(cached)
                start = starts[0]
                outcome = await _first_failure_or_all([
                    h.start_stage.remote(request.req_id, destination.token, starts[i], starts[i + 1] if i + 1 < len(starts) else None, inboxes[i])
                    for i, h in enumerate(handles)
                ])
        finally:
            for worker in plan.workers:
                self.pool.release(worker, request.req_id)
        if isinstance(outcome, _StageFailure):
            await self._pipeline_failed(active, plan, outcome)
            return
        results: list[PrefillResult] = outcome
        last = results[-1]
        for worker in plan.workers:
            worker.prefill_rate.done((num_tokens - start) // plan.num_stages, worker.busy_since or time.monotonic())
        timing = dataclasses.replace(last.timing, num_bytes=sum(r.timing.num_bytes for r in results),
                                     num_chunks=max(r.timing.num_chunks for r in results), num_cached_tokens=start)
        await self._relay_first_token(active, decode, last, timing)

    async def _relay_first_token(self, active: ActiveRequest, decode: WorkerRecord, result: PrefillResult, timing: PrefillTiming) -> None:
        """The prompt is prefilled: record its timing, hand the first token to the decode actor
        (a dead one is the collector's to report; its requests restart from there). Where the
        decode actor computed the last stage, it sampled the token itself."""
        active.assembler.timing.prefill = timing
        if result.prompt_logprobs:
            active.assembler.prompt_logprobs = result.prompt_logprobs
        if self.metrics is not None:
            self.metrics.observe_prefill(timing.num_bytes, timing.transfer_ms)
        if result.first_token_id is None:
            return
        with contextlib.suppress(*WORKER_GONE):
            await decode.handle.start.remote(active.work.req_id, result.first_token_id, result.first_logprob)

    async def _pipeline_failed(self, active: ActiveRequest, plan: PipelinePlan, failure: "_StageFailure") -> None:
        """A stage died, refused or failed: stop every stage (no write may land after D frees the
        blocks), then place the request again, or fail it where the engine refused it."""
        request, decode = active.work, active.decode
        worker, exc = plan.workers[failure.index], failure.error
        await self._quiesce_prefills(active.key, plan.workers, active.destination.token)
        if isinstance(exc, PrefillUnavailableError):
            logger.info("req %s: stage %d on %s refused (%s); prefilling on one actor", request.req_id, failure.index, worker.worker_id, _reason(exc))
            active.no_pipeline = True
            active.attempt = next(self._attempts)
            active.outputs.put_nowait(Restart(f"prefill worker {worker.worker_id} refused a stage", active.attempt, prefill_failed=True, pipeline_refused=True))
            return
        if isinstance(exc, WORKER_GONE):
            logger.warning("req %s: stage %d's prefill worker %s died", request.req_id, failure.index, worker.worker_id)
            self.on_worker_died(worker)
            try:
                # Every stage's writes landed (the decode actor admits the request on them, the
                # first token with the last) before its answer: then the death changes nothing,
                # as for one prefill actor (a restart prefilled the prompt again and counted
                # against the request's retries and worker deaths).
                if await decode.handle.is_admitted.remote(request.req_id):
                    return
            except WORKER_GONE:
                return  # the collector reports the decode actor's death
            active.attempt = next(self._attempts)
            active.outputs.put_nowait(Restart(f"prefill worker {worker.worker_id} died", active.attempt, prefill_failed=True, dead_worker_id=worker.worker_id))
            return
        logger.warning("req %s: stage %d on %s failed: %s", request.req_id, failure.index, worker.worker_id, _reason(exc))
        await self._prefill_raised(active, decode, worker, exc)

    async def _prefill_raised(self, active: ActiveRequest, decode: WorkerRecord, prefill: WorkerRecord, exc: Exception) -> None:
        """A live prefill actor's call raised ``exc``: place the request again or fail it."""
        cause = getattr(exc, "cause", None)
        if getattr(cause, "peer_lost", False) or isinstance(cause, _WRITE_FAILURES):
            # Writing into the decode actor failed (it died, its node went, the link broke, its
            # lease ran out): not this request's fault. It is placed again, like any request
            # whose decode actor died; a live decode actor gives its reservation up.
            await self._on_decode_unreachable(active, decode, _write_failure(cause, decode))
            return
        cause = remote_cause(exc)
        if cause is not exc:
            # The engine's own verdict on this request (bad input, its computation raised): the
            # client gets it as it is, and it is not tried elsewhere.
            active.outputs.put_nowait(Failure(cause))
        else:
            active.outputs.put_nowait(Failure(UnavailableError(f"prefill failed on {prefill.worker_id}: {_reason(exc)}")))

    async def _on_decode_unreachable(self, active: ActiveRequest, decode: WorkerRecord, why: str) -> None:
        """A prefill actor lost its connection to ``decode`` (``why``, in words): restart the
        request, as its death would (if it is dead, ``on_worker_died`` does; if not, its
        reservation is given up)."""
        try:
            await within(decode.handle.ping.remote(), self.config.status_timeout_s)
        except Exception:  # gone, silent, or unhealthy (its ping raises: a hung engine thread, a failed pump)
            self.on_worker_died(decode)  # restarts every request it held, this one included
            return
        active.attempt = next(self._attempts)
        active.outputs.put_nowait(Restart(why, active.attempt, prefill_failed=True))

    async def restart(self, active: ActiveRequest, reason: Restart) -> None:
        """Dispatch again after a worker died, within the retry bounds; raise UNAVAILABLE beyond them.

        A Restart of an earlier attempt is ignored: the worker died while that attempt was being
        placed, and the placement went on elsewhere (``dispatch`` retries a dead worker itself).

        Poison detection: a request that was in flight on ``max_worker_deaths_per_request``
        workers that died is not carried to another one. A bystander of one crash is retried;
        a request present at two is refused (INTERNAL, naming the workers), since it may be
        what kills them, and two crashed workers are the most it costs.
        """
        if reason.attempt != active.attempt:
            return
        if reason.dead_worker_id is not None:
            active.dead_workers.append(reason.dead_worker_id)
            limit = self.config.max_worker_deaths_per_request
            if len(active.dead_workers) >= limit:
                if self.metrics is not None:
                    self.metrics.poisoned.inc()
                raise InternalError(
                    f"this request was in flight on {len(active.dead_workers)} workers that died "
                    f"({', '.join(active.dead_workers)}); it is not retried on another, in case it is what "
                    f"kills them (router.max_worker_deaths_per_request = {limit})"
                )
        # A refused pipeline is not a failure: the prompt goes to one prefill actor instead.
        if reason.prefill_failed and not reason.pipeline_refused:
            active.num_prefill_retries += 1
            if active.num_prefill_retries > self.config.max_prefill_retries:
                raise UnavailableError(f"{reason.reason}; gave up after {self.config.max_prefill_retries} retries")
        elif not reason.prefill_failed:
            active.num_restarts += 1
            if active.num_restarts > self.config.max_decode_restarts:
                raise UnavailableError(f"{reason.reason}; gave up after {self.config.max_decode_restarts} restarts")
        kind = "prefill" if reason.prefill_failed else "migrate" if active.assembler.has_sent_tokens else "decode"
        if self.metrics is not None:
            self.metrics.retries(kind).inc()
        active.work = active.resume_point()
        logger.warning(
            "req %s: dispatching again (%s)%s", active.req_id, reason.reason,
            f"; resuming after the {active.assembler.num_completion_tokens} tokens sent" if kind == "migrate" else "",
        )
        if reason.prefill_failed and active.decode is not None and active.decode.state is not WorkerState.DEAD:
            # The reservation is given up, and its blocks are freed once no writer can reach
            # them: a live one (a writer whose push failed may still have a write in flight, and
            # the other stages of a pipeline write on) is cancelled and asked first, else the
            # lease frees them. The retry does not wait for that: the decode actor takes a new
            # reservation of the request beside the aborted one.
            decode, prefills, destination = active.decode, active.prefill_workers, active.destination
            self.pool.release(decode, active.key)
            try:
                # Given up: a later confirm by name (the client leaving before the retry holds a
                # reservation) must not free these blocks while their writer may still write.
                await decode.handle.abort.remote(active.key, active.decode_attempt, destination is not None)
                if destination is None:  # no writer was given the reservation
                    await decode.handle.confirm_quiesced.remote(active.key)
                else:
                    self.release_later(self._quiesce_then_free(active.key, decode, prefills, destination.token), f"give up {active.key}@{destination.token}")
            except WORKER_GONE:
                pass
        await self.cancel_prefill(active)
        await self.dispatch(active)

    async def cancel_prefill(self, active: ActiveRequest) -> None:
        """Stop a prefill whose decode actor is gone (before the request is dispatched again)."""
        if active.prefill_task is not None and not active.prefill_task.done():
            active.prefill_task.cancel()
        prefills = active.prefill_workers
        active.prefill, active.stages, active.prefill_task = None, [], None
        await self._cancel_on_prefills(active.key, prefills, active.destination.token if prefills else 0)

    @staticmethod
    async def _cancel_on_prefills(key: str, prefills: list[WorkerRecord], token: int) -> None:
        """Tell the live prefill actors holding attempt ``token`` of the request to drop it
        (without waiting for their writes: its decode reservation is gone)."""
        for prefill in prefills:
            if prefill.state is WorkerState.DEAD:
                continue
            try:
                await prefill.handle.cancel.remote(key, token)
            except WORKER_GONE:
                pass

    # -- outputs --------------------------------------------------------------------------

    def _ensure_collector(self, decode: WorkerRecord) -> None:
        task = self._collectors.get(decode.worker_id)
        if task is None or task.done():
            self._collectors[decode.worker_id] = asyncio.create_task(self._collect(decode))

    async def _collect(self, decode: WorkerRecord) -> None:
        # Runs while the actor has requests, or while anyone waits for room (its reports wake them).
        while decode.req_ids or (self.capacity.num_waiting and decode.routable):
            try:
                # With stream_interval N, the actor answers with N steps' outputs (first and last
                # outputs at once): one Ray call per N steps instead of one per step.
                report: DecodeReport = await decode.handle.poll_outputs.remote(
                    self.config.output_poll_s, self.router_id, self.config.stream_interval
                )
            except WORKER_GONE:
                self.on_worker_died(decode)
                return
            except Exception:
                logger.exception("output collection from %s failed", decode.worker_id)
                await asyncio.sleep(0.1)
                continue
            if decode.state is WorkerState.DEAD:
                # Taken for dead while this call was out (a health check or ping that timed out
                # on a worker still alive): its requests are restarting elsewhere from the tokens
                # already streamed, so what it sent since must not reach them too.
                return
            for out in report.outputs:
                active = self._by_key.get(out.req_id)
                if active is not None and active.decode is decode and out.attempt == active.attempt:
                    if out.finished:
                        active.decode_finished = True
                        self.pool.release(decode, out.req_id)
                        num_tokens = len(active.request.prompt_token_ids) + active.assembler.num_completion_tokens
                        if self.capacity.num_waiting:
                            self.kv_freed.add(self._blocks_for(num_tokens + len(out.token_ids)))
                    self._local_prefill_done(out.req_id, computed=True)
                    active.outputs.put_nowait(out)
            decode.num_reservable_blocks = report.num_reservable_blocks
            decode.num_kv_blocks = report.num_kv_blocks
            self.capacity.on_report()

    def on_worker_died(self, record: WorkerRecord) -> None:
        """Stop routing to a dead worker and tell its decode requests what that means."""
        if record.state is WorkerState.DEAD:
            return
        record.state = WorkerState.DEAD
        logger.warning("worker %s (%s) is dead", record.worker_id, record.role.value)
        self.capacity.on_report()  # waiters may fit elsewhere now, or nowhere
        if record.role is not Role.DECODE:
            return
        for key in list(record.req_ids):
            self.pool.release(record, key)
            self._local_prefill_done(key)
            active = self._by_key.get(key)
            if active is None or active.decode is not record:
                continue
            if active.prefill_task is not None:
                active.prefill_task.cancel()
            # Restarted (or, mid-stream, migrated) elsewhere; ``restart`` applies the bounds.
            active.outputs.put_nowait(Restart(f"decode worker {record.worker_id} died", active.attempt, dead_worker_id=record.worker_id))
            # Taken for dead is not always dead (a missed ping, a call that found it unreachable
            # for a moment): one still alive would decode this attempt to its end for nobody,
            # holding its blocks and a seat, while this router routes to it again.
            self.release_later(self._abort_stale_attempt(record, key, active.decode_attempt), f"abort {key} on {record.worker_id}")

    async def _abort_stale_attempt(self, decode: WorkerRecord, key: str, attempt: int) -> None:
        try:
            await within(decode.handle.abort.remote(key, attempt), self.config.status_timeout_s)
        except Exception as exc:  # dead indeed (or hung): nothing of it runs for this router
            logger.debug("req %s: abort on %s: %s", key, decode.worker_id, _reason(exc))

    # -- the end --------------------------------------------------------------------------

    def release(self, active: ActiveRequest) -> asyncio.Task:
        """``finish`` the request in a task of its own, started now: no cancellation of the
        caller reaches it. Awaiting a ``finish`` coroutine instead starts it only at the
        caller's next turn of the loop, and a caller cancelled before then (an HTTP handler
        whose client closed the connection just as the answer ended) never runs it: the request
        would stay admitted here for good (seen once in CI: a finished completion left in
        ``active``)."""
        return self.release_later(self.finish(active), f"release {active.req_id}")

    def release_later(self, release: Coroutine[Any, Any, None], name: str) -> asyncio.Task:
        """Run ``release`` in a task of its own, held until it is done (the loop holds tasks weakly)."""
        task = asyncio.get_running_loop().create_task(release, name=name)
        self._release_tasks.add(task)
        task.add_done_callback(self._release_tasks.discard)
        return task

    async def finish(self, active: ActiveRequest) -> None:
        """Release everything the request holds; abort it on its workers if it did not end there."""
        active.first_output.set()  # its followers wait no more
        if self.active.get(active.req_id) is active:
            del self.active[active.req_id]
        if self._by_key.get(active.key) is active:
            del self._by_key[active.key]
        self._prefill_tokens_on_the_way.pop(active.key, None)
        self._local_prefill_done(active.key)
        self._releasing[active.req_id] = active
        try:
            decode = active.decode
            prefilling = active.prefill_task is not None and not active.prefill_task.done()
            if prefilling:
                active.prefill_task.cancel()
            if decode is None:
                return
            if active.decode_finished:
                if prefilling:
                    # The decode actor ended it (failed) while prefill actors still write into
                    # its reservation: they stop, and it frees the blocks once they did.
                    await self._quiesce_then_free(active.key, decode, active.prefill_workers, active.destination.token)
                return
            self.pool.release(decode, active.key)
            await self._abort_on_workers(active)
        finally:
            active.released.set()
            if self._releasing.get(active.req_id) is active:
                del self._releasing[active.req_id]

    async def _abort_on_workers(self, active: ActiveRequest) -> None:
        key, decode, prefills = active.key, active.decode, active.prefill_workers
        try:
            # With the attempt: an abort that overtakes its own reserve call (an async actor may
            # run calls out of order) leaves a mark, and that reserve is refused.
            await decode.handle.abort.remote(key, active.decode_attempt)
        except WORKER_GONE:
            # Its blocks went with it; the prefill actors that still hold the request would
            # compute it for nobody, until a write into the missing peer failed.
            if prefills:
                await self._cancel_on_prefills(key, prefills, active.destination.token)
            return
        if not prefills:
            # Ended before any prefill actor was given a reservation (the prefill task sets
            # ``prefill`` before it submits), possibly while the reserve call itself was in
            # flight: nothing can write into those blocks, so they are free now, not when the
            # lease runs out. (A no-op where nothing was reserved.)
            try:
                await decode.handle.confirm_quiesced.remote(key)
            except WORKER_GONE:
                pass
            return
        await self._quiesce_then_free(key, decode, prefills, active.destination.token)

    async def _quiesce_then_free(self, key: str, decode: WorkerRecord, prefills: list[WorkerRecord], token: int) -> None:
        """Stop the prefill actors writing into reservation ``token`` of ``decode``; once none has
        a write in flight, the decode actor frees its blocks (else its lease does)."""
        if not await self._quiesce_prefills(key, prefills, token):
            return
        try:
            await decode.handle.confirm_quiesced.remote(key, token)
        except WORKER_GONE:
            pass

    async def _quiesce_prefills(self, key: str, prefills: list[WorkerRecord], token: int) -> bool:
        """Cancel the request's attempt ``token`` on every prefill actor writing into it; True once
        none has a write in flight (a dead one has none), False if one never said so."""

        async def quiesce(prefill: WorkerRecord) -> bool:
            try:
                report = await prefill.handle.cancel.remote(key, token)
                if not report.quiesced:
                    # Bounded: the lease frees the blocks if the writer never confirms.
                    report = await prefill.handle.wait_quiesced.remote(key, token, QUIESCE_WAIT_S)
                if not report.quiesced:
                    logger.warning("req %s: %s never quiesced; the lease will free the blocks", key, prefill.worker_id)
                return report.quiesced
            except ActorUnavailableError:
                # Unreachable, not dead: it may still be writing. Only the lease frees the blocks.
                logger.warning("req %s: %s is unreachable; the lease will free the blocks", key, prefill.worker_id)
                return False
            except WORKER_GONE:
                return True  # a dead writer has nothing in flight

        return all(await asyncio.gather(*(quiesce(p) for p in prefills)))

    async def close(self) -> None:
        for task in self._collectors.values():
            task.cancel()
        await self.lease_keeper.close()


def _decode_stage(plan: PipelinePlan | None) -> PipelineStage | None:
    """The decode actor's stage of ``plan``: the last, where it computes one."""
    if plan is None or not plan.decode_stage:
        return None
    last = plan.layers[-1]
    return PipelineStage(plan.num_stages - 1, plan.num_stages, last.start, last.stop, None, plan.chunk_tokens)


@dataclass(slots=True)
class _StageFailure:
    index: int  # which stage's call raised
    error: BaseException


async def _first_failure_or_all(refs: list) -> list | _StageFailure:
    """Every call's result in order, or the first failure as soon as it happens (a stage waiting
    for a dead stage's activations would wait forever: the caller stops them all)."""
    tasks = [asyncio.ensure_future(ref) for ref in refs]
    try:
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                if task.exception() is not None:
                    return _StageFailure(tasks.index(task), task.exception())
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()


def _capacity_error(request: ValidatedRequest) -> Exception:
    if request.deadline is not None and time.monotonic() >= request.deadline - 0.001:
        return DeadlineExceededError("the deadline passed while waiting for decode capacity")
    return ResourceExhaustedError("no decode worker had room for this request within capacity_wait_s; retry later", retry_after_s=QUEUE_FULL_RETRY_S)


def _seconds(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.1f}s"


def _write_failure(cause: BaseException, decode: WorkerRecord) -> str:
    """Why writing into ``decode``'s reservation failed, as a retry's reason (and the client's
    error where retries run out)."""
    if isinstance(cause, LeaseExpiredError):
        return f"the reservation's lease on decode worker {decode.worker_id} ran out before its KV was written"
    if isinstance(cause, StaleEpochError):
        return f"decode worker {decode.worker_id} restarted since the reservation was made"
    return f"the connection to decode worker {decode.worker_id} was lost"


def _reason(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)
    return str(cause if cause is not None else exc).strip().splitlines()[-1]

