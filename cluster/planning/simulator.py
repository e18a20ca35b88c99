"""A discrete-event simulation of a pdserve deployment, driven by a fitted step-time profile.

What is simulated, as the real parts do it:
- **Router.** A request arrives; if as many requests already wait for a first token as the
  router queues, it is refused. Otherwise it needs a decode worker with room to reserve its
  prompt's blocks (plus one token), as the decode actor reports it: its free blocks less a
  watermark and less what the sequences that must not wait longer need (preempted ones, local
  prompts past their patience), nothing while those wait for a seat in a full batch. A prompt
  the decode worker prefills itself goes there whatever its room (the worker queues it). It
  takes the routable one the router's policy
  picks (``kv_aware``, the default, without cache hits: the fewest prompt tokens assigned, then
  the fewest requests; ``least_loaded``: the fewest requests; ``round_robin``), or waits in
  FIFO order until blocks free up. Prompts up to ``local_prefill_max_tokens`` (or every
  prompt, without prefill workers) prefill on the decode worker; the rest on the prefill
  worker with the fewest queued prompt tokens.
  ``ttft_overhead_s`` (router, Ray calls, streaming: measured) delays the dispatch.
- **Prefill worker.** FIFO queue; each step fills the token budget with chunks (at most
  ``chunk_size`` tokens of one prompt), its duration is the profile's. After the step that
  completes a prompt, the blocks it completed are written to the decode worker (the earlier
  chunks' writes overlapped the compute); the KV lands after the transfer model's time.
- **Decode worker.** Continuous batching: every step computes one token of every running
  sequence plus, when it prefills locally, prompt chunks in the rest of the budget. A
  sequence whose KV landed joins at the next step boundary and its first token goes out then.
  A sequence takes a block each time its length passes a block's end. When the next step's
  blocks are not free, the last to arrive of the sequences it computes is preempted (its
  blocks freed) and queued to be recomputed on the worker, prompt and output so far, before it
  decodes on. Prompts the worker computes (local ones, recomputations) take blocks chunk by
  chunk, in arrival order, as far as the blocks left after the decode rows' go.
- **Pipelined prefill** (``PipelineSettings``: the router's ``prefill_pipeline`` and its
  companions). A long remote prompt is planned as the router plans it (``router.pipeline``: as
  many stages of the least loaded prefill workers as bring its first token soonest, the decode
  worker as one more while it has no other request; layers in balanced ranges; about two chunks
  per stage). Each stage computes its share of the layers of a chunk (the step's intercept, then
  that share of its token terms) once the previous stage's activations for it arrived (the
  transfer model's time for their bytes), in turns that alternate with the worker's ordinary
  steps; a decode worker's stage chunk rides in its step, as a local prompt's chunk does. The KV
  is ready once every prefill stage's write of its layers of the last chunk's blocks landed.

Decode steps are not simulated one by one while nothing changes: between two events a decode
worker's batch is fixed and its KV grows by the batch size per step, so step durations form
an arithmetic series and the time of the k-th step is closed-form. How many blocks the batch
takes over k steps is closed-form too (from how full each sequence's last block is), so a run
also ends where the cache would run out. An arrival in the middle of such a run cuts it at the
next step boundary. Events are then per request, not per token,
which is what lets a day of a 200-worker cluster run in minutes.

Latencies go into log-bucket histograms (0.5% wide), so memory does not grow with the run.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from cluster.planning.profile import Profile
from router.config import RouterConfig
from router.pipeline import PipelineMode, balanced_layers, chunk_tokens, num_stages
from router.pool import RoutingPolicy

_BUCKET_GROWTH = 1.005
_LOG_GROWTH = math.log(_BUCKET_GROWTH)
_MIN_MS = 1e-3
_NUM_BUCKETS = int(math.log(1e8 / _MIN_MS) / _LOG_GROWTH) + 2  # up to ~28 hours
_ITL_POINTS = 4  # ITL samples recorded per run of decode steps (each weighted by the tokens it stands for)
# The share of a decode worker's cache a new reservation may not take while anything runs there:
# decode_workers.scheduler.WATERMARK_FRACTION (not imported: that module loads torch; a test
# holds the two equal).
_WATERMARK_FRACTION = 0.02
# How long a local prompt waits for a seat before reservations pause for it: WAITING_PATIENCE_S there.
_WAITING_PATIENCE_S = 2.0


class LogHistogram:
    """Weighted values in 0.5%-wide logarithmic buckets (ms); percentiles within 0.5%.

    Values are appended to lists and binned by numpy in blocks: an append is what the event
    loop pays per value.
    """

    __slots__ = ("counts", "total", "sum", "max", "_values", "_weights")

    def __init__(self) -> None:
        self.counts = np.zeros(_NUM_BUCKETS)
        self.total = 0.0
        self.sum = 0.0
        self.max = 0.0
        self._values: list[float] = []
        self._weights: list[float] = []

    def add(self, value_ms: float, weight: float = 1.0) -> None:
        self._values.append(value_ms)
        self._weights.append(weight)
        if len(self._values) >= 65_536:
            self._flush()

    def _flush(self) -> None:
        if not self._values:
            return
        values = np.asarray(self._values)
        weights = np.asarray(self._weights)
        self._values, self._weights = [], []
        index = np.zeros(len(values), dtype=np.int64)
        above = values > _MIN_MS
        index[above] = (np.log(values[above] / _MIN_MS) / _LOG_GROWTH).astype(np.int64) + 1
        np.add.at(self.counts, np.minimum(index, _NUM_BUCKETS - 1), weights)
        self.total += float(weights.sum())
        self.sum += float((values * weights).sum())
        self.max = max(self.max, float(values.max()))

    def merge(self, other: "LogHistogram") -> None:
        self._flush()
        other._flush()
        self.counts += other.counts
        self.total += other.total
        self.sum += other.sum
        self.max = max(self.max, other.max)

    def spread(self, factors: list[float]) -> "LogHistogram":
        """The distribution of value x factor, each factor equally likely (a multiplicative
        noise): every bucket's count is shared out over the buckets its value lands in."""
        self._flush()
        result = LogHistogram()
        if not factors:
            result.merge(self)
            return result
        for factor in factors:
            shift = int(round(math.log(factor) / _LOG_GROWTH))
            shifted = np.zeros(_NUM_BUCKETS)
            if shift >= 0:
                shifted[shift:] = self.counts[:_NUM_BUCKETS - shift]
                shifted[-1] += self.counts[_NUM_BUCKETS - shift:].sum()
            else:
                shifted[:shift] = self.counts[-shift:]
                shifted[0] += self.counts[:-shift].sum()
            result.counts += shifted / len(factors)
        result.total = self.total
        result.sum = self.sum * sum(factors) / len(factors)
        result.max = self.max * max(factors)
        return result

    def percentile(self, q: float) -> float | None:
        self._flush()
        if self.total <= 0:
            return None
        cumulative = np.cumsum(self.counts)
        index = int(np.searchsorted(cumulative, self.total * q / 100.0))
        if index == 0:
            return _MIN_MS
        # The bucket's geometric middle.
        return min(_MIN_MS * _BUCKET_GROWTH ** (index - 0.5), self.max)

    @property
    def mean(self) -> float | None:
        self._flush()
        return self.sum / self.total if self.total > 0 else None

    def summary(self) -> dict[str, float | None]:
        self._flush()
        return {"mean": self.mean, "p50": self.percentile(50), "p90": self.percentile(90), "p99": self.percentile(99), "max": self.max or None}


class _Request:
    __slots__ = ("arrival", "prompt_len", "output_len", "blocks", "decode", "prefill", "computed", "first_token", "finish_step", "order", "finished",
                 "pipeline", "prefill_len", "recompute", "preempted", "held", "block_key", "overrun")

    def __init__(self, arrival: float, prompt_len: int, output_len: int, blocks: int, order: int):
        self.arrival = arrival
        self.prompt_len = prompt_len
        self.output_len = output_len
        self.blocks = blocks  # reserved at admission: the prompt's and one token's
        self.order = order
        self.decode: _DecodeWorker | None = None
        self.prefill: _PrefillWorker | None = None
        self.computed = 0  # tokens of prefill_len computed so far
        self.prefill_len = prompt_len  # what a prefill computes: the prompt, or after a preemption everything so far
        self.recompute = False  # preempted while decoding: its prefill is a recomputation (its first token is out)
        self.preempted = False  # ever preempted (the decode actor lets it wait no longer: _reservable)
        self.held = 0  # decode blocks it holds before it decodes: its reservation, or its prefill's so far
        self.block_key = 0  # (length - 1 - the worker's step count) mod block size, while it runs
        self.overrun = 0  # blocks its growth took beyond the cache (a lone sequence longer than the cache)
        self.first_token = math.nan
        self.finished = math.nan
        self.finish_step = 0  # the decode worker's step count at which its last token is out
        self.pipeline: _Pipeline | None = None  # where stages prefill it together


class _PrefillWorker:
    __slots__ = ("index", "queue", "busy", "queued_tokens", "routable", "starting", "step_chunks", "stage_ready", "step_stage", "stage_turn")

    def __init__(self, index: int) -> None:
        self.index = index
        self.queue: deque[_Request] = deque()
        self.busy = False
        self.queued_tokens = 0
        self.routable = True
        self.starting = False  # added by a pool change, still loading
        self.step_chunks: list[tuple[_Request, int]] = []
        self.stage_ready: deque[tuple[_Pipeline, int]] = deque()  # (pipeline, stage) whose next chunk's input is here
        self.step_stage: tuple[_Pipeline, int] | None = None  # the stage chunk the running step computes
        self.stage_turn = True  # a stage chunk goes next where both kinds wait (they alternate)


class _Pipeline:
    """A prompt prefilled by stages together: each stage's worker, share of the layers and
    progress over the chunks."""

    __slots__ = ("request", "stages", "fractions", "chunks", "done", "writes_left", "prefill_writes_left", "tokens_each")

    def __init__(self, request: _Request, stages: list, fractions: list[float], chunk: int, tokens_each: int) -> None:
        self.request = request
        self.stages = stages  # prefill workers, then the decode worker where it computes the last stage
        self.fractions = fractions  # of the layers, per stage
        self.chunks = [(start, min(chunk, request.prompt_len - start)) for start in range(0, request.prompt_len, chunk)]
        self.done = [0] * len(stages)  # chunks each stage has computed
        self.writes_left = len(stages)  # stages whose layers of the last blocks have not landed yet
        self.prefill_writes_left = sum(isinstance(w, _PrefillWorker) for w in stages)
        # Prompt tokens the router counts queued on each prefill stage, until every prefill stage is done.
        self.tokens_each = tokens_each


_ROUTER_DEFAULTS = RouterConfig()


@dataclass(frozen=True, slots=True)
class PipelineSettings:
    """The router's distributed split-fuse settings (``router.config.RouterConfig``), as the
    simulated router applies them; the defaults are the router's."""

    mode: PipelineMode = _ROUTER_DEFAULTS.prefill_pipeline
    max_stages: int | None = _ROUTER_DEFAULTS.max_pipeline_stages
    tokens_per_stage: int = _ROUTER_DEFAULTS.pipeline_tokens_per_stage
    chunk_tokens: int = _ROUTER_DEFAULTS.pipeline_chunk_tokens
    decode_stage: PipelineMode = _ROUTER_DEFAULTS.pipeline_decode_stage

    @classmethod
    def of(cls, config) -> "PipelineSettings":
        """A ``RouterConfig``'s."""
        return cls(PipelineMode(config.prefill_pipeline), config.max_pipeline_stages, config.pipeline_tokens_per_stage,
                   config.pipeline_chunk_tokens, PipelineMode(config.pipeline_decode_stage))


class _DecodeWorker:
    __slots__ = (
        "index", "running", "num_running", "kv_tokens", "steps_done", "prefilling", "joining", "free_blocks", "num_assigned",
        "assigned_tokens", "routable", "starting", "block_keys", "fuller_than", "fuller_than_at",
        "busy", "version", "epoch_start", "epoch_steps", "epoch_first_step_s", "epoch_growth_s", "epoch_chunks", "stage_ready", "epoch_stage",
    )

    def __init__(self, index: int, num_blocks: int, block_size: int) -> None:
        self.index = index
        self.running: list[tuple[int, int, _Request]] = []  # heap by the step its last token is out
        self.num_running = 0
        self.kv_tokens = 0  # KV tokens the next decode step reads, summed over the running sequences
        self.steps_done = 0
        # What it prefills itself (local prompts, recomputations of preempted sequences), by arrival.
        self.prefilling: list[_Request] = []
        self.joining: deque[_Request] = deque()  # KV landed, joining at the next boundary
        # Running sequences by block_key: how full their last blocks are, which says when each
        # takes its next one.
        self.block_keys = [0] * block_size
        # fuller_than[t]: running sequences whose last block holds more than t tokens, at the
        # step count fuller_than_at (None: the batch changed since).
        self.fuller_than = [0] * (block_size + 1)
        self.fuller_than_at: int | None = None
        self.free_blocks = num_blocks
        self.num_assigned = 0
        self.assigned_tokens = 0  # prompt tokens of the assigned requests
        self.routable = True
        self.starting = False  # added by a pool change, still loading
        self.busy = False
        self.version = 0  # invalidates a scheduled boundary that an arrival moved earlier
        self.epoch_start = 0.0
        self.epoch_steps = 0
        self.epoch_first_step_s = 0.0
        self.epoch_growth_s = 0.0  # each step of the run takes this much longer than the one before
        self.epoch_chunks: list[tuple[_Request, int]] = []
        self.stage_ready: deque[tuple[_Pipeline, int]] = deque()  # as a prefill worker's: it computes a pipeline's last stage
        self.epoch_stage: tuple[_Pipeline, int] | None = None  # the stage chunk the running step computes


@dataclass(slots=True)
class WindowStats:
    """Per time window of the run (the plot of a day)."""

    start_s: float
    num_prefill: int = 0
    num_decode: int = 0
    arrived: int = 0
    completed: int = 0
    rejected: int = 0
    ttft: LogHistogram = field(default_factory=LogHistogram)
    tpot: LogHistogram = field(default_factory=LogHistogram)


@dataclass(slots=True)
class SimResult:
    num_prefill: int
    num_decode: int
    num_requests: int
    completed: int
    rejected: int
    duration_s: float  # first arrival to last completion
    output_tokens: int
    ttft: LogHistogram
    tpot: LogHistogram
    itl: LogHistogram
    e2e: LogHistogram
    num_events: int
    windows: list[WindowStats] = field(default_factory=list)
    preemptions: int = 0  # sequences a decode worker preempted for want of blocks (each recomputed)
    too_long: int = 0  # of the rejected: prompts no decode worker could ever hold (the others: a full queue)

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def request_throughput(self) -> float:
        return self.completed / self.duration_s if self.duration_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "num_prefill": self.num_prefill,
            "num_decode": self.num_decode,
            "num_requests": self.num_requests,
            "completed": self.completed,
            "rejected": self.rejected,
            "rejected_too_long": self.too_long,
            "duration_s": self.duration_s,
            "output_throughput_tok_s": self.output_throughput,
            "request_throughput_req_s": self.request_throughput,
            "ttft_ms": self.ttft.summary(),
            "tpot_ms": self.tpot.summary(),
            "itl_ms": self.itl.summary(),
            "e2e_ms": self.e2e.summary(),
            "num_events": self.num_events,
            "preemptions": self.preemptions,
        }


@dataclass(slots=True)
class PoolChange:
    """At ``at_s`` the pools become this size: new workers start after the startup time, removed
    ones drain (take nothing new, finish what they hold)."""

    at_s: float
    num_prefill: int
    num_decode: int


# Event kinds, in tie-break order at equal times.
_POOL_CHANGE, _WORKER_UP, _DISPATCH, _PREFILL_STEP, _STAGE_INPUT, _STAGE_WRITE, _KV_READY, _DECODE_BOUNDARY = range(8)


class Simulation:
    max_steps_per_run: int | None = None  # 1: an event per decode step (the shortcut's reference, in tests)

    def __init__(
        self,
        profile: Profile,
        num_prefill: int,
        num_decode: int,
        max_queued_requests: int = 256,
        window_s: float | None = None,
        worker_startup_s: float = 30.0,
        colocated: bool = False,
        keep_requests: bool = False,
        routing_policy: RoutingPolicy = RoutingPolicy.KV_AWARE,
        pipeline: PipelineSettings | None = None,
    ):
        """``pipeline``: how the router pipelines long prompts over the prefill pool (None: it
        does not: one prefill worker per prompt)."""
        if num_decode < 1:
            raise ValueError(f"decode: a deployment needs at least one decode worker, got {num_decode}")
        if num_prefill < 0:
            raise ValueError(f"prefill: must be >= 0, got {num_prefill}")
        self.profile = profile
        facts = profile.facts
        self.step = profile.step
        self.block_size = facts.block_size
        self.bytes_per_block = facts.bytes_per_block
        self.decode_blocks = facts.decode_num_blocks
        self.watermark_blocks = max(1, int(self.decode_blocks * _WATERMARK_FRACTION))
        self.prefill_budget = facts.token_budget["prefill"]
        self.prefill_chunk = facts.chunk_size["prefill"] or self.prefill_budget
        self.decode_budget = facts.token_budget["decode"]
        self.decode_chunk = facts.chunk_size["decode"] or self.decode_budget
        self.max_num_seqs = facts.max_num_seqs
        self.local_max = facts.local_prefill_max_tokens
        self.pipeline = pipeline if pipeline is not None and pipeline.mode is not PipelineMode.OFF else None
        self.num_layers = facts.num_layers
        self.activation_bytes_per_token = facts.activation_bytes_per_token
        self._shares_by_stages: dict[int, list[float]] = {}
        self.max_queued = max_queued_requests
        self.window_s = window_s
        self.worker_startup_s = worker_startup_s
        # Every worker on one machine, as when profiled on it: a step is slower by the profile's
        # contention factors times the shares of the other workers prefilling and decoding
        # when it starts.
        self._contended = colocated and any(v for factors in self.step.contention.values() for v in factors.values())
        self.kept: list[_Request] | None = [] if keep_requests else None  # every request, for per-request comparisons
        self.prefills = [_PrefillWorker(i) for i in range(num_prefill)]
        self.decodes = [_DecodeWorker(i, self.decode_blocks, self.block_size) for i in range(num_decode)]
        # Least-loaded picks from heaps of (load, index) with lazy deletion: an entry whose load
        # is no longer the worker's (or whose worker left) is dropped when it reaches the top.
        # Ties go to the lower index, as the router's ``min`` over its list does.
        policy = RoutingPolicy(routing_policy)
        self._round_robin = itertools.count() if policy == RoutingPolicy.ROUND_ROBIN else None
        self._decode_load = _DECODE_LOADS.get(policy)
        self._prefill_heap = [(0, w.index) for w in self.prefills]
        self._decode_heap = [] if self._round_robin is not None else [(self._decode_load(w), w.index) for w in self.decodes]
        self.num_prefill, self.num_decode = num_prefill, num_decode
        self._events: list = []
        self._counter = itertools.count()
        self._router_queue: deque[_Request] = deque()
        self._waiting_first_token = 0
        self.now = 0.0
        self.ttft, self.tpot, self.itl, self.e2e = LogHistogram(), LogHistogram(), LogHistogram(), LogHistogram()
        self.num_requests = self.completed = self.rejected = self.too_long = self.output_tokens = self.preemptions = 0
        self.first_arrival = math.nan
        self.last_finish = 0.0
        self.num_events = 0
        self.windows: list[WindowStats] = []
        # Decode-step terms, hoisted: the inner loops read them per step.
        self._d_intercept = self.step.intercept_s["decode"]
        self._d_row = self.step.decode_row_s
        self._d_kv = self.step.decode_kv_s

    # -- running ------------------------------------------------------------------------

    def run(self, arrivals: Iterable[tuple[float, int, int]], pool_changes: Iterable[PoolChange] = ()) -> SimResult:
        for change in pool_changes:
            self._push(change.at_s, _POOL_CHANGE, change)
        events = self._events
        arrivals = iter(arrivals)
        next_arrival = next(arrivals, None)
        pop = heapq.heappop
        while next_arrival is not None or events:
            if next_arrival is not None and (not events or next_arrival[0] <= events[0][0]):
                self.now = next_arrival[0]
                self._arrive(*next_arrival)
                next_arrival = next(arrivals, None)
            else:
                when, _, kind, subject, version = pop(events)
                self.now = when
                if kind == _DECODE_BOUNDARY:
                    if version == subject.version:
                        self._decode_boundary(subject)
                elif kind == _KV_READY:
                    self._kv_ready(subject)
                elif kind == _PREFILL_STEP:
                    self._prefill_step_end(subject)
                elif kind == _STAGE_INPUT:
                    self._stage_input(*subject)
                elif kind == _STAGE_WRITE:
                    self._stage_write_landed(*subject)
                elif kind == _DISPATCH:
                    self._dispatch(subject)
                elif kind == _WORKER_UP:
                    self._worker_up(subject)
                else:
                    self._change_pools(subject)
            self.num_events += 1
        start = 0.0 if math.isnan(self.first_arrival) else self.first_arrival
        # Decode steps scatter around the model; an inter-token latency is one step, so its
        # percentiles carry that scatter (TPOT and TTFT average over many steps: they do not).
        itl = self.itl.spread(self.step.residuals.get("decode", []))
        return SimResult(
            self.num_prefill, self.num_decode, self.num_requests, self.completed, self.rejected, max(0.0, self.last_finish - start),
            self.output_tokens, self.ttft, self.tpot, itl, self.e2e, self.num_events, self.windows, self.preemptions, self.too_long,
        )

    def _push(self, when: float, kind: int, subject, version: int = 0) -> None:
        heapq.heappush(self._events, (when, next(self._counter), kind, subject, version))

    def _window(self) -> WindowStats | None:
        if self.window_s is None:
            return None
        index = int(self.now // self.window_s)
        while len(self.windows) <= index:
            self.windows.append(WindowStats(
                len(self.windows) * self.window_s, sum(1 for w in self.prefills if w.routable), sum(1 for w in self.decodes if w.routable)
            ))
        return self.windows[index]

    # -- router -------------------------------------------------------------------------

    def _arrive(self, when: float, prompt_len: int, output_len: int) -> None:
        if math.isnan(self.first_arrival):
            self.first_arrival = when
        self.num_requests += 1
        window = self._window()
        if window is not None:
            window.arrived += 1
        if self._waiting_first_token >= self.max_queued:
            self.rejected += 1
            if window is not None:
                window.rejected += 1
            return
        blocks = self._blocks(prompt_len + 1)  # what the router reserves: the prompt and one token
        if blocks > self.decode_blocks:
            self.rejected += 1  # the router refuses it: no decode worker could ever hold its prompt
            self.too_long += 1
            return
        request = _Request(when, prompt_len, output_len, blocks, self.num_requests)
        if self.kept is not None:
            self.kept.append(request)
        self._waiting_first_token += 1
        # A prompt prefilled where it decodes waits for no room (its worker queues it), so not
        # behind the ones that do.
        local = prompt_len <= self.local_max or self._least_queued_prefill() is None
        if (self._router_queue and not local) or not self._admit(request):
            self._router_queue.append(request)

    def _admit(self, request: _Request) -> bool:
        """Give the request a decode worker (with room to reserve, unless it prefills there), or
        return False (it waits)."""
        prefill = None if request.prompt_len <= self.local_max else self._least_queued_prefill()
        decode = self._least_assigned_decode(0 if prefill is None else request.blocks)
        if decode is None:
            return False
        decode_alone = decode.num_assigned == 0  # before this request: may it compute a pipeline's last stage?
        if prefill is not None:
            decode.free_blocks -= request.blocks
            request.held = request.blocks
            self._end_run_before_the_cache_runs_out(decode)
        self._assign(decode, request, +1)
        request.decode = decode
        if prefill is not None and self.pipeline is not None:
            request.pipeline = self._plan_pipeline(request, decode_alone)
        if request.pipeline is not None:
            request.prefill = request.pipeline.stages[0]
        elif prefill is not None:
            request.prefill = prefill
            self._set_queued(prefill, prefill.queued_tokens + request.prompt_len)
        overhead = self.profile.ttft_overhead_s["local" if prefill is None else "remote"]
        self._push(self.now + overhead, _DISPATCH, request)
        return True

    def _plan_pipeline(self, request: _Request, decode_alone: bool) -> _Pipeline | None:
        """The stages that prefill a remote prompt together, as the router plans them
        (``router.pipeline.plan_pipeline``), or None: one prefill worker does."""
        settings = self.pipeline
        if settings.mode is PipelineMode.AUTO and request.prompt_len < 2 * settings.tokens_per_stage:
            return None  # under two stages' worth (most prompts): no pass over the pool
        candidates = [w for w in self.prefills if w.routable]
        decode_stage = settings.decode_stage is PipelineMode.ALWAYS or (settings.decode_stage is PipelineMode.AUTO and decode_alone)
        extra = 1 if decode_stage else 0
        ordered: list = sorted(candidates, key=lambda w: (w.queued_tokens, w.index))
        # A profile without the model's layers bounds the stages by the pool alone.
        layers = self.num_layers or len(candidates) + extra
        stages = num_stages(settings.mode, request.prompt_len, [w.queued_tokens for w in ordered], extra, settings.max_stages,
                            settings.tokens_per_stage, layers, settings.chunk_tokens, self.block_size)
        if stages < 2:  # also with no routable prefill actor: a pipeline keeps a prefill stage
            return None
        workers = ordered[: stages - extra]
        tokens_each = request.prompt_len // stages
        for worker in workers:
            self._set_queued(worker, worker.queued_tokens + tokens_each)
        if decode_stage:
            workers.append(request.decode)
        chunk = chunk_tokens(request.prompt_len, stages, settings.chunk_tokens, self.block_size)
        return _Pipeline(request, workers, self._layer_shares(stages), chunk, tokens_each)

    def _layer_shares(self, stages: int) -> list[float]:
        """Each stage's share of the layers, cut as the router cuts them (balanced ranges)."""
        shares = self._shares_by_stages.get(stages)
        if shares is None:
            if self.num_layers >= stages:
                shares = [len(r) / self.num_layers for r in balanced_layers([1.0] * self.num_layers, stages)]
            else:
                shares = [1.0 / stages] * stages
            self._shares_by_stages[stages] = shares
        return shares

    def _least_assigned_decode(self, blocks: int) -> _DecodeWorker | None:
        if self._round_robin is not None:
            candidates = [w for w in self.decodes if w.routable and self._has_room(w, blocks)]
            return candidates[next(self._round_robin) % len(candidates)] if candidates else None
        heap, workers, load_of = self._decode_heap, self.decodes, self._decode_load
        passed = []
        chosen = None
        while heap:
            load, index = heap[0]
            worker = workers[index]
            if not worker.routable or load != load_of(worker):
                heapq.heappop(heap)
            elif self._has_room(worker, blocks):
                chosen = worker
                break
            else:
                passed.append(heapq.heappop(heap))  # no room for this one: the next least loaded
        for entry in passed:
            heapq.heappush(heap, entry)
        return chosen

    def _least_queued_prefill(self) -> _PrefillWorker | None:
        heap, workers = self._prefill_heap, self.prefills
        while heap:
            load, index = heap[0]
            worker = workers[index]
            if worker.routable and load == worker.queued_tokens:
                return worker
            heapq.heappop(heap)
        return None

    def _assign(self, worker: _DecodeWorker, request: _Request, sign: int) -> None:
        """``request`` is assigned to ``worker`` (sign +1) or done there (-1)."""
        worker.num_assigned += sign
        worker.assigned_tokens += sign * request.prompt_len
        self._push_decode_load(worker)

    def _push_decode_load(self, worker: _DecodeWorker) -> None:
        if worker.routable and self._round_robin is None:  # round robin ranks nothing: no heap
            self._push_load(self._decode_heap, worker.index, self.decodes, self._decode_load)

    def _set_queued(self, worker: _PrefillWorker, value: int) -> None:
        worker.queued_tokens = value
        if worker.routable:
            self._push_load(self._prefill_heap, worker.index, self.prefills, _queued_tokens)

    @staticmethod
    def _push_load(heap: list, index: int, workers: list, load_of) -> None:
        heapq.heappush(heap, (load_of(workers[index]), index))
        if len(heap) > 8 * len(workers) + 64:  # stale entries piled up: rebuild from the live loads
            heap[:] = [(load_of(w), w.index) for w in workers if w.routable]
            heapq.heapify(heap)

    def _retry_router_queue(self) -> None:
        queue = self._router_queue
        while queue and self._admit(queue[0]):
            queue.popleft()

    def _dispatch(self, request: _Request) -> None:
        pipeline = request.pipeline
        if pipeline is not None:
            first = pipeline.stages[0]  # a prefill worker: every chunk's input is there
            first.stage_ready.extend([(pipeline, 0)] * len(pipeline.chunks))
            if not first.busy:
                self._start_prefill_step(first)
            return
        if request.prefill is None:
            worker = request.decode
            bisect.insort(worker.prefilling, request, key=_arrival_order)
            self._wake_decode(worker)
            return
        worker = request.prefill
        worker.queue.append(request)
        if not worker.busy:
            self._start_prefill_step(worker)

    # -- prefill workers ----------------------------------------------------------------

    def _start_prefill_step(self, worker: _PrefillWorker) -> None:
        if worker.stage_ready and (worker.stage_turn or not worker.queue):
            worker.stage_turn = False
            worker.step_stage = worker.stage_ready.popleft()
            pipeline, stage = worker.step_stage
            duration = (self.step.intercept_s["prefill"] + self._stage_chunk_s(pipeline, stage, "prefill")) * self._crowding("prefill", worker)
            self._set_busy(worker, True)
            self._push(self.now + duration, _PREFILL_STEP, worker)
            return
        worker.stage_turn = True
        budget = self.prefill_budget
        chunks = []
        tokens = 0
        attention = 0.0
        for request in worker.queue:
            if budget <= 0:
                break
            chunk = min(request.prompt_len - request.computed, budget, self.prefill_chunk)
            chunks.append((request, chunk))
            attention += chunk * (request.computed + chunk / 2)
            tokens += chunk
            budget -= chunk
        duration = self.step.step_s("prefill", tokens, attention, len(chunks)) * self._crowding("prefill", worker)
        worker.step_chunks = chunks
        self._set_busy(worker, True)
        self._push(self.now + duration, _PREFILL_STEP, worker)

    def _prefill_step_end(self, worker: _PrefillWorker) -> None:
        self._set_busy(worker, False)
        if worker.step_stage is not None:
            pipeline, stage = worker.step_stage
            worker.step_stage = None
            self._stage_chunk_done(pipeline, stage)
        for request, chunk in worker.step_chunks:
            start = request.computed
            request.computed += chunk
            if request.computed == request.prompt_len:
                worker.queue.remove(request)
                self._set_queued(worker, worker.queued_tokens - request.prompt_len)
                # The blocks this step completed go last; the earlier ones were written meanwhile.
                blocks = -(-request.prompt_len // self.block_size) - start // self.block_size
                self._push(self.now + self.profile.transfer.transfer_s(blocks * self.bytes_per_block, 1), _KV_READY, request)
        worker.step_chunks = []
        if worker.queue or worker.stage_ready:
            self._start_prefill_step(worker)

    # -- pipelined prefill --------------------------------------------------------------

    def _stage_chunk_s(self, pipeline: _Pipeline, stage: int, role: str) -> float:
        """What a stage's next chunk adds to a step beyond its intercept: its share of the layers
        of the chunk's token terms."""
        start, tokens = pipeline.chunks[pipeline.done[stage]]
        whole = self.step.step_s(role, tokens, tokens * (start + tokens / 2), 1) - self.step.intercept_s[role]
        return pipeline.fractions[stage] * whole

    def _stage_chunk_done(self, pipeline: _Pipeline, stage: int) -> None:
        """A stage computed a chunk: its activations go to the next stage; after its last chunk,
        its layers of the blocks that chunk completed are written to the decode worker."""
        index = pipeline.done[stage]
        pipeline.done[stage] += 1
        start, tokens = pipeline.chunks[index]
        if stage + 1 < len(pipeline.stages):
            hop = self.profile.transfer.transfer_s(tokens * self.activation_bytes_per_token, 1)
            self._push(self.now + hop, _STAGE_INPUT, (pipeline, stage + 1))
        if index + 1 < len(pipeline.chunks):
            return
        write = 0.0  # the decode worker computed its layers into its own cache
        if isinstance(pipeline.stages[stage], _PrefillWorker):
            blocks = -(-pipeline.request.prompt_len // self.block_size) - start // self.block_size
            write = self.profile.transfer.transfer_s(int(blocks * self.bytes_per_block * pipeline.fractions[stage]), 1)
        self._push(self.now + write, _STAGE_WRITE, (pipeline, stage))

    def _stage_input(self, pipeline: _Pipeline, stage: int) -> None:
        worker = pipeline.stages[stage]
        worker.stage_ready.append((pipeline, stage))
        if isinstance(worker, _DecodeWorker):
            self._wake_decode(worker)
        elif not worker.busy:
            self._start_prefill_step(worker)

    def _stage_write_landed(self, pipeline: _Pipeline, stage: int) -> None:
        if isinstance(pipeline.stages[stage], _PrefillWorker):
            pipeline.prefill_writes_left -= 1
            if pipeline.prefill_writes_left == 0:  # the router hears from every prefill stage at once
                for worker in pipeline.stages:
                    if isinstance(worker, _PrefillWorker):
                        self._set_queued(worker, worker.queued_tokens - pipeline.tokens_each)
        pipeline.writes_left -= 1
        if pipeline.writes_left == 0:  # every stage's layers of every block are in the reservation
            request = pipeline.request
            request.computed = request.prompt_len
            self._kv_ready(request)

    # -- decode workers -----------------------------------------------------------------

    def _kv_ready(self, request: _Request) -> None:
        worker = request.decode
        worker.joining.append(request)
        self._wake_decode(worker)

    def _wake_decode(self, worker: _DecodeWorker) -> None:
        """Something arrived: an idle worker starts now; a run of decode steps stops at the next boundary."""
        if not worker.busy:
            self._decode_boundary(worker)
            return
        if worker.epoch_chunks or worker.epoch_steps <= 1:
            return  # a single step is running; its end is the next boundary anyway
        self._cut_run(worker, self._step_running(worker) + 1)

    def _step_running(self, worker: _DecodeWorker) -> int:
        """The step (0-based) of the worker's run that is computing now: the first whose end is at
        or after now, end(j) = (j + 1) first + growth j (j + 1) / 2."""
        elapsed = self.now - worker.epoch_start
        first, growth = worker.epoch_first_step_s, worker.epoch_growth_s
        if growth > 0:
            a, b, c = growth / 2, first + growth / 2, first - elapsed
            j = math.ceil((-b + math.sqrt(max(0.0, b * b - 4 * a * c))) / (2 * a) - 1e-9)
        else:
            j = math.ceil(elapsed / first - 1 - 1e-9) if first > 0 else 0
        return min(max(j, 0), worker.epoch_steps - 1)

    def _cut_run(self, worker: _DecodeWorker, steps: int) -> None:
        """The worker's run of steps ends after ``steps`` of them, if that is sooner."""
        if steps < worker.epoch_steps:
            worker.epoch_steps = steps
            worker.version += 1
            end = worker.epoch_start + _run_s(worker.epoch_first_step_s, worker.epoch_growth_s, steps)
            self._push(max(end, self.now), _DECODE_BOUNDARY, worker, worker.version)

    # -- decode KV blocks ---------------------------------------------------------------

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _growth_blocks(self, worker: _DecodeWorker, steps: int) -> int:
        """The blocks the running sequences take in their next ``steps`` decode steps (from the
        run's start): a sequence whose last block holds r + 1 tokens takes floor((r + steps) / B)."""
        if steps <= 0 or not worker.num_running:
            return 0
        size = self.block_size
        full, part = divmod(steps, size)
        blocks = worker.num_running * full
        if part:
            if worker.fuller_than_at != worker.steps_done:  # (asked many times per run: counted once)
                offset = worker.steps_done % size
                keys = worker.block_keys
                fuller = worker.fuller_than
                fuller[size] = 0
                for r in range(size - 1, -1, -1):
                    fuller[r] = fuller[r + 1] + keys[(r - offset) % size]
                worker.fuller_than_at = worker.steps_done
            blocks += worker.fuller_than[size - part]
        return blocks

    def _count_block_key(self, worker: _DecodeWorker, request: _Request, sign: int) -> None:
        worker.block_keys[request.block_key] += sign
        worker.fuller_than_at = None

    def _steps_before_the_cache_runs_out(self, worker: _DecodeWorker, steps: int) -> int:
        """How many of the next ``steps`` decode steps the free blocks last for."""
        free = worker.free_blocks
        if worker.num_running * (steps // self.block_size + 1) <= free or self._growth_blocks(worker, steps) <= free:
            return steps
        low, high = 0, steps  # growth(low) fits, growth(high) does not
        while high - low > 1:
            middle = (low + high) // 2
            if self._growth_blocks(worker, middle) <= free:
                low = middle
            else:
                high = middle
        return low

    def _end_run_before_the_cache_runs_out(self, worker: _DecodeWorker) -> None:
        """Blocks were taken from a worker mid-run (a reservation): its run ends where the rest
        runs out (after the step computing now, which has its blocks)."""
        if worker.busy and not worker.epoch_chunks and worker.epoch_stage is None and worker.epoch_steps > 1:
            fits = self._steps_before_the_cache_runs_out(worker, worker.epoch_steps)
            if fits < worker.epoch_steps:  # (as for nearly every reservation: nothing to cut)
                self._cut_run(worker, max(fits, self._step_running(worker) + 1))

    def _has_room(self, worker: _DecodeWorker, blocks: int) -> bool:
        # Bounds first (this is asked of every worker a full pool walks past): never more than
        # the free blocks; at least what is left after the whole run in flight and a watermark,
        # with nothing waiting for a seat.
        free = worker.free_blocks
        if blocks > free:
            return False
        if not worker.prefilling and blocks <= free - self.watermark_blocks - worker.num_running * (worker.epoch_steps // self.block_size + 1):
            return True
        return blocks <= self._reservable(worker)

    def _reservable(self, worker: _DecodeWorker) -> int:
        """The blocks a new reservation may take on the worker now, as the decode actor reports
        them (``DecodeScheduler.num_reservable_blocks``)."""
        if not worker.num_running and not worker.prefilling:
            return worker.free_blocks
        overdue = [r for r in worker.prefilling if self._overdue(r)]
        if overdue and worker.num_running + self._num_started(worker) >= self.max_num_seqs:
            return 0
        taken = 0  # by the steps of the run done so far and the one computing now (it has its blocks)
        if worker.busy:
            taken = self._growth_blocks(worker, self._step_running(worker) + 1)
        waiting = sum(self._blocks(r.prefill_len + 1) for r in overdue)
        return max(0, worker.free_blocks - taken - self.watermark_blocks - waiting)

    def _overdue(self, request: _Request) -> bool:
        """Whether a sequence waiting here (not started) holds reservations back: a preempted one,
        or a local prompt past its patience (``DecodeScheduler.num_reservable_blocks``)."""
        return not request.held and (request.preempted or self.now - request.arrival >= _WAITING_PATIENCE_S)

    @staticmethod
    def _num_started(worker: _DecodeWorker) -> int:
        """Prompts the worker is part-way through (in the engine's running batch, beside the decode rows)."""
        return sum(1 for r in worker.prefilling if r.held)

    def _make_room_for_the_next_step(self, worker: _DecodeWorker) -> None:
        """Preempt until the decode rows' blocks for the next step are free, as
        ``engine.scheduler`` does: by recompute, the last to arrive of the sequences it computes
        first (a lone decoding sequence the cache cannot hold goes on: it takes what there is)."""
        while worker.num_running > worker.free_blocks and self._growth_blocks(worker, 1) > worker.free_blocks:
            decoding = _last_decoding(worker)
            prefilling = _last_started(worker)
            if prefilling is not None and prefilling.order > decoding.order:
                self._preempt_prefill(worker, prefilling)
            elif worker.num_running > 1 or self._blocks(self._length(worker, decoding) + 1) <= self.decode_blocks:
                self._preempt_decoding(worker, decoding)
            else:
                return

    def _preempt_prefill(self, worker: _DecodeWorker, request: _Request) -> None:
        """A prompt part-way through gives its blocks up; it starts over when its turn comes."""
        worker.free_blocks += request.held
        request.held = request.computed = 0
        request.preempted = True
        self.preemptions += 1

    @staticmethod
    def _length(worker: _DecodeWorker, request: _Request) -> int:
        """A decoding sequence's tokens so far (the last one sampled, not yet computed)."""
        return request.prompt_len + request.output_len - (request.finish_step - worker.steps_done)

    def _preempt_decoding(self, worker: _DecodeWorker, request: _Request) -> None:
        worker.running = [entry for entry in worker.running if entry[2] is not request]
        heapq.heapify(worker.running)
        length = self._length(worker, request)
        worker.num_running -= 1
        worker.kv_tokens -= length
        self._count_block_key(worker, request, -1)
        worker.free_blocks += self._blocks(length) - request.overrun
        request.overrun = request.held = 0
        request.prefill_len, request.computed, request.recompute, request.preempted = length, 0, True, True
        bisect.insort(worker.prefilling, request, key=_arrival_order)
        self.preemptions += 1

    def _decode_boundary(self, worker: _DecodeWorker) -> None:
        now = self.now
        if worker.busy:
            self._finish_epoch(worker)
        self._set_busy(worker, False)
        # Sequences whose KV landed join and send their first token: all of them, as the decode
        # actor admits them (max_num_seqs bounds its local prompts, not these), as far as a
        # step's token budget has rows for them.
        while worker.joining and worker.num_running < self.decode_budget:
            self._start_decoding(worker, worker.joining.popleft(), now)
        self._make_room_for_the_next_step(worker)
        if not worker.routable and worker.num_assigned == 0:
            return
        self._start_epoch(worker)

    def _finish_epoch(self, worker: _DecodeWorker) -> None:
        steps, batch = worker.epoch_steps, worker.num_running
        worker.epoch_steps = 0  # the run is over: its blocks are debited here, not counted in flight (_reservable)
        if batch:
            first, growth = worker.epoch_first_step_s, worker.epoch_growth_s
            points = min(steps, _ITL_POINTS)
            weight = batch * steps / points
            for i in range(points):
                j = (i + 0.5) * steps / points - 0.5
                self.itl.add((first + growth * j) * 1000.0, weight)
            worker.kv_tokens += steps * batch
            self.output_tokens += steps * batch
            blocks = self._growth_blocks(worker, steps)
            if blocks > worker.free_blocks:
                # More than the cache: a lone sequence longer than it (a reservation's step
                # in flight at most otherwise). It takes what there is.
                last = _last_decoding(worker)
                last.overrun += blocks - worker.free_blocks
                blocks = worker.free_blocks
            worker.free_blocks -= blocks
        worker.steps_done += steps
        done = worker.steps_done
        running = worker.running
        while running and running[0][0] <= done:
            self._finish(worker, heapq.heappop(running)[2])
        for request, chunk in worker.epoch_chunks:
            request.computed += chunk
            if request.computed == request.prefill_len:
                worker.prefilling.remove(request)
                self.output_tokens += 1
                if request.recompute:
                    self._resume_decoding(worker, request)
                else:
                    self._start_decoding(worker, request, self.now)
        worker.epoch_chunks = []
        if worker.epoch_stage is not None:
            pipeline, stage = worker.epoch_stage
            worker.epoch_stage = None
            self._stage_chunk_done(pipeline, stage)

    def _start_decoding(self, worker: _DecodeWorker, request: _Request, now: float) -> None:
        request.first_token = now
        self._waiting_first_token -= 1
        self.ttft.add((now - request.arrival) * 1000.0)
        window = self._window()
        if window is not None:
            window.ttft.add((now - request.arrival) * 1000.0)
        if request.prefill is not None:
            self.output_tokens += 1  # the first token, sampled by the prefill worker
        if request.output_len <= 1:
            self._finish(worker, request)
            return
        self._run(worker, request, request.prompt_len + 1)

    def _resume_decoding(self, worker: _DecodeWorker, request: _Request) -> None:
        """A preempted sequence was recomputed; that step sampled its next token."""
        request.recompute = False
        if not self._run(worker, request, request.prefill_len + 1):
            self._finish(worker, request)  # that token was its last

    def _run(self, worker: _DecodeWorker, request: _Request, length: int) -> bool:
        """The sequence, ``length`` tokens long so far, joins the worker's running batch; False
        if it has no token left to decode (the caller finishes it)."""
        request.finish_step = worker.steps_done + request.prompt_len + request.output_len - length
        request.block_key = (length - 1 - worker.steps_done) % self.block_size
        self._count_block_key(worker, request, +1)
        worker.num_running += 1
        worker.kv_tokens += length
        if request.finish_step == worker.steps_done:
            return False
        heapq.heappush(worker.running, (request.finish_step, request.order, request))
        return True

    def _finish(self, worker: _DecodeWorker, request: _Request) -> None:
        now = self.now
        if request.finish_step:  # it decoded (else it ended with its first token)
            worker.num_running -= 1
            worker.kv_tokens -= request.prompt_len + request.output_len
            self._count_block_key(worker, request, -1)
            worker.free_blocks += self._blocks(request.prompt_len + request.output_len) - request.overrun
            tpot = (now - request.first_token) * 1000.0 / (request.output_len - 1)
            self.tpot.add(tpot)
        else:
            worker.free_blocks += request.held
        request.finished = now
        self._assign(worker, request, -1)
        self.completed += 1
        self.e2e.add((now - request.arrival) * 1000.0)
        self.last_finish = max(self.last_finish, now)
        window = self._window()
        if window is not None:
            window.completed += 1
            if request.finish_step:
                window.tpot.add(tpot)
        if self._router_queue:
            self._retry_router_queue()

    def _start_epoch(self, worker: _DecodeWorker) -> None:
        batch = worker.num_running
        stage = worker.stage_ready.popleft() if worker.stage_ready else None  # a pipeline's last stage: its next chunk
        chunks, unpaused = self._prompt_chunks(worker, batch)
        while not batch and not chunks and stage is None and self._num_started(worker):
            # Prompts part-way through hold the blocks the next chunk needs, and nothing else
            # runs: the last to arrive gives its up (engine.scheduler preempts when a step
            # would schedule nothing).
            self._preempt_prefill(worker, _last_started(worker))
            chunks, unpaused = self._prompt_chunks(worker, batch)
        if not batch and not chunks and stage is None:
            return  # idle until something arrives
        first = self._d_intercept + self._d_row * batch + self._d_kv * worker.kv_tokens
        if chunks or stage is not None:
            steps = 1
            tokens = sum(c for _, c in chunks)
            attention = sum(c * (r.computed + c / 2) for r, c in chunks)
            first += self.step.prefill_token_s * tokens + self.step.prefill_attention_s * attention + self.step.prefill_seq_s * len(chunks)
            if stage is not None:
                first += self._stage_chunk_s(*stage, "decode")
        else:
            steps = worker.running[0][0] - worker.steps_done  # until the next sequence finishes
            if self.max_steps_per_run is not None:
                steps = min(steps, self.max_steps_per_run)
            steps = max(1, self._steps_before_the_cache_runs_out(worker, steps))  # (one: a lone sequence past the cache)
        crowding = self._crowding("decode", worker)
        first *= crowding
        growth = self._d_kv * batch * crowding
        worker.epoch_start = self.now
        worker.epoch_steps = steps
        worker.epoch_first_step_s = first
        worker.epoch_growth_s = growth
        worker.epoch_chunks = chunks
        worker.epoch_stage = stage
        worker.version += 1
        self._set_busy(worker, True)
        end = self.now + _run_s(first, growth, steps)
        self._push(end, _DECODE_BOUNDARY, worker, worker.version)
        if unpaused and self._router_queue:
            self._retry_router_queue()  # (now that the step has its blocks)

    def _prompt_chunks(self, worker: _DecodeWorker, batch: int) -> tuple[list[tuple[_Request, int]], bool]:
        """The prompt chunks (local prompts, recomputations) a step with ``batch`` decode rows
        carries, in arrival order, each with its blocks taken; and whether a sequence that held
        reservations back started. A prompt not yet started needs a seat (``max_num_seqs``, as
        the engine's waiting queue); one without room for its chunk holds back those behind it."""
        chunks: list[tuple[_Request, int]] = []
        unpaused = False
        if not worker.prefilling:
            return chunks, unpaused
        budget = self.decode_budget - batch
        seats = self.max_num_seqs - batch - self._num_started(worker)
        free = worker.free_blocks - self._growth_blocks(worker, 1)  # the decode rows' blocks come first
        for request in worker.prefilling:
            if budget <= 0:
                break
            if not request.held and seats <= 0:
                continue
            chunk = min(request.prefill_len - request.computed, budget, self.decode_chunk)
            done = request.computed + chunk
            blocks = self._blocks(done + 1 if done == request.prefill_len else done) - request.held  # the last: with its next token's
            if blocks > free:
                break
            if not request.held:
                seats -= 1
                unpaused = unpaused or self._overdue(request)
            free -= blocks
            request.held += blocks
            worker.free_blocks -= blocks
            chunks.append((request, chunk))
            budget -= chunk
        return chunks, unpaused

    # -- sharing a machine ---------------------------------------------------------------

    def _crowding(self, role: str, worker) -> float:
        """How much slower a step starting now runs for the other workers computing beside it
        (by what they compute: prompt tokens, or decode rows only)."""
        if not self._contended:
            return 1.0
        others = len(self.prefills) + len(self.decodes) - 1
        if not others:
            return 1.0
        prefilling = sum(1 for w in self.prefills if w.busy and w is not worker)
        decoding = 0
        for other in self.decodes:
            if other.busy and other is not worker:
                if other.epoch_chunks or other.epoch_stage is not None:
                    prefilling += 1
                else:
                    decoding += 1
        return self.step.crowding(role, (prefilling / others, decoding / others))

    def _set_busy(self, worker, busy: bool) -> None:
        changed = worker.busy != busy
        worker.busy = busy
        if changed and self._contended:
            # The other decode workers' runs of steps were timed for the old crowding: they stop
            # at their next boundary and are timed again.
            for other in self.decodes:
                if other is not worker and other.busy:
                    self._wake_decode(other)

    # -- pool changes -------------------------------------------------------------------

    def _change_pools(self, change: PoolChange) -> None:
        self._resize(self.prefills, change.num_prefill, "prefill")
        self._resize(self.decodes, change.num_decode, "decode")
        if self._contended:  # more or fewer workers beside them: runs timed for the old crowding end at their next step
            for worker in self.decodes:
                if worker.busy:
                    self._wake_decode(worker)

    def _resize(self, workers: list, size: int, role: str) -> None:
        routable = [w for w in workers if w.routable]
        # Workers still loading count: a change that landed as they were about to come up added
        # as many again (a day's hour that grew one pool and shrank the other).
        starting = [w for w in workers if w.starting]
        while starting and len(routable) + len(starting) > size:
            starting.pop().starting = False  # it never comes up: it holds nothing yet
        for worker in routable[max(0, size - len(starting)):]:
            worker.routable = False  # drains: finishes what it holds, takes nothing new
        for _ in range(size - len(routable) - len(starting)):
            index = len(workers)
            worker = _PrefillWorker(index) if role == "prefill" else _DecodeWorker(index, self.decode_blocks, self.block_size)
            worker.routable, worker.starting = False, True
            workers.append(worker)
            self._push(self.now + self.worker_startup_s, _WORKER_UP, worker)
        if role == "prefill":  # the result reports the largest size each pool reached
            self.num_prefill = max(self.num_prefill, size)
        else:
            self.num_decode = max(self.num_decode, size)

    def _worker_up(self, worker) -> None:
        if not worker.starting:
            return  # a later change took it back while it loaded
        worker.routable, worker.starting = True, False
        if isinstance(worker, _PrefillWorker):
            self._set_queued(worker, worker.queued_tokens)
        else:
            self._push_decode_load(worker)
        if self._router_queue:
            self._retry_router_queue()

    @property
    def pool_sizes(self) -> tuple[int, int]:
        return sum(1 for w in self.prefills if w.routable), sum(1 for w in self.decodes if w.routable)


def _queued_tokens(worker: _PrefillWorker) -> int:
    return worker.queued_tokens


def _arrival_order(request: _Request) -> int:
    return request.order


def _last_decoding(worker: _DecodeWorker) -> _Request:
    """The running sequence that arrived last (the engine preempts it first)."""
    return max((entry[2] for entry in worker.running), key=_arrival_order)


def _last_started(worker: _DecodeWorker) -> _Request | None:
    """The part-computed prompt that arrived last (``prefilling`` is kept in arrival order)."""
    return next((request for request in reversed(worker.prefilling) if request.held), None)


# A decode worker's load as each routing policy ranks it (the lowest is picked; ties: the lower
# index, as the router's ``min`` over its list). ``kv_aware`` without cache hits ranks by the
# prompt tokens assigned (``router.routing.KVAware``); round robin does not rank (its own path, no heap).
_DECODE_LOADS = {
    RoutingPolicy.KV_AWARE: lambda w: (w.assigned_tokens, w.num_assigned),
    RoutingPolicy.LEAST_LOADED: lambda w: (w.num_assigned, 0),
}


def _run_s(first_step_s: float, growth_s: float, steps: int) -> float:
    """How long ``steps`` decode steps take when each takes ``growth_s`` longer than the one before."""
    return steps * first_step_s + growth_s * steps * (steps - 1) / 2


def simulate(profile: Profile, workload, num_prefill: int, num_decode: int, **options) -> SimResult:
    """Run ``workload`` (a ``WorkloadModel``) through a deployment of that shape."""
    pool_changes = options.pop("pool_changes", ())
    return Simulation(profile, num_prefill, num_decode, **options).run(workload.requests(), pool_changes)
