"""Typed messages between the router and a prefill actor."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams
from engine.sampling_params import TokenLogprob
from engine.stats import EngineStats, WorkerState
from kvtransfer.handshake import HandshakeOffer
from kvtransfer.messages import KVDestination
from kvtransfer.path import PathStats
from workers.pipeline import PipelineStage


# Errors a worker raises that the router catches (raised across Ray as the cause of a RayTaskError).


class PrefillUnavailableError(RuntimeError):
    """The prefill actor takes no new requests (draining or stopping)."""


@dataclass(slots=True)
class PrefillRequest:
    """Prefill this prompt and push its KV into ``destination`` (the decode actor's blocks)."""

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    destination: KVDestination
    decode_offer: HandshakeOffer  # connected if this (peer, epoch) is new to the prefill actor
    priority: int = 0
    stage: PipelineStage | None = None  # set: one stage of a pipelined prefill (``open_stage``)


@dataclass(slots=True)
class PrefillTiming:
    """Milliseconds on the prefill actor."""

    queue_ms: float  # arrival -> first chunk scheduled
    compute_ms: float  # first chunk scheduled -> first token sampled
    transfer_ms: float  # first token sampled -> last write completed (the exposed transfer)
    num_chunks: int
    num_bytes: int  # KV bytes pushed (blocks the decode actor held already are not)
    num_cached_tokens: int = 0  # prompt tokens whose KV this actor's prefix cache held


@dataclass(slots=True)
class PrefillResult:
    req_id: str
    first_token_id: int | None  # None from a pipeline stage before the last
    first_logprob: TokenLogprob | None
    timing: PrefillTiming
    # Where the request asked (``SamplingParams.prompt_logprobs``) and this actor computed the
    # prompt's last layers: prompt token i + 1's log-probability at i.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(slots=True)
class PrefillStatus:
    worker_id: str
    state: WorkerState
    epoch: str
    node: str
    engine: EngineStats
    num_transfers_in_flight: int
    rank_nodes: list[str] = field(default_factory=list)  # each tensor-parallel rank's node, rank 0 first
    # Pipeline stages' chunks of activations this actor handed on, since it started: written over
    # NIXL into the next stage's inbox, or sent over Ray (no inbox, or none free).
    num_stage_chunks_over_nixl: int = 0
    num_stage_chunks_over_ray: int = 0
    # Per decode peer: which way its KV goes (shm, rdma, tcp; the device) and what went there.
    transfer_paths: list[PathStats] = field(default_factory=list)
