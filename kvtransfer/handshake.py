"""The handshake: what two agents exchange (over the workers' Ray calls) before any write.

A worker's agent publishes a ``HandshakeOffer``: protocol version, epoch, transport kind
and metadata, its KV region and the compatibility descriptor with its hash. A writer
``connect``s an offer only if every compatibility field matches; otherwise the refusal
lists each field that differs. The epoch is fresh on every agent start and ordered by
start time, so a writer can tell a restarted peer (newer epoch: re-handshake) from a
destination handed out by a dead incarnation (older epoch: refuse, never write).

The offer also carries the peer's tensor-parallel shape: its TP size, and each rank's KV head
range and region. Workers of different TP sizes connect when every head the reader holds can
be written by a rank of the writer holding it (``kvtransfer.sharding``); a pair that cannot be
mapped is refused naming both shapes.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from kvtransfer.errors import IncompatiblePeerError, LayoutError
from kvtransfer.layout import KVCompat, KVRegion
from kvtransfer.messages import PeerRef
from kvtransfer.sharding import KVShard, describe, plan_legs

PROTOCOL_VERSION = 2  # 2: heads-outermost blocks, per-rank legs


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
    region: KVRegion  # rank 0's
    shards: list[KVShard]  # every rank's KV heads
    regions: list[KVRegion]  # every rank's memory
    # Where the peer is (kvtransfer.path): its host, and the address its node is reached at.
    host_id: str = ""
    address: str = ""

    @property
    def tp_size(self) -> int:
        return len(self.shards)


def check_offer(local_compat: KVCompat, local_transport: str, offer: HandshakeOffer, local_shards: list[KVShard]) -> None:
    """Raise IncompatiblePeerError listing every difference; return if the peer is usable
    (by a writer whose ranks hold ``local_shards``)."""
    problems: list[str] = []
    if offer.protocol_version != PROTOCOL_VERSION:
        problems.append(f"protocol_version: {PROTOCOL_VERSION} != {offer.protocol_version}")
    if offer.transport != local_transport:
        problems.append(f"transport: {local_transport!r} != {offer.transport!r}")
    if offer.compat_hash != local_compat.compat_hash():
        differences = local_compat.differences(offer.compat)
        problems.extend(differences or [f"compat_hash: {local_compat.compat_hash()} != {offer.compat_hash}"])
    if not problems:
        for shard, region in zip(offer.shards, offer.regions):
            expected = shard.num_heads * local_compat.bytes_per_head
            if region.bytes_per_block != expected:
                problems.append(f"bytes_per_block of rank {shard.rank}: {expected} for {shard.num_heads} heads != {region.bytes_per_block}")
        try:
            plan_legs(local_shards, offer.shards, local_compat.num_kv_heads, local_compat.bytes_per_head)
        except LayoutError as exc:
            problems.append(f"tensor parallel shapes: writer {describe(local_shards)}, reader {describe(offer.shards)}: {exc}")
    if problems:
        raise IncompatiblePeerError(str(offer.peer), problems)
