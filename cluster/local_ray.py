"""A Ray instance for this machine alone: every listener it opens binds loopback.

Left to itself, a Ray instance started by ``ray.init()`` takes the host's LAN address as its
node address and its GCS, raylet, workers and agents listen on every interface. Ray keeps to
loopback when it runs as a single-machine instance (its mode for laptops without cluster
support); ``confine_to_loopback`` selects that mode for the Ray this process starts and for
every process that Ray spawns, since they inherit the environment.
"""

from __future__ import annotations

import os
import sys

LOOPBACK = "127.0.0.1"
# Ray reads it once, at import (ray._private.ray_constants.ENABLE_RAY_CLUSTER).
_SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# UCX's network devices for NIXL transfers between the actors of a local deployment.
LOOPBACK_NETWORK_DEVICES = "lo"


def confine_to_loopback() -> None:
    """Make a Ray instance this process starts (and its processes) listen on loopback only."""
    os.environ[_SINGLE_MACHINE_ENV] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:  # ray was imported already: its constant was read
        constants.ENABLE_RAY_CLUSTER = False


def release_loopback_confinement() -> None:
    """Stop passing the confinement on to processes started from now on (a Ray already
    started keeps it)."""
    os.environ.pop(_SINGLE_MACHINE_ENV, None)
