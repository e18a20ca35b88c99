"""The interface every transfer backend implements, and how to pick one.

A transport moves runs of blocks from this worker's KV region into a peer's and carries
one notification per write. The sender and receiver logic (leases, ordering, ownership)
lives above it and is the same for every backend. Backends:

- ``nixl`` (default): one-sided UCX writes straight into the peer's registered memory;
  the notification arrives after the bytes.
- ``ray``: the writer puts the bytes in Ray's object store and the receiver copies them
  in when it polls, so it can drop writes for blocks it no longer owns. For platforms
  without NIXL, and the benchmark's baseline.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtransfer.descriptors import BlockRuns
from kvtransfer.errors import BackendUnavailableError
from kvtransfer.layout import KVRegion

if TYPE_CHECKING:
    import torch

BACKENDS = ("nixl", "ray")


class XferState(enum.Enum):
    IN_PROGRESS = "PROC"
    DONE = "DONE"
    FAILED = "ERR"


@dataclass(slots=True)
class Incoming:
    """One notification received; ``payload`` holds the bytes when the receiver must land them."""

    sender: str  # the writer's transport-level agent name
    message: bytes
    payload: Any = None


class Transport(ABC):
    """Moves block runs to peers; one instance per agent, used from one thread."""

    kind: str = ""
    # True when bytes land only in ``land`` (so the receiver can drop late writes itself).
    receiver_lands: bool = False

    @abstractmethod
    def metadata(self) -> bytes:
        """Opaque bytes a peer needs (with our region) to write into us."""

    @abstractmethod
    def add_peer(self, transport_name: str, metadata: bytes, region: KVRegion) -> None:
        """Make ``transport_name`` writable; raise TransportError if its metadata is unusable."""

    @abstractmethod
    def remove_peer(self, transport_name: str) -> None:
        """Forget a peer; later writes to it are impossible. Idempotent."""

    @abstractmethod
    def post_write(self, transport_name: str, runs: BlockRuns, notif: bytes) -> Any:
        """Start writing ``runs`` to the peer; return a handle. Raise TransportError on failure."""

    @abstractmethod
    def check(self, handle: Any) -> XferState:
        """Non-blocking completion check of a posted write."""

    @abstractmethod
    def release(self, handle: Any) -> bool:
        """Free a handle, cancelling the write if it still runs; False if it cannot be stopped."""

    @abstractmethod
    def get_incoming(self) -> list[Incoming]:
        """Notifications that arrived since the last call, in arrival order."""

    def land(self, incoming: Incoming, dst_spans: Sequence[tuple[int, int]]) -> None:
        """Copy an incoming payload into (start, count) block spans (``receiver_lands`` only)."""

    def close(self) -> None:
        """Release everything the transport registered or created."""


def make_transport(
    backend: str,
    transport_name: str,
    kv_cache: torch.Tensor,
    region: KVRegion,
    nixl_mode: str = "prepped",
    merge_descriptors: bool = True,
    progress_thread: bool = False,
    network_devices: str | None = None,
) -> Transport:
    """Create the named backend; its module (and nixl or ray) is imported only here."""
    if backend == "nixl":
        from kvtransfer.nixl_backend import NixlTransport

        return NixlTransport(
            transport_name,
            kv_cache,
            region,
            mode=nixl_mode,
            merge=merge_descriptors,
            progress_thread=progress_thread,
            network_devices=network_devices,
        )
    if backend == "ray":
        from kvtransfer.ray_backend import RayTransport

        return RayTransport(transport_name, kv_cache, region)
    raise BackendUnavailableError(f"backend: unknown {backend!r}; choose one of {BACKENDS}")
