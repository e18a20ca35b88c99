"""Code and model on every node: what a multi-node deployment checks before its pools start.

A worker placed on a node that lacks pdserve's code, its libraries (torch, NIXL) or the model
fails there, late, with an error about an actor that died. So before launching, the pool
manager of a cluster of several nodes runs one small probe on each live node (pinned to it)
that imports what a worker imports and resolves the model as a worker would (a Hugging Face id
in that node's own cache); a node that cannot is named with what it lacks, and nothing starts.

The code itself can travel: ``code_runtime_env`` is the Ray runtime environment that ships
pdserve's packages to every node (``pdserve up --address`` uses it when joining a cluster);
libraries cannot, and the probe names the ones missing.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

PACKAGES = ("engine", "kvtransfer", "workers", "prefill_workers", "decode_workers", "router", "cluster")
# What a worker process imports; each failing one is named.
_WORKER_MODULES = ("torch", "engine.llm_engine", "prefill_workers.worker", "decode_workers.worker")
PROBE_TIMEOUT_S = 120.0


class NodeNotReadyError(RuntimeError):
    """Some node of the cluster cannot run pdserve's workers; the message names each and why."""


def code_runtime_env() -> dict:
    """A Ray runtime environment that ships pdserve's packages (this checkout's) to every node."""
    root = Path(__file__).resolve().parents[1]
    return {"py_modules": [str(root / name) for name in PACKAGES], "excludes": ["__pycache__", "*.pyc"]}


def _probe(model: str, backend: str) -> list[str]:
    """Runs on one node: what a worker there would lack."""
    problems = []
    for module in _WORKER_MODULES:
        try:
            importlib.import_module(module)
        except Exception as exc:
            problems.append(f"cannot import {module} ({type(exc).__name__}: {exc})")
    if backend == "nixl":
        try:
            from kvtransfer.backends.nixl import api

            api.load()
        except Exception as exc:
            problems.append(f"no NIXL ({exc})")
    try:
        from engine.model_source import resolve_model

        path = resolve_model(model).path
        if not (path / "config.json").is_file():
            problems.append(f"model {model}: {path} has no config.json")
    except Exception as exc:
        problems.append(f"model {model}: {exc}")
    return problems


async def check_nodes(
    model: str, backend: str, timeout_s: float = PROBE_TIMEOUT_S, can_host: Callable[[dict[str, float]], bool] | None = None
) -> int:
    """Probe every live node that could hold a worker (``can_host`` of its resources; every node
    when None) when the cluster has several; raise NodeNotReadyError naming each node that cannot
    run workers and what it lacks. Returns how many nodes were probed."""
    nodes = [n for n in await asyncio.to_thread(ray.nodes) if n.get("Alive")]
    if len(nodes) < 2:
        return 0  # this process is on the only node, and it imported all of it already
    # A node no pool fits on (a head without the workers' resources) never runs a worker: a
    # probe there would cost seconds of its CPU (it imports torch and the engine) for nothing.
    nodes = [n for n in nodes if can_host is None or can_host(n.get("Resources", {}))]
    probe = ray.remote(num_cpus=0, max_retries=0)(_probe)
    refs = [
        probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(model, backend)
        for n in nodes
    ]
    results = await asyncio.gather(*(asyncio.wait_for(ref, timeout_s) for ref in refs), return_exceptions=True)
    failures = []
    for node, result in zip(nodes, results):
        where = node.get("NodeManagerAddress", node["NodeID"][:8])
        if isinstance(result, BaseException):
            cause = getattr(result, "cause", None) or result
            failures.append(f"node {where}: pdserve's code does not run there ({type(cause).__name__}: {cause}); install pdserve "
                            "on it or ship the code (pdserve up --address ships it unless --no-ship-code)")
        elif result:
            failures.append(f"node {where}: " + "; ".join(result))
    if failures:
        raise NodeNotReadyError("some nodes cannot run pdserve workers:\n  " + "\n  ".join(failures))
    return len(nodes)
