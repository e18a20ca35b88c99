"""Typed messages between the router and a decode actor."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams
from engine.sampling_params import TokenLogprob
from engine.stats import EngineStats, WorkerState
from workers.pipeline import PipelineStage


# Errors a worker raises that the router catches (raised across Ray as the cause of a RayTaskError).


class DecodeCapacityError(RuntimeError):
    """The decode actor cannot take this request now (no free blocks, or draining)."""


class DecodeAbortedError(RuntimeError):
    """This attempt of the request was aborted before it arrived here (calls ran out of order)."""


class PrefixNotHeldError(RuntimeError):
    """A local prompt sent on the promise of a cached prefix (``DecodeRequest.only_if_cached``)
    whose prefix this actor's cache does not hold (evicted, or caching off)."""


class PrefixCachingOffError(PrefixNotHeldError):
    """``PrefixNotHeldError`` of an actor that keeps no prefix cache at all."""


@dataclass(slots=True)
class DecodeRequest:
    """A request for a decode actor: prefilled remotely (KV arrives) or locally."""

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    lease_s: float | None = None  # remote only: how long the reservation may wait for KV
    attempt: int = 0  # the router's dispatch attempt; echoed in every output of this request
    # The router that sent it: only that router's ``poll_outputs`` returns its outputs, and if
    # that router is not heard from for ``router_lease_s`` (it died) the request is dropped.
    router_id: str = ""
    router_lease_s: float | None = None
    num_writers: int = 1  # remote only: the prefill actors writing the KV (a pipeline's stages, each its layers)
    # Remote only: this actor computes the last stage of a pipelined prefill (its layers of the
    # prompt, from the previous stage's activations, straight into the reservation) and samples
    # the first token; ``num_writers`` counts the prefill stages before it.
    stage: PipelineStage | None = None
    # Local only: taken only where this actor's prefix cache holds all of the prompt but its last
    # block or so (PrefixNotHeldError otherwise), as for a choice of an ``n`` request sent where
    # its first choice's prompt was just computed.
    only_if_cached: bool = False


@dataclass(slots=True)
class DecodeTiming:
    """What the decode actor measured for one request, in milliseconds."""

    decode_queue_ms: float = 0.0  # KV landed (or arrival, for local prefill) -> first scheduled
    local_prefill_ms: float = 0.0  # prompt compute on the decode actor (local prefill only)
    decode_ms: float = 0.0  # first token -> last token
    num_cached_tokens: int = 0  # prompt tokens whose KV this actor's prefix cache held
    # Speculative decoding (engine.speculation): decode steps the request took part in, draft
    # tokens proposed for it, and how many of those the model confirmed.
    num_decode_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0


@dataclass(slots=True)
class SeqOutput:
    """New tokens of one sequence from one step; the first and the last carry timing (the last
    its finish)."""

    req_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # FinishReason value, or "error"
    error: str | None = None
    error_field: str | None = None  # the request field whose values left nothing to compute (the client's error)
    timing: DecodeTiming | None = None
    attempt: int = 0  # the dispatch attempt it belongs to: a restarted request ignores older ones
    # On the first output of a request this actor prefilled itself, where it asked for them:
    # prompt token i + 1's log-probability at i (SamplingParams.prompt_logprobs).
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class DecodeReport:
    """What one ``poll_outputs`` returns: new outputs, and room for new requests right now."""

    outputs: list[SeqOutput]
    num_reservable_blocks: int  # free blocks beyond the watermark kept for running sequences
    num_kv_blocks: int | None = None  # the whole cache: the most one reservation could ever take


@dataclass(slots=True)
class DecodeStatus:
    worker_id: str
    state: WorkerState
    epoch: str
    node: str
    engine: EngineStats
    num_awaiting_kv: int  # reservations whose KV is still arriving
    num_active_requests: int  # everything the router may still hear about
    num_orphans_aborted: int = 0  # requests dropped because their router fell silent (died)
    rank_nodes: list[str] = field(default_factory=list)  # each tensor-parallel rank's node, rank 0 first
