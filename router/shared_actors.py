"""The actors a deployment's routers share (the responses board, the metrics exchange): one of
each per deployment, named after it, on the node of the router that starts it, restarted by Ray
if its process dies, and found by name by the other routers and by a restarted controller."""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

NAMESPACE = "pdserve"


def start_shared(cls: type, name: str, *args, max_concurrency: int, detached: bool):
    """``cls(*args)`` as the actor ``name`` (the one running already, if any), on this node.
    ``max_concurrency``: calls it serves at once (its methods are coroutines)."""
    options = dict(
        name=name,
        namespace=NAMESPACE,
        num_cpus=0,
        max_concurrency=max_concurrency,
        max_restarts=-1,
        max_task_retries=-1,
        get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
    )
    if detached:
        options["lifetime"] = "detached"
    return ray.remote(cls).options(**options).remote(*args)


def find_shared(name: str):
    """The actor ``name``, or None."""
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None
