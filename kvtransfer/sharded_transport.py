"""A worker's ranks as one transport: every write fans out into legs, one per rank pair.

Each rank of a tensor-parallel worker registers its own KV shard with its own backend
transport (its own NIXL agent: memory is registered by the process that owns it). This
transport joins them: ``metadata`` lists every rank's endpoint (its KV heads, transport name,
backend metadata and region); ``add_peer`` plans the legs between our ranks and the peer's
(``kvtransfer.sharding``) and makes each peer rank writable from the rank that writes it; a
write posts one leg per (our rank, peer rank) pair, each from that rank's memory straight into
that peer rank's, carrying the write's notification with a leg header. The reading side
collects a write's legs from all its ranks and reports the write once every leg landed, so
the sender and receiver logic above (sequence order, leases, quiesce) sees one write as
before. With one rank on each side this is one leg of whole blocks: today's transfer.

A pipeline stage writes only its layers of each block (``layers``): within every head of a leg,
that range of layers is one run (and one more for its scales in a quantized cache), so the write
becomes one leg per (rank pair, head, run), each a piece of every block, reassembled the same way.

Ranks other than 0 live in other processes; the worker hands their transports in as proxies
(any ``Transport``), so this module never knows how they are reached.
"""

from __future__ import annotations

import itertools
import logging
import pickle
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtransfer.descriptors import BlockRuns
from kvtransfer.errors import LayoutError, TransportError
from kvtransfer.layout import KVCompat, KVRegion
from kvtransfer.sharding import KVShard, Leg, plan_legs
from kvtransfer.transport import BlockPiece, Incoming, Transport, XferState

logger = logging.getLogger(__name__)

LEG_MAGIC = b"pdleg1:"
RANK_SEPARATOR = "/r"  # a rank's transport is named "<worker transport name>/r<rank>"
PARTIAL_WRITE_TTL_S = 600.0  # legs of a write whose other legs never came (a failed attempt) are dropped after this


def rank_transport_name(base: str, rank: int) -> str:
    return f"{base}{RANK_SEPARATOR}{rank}"


@dataclass(slots=True, frozen=True)
class RankEndpoint:
    """What a peer needs to write into one of our ranks."""

    shard: KVShard
    transport_name: str
    metadata: bytes
    region: KVRegion


@dataclass(slots=True)
class RankTransport:
    """One rank's backend transport (a proxy for ranks in other processes), its heads and memory."""

    shard: KVShard
    region: KVRegion
    transport: Transport
    name: str


@dataclass(slots=True)
class _Peer:
    endpoints: list[RankEndpoint]
    legs: list[Leg]


@dataclass(slots=True)
class _PartialWrite:
    num_legs: int
    first_seen: float
    legs: dict[int, tuple[int, Incoming, BlockPiece | None]] = field(default_factory=dict)


@dataclass(slots=True)
class _ShardedWrite:
    """One write's legs, (the rank posting it, its handle) each, and the final state of every leg
    that has one: a leg is released as it ends (done, failed, or cancelled) and never checked or
    released again (NIXL reads a released handle's freed request)."""

    legs: list[tuple[int, Any]]
    ended: dict[int, XferState] = field(default_factory=dict)
    partly_posted: bool = False  # a leg failed to post: the write fails once the posted legs end

    @property
    def over(self) -> bool:
        return len(self.ended) == len(self.legs)


def _encode_leg(post: int, index: int, num_legs: int, part: Leg | BlockPiece, notif: bytes) -> bytes:
    """The notification of one leg: the post it belongs to (a write posted again is a new post:
    its legs never complete with a failed post's), which of how many, and the bytes of each
    block it lands."""
    return LEG_MAGIC + f"{post},{index},{num_legs},{part.dst_offset},{part.num_bytes}:".encode() + notif


def _decode_leg(message: bytes) -> tuple[int, int, int, int, int, bytes]:
    if not message.startswith(LEG_MAGIC):
        raise ValueError(f"not a leg: {message[:24]!r}")
    header, _, notif = message[len(LEG_MAGIC) :].partition(b":")
    post, index, num_legs, offset, num_bytes = (int(x) for x in header.split(b","))
    return post, index, num_legs, offset, num_bytes, notif


class ShardedTransport(Transport):
    def __init__(self, name: str, ranks: Sequence[RankTransport], compat: KVCompat):
        if [r.shard.rank for r in ranks] != list(range(len(ranks))):
            raise LayoutError(f"ranks: expected 0..{len(ranks) - 1} in order, got {[r.shard.rank for r in ranks]}")
        self.name = name
        self._ranks = list(ranks)
        self.kind = ranks[0].transport.kind
        self.receiver_lands = ranks[0].transport.receiver_lands
        self._compat = compat
        self._num_kv_heads = compat.num_kv_heads
        self._bytes_per_head = compat.bytes_per_head
        self._peers: dict[str, _Peer] = {}
        # (sender, notification, post) -> the legs of that post that landed so far
        self._partial: dict[tuple[str, bytes, int], _PartialWrite] = {}
        self._posts = itertools.count()

    @property
    def shards(self) -> list[KVShard]:
        return [r.shard for r in self._ranks]

    @property
    def regions(self) -> list[KVRegion]:
        return [r.region for r in self._ranks]

    def metadata(self) -> bytes:
        return pickle.dumps([RankEndpoint(r.shard, r.name, r.transport.metadata(), r.region) for r in self._ranks])

    @staticmethod
    def endpoints(metadata: bytes) -> list[RankEndpoint]:
        """A peer's rank endpoints from its metadata; TransportError if they are not that."""
        try:
            endpoints = pickle.loads(metadata)
        except Exception as exc:
            raise TransportError(f"unusable peer metadata: {exc}") from exc
        if not isinstance(endpoints, list) or not all(isinstance(e, RankEndpoint) for e in endpoints):
            raise TransportError("unusable peer metadata: not a list of rank endpoints")
        return endpoints

    def plan(self, endpoints: Sequence[RankEndpoint]) -> list[Leg]:
        """The legs our ranks write to reach every head of a peer of these endpoints (LayoutError if none)."""
        return plan_legs(self.shards, [e.shard for e in endpoints], self._num_kv_heads, self._bytes_per_head)

    def add_peer(self, transport_name: str, metadata: bytes, region: KVRegion) -> None:
        if transport_name in self._peers:
            return
        endpoints = self.endpoints(metadata)
        legs = self.plan(endpoints)
        added: list[tuple[int, str]] = []
        try:
            for src, dst in sorted({(leg.src_rank, leg.dst_rank) for leg in legs}):
                endpoint = endpoints[dst]
                self._ranks[src].transport.add_peer(endpoint.transport_name, endpoint.metadata, endpoint.region)
                added.append((src, endpoint.transport_name))
        except TransportError:
            for src, name in added:
                self._ranks[src].transport.remove_peer(name)
            raise
        self._peers[transport_name] = _Peer(endpoints, legs)

    def remove_peer(self, transport_name: str) -> None:
        peer = self._peers.pop(transport_name, None)
        if peer is None:
            return
        for src, dst in sorted({(leg.src_rank, leg.dst_rank) for leg in peer.legs}):
            self._ranks[src].transport.remove_peer(peer.endpoints[dst].transport_name)

    def _pieces(self, legs: Sequence[Leg], layers: range | None) -> list[tuple[Leg, BlockPiece | None]]:
        """What a write posts, one per leg: each leg (None: whole blocks), or with ``layers``,
        the runs of those layers in every head of each leg."""
        if layers is None:
            return [(leg, None if leg.whole else BlockPiece(leg.src_offset, leg.dst_offset, leg.num_bytes)) for leg in legs]
        in_head = self._compat.layer_runs_in_head(layers)
        pieces = []
        for leg in legs:
            for head in range(leg.num_bytes // self._bytes_per_head):
                at = head * self._bytes_per_head
                pieces.extend((leg, BlockPiece(leg.src_offset + at + off, leg.dst_offset + at + off, length)) for off, length in in_head)
        return pieces

    def num_descriptors(self, transport_name: str, runs: BlockRuns, layers: range | None = None) -> int:
        """Descriptors a write of ``runs`` (of ``layers`` only, if given) to the peer costs: a run
        per whole-block leg, a block per piece."""
        peer = self._peers.get(transport_name)
        pieces = self._pieces(peer.legs, layers) if peer is not None else []
        return sum(len(runs) if piece is None else runs.num_blocks for _, piece in pieces)

    def post_write(self, transport_name: str, runs: BlockRuns, notif: bytes, piece: BlockPiece | None = None, layers: range | None = None) -> Any:
        """Post every leg of the write (``layers``: only those layers of each block)."""
        peer = self._peers.get(transport_name)
        if peer is None:
            raise TransportError(f"no peer {transport_name}", peer_lost=True)
        pieces = self._pieces(peer.legs, layers)
        write = _ShardedWrite([])
        post = next(self._posts)
        try:
            for index, (leg, leg_piece) in enumerate(pieces):
                message = _encode_leg(post, index, len(pieces), leg_piece or leg, notif)
                handle = self._ranks[leg.src_rank].transport.post_write(peer.endpoints[leg.dst_rank].transport_name, runs, message, leg_piece)
                write.legs.append((leg.src_rank, handle))
        except TransportError:
            if self.release(write):
                raise
            # A posted leg could not be stopped and may yet land: the write is handed back as
            # one in flight (the sender keeps counting it, a quiesce waits for it) and reports
            # FAILED once that leg ends. Raised, it was forgotten while it wrote.
            logger.warning("a leg of a write to %s did not post and another could not be stopped; the write fails once it ends", transport_name)
            write.partly_posted = True
        return write

    def check(self, handle: _ShardedWrite) -> XferState:
        """DONE once every leg is done; FAILED once one failed and none still runs (the others
        are cancelled where they can be); IN_PROGRESS while any leg may still write."""
        for index, (rank, leg) in enumerate(handle.legs):
            if index in handle.ended:
                continue
            state = self._ranks[rank].transport.check(leg)
            if state is not XferState.IN_PROGRESS:
                self._ranks[rank].transport.release(leg)
                handle.ended[index] = state
        if not handle.over and XferState.FAILED in handle.ended.values():
            self.release(handle)  # the write failed: stop what still runs of it
        if not handle.over:
            # A leg still writes: reported failed now, the write would be posted again (or its
            # blocks freed) while this leg may yet land in them.
            return XferState.IN_PROGRESS
        return XferState.FAILED if handle.partly_posted or XferState.FAILED in handle.ended.values() else XferState.DONE

    def release(self, handle: _ShardedWrite) -> bool:
        """Cancel every leg still running; True once none is (a False call may be repeated)."""
        for index, (rank, leg) in enumerate(handle.legs):
            if index not in handle.ended and self._ranks[rank].transport.release(leg):
                handle.ended[index] = XferState.FAILED
        return handle.over

    def get_incoming(self) -> list[Incoming]:
        complete: list[Incoming] = []
        now = time.monotonic()
        for rank in self._ranks:
            for incoming in rank.transport.get_incoming():
                try:
                    post, index, num_legs, offset, num_bytes, notif = _decode_leg(incoming.message)
                except ValueError as exc:
                    logger.warning("ignoring a notification from %s: %s", incoming.sender, exc)
                    continue
                sender = incoming.sender.rpartition(RANK_SEPARATOR)[0] or incoming.sender
                key = (sender, notif, post)
                partial = self._partial.setdefault(key, _PartialWrite(num_legs, now))
                whole = offset == 0 and num_bytes == rank.region.bytes_per_block
                partial.legs[index] = (rank.shard.rank, incoming, None if whole else BlockPiece(0, offset, num_bytes))
                if len(partial.legs) == partial.num_legs:
                    del self._partial[key]
                    # The earlier posts of this write failed (it was posted again): their legs
                    # that landed are no part of it.
                    for stale in [k for k in self._partial if k[:2] == key[:2] and k[2] < post]:
                        del self._partial[stale]
                    payload = list(partial.legs.values()) if self.receiver_lands else None
                    complete.append(Incoming(sender=sender, message=notif, payload=payload))
        for key in [k for k, p in self._partial.items() if now - p.first_seen > PARTIAL_WRITE_TTL_S]:
            logger.warning("dropping %d of %d legs of a write from %s that never completed", len(self._partial[key].legs), self._partial[key].num_legs, key[0])
            del self._partial[key]
        return complete

    def land(self, incoming: Incoming, dst_spans: Sequence[tuple[int, int]], piece: BlockPiece | None = None) -> None:
        for rank, leg_incoming, leg_piece in incoming.payload:
            self._ranks[rank].transport.land(leg_incoming, dst_spans, leg_piece)

    def close(self) -> None:
        for rank in self._ranks:
            try:
                rank.transport.close()
            except Exception:
                logger.warning("closing rank %d's transport failed", rank.shard.rank, exc_info=True)
