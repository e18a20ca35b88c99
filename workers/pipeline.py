"""Typed messages of a pipelined prefill (distributed split-fuse) between its stages' actors:
prefill actors, and the decode actor when it computes the last stage (``router.pipeline``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtransfer.messages import ActivationSlots


@dataclass(slots=True)
class PipelineStage:
    """One actor's part of a pipelined prefill (distributed split-fuse): layers
    [layer_start, layer_stop) of every chunk, from the previous stage's activations (stage 0
    embeds the tokens), handing its own to ``next_stage`` (None: the last stage, which samples)."""

    index: int
    num_stages: int
    layer_start: int
    layer_stop: int
    next_stage: Any = None  # the next stage's actor handle (a prefill actor, or the decode actor computing the last stage)
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
    def of(cls, req_id: str, token: int, start: int, activations: Any, skip: int = 0) -> StageChunk:
        """From ``engine.model.StageActivations`` of tokens from ``start``, less the first ``skip``
        (the next stage holds those cached), as numpy arrays: Ray moves those through its object
        store without pickling their bytes."""
        hidden, residual = activations.hidden[skip:], activations.residual[skip:] if activations.residual is not None else None
        return cls(req_id, token, start + skip, hidden.shape[0], _as_array(hidden), _as_array(residual) if residual is not None else None,
                   str(hidden.dtype).removeprefix("torch."))

    def activations(self, device: Any = "cpu") -> Any:
        """As the engine takes them (``engine.model.StageActivations``) on ``device``, in writable
        memory: the arrays may be read-only views of Ray's object store, and the layers update the
        residual in place."""
        from engine.model import StageActivations

        residual = _as_tensor(self.residual, self.dtype, device) if self.residual is not None else None
        return StageActivations(_as_tensor(self.hidden, self.dtype, device), residual)


def _as_array(tensor: Any) -> Any:
    """In host memory (a GPU stage's activations cross Ray as host arrays)."""
    import torch

    tensor = tensor.detach().contiguous().cpu()
    return (tensor.view(torch.int16) if tensor.dtype in (torch.bfloat16, torch.float16) else tensor).numpy()


def _as_tensor(array: Any, dtype: str, device: Any) -> Any:
    import torch

    tensor = torch.tensor(array)  # a copy
    tensor = tensor.view(getattr(torch, dtype)) if dtype in ("bfloat16", "float16") else tensor
    return tensor.to(device)


@dataclass(slots=True)
class StageOpened:
    """What opening a stage says: how much of the prompt its prefix cache holds (of its layers),
    and where the previous stage writes its activations over NIXL (None: over Ray)."""

    num_cached_tokens: int
    inbox: ActivationSlots | None = None


def inbox_chunks(num_tokens: int, chunk_tokens: int) -> int:
    """Chunks a stage may receive for a prompt of ``num_tokens``: one per chunk the stage before
    computes, however far into the prompt it starts (a later stage's cached prefix trims a
    chunk's head, never splits it). (One more, as it was, asked 17 slots of 16 for an 8k prompt
    in 512-token chunks: its every chunk went over Ray.)"""
    return -(-num_tokens // chunk_tokens)
