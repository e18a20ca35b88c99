"""A Ray instance for this machine alone: every listener it opens binds loopback.

Left to itself, a Ray instance started by ``ray.init()`` takes the host's LAN address as its
node address and its GCS, raylet, workers and agents listen on every interface. Ray keeps to
loopback when it runs as a single-machine instance (its mode for laptops without cluster
support); ``confine_to_loopback`` selects that mode for the Ray this process starts and for
every process that Ray spawns, since they inherit the environment. It also keeps NIXL's UCX
transport in those processes on the loopback device, unless UCX_NET_DEVICES says otherwise,
and has that Ray start no idle worker processes ahead of the first task.
"""

from __future__ import annotations

import os
import sys

# Ray reads it once, at import (ray._private.ray_constants.ENABLE_RAY_CLUSTER).
_SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_UCX_DEVICES_ENV = "UCX_NET_DEVICES"
# Ray starts this many idle workers (one per CPU, at most its start-up concurrency: 2 here) when
# the first driver connects, for tasks to come. pdserve's actors each take a process of their
# own, so on one machine those sat idle for the instance's life: about 2 s of CPU each to start,
# then 1% of a core each (measured on a 2-core host), and their memory.
_PRESTART_ENV = "RAY_prestart_worker_first_driver"


def confine_to_loopback() -> None:
    """Make a Ray instance this process starts (and its processes) listen on loopback only."""
    os.environ[_SINGLE_MACHINE_ENV] = "0"
    os.environ.setdefault(_UCX_DEVICES_ENV, "lo")
    os.environ.setdefault(_PRESTART_ENV, "0")
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:  # ray was imported already: its constant was read
        constants.ENABLE_RAY_CLUSTER = False


def release_loopback_confinement() -> None:
    """Stop passing Ray's single-machine mode on to processes started from now on (a Ray
    already started keeps it; UCX stays on loopback)."""
    os.environ.pop(_SINGLE_MACHINE_ENV, None)
