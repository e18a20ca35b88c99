"""What every scenario shares: the model, Ray, launching a local cluster, and the outcome.

Scenarios compare clusters on the same hardware by launching them one after the other in
this process (router on a background loop, actors on the local Ray instance), each actor
with one torch thread. Without ``--model`` the model is a random-weight checkpoint of
SmolLM2-135M's shape with a byte-level tokenizer: realistic compute per token, nothing to
download. Prompts are token ids, so the tokenizer only matters for detokenizing output.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from router.config import Disaggregation, RouterConfig
from router.pool import RoutingPolicy

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScenarioOutcome:
    """What the CLI prints and where the results went."""

    name: str
    lines: list[str]  # the ratio the scenario is about, first, then supporting figures
    json_path: Path
    ratios: dict[str, float | None] = field(default_factory=dict)
    ok: bool = True


@dataclass(slots=True)
class ClusterShape:
    """One cluster a scenario launches."""

    label: str
    num_prefill: int
    num_decode: int
    disaggregation: Disaggregation
    prefill_engine: EngineConfig
    decode_engine: EngineConfig
    routing_policy: RoutingPolicy | None = None  # None: the router's default
    kv_overlap_weight: float | None = None  # kv_aware: None, the router's default
    router_overrides: dict[str, Any] = field(default_factory=dict)  # other RouterConfig fields
    transfer: Any = None  # a kvtransfer.agent.KVTransferConfig (None: the default)
    router_replicas: int = 1  # routers serving the cluster (more than one: durable workers, replicas following them)

    def describe(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "num_prefill": self.num_prefill,
            "num_decode": self.num_decode,
            "disaggregation": self.disaggregation.value,
            "prefill_chunk": self.prefill_engine.long_prefill_chunk,
            "prefill_token_budget": self.prefill_engine.max_num_batched_tokens,
            "decode_chunk": self.decode_engine.long_prefill_chunk,
            "decode_token_budget": self.decode_engine.max_num_batched_tokens,
            "prefix_caching": [self.prefill_engine.enable_prefix_caching, self.decode_engine.enable_prefix_caching],
            "routing_policy": (self.routing_policy or RouterConfig().routing_policy).value,
            "kv_overlap_weight": self.kv_overlap_weight if self.kv_overlap_weight is not None else RouterConfig().kv_overlap_weight,
            "router": {k: getattr(v, "value", v) for k, v in self.router_overrides.items()},
        }


def engine_config(dtype: str, token_budget: int, chunk: int | None, kv_cache_bytes: int = 512 * 2**20, seed: int = 0) -> EngineConfig:
    # One torch thread per actor: on a small machine the actors, not intra-op threads,
    # should divide the cores, so that every cluster compared gets the same share.
    return EngineConfig(dtype=dtype, num_threads=1, max_num_batched_tokens=token_budget, long_prefill_chunk=chunk, kv_cache_bytes=kv_cache_bytes, seed=seed)


@contextlib.contextmanager
def scenario_model(model: Path | None, dtype: str, seed: int = 0, shape: dict | None = None) -> Iterator[Path]:
    """``model`` if given, else a random checkpoint of ``shape`` (SmolLM2-135M's by default) in a
    temporary directory."""
    if model is not None:
        if not (Path(model) / "config.json").is_file():
            raise ValueError(f"model: {model} is not a model directory (no config.json)")
        yield Path(model)
        return
    import torch

    from cluster.serving_bench import _write_byte_tokenizer  # the serving microbenchmark's byte tokenizer
    from engine.bench import SMOLLM2_135M_SHAPE, write_random_checkpoint

    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as tmp:
        model_dir = write_random_checkpoint(Path(tmp) / "random-checkpoint", shape or SMOLLM2_135M_SHAPE, getattr(torch, dtype), seed=seed)
        _write_byte_tokenizer(model_dir)
        yield model_dir


@contextlib.contextmanager
def ray_running() -> Iterator[None]:
    """A local Ray instance for the scenario, unless one is already up (then it is left up)."""
    import ray

    if ray.is_initialized():
        yield
        return
    from cluster.local_ray import confine_to_loopback

    # address="local": always a fresh instance of our own, never a cluster someone else
    # left running on this machine (ray.init() would silently join it). It listens on
    # loopback only, and so do the actors' NIXL transfers.
    confine_to_loopback()
    ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


@contextlib.contextmanager
def local_cluster(model_dir: Path, shape: ClusterShape, actor_num_cpus: float = 0.0) -> Iterator[Any]:
    """Start ``shape`` on the local Ray instance; yield the Deployment (its ``address`` is the router's)."""
    from cluster.deployment import Deployment, DeploymentSpec, PoolSpec

    spec = DeploymentSpec(
        model_path=model_dir,
        prefill=PoolSpec(shape.num_prefill, shape.prefill_engine, num_cpus=actor_num_cpus),
        decode=PoolSpec(shape.num_decode, shape.decode_engine, num_cpus=actor_num_cpus),
        router=RouterConfig(disaggregation=shape.disaggregation, **shape.router_overrides),
    )
    if shape.transfer is not None:
        spec.transfer = shape.transfer
    if shape.router_replicas > 1:
        spec.router_replicas = shape.router_replicas
        spec.durable_workers = True  # replicas find the workers by name
    if shape.routing_policy is not None:
        spec.router.routing_policy = shape.routing_policy
    if shape.kv_overlap_weight is not None:
        spec.router.kv_overlap_weight = shape.kv_overlap_weight
    deployment = Deployment(spec)
    logger.info("starting cluster %s: %d prefill, %d decode, %s", shape.label, shape.num_prefill, shape.num_decode, shape.disaggregation.value)
    try:
        deployment.start()
        yield deployment
    finally:
        deployment.stop()


def int_list(text: str) -> list[int]:
    """A flag's comma-separated integers, each >= 1 (argparse ``type``)."""
    import argparse

    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"a comma-separated list of integers >= 1, got {text!r}")
    return values


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def fmt(value: float | None, unit: str = "", digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{unit}"


def flags_of(args: Any) -> dict[str, Any]:
    """A scenario's flags for its JSON (paths as strings, the CLI's handler left out)."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if not callable(v)}
