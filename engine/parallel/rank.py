"""A tensor-parallel rank other than 0: its shard of the model and of the KV cache, and its loop.

A rank's life: it joins its worker's group (``TPGroup.join``), loads only its slices of the
checkpoint, allocates its shard of the KV cache (the same block count as rank 0, its own KV
heads), then waits for rank 0's broadcasts: each ``StepInput`` (or a pipeline stage's ``StageStep``) it runs through its shard (the
layers' all-reduces and the logits' gather meet rank 0's), until ``STOP``. Where it runs (a Ray
actor, a subprocess) is the launcher's business; it knows nothing of either.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.attention import CacheGeometry, select_backend
from engine.config import EngineConfig
from engine.executor import STOP, AdapterChange, StageStep
from engine.kv_cache import KVCache
from engine.loader import load_model
from engine.model import StageActivations
from engine.model_runner import ModelRunner, StepInput
from engine.parallel.group import GroupAddress, RankFailedError, TPGroup

logger = logging.getLogger(__name__)


class ShardRank:
    """Rank ``rank`` (> 0) of a worker whose rank 0 is an ``LLMEngine`` with a ``MultiRankExecutor``."""

    def __init__(self, model_path: str | Path, config: EngineConfig, address: GroupAddress, rank: int):
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        if config.num_kv_blocks is None:
            raise ValueError("num_kv_blocks: rank 0 decides the block count and hands it to every rank")
        self.rank = rank
        config = _own_device(config, rank)
        self.group = TPGroup.join(address, rank)
        loaded = load_model(
            model_path, dtype=config.dtype, device=config.device, max_positions=config.max_model_len,
            prepack_linear=config.prepack_linear, tp_size=address.world_size, group=self.group, lora_adapters=config.lora_adapters,
        )
        shard = loaded.model.shard
        self.kv_cache = KVCache(loaded.config, config, loaded.dtype, num_kv_heads=shard.num_kv_heads)
        attention = select_backend(config.attention_backend, CacheGeometry.of(loaded.config, self.kv_cache, loaded.dtype, config.device, shard.num_heads))
        self.runner = ModelRunner(loaded.model, self.kv_cache, config.device, attention)
        self.dtype = loaded.dtype
        self.num_steps = 0

    def serve(self) -> None:
        """Run rank 0's steps until it says stop (or the group breaks: RankFailedError)."""
        while True:
            step = self.group.broadcast_from_first()
            if step is STOP:
                break
            if isinstance(step, AdapterChange):  # a LoRA adapter loaded or unloaded at runtime
                error = step.apply_on_rank(self.runner.model, self.dtype, self.runner.device, self.group)
                if error is not None:
                    logger.error("rank %d: LoRA adapter %s not loaded: %r", self.rank, step.adapter_dir, error)
                continue
            try:
                self.group.run_step(lambda: self._run(step))
            except RankFailedError:
                raise
            except Exception:
                # Every rank met it (run_step): rank 0 runs the batch's sequences again one at
                # a time, and this rank follows its broadcasts.
                logger.exception("rank %d: a step failed", self.rank)
            self.num_steps += 1
        self.group.close()
        logger.info("rank %d: stopped after %d steps", self.rank, self.num_steps)

    def _run(self, step: StepInput | StageStep) -> None:
        if isinstance(step, StageStep):  # a pipeline stage's step: only its layers
            self.runner.run_stage(step.step, step.layers, _on_device(step.incoming, self.runner.device))
        else:
            self.runner.run(step)


def _on_device(incoming: StageActivations | None, device: str) -> StageActivations | None:
    """Rank 0's activations on this rank's device: broadcast, they unpickle onto rank 0's GPU
    (cuda:0), and a rank started as a plain process computes on cuda:<rank>."""
    if incoming is None or incoming.hidden.device == torch.device(device):
        return incoming
    residual = incoming.residual.to(device) if incoming.residual is not None else None
    return StageActivations(incoming.hidden.to(device), residual)


def _own_device(config: EngineConfig, rank: int) -> EngineConfig:
    """On CUDA each rank needs its own GPU: a Ray actor sees only its own (cuda:0 is it); ranks
    started as plain processes on one machine see them all and take cuda:<rank>."""
    if config.device != "cuda" or not torch.cuda.is_available() or torch.cuda.device_count() <= rank:
        return config
    import dataclasses

    device = f"cuda:{rank}"
    torch.cuda.set_device(device)
    return dataclasses.replace(config, device=device)
