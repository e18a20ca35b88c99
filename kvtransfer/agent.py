"""KVAgent: the one object a worker holds to move KV blocks, as sender, receiver or both.

Wiring (the workers do the Ray calls; kvtransfer never imports ray outside its Ray backend):

    decode D                                  prefill P
    agent = KVAgent("D0", kv, compat)         agent = KVAgent("P0", kv, compat)
    offer = agent.handshake_offer()  ──Ray──▶ agent.connect(offer)        # once per D epoch
    dest = agent.reserve(req, ids, lease_s) ─router─▶ seq = agent.push(req, dest, src, dst, n)
    ev = agent.poll_receives()  ◀── NIXL ──   ev = agent.poll_sends()     # while computing
    if agent.ready(req): ids = agent.complete(req)

Abort: P's ``cancel(req)`` returns a ``QuiesceReport``; once ``quiesced`` the workers relay
it to D, whose ``abort(req)`` + ``confirm_quiesced(req)`` free the blocks (or D frees them
when the lease runs out). A push to a (peer, epoch) not handshaken raises
``HandshakeRequiredError``: fetch the peer's current offer, ``connect`` it, push again.

Tensor parallelism: the agent lives with rank 0 and holds rank 0's KV shard; ``open_ranks``
(from the worker) opens the other ranks' transports under the names it is given, and the
agent drives them all as one ``ShardedTransport``: a push writes every rank's heads straight
from that rank into the peer rank(s) holding them.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtransfer.backends import BackendOptions, make_transport
from kvtransfer.descriptors import merge_runs
from kvtransfer.handshake import PROTOCOL_VERSION, HandshakeOffer, check_offer, new_epoch, transport_agent_name
from kvtransfer.layout import KVCompat, KVRegion
from kvtransfer.leases import Clock, LeasePolicy
from kvtransfer.messages import KVDestination, PeerRef, QuiesceReport, ReceiveEvents, SendEvent
from kvtransfer.path import PathStats, describe_path, host_id
from kvtransfer.receiver import KVReceiver
from kvtransfer.sender import KVSender
from kvtransfer.sharded_transport import RankTransport, ShardedTransport, rank_transport_name
from kvtransfer.sharding import KVShard, whole_shards

# Opens ranks 1..n-1's transports, each named rank_transport_name(base, rank): (base name) -> them.
OpenRanks = Callable[[str], list[RankTransport]]

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class KVTransferConfig:
    """How an agent moves blocks; the defaults suit the CPU test machine."""

    backend: str = "nixl"  # "nixl" or "ray"
    nixl_mode: str = "prepped"  # "prepped": per-block lists prepared once; "dynamic": per push
    merge_descriptors: bool = True  # False sends one descriptor per block (benchmark baseline)
    progress_thread: bool = False  # UCX progress thread; busy-polls a core, so off on CPU
    # UCX network devices (UCX_NET_DEVICES) NIXL may listen and send on: "lo" keeps a
    # single-machine deployment's transfers on loopback; None: every device UCX finds.
    network_devices: str | None = None
    # UCX transports (UCX_TLS) NIXL may use, e.g. "rc,sm,self" or "tcp"; None: every one UCX finds.
    transports: str | None = None
    lease: LeasePolicy = field(default_factory=LeasePolicy)
    # Activations of pipelined prefills (kvtransfer.activations), with the nixl backend: inbox
    # slots of this many tokens each (a longer chunk goes over Ray), and how many (0: all over Ray).
    stage_slot_tokens: int = 512
    stage_inbox_slots: int = 16

    def backend_options(self, transport_name: str, kv_cache: torch.Tensor, region: KVRegion) -> BackendOptions:
        """What this config's backend is built from, over ``kv_cache`` (one rank's)."""
        return BackendOptions(
            transport_name, kv_cache, region, nixl_mode=self.nixl_mode, merge_descriptors=self.merge_descriptors,
            progress_thread=self.progress_thread, network_devices=self.network_devices, transports=self.transports,
        )


def _locked(method):
    """Run an agent method under the agent's lock: the engine thread and the pump share it."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


class KVAgent:
    """One transport agent over this worker's KV tensor, with sending and receiving state.

    Thread-safe: the worker's engine thread pushes and reserves while its transfer pump
    (``kvtransfer.pump``) polls; every call that touches the state holds one lock.
    """

    def __init__(
        self,
        name: str,
        kv_cache: torch.Tensor,
        compat: KVCompat,
        config: KVTransferConfig | None = None,
        wall_clock: Clock = time.time,
        shard: KVShard | None = None,
        open_ranks: OpenRanks | None = None,
        address: str = "",
    ) -> None:
        """``address``: where this agent's node is reached (its peers find their route to it)."""
        shard = shard or whole_shards(compat.num_kv_heads)[0]
        self.address = address
        compat.check_tensor(kv_cache, shard.num_heads)
        self.config = config or KVTransferConfig()
        self.compat = compat
        self.region = KVRegion.from_tensor(kv_cache)
        self.ref = PeerRef(name, new_epoch())
        self._lock = threading.RLock()
        base_name = transport_agent_name(self.ref)
        options = self.config.backend_options(rank_transport_name(base_name, 0), kv_cache, self.region)
        local = RankTransport(shard, self.region, make_transport(self.config.backend, options), options.transport_name)
        others = open_ranks(base_name) if open_ranks is not None else []
        if len(others) + 1 != shard.tp_size:
            raise ValueError(f"open_ranks: {len(others)} ranks opened beside rank 0, the worker has {shard.tp_size}")
        self._transport = ShardedTransport(base_name, [local, *others], compat)
        policy = self.config.lease
        self.sender = KVSender(
            self.ref, self._transport, self.region, policy, self.config.merge_descriptors, wall_clock, write_bytes=self._write_bytes
        )
        self.receiver = KVReceiver(self.ref, self._transport, self.region, policy, wall_clock)
        logger.info("kv agent %s up: backend %s, compat %s", self.ref, self.config.backend, compat.compat_hash())

    # -- handshake -----------------------------------------------------------------------

    def handshake_offer(self) -> HandshakeOffer:
        """What a peer must ``connect`` before writing into this agent."""
        return HandshakeOffer(
            protocol_version=PROTOCOL_VERSION,
            peer=self.ref,
            transport=self.config.backend,
            transport_name=transport_agent_name(self.ref),
            transport_metadata=self._transport.metadata(),
            compat=self.compat,
            compat_hash=self.compat.compat_hash(),
            region=self.region,
            shards=self._transport.shards,
            regions=self._transport.regions,
            host_id=host_id(),
            address=self.address,
        )

    @_locked
    def connect(self, offer: HandshakeOffer) -> PeerRef:
        """Validate and load a peer's offer; raise IncompatiblePeerError naming each difference.

        Connecting a newer epoch of a known peer fails that peer's old requests and
        replaces it; an older epoch is refused; the same epoch is a no-op.
        """
        check_offer(self.compat, self.config.backend, offer, self._transport.shards)
        self.sender.add_peer(offer, describe_path(self.config.backend, offer.host_id, offer.address))
        return offer.peer

    @_locked
    def path_stats(self) -> list[PathStats]:
        """Per peer: which way its KV goes, and what went (bytes, writes, failures, write time)."""
        return self.sender.path_stats()

    def _write_bytes(self, num_blocks: int, layers: range | None) -> int:
        per_head = self.compat.bytes_per_head if layers is None else sum(n for _, n in self.compat.layer_runs_in_head(layers))
        return num_blocks * self.compat.num_kv_heads * per_head

    @_locked
    def write_cost(
        self, dest: KVDestination, src_block_ids: Sequence[int], dst_block_ids: Sequence[int], layers: range | None = None
    ) -> tuple[int, int]:
        """(bytes, descriptors) a push of these blocks (of ``layers`` only, if given) into
        ``dest`` moves: every rank's heads."""
        runs = merge_runs(src_block_ids, dst_block_ids, self.config.merge_descriptors)
        transport_name = transport_agent_name(dest.peer)
        return self._write_bytes(runs.num_blocks, layers), self._transport.num_descriptors(transport_name, runs, layers)

    @_locked
    def is_connected(self, peer: PeerRef) -> bool:
        return self.sender.is_connected(peer)

    @_locked
    def disconnect(self, peer_name: str, reason: str = "disconnected by the worker") -> list[str]:
        """Forget a peer (e.g. Ray says it died): fail its requests, return their ids."""
        return self.sender.drop_peer(peer_name, reason)

    @_locked
    def peers(self) -> list[PeerRef]:
        """The peers this agent can write to now."""
        return self.sender.peers()

    # -- sending (prefill side) ----------------------------------------------------------

    @_locked
    def push(
        self,
        req_id: str,
        dest: KVDestination,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        num_valid_blocks: int,
        payload: str = "",
        layers: range | None = None,
    ) -> int:
        """Write local blocks into ``dest``'s blocks without waiting; return the write's seq.

        ``num_valid_blocks`` is how many of the reservation's blocks are valid once this
        write lands; the push that makes it equal to the reservation size seals the request.
        ``layers``: only those layers of each block (a pipeline stage's; the reservation then
        expects one writer per stage).
        Raises RequestTransferError if the request failed or was cancelled (reported once
        by ``poll_sends`` as well), HandshakeRequiredError, InvalidBlocksError.
        """
        return self.sender.push(req_id, dest, src_block_ids, dst_block_ids, num_valid_blocks, payload, layers)

    @_locked
    def poll_sends(self) -> list[SendEvent]:
        """Completed writes and failed requests since the last call. Never blocks."""
        return self.sender.poll()

    @_locked
    def cancel(self, req_id: str, token: int | None = None) -> QuiesceReport:
        """Stop writes for ``req_id`` now (only into reservation ``token``, if given).

        The report says whether writes are still in flight; without a token every
        reservation of the request is refused from now on, with one only that attempt.
        """
        return self.sender.cancel(req_id, token)

    @_locked
    def quiesce_report(self, req_id: str, token: int | None = None) -> QuiesceReport:
        """Ask again after ``cancel`` (same ``token``) until ``quiesced``; relay it to the receiver."""
        return self.sender.quiesce_report(req_id, token)

    @_locked
    def num_in_flight(self) -> int:
        return self.sender.num_in_flight()

    def num_quiesced(self) -> int:
        """Given-up requests whose writes have all ended, so far (``Sender.num_quiesced``: an
        int read, no lock: the pump asks at every poll)."""
        return self.sender.num_quiesced

    @_locked
    def extend_lease(self, req_id: str, token: int, lease_deadline: float) -> bool:
        """The reserver renewed reservation ``token`` of ``req_id``: writes may go on until then."""
        return self.sender.extend_lease(req_id, token, lease_deadline)

    @_locked
    def has_pending_work(self) -> bool:
        """Whether something needs polling: a write in flight, a reservation awaiting writes or a lease."""
        return self.sender.has_work() or self.receiver.has_work()

    # -- receiving (decode side) ---------------------------------------------------------

    @_locked
    def reserve(
        self, req_id: str, block_ids: Sequence[int], lease_s: float | None = None, num_cached_blocks: int = 0, num_writers: int = 1
    ) -> KVDestination:
        """Own ``block_ids`` for ``req_id`` (exactly the blocks the writer will fill; the
        request's first ``num_cached_blocks`` are held here already and not written); with
        ``num_writers`` > 1, ready once that many writers (pipeline stages) each wrote them all."""
        return self.receiver.reserve(req_id, block_ids, lease_s, num_cached_blocks, num_writers)

    @_locked
    def renew_lease(self, req_id: str, lease_s: float) -> KVDestination:
        return self.receiver.renew_lease(req_id, lease_s)

    @_locked
    def renew_leases(self, req_ids: Sequence[str], lease_s: float) -> list[KVDestination]:
        """Renew the leases of the still-receiving reservations among ``req_ids``."""
        return self.receiver.renew_leases(req_ids, lease_s)

    @_locked
    def poll_receives(self) -> ReceiveEvents:
        """Progress, readiness, failures and lease-expiry frees since the last call."""
        return self.receiver.poll()

    @_locked
    def ready(self, req_id: str) -> bool:
        return self.receiver.ready(req_id)

    @_locked
    def num_valid_blocks(self, req_id: str) -> int:
        return self.receiver.num_valid_blocks(req_id)

    @_locked
    def payload(self, req_id: str) -> str:
        """What the writer attached to the request's landed writes (e.g. the first sampled token)."""
        return self.receiver.payload(req_id)

    @_locked
    def complete(self, req_id: str) -> list[int]:
        """Hand a ready request's blocks to the engine; the agent forgets them."""
        return self.receiver.complete(req_id)

    @_locked
    def abort(self, req_id: str, given_up: bool = False) -> list[int]:
        """Begin freeing; returns blocks safe to reuse now, the rest come later (``given_up``:
        see ``KVReceiver.abort``)."""
        return self.receiver.abort(req_id, given_up)

    @_locked
    def confirm_quiesced(self, req_id: str, token: int | None = None) -> list[int]:
        """Free after the writer's quiesced report (or its confirmed death); with ``token``, only
        that reservation's."""
        return self.receiver.confirm_quiesced(req_id, token)

    @_locked
    def close(self) -> None:
        self._transport.close()
