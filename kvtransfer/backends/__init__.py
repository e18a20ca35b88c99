"""Transfer backends, a folder each; ``make_transport`` builds the one a config names.

- ``nixl`` (default): one-sided UCX writes straight into the peer's registered memory; the
  notification arrives after the bytes.
- ``ray``: the writer puts the bytes in Ray's object store and the receiver copies them in
  when it polls, so it can drop writes for blocks it no longer owns. For platforms without
  NIXL, and the benchmark's baseline.

A backend's folder holds a ``transport`` module with a ``create(options)`` function; it is
imported only when that backend is asked for (NIXL and Ray are heavy, and optional).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtransfer.errors import BackendUnavailableError
from kvtransfer.layout import KVRegion

if TYPE_CHECKING:
    import torch

    from kvtransfer.transport import Transport

BACKENDS = ("nixl", "ray")


@dataclass(slots=True)
class BackendOptions:
    """What a backend is built from: the memory it moves, its name, and its tuning."""

    transport_name: str
    kv_cache: "torch.Tensor"
    region: KVRegion
    nixl_mode: str = "prepped"
    merge_descriptors: bool = True
    progress_thread: bool = False
    network_devices: str | None = None
    transports: str | None = None  # UCX_TLS


def make_transport(backend: str, options: BackendOptions) -> "Transport":
    """Create the named backend's transport over ``options.kv_cache``."""
    if backend not in BACKENDS:
        raise BackendUnavailableError(f"backend: unknown {backend!r}; choose one of {BACKENDS}")
    module = importlib.import_module(f"kvtransfer.backends.{backend}.transport")
    return module.create(options)
