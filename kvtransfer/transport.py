"""The interface every transfer backend implements (the backends are ``kvtransfer.backends``).

A transport moves runs of blocks from this worker's KV region into a peer's and carries
one notification per write. The sender and receiver logic (leases, ordering, ownership)
lives above it and is the same for every backend. A write may move a ``BlockPiece`` of each
block instead of the whole block: the same byte range of every block (one KV head range of a
heads-outermost block, ``kvtransfer.sharding``), at its own offset on each side.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtransfer.descriptors import BlockRuns
from kvtransfer.layout import KVRegion


class XferState(enum.Enum):
    IN_PROGRESS = "PROC"
    DONE = "DONE"
    FAILED = "ERR"


@dataclass(slots=True, frozen=True)
class BlockPiece:
    """Bytes [src_offset, src_offset + num_bytes) of each source block into bytes
    [dst_offset, dst_offset + num_bytes) of its destination block."""

    src_offset: int
    dst_offset: int
    num_bytes: int


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
    def post_write(self, transport_name: str, runs: BlockRuns, notif: bytes, piece: BlockPiece | None = None) -> Any:
        """Start writing ``runs`` (whole blocks, or ``piece`` of each) to the peer; return a
        handle. Raise TransportError on failure."""

    @abstractmethod
    def check(self, handle: Any) -> XferState:
        """Non-blocking completion check of a posted write."""

    @abstractmethod
    def release(self, handle: Any) -> bool:
        """Free a handle, cancelling the write if it still runs; False if it cannot be stopped."""

    @abstractmethod
    def get_incoming(self) -> list[Incoming]:
        """Notifications that arrived since the last call, in arrival order."""

    def land(self, incoming: Incoming, dst_spans: Sequence[tuple[int, int]], piece: BlockPiece | None = None) -> None:
        """Copy an incoming payload into (start, count) block spans, whole blocks or ``piece``
        of each (``receiver_lands`` only)."""

    def close(self) -> None:
        """Release everything the transport registered or created."""
