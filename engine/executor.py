"""How an engine runs its model: in this process, or over the ranks of a tensor-parallel group.

The engine (one scheduler, one block manager, one sampler) hands each scheduled batch to its
executor and gets logits back; it never knows how many ranks computed them.

- ``LocalExecutor``: the whole model in this process (tensor_parallel_size 1).
- ``MultiRankExecutor``: this process is rank 0 of a group; each step's inputs are broadcast
  to the other ranks (``engine.parallel.rank``), every rank runs its shard (all-reduces inside
  the layers), and rank 0 gathers the logits. Each rank holds its shard of the weights and of
  the KV cache, with the same block ids: the block manager's decisions hold for all of them.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from engine.errors import ModelLoadError
from engine.lora import install_adapter, remove_adapter
from engine.model import CausalLM, StageActivations
from engine.model_runner import ModelRunner, StepInput
from engine.parallel.group import RankFailedError, TPGroup
from engine.scheduler import ScheduledBatch

logger = logging.getLogger(__name__)

STOP = None  # what rank 0 broadcasts to end the other ranks' loops


@dataclass(slots=True)
class StageStep:
    """What rank 0 broadcasts for a pipeline stage's step: its inputs, the layers it computes
    and the previous stage's activations (every rank holds them whole)."""

    step: StepInput
    layers: range
    incoming: StageActivations | None


@dataclass(slots=True)
class AdapterChange:
    """What rank 0 broadcasts to load a LoRA adapter into a slot (each rank its slices), or,
    with no directory, to free the slot."""

    slot: int
    adapter_dir: str | None

    def apply(self, model: CausalLM, dtype: torch.dtype, device: str) -> None:
        if self.adapter_dir is None:
            remove_adapter(model, self.slot)
        else:
            install_adapter(model, self.slot, self.adapter_dir, dtype, device)

    def apply_on_rank(self, model: CausalLM, dtype: torch.dtype, device: str, group: TPGroup) -> BaseException | None:
        """Apply on this rank, then agree with every other rank on whether all did (an all-reduce
        of failures); a rank that failed freed the slot. Returns this rank's error, if any; a
        failure elsewhere is reported to rank 0 as ModelLoadError."""
        error = None
        try:
            self.apply(model, dtype, device)
        except Exception as exc:  # an adapter this rank cannot read or hold
            error = exc
        # On the model's device: an NCCL group reduces CUDA tensors only (a host one raised, and
        # every rank took the group for broken).
        failures = group.all_reduce(torch.tensor([0.0 if error is None else 1.0], device=device))
        if failures.item() > 0:
            remove_adapter(model, self.slot)  # every rank, so none computes with a part of it
            if error is None:
                error = ModelLoadError(f"LoRA adapter {self.adapter_dir}: {int(failures.item())} tensor-parallel rank(s) could not load their slices")
        return error


class Executor(ABC):
    """Runs a scheduled batch through the model; ``runner`` is this process's (rank 0's)."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    @property
    def tp_size(self) -> int:
        return 1

    @abstractmethod
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits [rows sampled this step, vocab] in slice order, then the rows that score prompts
        whose log-probabilities are asked for (``ModelRunner.prepare``)."""

    @abstractmethod
    def execute_stage(self, batch: ScheduledBatch, layers: range, incoming: StageActivations | None) -> torch.Tensor | StageActivations:
        """Layers ``layers`` of the batch (a pipeline stage): its activations, or through the
        last layer, its logits."""

    def change_adapter(self, change: AdapterChange, dtype: torch.dtype) -> None:
        """Load or free a LoRA adapter slot on every rank."""
        change.apply(self.runner.model, dtype, self.runner.device)

    def close(self) -> None:
        """Release the ranks (if any)."""


class LocalExecutor(Executor):
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        return self.runner.execute(batch)

    def execute_stage(self, batch: ScheduledBatch, layers: range, incoming: StageActivations | None) -> torch.Tensor | StageActivations:
        return self.runner.run_stage(self.runner.prepare(batch), layers, incoming)


class MultiRankExecutor(Executor):
    """Rank 0 of ``group``: broadcasts each step, computes its shard, returns the gathered logits.

    A failed collective means another rank is gone, and a step that failed on some ranks only
    leaves them out of step (``TPGroup.run_step``): either way ``RankFailedError`` propagates and
    the worker ends, never failing a request for it. A step that failed on every rank alike
    raises its own error, which the engine isolates per request as with one rank.
    """

    def __init__(self, runner: ModelRunner, group: TPGroup):
        super().__init__(runner)
        self.group = group
        self._closed = False

    @property
    def tp_size(self) -> int:
        return self.group.world_size

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        step = self.runner.prepare(batch)
        self.group.broadcast_from_first(step)
        return self.group.run_step(lambda: self.runner.run(step))

    def change_adapter(self, change: AdapterChange, dtype: torch.dtype) -> None:
        self.group.broadcast_from_first(change)
        error = change.apply_on_rank(self.runner.model, dtype, self.runner.device, self.group)
        if error is not None:
            raise error

    def execute_stage(self, batch: ScheduledBatch, layers: range, incoming: StageActivations | None) -> torch.Tensor | StageActivations:
        stage = StageStep(self.runner.prepare(batch), layers, incoming)
        self.group.broadcast_from_first(stage)
        return self.group.run_step(lambda: self.runner.run_stage(stage.step, layers, incoming))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.group.broadcast_from_first(STOP)
        except RankFailedError:
            logger.info("ranks already gone at close")
        self.group.close()
