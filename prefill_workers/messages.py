"""Typed messages between the router and a prefill actor."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import SamplingParams
from engine.sequence import TokenLogprob
from engine.stats import EngineStats, WorkerState
from kvtransfer.handshake import HandshakeOffer
from kvtransfer.messages import KVDestination


@dataclass(slots=True)
class PipelineStage:
    """This prefill actor's part of a pipelined prefill (distributed split-fuse): layers
    [layer_start, layer_stop) of every chunk, from the previous stage's activations (stage 0
    embeds the tokens), handing its own to ``next_stage`` (None: the last stage, which samples)."""

    index: int
    num_stages: int
    layer_start: int
    layer_stop: int
    next_stage: Any = None  # the next stage's prefill actor handle
    # Stage 0 cuts the prompt into chunks of this many tokens. (Uniform: with stages of equal
    # speed, a pipeline's fill plus drain is one largest chunk whatever the schedule; chunks that
    # start and end small measured the same on an 8k prompt.)
    chunk_tokens: int = 512

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_stop)


    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def salt(self) -> bytes:
        """What this stage's prefix-cache entries are salted with (they hold only its layers)."""
        return f"layers:{self.layer_start}-{self.layer_stop}".encode()


@dataclass(slots=True)
class StageChunk:
    """One chunk's activations from a stage to the next: tokens [start, start + num_tokens)."""

    req_id: str
    token: int  # the decode reservation's: which attempt of the request
    start: int
    num_tokens: int
    hidden: Any  # numpy array [num_tokens, hidden] (of the raw bits, for dtypes numpy lacks)
    residual: Any  # numpy array [num_tokens, hidden], or None
    dtype: str = "float32"  # the tensors' torch dtype

    @classmethod
    def of(cls, req_id: str, token: int, start: int, activations: Any) -> StageChunk:
        """From ``engine.model.StageActivations``, as numpy arrays: Ray moves those through its
        object store without pickling their bytes."""
        hidden, residual = activations.hidden, activations.residual
        return cls(req_id, token, start, hidden.shape[0], _as_array(hidden), _as_array(residual) if residual is not None else None,
                   str(hidden.dtype).removeprefix("torch."))

    def activations(self) -> Any:
        """As the engine takes them (``engine.model.StageActivations``), in writable memory: the
        arrays may be read-only views of Ray's object store, and the layers update the residual
        in place."""
        from engine.model import StageActivations

        residual = _as_tensor(self.residual, self.dtype) if self.residual is not None else None
        return StageActivations(_as_tensor(self.hidden, self.dtype), residual)


def _as_array(tensor: Any) -> Any:
    import torch

    if tensor.dtype in (torch.bfloat16, torch.float16):
        return tensor.contiguous().view(torch.int16).numpy()
    return tensor.contiguous().numpy()


def _as_tensor(array: Any, dtype: str) -> Any:
    import torch

    tensor = torch.tensor(array)  # a copy
    return tensor.view(getattr(torch, dtype)) if dtype in ("bfloat16", "float16") else tensor


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


@dataclass(slots=True)
class PrefillStatus:
    worker_id: str
    state: WorkerState
    epoch: str
    node: str
    engine: EngineStats
    num_transfers_in_flight: int
    rank_nodes: list[str] = field(default_factory=list)  # each tensor-parallel rank's node, rank 0 first
