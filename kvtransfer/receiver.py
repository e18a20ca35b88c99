"""Receiving side: a decode worker's reservations and the blocks that land in them.

A request's life here:
1. ``reserve(req_id, block_ids, lease_s)`` records that the blocks belong to this request
   (a block belongs to at most one live reservation) and returns the ``KVDestination``
   the router hands to the prefill worker. The lease deadline travels with it.
2. ``poll()`` runs on the agent's transfer pump, also while the engine computes. Notifications are applied in the
   writer's sequence order (NIXL may deliver them out of order); each applied one marks
   its blocks landed and may raise ``num_valid_blocks``, reported as progress. When
   every reserved block has landed and the writer said all are valid, the request is
   ready, once.
3. ``complete(req_id)`` hands the blocks over to the engine's running sequence.
A reservation may expect several writers (``num_writers``: the stages of a pipelined prefill,
each writing its own layers of every block): each writer's writes are ordered by its own
sequence numbers, and the request is ready once every writer has landed every block and said
all are valid; progress reports the fewest blocks any expected writer has made valid.
Abort: ``abort(req_id)`` frees at once what no write can still reach (a ready request,
or any request on a backend where the receiver lands bytes itself); otherwise the blocks
wait for ``confirm_quiesced`` (the writer said nothing is in flight, or it is dead) or
for the lease deadline plus grace, reported by ``poll()`` in ``freed``. Every block comes
back exactly once: from ``abort``, ``confirm_quiesced``, ``complete`` or ``freed``.
"""

from __future__ import annotations

import enum
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtransfer.descriptors import check_block_ids, spans_to_ids
from kvtransfer.errors import (
    BlockInUseError,
    InvalidBlocksError,
    KVTransferError,
    LeaseExpiredError,
    RequestTransferError,
    TransferFailedError,
    UnknownRequestError,
)
from kvtransfer.layout import KVRegion
from kvtransfer.leases import Clock, LeasePolicy, RecentKeys
from kvtransfer.messages import FreedBlocks, KVDestination, PeerRef, ReceiveEvents, TransferNotif
from kvtransfer.transport import Incoming, Transport

logger = logging.getLogger(__name__)


class _State(enum.Enum):
    RECEIVING = "receiving"
    READY = "ready"
    ABORTING = "aborting"  # waiting for the writer's confirmation or the lease
    FAILED = "failed"  # lease ran out before every block landed; freed at deadline + grace


@dataclass(slots=True)
class _WriterProgress:
    """One writer's writes into a reservation."""

    landed: set[int] = field(default_factory=set)
    num_valid: int = 0
    next_seq: int = 0
    pending: dict[int, tuple[Incoming, TransferNotif]] = field(default_factory=dict)

    def complete(self, num_blocks: int) -> bool:
        return self.num_valid == num_blocks and len(self.landed) == num_blocks


@dataclass(slots=True)
class _Reservation:
    req_id: str
    token: int
    block_ids: list[int]
    block_set: frozenset[int]
    deadline: float
    num_cached_blocks: int  # the request's leading blocks the reserver holds; not written
    num_writers: int = 1  # writers expected (pipeline stages), each writing every block
    state: _State = _State.RECEIVING
    writers: dict[str, _WriterProgress] = field(default_factory=dict)
    num_valid: int = 0  # the fewest blocks any expected writer made valid
    payload: str = ""  # the latest non-empty payload a landed write carried

    @property
    def writer(self) -> str | None:
        return ", ".join(self.writers) or None

    def num_landed(self) -> int:
        """Blocks every expected writer has landed."""
        if len(self.writers) < self.num_writers:
            return 0
        return min(len(w.landed) for w in self.writers.values())


class KVReceiver:
    """Per-agent receiving state; plain object owned by one worker, called from one thread."""

    def __init__(
        self, local: PeerRef, transport: Transport, region: KVRegion, policy: LeasePolicy, wall_clock: Clock = time.time
    ) -> None:
        self._local = local
        self._transport = transport
        self._region = region
        self._policy = policy
        self._wall = wall_clock
        self._by_req: dict[str, _Reservation] = {}
        self._by_token: dict[int, _Reservation] = {}
        self._owner: dict[int, str] = {}
        # Random start: tokens of different receivers must not collide, since a writer that
        # cancelled one attempt of a request refuses only that attempt's token.
        self._next_token = secrets.randbits(48) + 1
        # Tokens freed on a writer's quiesced report: their trailing notifications (the bytes
        # landed before the writer saw the write done) are not alarms.
        self._quiesced_tokens = RecentKeys()
        self.num_late_writes = 0  # writes seen for blocks freed without the writer's word: must stay 0

    def reserve(
        self, req_id: str, block_ids: Sequence[int], lease_s: float | None = None, num_cached_blocks: int = 0, num_writers: int = 1
    ) -> KVDestination:
        """Take ownership of ``block_ids`` for ``req_id`` under a lease; return the destination.
        ``num_writers``: how many writers (pipeline stages) each write every block."""
        earlier = self._by_req.get(req_id)
        if earlier is not None and earlier.state not in (_State.ABORTING, _State.FAILED):
            raise InvalidBlocksError("req_id", f"{req_id} already holds a reservation")
        ids = check_block_ids(block_ids, self._region.num_blocks, "block_ids").tolist()
        if not ids:
            raise InvalidBlocksError("block_ids", "is empty")
        if len(set(ids)) != len(ids):
            raise InvalidBlocksError("block_ids", "names a block twice")
        busy = [b for b in ids if b in self._owner]
        if busy:
            raise BlockInUseError("block_ids", f"blocks {busy[:8]} still belong to req {self._owner[busy[0]]}")
        lease_s = self._policy.lease_s if lease_s is None else lease_s
        if lease_s <= self._policy.write_timeout_s:
            timeout = self._policy.write_timeout_s
            raise InvalidBlocksError("lease_s", f"{lease_s} must exceed the write timeout {timeout}s")
        if num_writers < 1:
            raise InvalidBlocksError("num_writers", f"must be >= 1, got {num_writers}")
        res = _Reservation(req_id, self._next_token, ids, frozenset(ids), self._wall() + lease_s, num_cached_blocks, num_writers)
        self._next_token += 1
        if earlier is not None:
            # An earlier attempt given up whose writer has not confirmed yet (the router placed
            # the request again at once): it stays until a confirm naming its token, or its lease.
            logger.info("req %s: a new reservation beside the aborted one %d, whose blocks wait for its writer or lease", req_id, earlier.token)
        self._by_req[req_id] = self._by_token[res.token] = res
        for b in ids:
            self._owner[b] = req_id
        logger.debug("req %s: reserved %d blocks, lease %.1fs", req_id, len(ids), lease_s)
        return self._destination(res)

    def _destination(self, res: _Reservation) -> KVDestination:
        return KVDestination(res.req_id, self._local, list(res.block_ids), res.deadline, res.token, res.num_cached_blocks)

    def renew_lease(self, req_id: str, lease_s: float) -> KVDestination:
        """Push the deadline to now + ``lease_s`` (never earlier); pass the result to the writer."""
        res = self._get(req_id)
        if res.state is _State.RECEIVING:
            res.deadline = max(res.deadline, self._wall() + lease_s)
        return self._destination(res)

    def renew_leases(self, req_ids: Sequence[str], lease_s: float) -> list[KVDestination]:
        """Renew every still-receiving reservation among ``req_ids``; the others are skipped.

        The returned destinations carry the new deadlines for the writers.
        """
        now = self._wall()
        renewed = []
        for req_id in req_ids:
            res = self._by_req.get(req_id)
            if res is not None and res.state is _State.RECEIVING:
                res.deadline = max(res.deadline, now + lease_s)
                renewed.append(self._destination(res))
        return renewed

    def has_work(self) -> bool:
        """Whether a reservation still expects writes or waits out a lease: someone must poll."""
        return any(res.state is not _State.READY for res in self._by_token.values())

    def _get(self, req_id: str) -> _Reservation:
        res = self._by_req.get(req_id)
        if res is None:
            raise UnknownRequestError(f"req {req_id} has no reservation here")
        return res

    # -- polling -------------------------------------------------------------------------

    def poll(self) -> ReceiveEvents:
        """Apply arrived notifications, expire leases; return what changed."""
        events = ReceiveEvents()
        for incoming in self._transport.get_incoming():
            self._on_incoming(incoming, events)
        now = self._wall()
        for res in list(self._by_token.values()):  # by token: an aborted attempt beside a newer one too
            if res.state is _State.RECEIVING and now > res.deadline:
                landed = f"{res.num_landed()}/{len(res.block_ids)}"
                self._fail(res, LeaseExpiredError(
                    res.req_id, res.writer or "-", f"lease ran out with {landed} blocks landed"
                ), events)
            if res.state in (_State.ABORTING, _State.FAILED) and now >= self._policy.free_at(res.deadline):
                events.freed.append(FreedBlocks(res.req_id, self._free(res), "lease expired"))
        return events

    def _on_incoming(self, incoming: Incoming, events: ReceiveEvents) -> None:
        try:
            notif = TransferNotif.decode(incoming.message)
        except KVTransferError as e:
            logger.warning("ignoring a notification from %s: %s", incoming.sender, e)
            return
        res = self._by_token.get(notif.token)
        if res is None or res.req_id != notif.req_id:
            if self._transport.receiver_lands:
                logger.info("req %s: dropped a write for a reservation that is gone", notif.req_id)
            elif notif.token in self._quiesced_tokens:
                logger.debug("req %s: notification of write %d trailed the writer's quiesced report",
                             notif.req_id, notif.seq)
            else:
                self.num_late_writes += 1
                logger.error("req %s: write %d landed after its blocks were freed (from %s)",
                             notif.req_id, notif.seq, incoming.sender)
            return
        progress = res.writers.get(incoming.sender)
        if progress is None:
            if len(res.writers) >= res.num_writers:
                logger.error("req %s: ignoring writer %s beyond the %d expected (%s)", res.req_id, incoming.sender, res.num_writers, res.writer)
                return
            progress = res.writers[incoming.sender] = _WriterProgress()
        if res.state is not _State.RECEIVING:
            logger.debug("req %s: write %d arrived while %s; ignored", res.req_id, notif.seq, res.state.value)
            return
        if notif.seq < progress.next_seq or notif.seq in progress.pending:
            logger.error("req %s: duplicate write %d from %s ignored", res.req_id, notif.seq, incoming.sender)
            return
        progress.pending[notif.seq] = (incoming, notif)
        while res.state is _State.RECEIVING and progress.next_seq in progress.pending:
            self._apply(res, progress, *progress.pending.pop(progress.next_seq), events)
            progress.next_seq += 1

    def _apply(self, res: _Reservation, progress: _WriterProgress, incoming: Incoming, notif: TransferNotif, events: ReceiveEvents) -> None:
        spans = spans_to_ids(notif.dst_spans)
        if not all(res.block_set.issuperset(span) for span in spans):
            outside = sorted(set().union(*spans) - res.block_set)[:8]
            error = TransferFailedError(res.req_id, incoming.sender, f"wrote outside the reservation: {outside}")
            self._fail(res, error, events)
            return
        if self._transport.receiver_lands:
            try:
                self._transport.land(incoming, notif.dst_spans)
            except Exception as e:
                error = TransferFailedError(res.req_id, incoming.sender, f"landing write {notif.seq}: {e}")
                self._fail(res, error, events)
                return
        progress.landed.update(*spans)
        if notif.payload:
            res.payload = notif.payload
        progress.num_valid = max(progress.num_valid, notif.num_valid_blocks)
        num_valid = min(w.num_valid for w in res.writers.values()) if len(res.writers) == res.num_writers else 0
        if num_valid > res.num_valid:
            res.num_valid = num_valid
            events.progress.append((res.req_id, res.num_valid))
        num_blocks = len(res.block_ids)
        if len(res.writers) == res.num_writers and all(w.complete(num_blocks) for w in res.writers.values()):
            res.state = _State.READY
            events.ready.append(res.req_id)
            logger.info("req %s: all %d blocks landed from %d writer(s)", res.req_id, num_blocks, res.num_writers)

    def _fail(self, res: _Reservation, error: RequestTransferError, events: ReceiveEvents) -> None:
        res.state = _State.FAILED
        for progress in res.writers.values():
            progress.pending.clear()
        events.failed.append(error)
        logger.warning("req %s: receive failed: %s", res.req_id, error)

    # -- queries and hand-back -----------------------------------------------------------

    def ready(self, req_id: str) -> bool:
        return self._get(req_id).state is _State.READY

    def num_valid_blocks(self, req_id: str) -> int:
        return self._get(req_id).num_valid

    def block_ids(self, req_id: str) -> list[int]:
        return list(self._get(req_id).block_ids)

    def num_reserved_blocks(self) -> int:
        return len(self._owner)

    def payload(self, req_id: str) -> str:
        """The latest payload that arrived with a landed write of ``req_id`` ("" if none)."""
        return self._get(req_id).payload

    def complete(self, req_id: str) -> list[int]:
        """Hand a ready request's blocks to the caller (the engine's sequence) and forget it."""
        res = self._get(req_id)
        if res.state is not _State.READY:
            raise KVTransferError(f"req {req_id}: cannot complete while {res.state.value}")
        return self._free(res)

    def abort(self, req_id: str, given_up: bool = False) -> list[int]:
        """Start freeing ``req_id``; return the blocks that are safe to reuse now (maybe none).

        ``given_up``: the request is placed again (its writer failed, and may still be writing):
        what is left of the reservation no longer answers to the request's name, only to a
        confirm naming its token, or to its lease (a confirm by name then means a newer one)."""
        res = self._by_req.get(req_id)
        if res is None:
            return []  # already freed (lease) or never reserved: nothing to give back twice
        # Ready: the writer sealed the request and every write landed. Receiver-landed
        # backends drop later payloads themselves. Either way no late write can arrive.
        if res.state is _State.READY or self._transport.receiver_lands:
            logger.info("req %s: aborted, %d blocks freed at once", req_id, len(res.block_ids))
            return self._free(res)
        if res.state is _State.RECEIVING:
            res.state = _State.ABORTING
            for progress in res.writers.values():
                progress.pending.clear()
        if given_up:
            del self._by_req[req_id]
        logger.info("req %s: aborted, blocks held until the writer confirms or the lease ends", req_id)
        return []

    def confirm_quiesced(self, req_id: str, token: int | None = None) -> list[int]:
        """The writer confirmed no write is in flight (or is dead): free the blocks now. With
        ``token``, only that reservation's (an earlier attempt's confirm never frees a newer one)."""
        res = self._by_req.get(req_id) if token is None else self._by_token.get(token)
        if res is None or res.req_id != req_id:
            return []
        if res.state is _State.RECEIVING:
            logger.info("req %s: writer quiesced before an abort; aborting now", req_id)
        self._quiesced_tokens.add(res.token)
        return self._free(res)

    def _free(self, res: _Reservation) -> list[int]:
        if self._by_req.get(res.req_id) is res:  # else a newer attempt holds the request's name
            del self._by_req[res.req_id]
        del self._by_token[res.token]
        for b in res.block_ids:
            del self._owner[b]
        return list(res.block_ids)
