"""The handshake: what two agents exchange (over the workers' Ray calls) before any write.

A worker's agent publishes a ``HandshakeOffer``: protocol version, epoch, transport kind
and metadata, its KV region and the compatibility descriptor with its hash. A writer
``connect``s an offer only if every compatibility field matches; otherwise the refusal
lists each field that differs. The epoch is fresh on every agent start and ordered by
start time, so a writer can tell a restarted peer (newer epoch: re-handshake) from a
destination handed out by a dead incarnation (older epoch: refuse, never write).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from kvtransfer.errors import IncompatiblePeerError
from kvtransfer.layout import KVCompat, KVRegion
from kvtransfer.messages import PeerRef

PROTOCOL_VERSION = 1


def new_epoch() -> str:
    """A fresh epoch: start time in ns (so later starts sort later) plus random bits."""
    return f"{time.time_ns():016x}-{os.urandom(4).hex()}"


def transport_agent_name(peer: PeerRef) -> str:
    """The transport-level agent name; it carries the epoch so incarnations never alias."""
    return f"{peer.name}@{peer.epoch}"


@dataclass(slots=True)
class HandshakeOffer:
    """Everything a writer needs to know about a peer before writing into it."""

    protocol_version: int
    peer: PeerRef
    transport: str  # "nixl" or "ray"
    transport_name: str
    transport_metadata: bytes
    compat: KVCompat
    compat_hash: str
    region: KVRegion


def check_offer(local_compat: KVCompat, local_transport: str, offer: HandshakeOffer) -> None:
    """Raise IncompatiblePeerError listing every difference; return if the peer is usable."""
    problems: list[str] = []
    if offer.protocol_version != PROTOCOL_VERSION:
        problems.append(f"protocol_version: {PROTOCOL_VERSION} != {offer.protocol_version}")
    if offer.transport != local_transport:
        problems.append(f"transport: {local_transport!r} != {offer.transport!r}")
    if offer.compat_hash != local_compat.compat_hash():
        differences = local_compat.differences(offer.compat)
        problems.extend(differences or [f"compat_hash: {local_compat.compat_hash()} != {offer.compat_hash}"])
    if offer.region.bytes_per_block != local_compat.bytes_per_block:
        problems.append(f"bytes_per_block: {local_compat.bytes_per_block} != {offer.region.bytes_per_block}")
    if problems:
        raise IncompatiblePeerError(str(offer.peer), problems)
