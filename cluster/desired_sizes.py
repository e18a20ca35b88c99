"""The pools' desired sizes, kept where a restarted controller finds them.

A durable deployment's controller can die and be restarted by Ray; its workers live on and the
new pool manager adopts them. What it cannot see in them is the size each pool was last scaled
to: a pool scaled down by hand or by the autoscaler, or one short of a worker that died with
the controller, looks the same as one at its size. So every change of a desired size is written
to Ray's key-value store in the GCS (where Ray Serve's controller keeps its own checkpoint),
which outlives every actor, and a manager starting under the same deployment reads it back.

``pdserve up`` forgets the record before it creates a controller (a new deployment starts from
its configuration) and ``pdserve down`` forgets it after stopping one.
"""

from __future__ import annotations

import json
import logging

from ray.experimental import internal_kv

from router.pool import Role

logger = logging.getLogger(__name__)

KV_NAMESPACE = "pdserve"


def _key(deployment_name: str) -> str:
    return f"desired_sizes/{deployment_name}"


def load(deployment_name: str) -> dict[Role, int] | None:
    """The sizes a manager of this deployment last set, or None where none was recorded (or the
    record cannot be read: the manager then goes by its configuration and what it adopts)."""
    try:
        raw = internal_kv._internal_kv_get(_key(deployment_name), namespace=KV_NAMESPACE)
        if raw is None:
            return None
        recorded = json.loads(raw)
        return {role: max(0, int(recorded[role.value])) for role in Role}
    except Exception:
        logger.warning("the recorded pool sizes of %s could not be read; going by the configuration", deployment_name, exc_info=True)
        return None


def save(deployment_name: str, sizes: dict[Role, int]) -> None:
    """Record ``sizes``; a failure to write is logged (a restart would then go by the spec)."""
    try:
        value = json.dumps({role.value: count for role, count in sizes.items()})
        internal_kv._internal_kv_put(_key(deployment_name), value, overwrite=True, namespace=KV_NAMESPACE)
    except Exception:
        logger.warning("recording the pool sizes of %s failed", deployment_name, exc_info=True)


def forget(deployment_name: str) -> None:
    try:
        internal_kv._internal_kv_del(_key(deployment_name), namespace=KV_NAMESPACE)
    except Exception:
        logger.warning("forgetting the recorded pool sizes of %s failed", deployment_name, exc_info=True)
