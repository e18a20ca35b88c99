"""The default KV cache size of an actor, measured on the machine the actor runs on.

``pdserve up`` without ``kv_cache_mb`` gives each pool a ``KVMemoryPolicy``; the pool
manager then creates ``KVSized*Worker`` actors, whose constructor measures the node's (or
the GPU's) memory, applies ``default_kv_cache_bytes`` and hands the engine an explicit
``kv_cache_bytes`` before any weight is loaded. An explicit ``kv_cache_mb`` skips all this.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path

from decode_workers.worker import DecodeWorker
from engine.config import EngineConfig, ModelConfig
from engine.device_caps import resolve_dtype
from engine.model_source import resolve_model
from prefill_workers.worker import PrefillWorker
from workers.base import configure_worker_logging

logger = logging.getLogger(__name__)

MiB = 2**20
GiB = 2**30


@dataclass(slots=True, frozen=True)
class KVMemoryPolicy:
    """How an actor sizes its KV cache; travels to the actor with its engine config."""

    gpu_memory_utilization: float = 0.9  # share of the GPU's total memory this actor may use
    host_memory_fraction: float = 0.5  # share of the host's available memory for all KV caches
    max_host_bytes: int = 16 * GiB  # per actor, on CPU
    min_bytes: int = 64 * MiB
    num_sharing: int = 1  # actors starting at once on the same node (CPU) or GPU


@dataclass(slots=True, frozen=True)
class MemoryFigures:
    """What the actor measured (bytes) and what its engine will need besides the KV cache."""

    device: str  # "cpu" or "cuda"
    host_available: int = 0
    gpu_total: int = 0
    gpu_free: int = 0
    weight_bytes: int = 0
    activation_bytes: int = 0
    max_useful_bytes: int | None = None  # max_num_seqs sequences of max_model_len tokens


def default_kv_cache_bytes(policy: KVMemoryPolicy, figures: MemoryFigures) -> int:
    """The KV cache bytes for one actor, sized from its machine as vLLM sizes it.

    CUDA: an even share (when several actors share the GPU) of ``gpu_memory_utilization`` of
    the GPU's total memory, at most what is free of it beyond the other ``1 - utilization``,
    less this actor's weights and an activation reserve for one full token budget. The share
    is not cut by what the GPU's other actors already hold: a replacement that starts beside
    a running one takes the same share as the one it replaces (subtracting the survivor's
    memory and then splitting again left it 64 MiB of an 80 GiB GPU).
    CPU: ``host_memory_fraction`` of the host's available memory when the actor starts,
    split evenly among the actors starting on the node at once, less this actor's weights
    and activation reserve, and at most ``max_host_bytes`` (a 2-core host gains nothing from
    hundreds of GiB of cache, and zeroing and registering it would slow start-up).
    Both: never less than ``min_bytes`` (a tight machine still starts; the engine refuses
    requests that do not fit), never more than ``max_useful_bytes`` (more blocks than
    ``max_num_seqs`` full-length sequences could ever use).
    """
    sharing = max(1, policy.num_sharing)
    overhead = figures.weight_bytes + figures.activation_bytes
    if figures.device == "cuda":
        share = figures.gpu_total * policy.gpu_memory_utilization / sharing
        free_within_utilization = figures.gpu_free - figures.gpu_total * (1 - policy.gpu_memory_utilization)
        budget = min(share, free_within_utilization) - overhead
    else:
        budget = min(figures.host_available * policy.host_memory_fraction / sharing - overhead, policy.max_host_bytes)
    budget = max(budget, policy.min_bytes)
    if figures.max_useful_bytes is not None:
        budget = min(budget, figures.max_useful_bytes)
    return int(budget)


def _read_bytes(model_dir: Path) -> int:
    """The size of the weight files the loader reads (not a repository's other copies: .bin
    files, a consolidated file beside an index, which counted twice took a 7B model's KV cache
    down to its floor on a 24 GB GPU)."""
    from engine.loader import checkpoint_files

    return sum((model_dir / name).stat().st_size for name in checkpoint_files(model_dir))


def measure(engine_config: EngineConfig, model_path: str | Path) -> MemoryFigures:
    """Measure this process's machine and estimate the engine's own needs (no weight is loaded),
    per tensor-parallel rank: its shard of the weights, a KV cache of its KV heads."""
    from engine.parallel.shard import TPShard

    model = ModelConfig.from_model_dir(Path(model_path))
    shard = TPShard.of(model, engine_config.tensor_parallel_size)  # a rank's share: its weights, its KV heads
    elem = _element_size(engine_config.dtype, model, engine_config.device)
    checkpoint_elem = model.checkpoint_dtype.itemsize
    checkpoint_bytes = _read_bytes(Path(model_path))
    activation = activation_bytes(engine_config, model, elem)
    max_model_len = engine_config.max_model_len or model.max_position_embeddings
    bytes_per_token = model.num_layers * 2 * shard.num_kv_heads * model.head_dim * elem
    block_size = engine_config.block_size
    max_useful = engine_config.max_num_seqs * math.ceil(max_model_len / block_size) * block_size * bytes_per_token
    weight_bytes = checkpoint_bytes * elem // checkpoint_elem // shard.tp_size
    draft = engine_config.speculative.draft_model if engine_config.speculative is not None else None
    if draft:  # the draft model's weights sit beside the target's (whole on rank 0)
        draft_model = ModelConfig.from_model_dir(Path(draft))
        weight_bytes += _read_bytes(Path(draft)) * elem // draft_model.checkpoint_dtype.itemsize
    figures = dict(
        device="cuda" if str(engine_config.device).startswith("cuda") else "cpu",
        weight_bytes=weight_bytes,
        activation_bytes=activation,
        max_useful_bytes=max_useful,
    )
    if figures["device"] == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(engine_config.device))
        return MemoryFigures(gpu_total=total, gpu_free=free, **figures)
    return MemoryFigures(host_available=host_available_bytes(), **figures)


def activation_bytes(engine_config: EngineConfig, model: ModelConfig, elem: int) -> int:
    """What a step needs beside weights and KV: float32 logits for a whole token budget plus a
    few hidden-wide and MLP-wide buffers. On CUDA also FlashInfer's scratch and the decode
    graphs' memory (engine.cuda_graphs: one float32 logits buffer for the largest bucket, and
    that bucket's activations in the graphs' pool, which eager steps cannot reuse)."""
    per_token = 4 * model.vocab_size + 4 * elem * max(model.hidden_size, model.intermediate_size)
    activation = engine_config.max_num_batched_tokens * per_token
    if str(engine_config.device).startswith("cuda"):
        from engine.attention.flashinfer_paged import WORKSPACE_BYTES

        activation += WORKSPACE_BYTES
        if engine_config.cuda_graph_max_batch > 0 and engine_config.tensor_parallel_size == 1:
            activation += min(engine_config.cuda_graph_max_batch, engine_config.max_num_seqs) * per_token
    return activation


def host_available_bytes() -> int:
    """Memory this process can still take: MemAvailable, lowered by a cgroup limit if one is set."""
    available = _meminfo_kib("MemAvailable") * 1024
    for limit_path, usage_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),  # v1
    ):
        try:
            limit_text = Path(limit_path).read_text().strip()
            usage = int(Path(usage_path).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text != "max" and int(limit_text) < 2**60:
            available = min(available, int(limit_text) - usage)
    return max(0, available)


def sized_engine_config(engine_config: EngineConfig, model_path: str, policy: KVMemoryPolicy, worker_id: str) -> EngineConfig:
    """``engine_config`` with ``kv_cache_bytes`` chosen for this machine (logged)."""
    figures = measure(engine_config, resolve_model(model_path).path)  # a Hugging Face id: this node's cache
    kv_bytes = default_kv_cache_bytes(policy, figures)
    logger.info(
        "%s: KV cache %.1f MiB (device %s, host available %.0f MiB, GPU free/total %.0f/%.0f MiB, "
        "weights ~%.0f MiB, %d actors sharing, useful at most %.0f MiB)",
        worker_id, kv_bytes / MiB, figures.device, figures.host_available / MiB, figures.gpu_free / MiB,
        figures.gpu_total / MiB, figures.weight_bytes / MiB, policy.num_sharing, (figures.max_useful_bytes or 0) / MiB,
    )
    return replace(engine_config, kv_cache_bytes=kv_bytes, num_kv_blocks=None)


class KVSizedPrefillWorker(PrefillWorker):
    """A prefill actor whose KV cache is sized from the node it runs on."""

    def __init__(self, worker_id: str, model_path: str, engine_config: EngineConfig, transfer_config=None, kv_memory: KVMemoryPolicy | None = None,
                 adapter_files: dict | None = None):
        configure_worker_logging()  # before the sizing, which logs what it measured
        if kv_memory is not None:
            engine_config = sized_engine_config(engine_config, model_path, kv_memory, worker_id)
        super().__init__(worker_id, model_path, engine_config, transfer_config, adapter_files)


class KVSizedDecodeWorker(DecodeWorker):
    """A decode actor whose KV cache is sized from the node it runs on."""

    def __init__(self, worker_id: str, model_path: str, engine_config: EngineConfig, transfer_config=None, kv_memory: KVMemoryPolicy | None = None,
                 adapter_files: dict | None = None):
        configure_worker_logging()  # before the sizing, which logs what it measured
        if kv_memory is not None:
            engine_config = sized_engine_config(engine_config, model_path, kv_memory, worker_id)
        super().__init__(worker_id, model_path, engine_config, transfer_config, adapter_files)


def _element_size(dtype: str | None, model: ModelConfig, device: str) -> int:
    """Bytes per weight and KV element, as the engine will resolve ``dtype`` on this device."""
    return resolve_dtype(dtype, model.checkpoint_dtype, device).itemsize


def _meminfo_kib(field: str) -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/meminfo has no {field}")
