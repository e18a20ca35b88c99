"""Sending side: a prefill worker pushes finished KV blocks into a decode worker's reservation.

A request's life here:
1. After each prefill chunk the worker calls ``push(req_id, dest, src_ids, dst_ids,
   num_valid_blocks)``. The push is refused unless the destination's (peer, epoch) was
   handshaken, the lease leaves room for a whole write timeout, and every destination
   block belongs to the reservation. Adjacent blocks are merged into runs and the write
   is posted with a notification; it does not wait.
2. ``poll()`` (from the agent's transfer pump, while the engine computes the next chunk)
   checks the writes: completed ones come back as ``SendEvent``s; a write that failed in
   the transport, or timed out and could be cancelled, is posted again up to
   ``max_write_retries`` times; after that, or when the peer is lost, it fails this
   request only (one event with the error), and the actor's other requests go on.
3. The push whose ``num_valid_blocks`` covers the whole reservation seals the request;
   when its writes complete, the last event says ``finished`` and the state is dropped.
A write that touches a block an earlier write of the same request is still writing waits
(posted by a later poll), so two writes never race into one block.

Abort: ``cancel(req_id)`` refuses every later push for the request at once and reports
how many writes are still in flight; ``quiesce_report`` answers again until none are.
The worker relays the quiesced report to the decode worker, which may then free.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtransfer.descriptors import BlockRuns, check_block_ids, merge_runs
from kvtransfer.errors import (
    HandshakeRequiredError,
    IncompatiblePeerError,
    InvalidBlocksError,
    LeaseExpiredError,
    PeerLostError,
    RequestTransferError,
    StaleEpochError,
    TransferCancelledError,
    TransferFailedError,
    TransferTimeoutError,
    TransportError,
)
from kvtransfer.handshake import HandshakeOffer
from kvtransfer.layout import KVRegion
from kvtransfer.leases import Clock, LeasePolicy, Tombstones
from kvtransfer.messages import KVDestination, PeerRef, QuiesceReport, SendEvent, TransferNotif
from kvtransfer.path import PathStats, TransferPath, log_path
from kvtransfer.transport import Transport, XferState

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Peer:
    ref: PeerRef
    transport_name: str


@dataclass(slots=True)
class _Write:
    seq: int
    num_valid_blocks: int
    runs: BlockRuns
    dst_blocks: frozenset[int]
    notif: bytes
    layers: range | None = None  # only these layers of each block (a pipeline stage's)
    handle: Any = None
    posted_at: float = 0.0
    timed_out: bool = False  # failed or timed out and could not be cancelled: the request failed for it
    num_retries: int = 0


@dataclass(slots=True)
class _SendState:
    req_id: str
    dest: KVDestination
    reserved: frozenset[int]
    next_seq: int = 0
    in_flight: list[_Write] = field(default_factory=list)
    deferred: deque[_Write] = field(default_factory=deque)
    sealed: bool = False
    error: RequestTransferError | None = None


class KVSender:
    """Per-agent sending state; plain object owned by one worker, called from one thread."""

    def __init__(
        self,
        local: PeerRef,
        transport: Transport,
        region: KVRegion,
        policy: LeasePolicy,
        merge: bool = True,
        wall_clock: Clock = time.time,
        write_bytes: Callable[[int, range | None], int] | None = None,
    ) -> None:
        self._local = local
        # Bytes a write of N blocks (of some layers) moves; None: not counted (unit tests).
        self._write_bytes = write_bytes or (lambda num_blocks, layers: 0)
        self._paths: dict[str, PathStats] = {}  # per peer name: its path and what went there
        self._transport = transport
        self._region = region
        self._policy = policy
        self._merge = merge
        self._wall = wall_clock
        self._peers: dict[str, _Peer] = {}
        self._lost: set[PeerRef] = set()
        # By request and reservation: a request sent again into a fresh reservation (its decode
        # actor died mid-push, and the retry came back here) is a state of its own, while the
        # cancelled attempt's writes still finish or time out.
        self._reqs: dict[tuple[str, int], _SendState] = {}
        self._tombstones: Tombstones[RequestTransferError] = Tombstones(policy.tombstone_s)
        self._events: list[SendEvent] = []
        # Requests given up (cancelled, failed) whose writes have all ended, ever: that makes no
        # event, and the pump tells whoever waits for such a request to quiesce when this grows.
        self.num_quiesced = 0

    # -- peers ---------------------------------------------------------------------------

    def add_peer(self, offer: HandshakeOffer, path: TransferPath | None = None) -> None:
        """Make a (validated) peer writable; a newer epoch replaces the old incarnation.
        ``path``: which way its KV goes (logged once, counted per write)."""
        current = self._peers.get(offer.peer.name)
        if current is not None and current.ref.epoch == offer.peer.epoch:
            return
        if current is not None and offer.peer.epoch < current.ref.epoch:
            raise IncompatiblePeerError(
                str(offer.peer), [f"epoch: offer is older than the connected epoch {current.ref.epoch}"]
            )
        if current is not None:
            self.drop_peer(offer.peer.name, f"restarted (epoch {current.ref.epoch} -> {offer.peer.epoch})")
        self._transport.add_peer(offer.transport_name, offer.transport_metadata, offer.region)
        self._peers[offer.peer.name] = _Peer(ref=offer.peer, transport_name=offer.transport_name)
        logger.info("connected to peer %s (%d blocks x %d bytes)", offer.peer, offer.region.num_blocks,
                    offer.region.bytes_per_block)
        if path is not None:
            log_path(str(offer.peer), path)
            stats = self._paths.setdefault(offer.peer.name, PathStats(offer.peer.name, path.transport, path.device))
            stats.transport, stats.device = path.transport, path.device

    def path_stats(self) -> list[PathStats]:
        return [dataclasses.replace(stats) for stats in self._paths.values()]

    def _count_done(self, state: _SendState, write: _Write) -> None:
        stats = self._paths.get(state.dest.peer.name)
        if stats is not None:
            stats.num_writes += 1
            stats.num_bytes += self._write_bytes(write.runs.num_blocks, write.layers)
            stats.write_seconds += time.monotonic() - write.posted_at

    def _count_failure(self, state: _SendState) -> None:
        stats = self._paths.get(state.dest.peer.name)
        if stats is not None:
            stats.num_failures += 1

    def drop_peer(self, name: str, reason: str) -> list[str]:
        """Fail every request writing to peer ``name`` and forget the peer; return their ids."""
        peer = self._peers.pop(name, None)
        if peer is None:
            return []
        self._lost.add(peer.ref)
        failed = []
        for state in list(self._reqs.values()):
            if state.dest.peer.name == name and state.error is None:
                self._fail(state, PeerLostError(state.req_id, str(peer.ref), reason))
                failed.append(state.req_id)
            if state.dest.peer.name == name:
                state.in_flight = [w for w in state.in_flight if not self._transport.release(w.handle)]
        self._transport.remove_peer(peer.transport_name)
        logger.warning("dropped peer %s: %s; %d requests failed", peer.ref, reason, len(failed))
        return failed

    def peers(self) -> list[PeerRef]:
        return [peer.ref for peer in self._peers.values()]

    def is_connected(self, peer: PeerRef) -> bool:
        current = self._peers.get(peer.name)
        return current is not None and current.ref == peer

    # -- pushing -------------------------------------------------------------------------

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
        """Start writing src blocks (only ``layers`` of each, if given) into dst blocks of
        ``dest``; return the write's seq number.

        ``payload`` rides in this write's notification and reaches the reader when it lands.
        """
        refusal = self._tombstones.refusal(req_id, dest.token)
        if refusal is not None:
            raise refusal
        state = self._reqs.get((req_id, dest.token))
        if state is not None and state.error is not None:
            raise state.error
        if state is not None and state.sealed:
            raise TransferCancelledError(req_id, str(dest.peer), "its final blocks were already pushed")
        peer = self._resolve_peer(req_id, dest)
        src = check_block_ids(src_block_ids, self._region.num_blocks, "src_block_ids")
        if src.size == 0:
            raise InvalidBlocksError("src_block_ids", "is empty")
        reserved = state.reserved if state is not None else frozenset(dest.block_ids)
        dst_blocks = frozenset(dst_block_ids)
        if not reserved.issuperset(dst_blocks):
            outside = sorted(dst_blocks - reserved)[:8]
            raise InvalidBlocksError("dst_block_ids", f"blocks {outside} are not reserved for req {req_id}")
        if not 0 <= num_valid_blocks <= len(reserved):
            raise InvalidBlocksError("num_valid_blocks", f"{num_valid_blocks} is outside [0, {len(reserved)}]")
        runs = merge_runs(src, dst_block_ids, self._merge)
        if state is None:
            # A copy: the deadline below is updated in place, the caller's object is not ours.
            state = _SendState(req_id=req_id, dest=dataclasses.replace(dest), reserved=reserved)
            self._reqs[req_id, dest.token] = state
        # A renewed lease only ever extends the deadline the reserver handed out.
        state.dest.lease_deadline = max(state.dest.lease_deadline, dest.lease_deadline)
        write = _Write(
            seq=state.next_seq,
            num_valid_blocks=num_valid_blocks,
            runs=runs,
            dst_blocks=dst_blocks,
            notif=TransferNotif(req_id, dest.token, state.next_seq, num_valid_blocks, runs.dst_spans(), payload).encode(),
            layers=layers,
        )
        state.next_seq += 1
        state.sealed = num_valid_blocks == len(reserved)
        if state.deferred or self._conflicts(state, write):
            logger.debug("req %s: write %d waits for an earlier write to the same blocks", req_id, write.seq)
            state.deferred.append(write)
        else:
            self._post(state, write, peer)
        if state.error is not None:
            raise state.error
        return write.seq

    def _resolve_peer(self, req_id: str, dest: KVDestination) -> _Peer:
        peer = self._peers.get(dest.peer.name)
        if peer is not None and peer.ref.epoch == dest.peer.epoch:
            return peer
        if peer is not None and dest.peer.epoch < peer.ref.epoch:
            error = StaleEpochError(
                req_id, str(dest.peer), f"destination is from an old epoch; the peer now runs {peer.ref.epoch}"
            )
            self._fail_unstarted(req_id, dest, error)
        if dest.peer in self._lost:
            error = PeerLostError(req_id, str(dest.peer), "the peer was lost; its reservations are void")
            self._fail_unstarted(req_id, dest, error)
        raise HandshakeRequiredError(dest.peer.name, dest.peer.epoch, peer.ref.epoch if peer else None)

    def _conflicts(self, state: _SendState, write: _Write) -> bool:
        return any(not write.dst_blocks.isdisjoint(w.dst_blocks) for w in state.in_flight)

    def _post(self, state: _SendState, write: _Write, peer: _Peer | None = None, in_flight: list[_Write] | None = None) -> None:
        """Post ``write`` and count it in ``in_flight`` (the state's own list unless given)."""
        peer = peer or self._peers.get(state.dest.peer.name)
        if peer is None or peer.ref != state.dest.peer:
            self._fail(state, PeerLostError(state.req_id, str(state.dest.peer), "peer disconnected before the write"))
            return
        if not self._policy.can_post(state.dest.lease_deadline, self._wall()):
            self._fail(state, LeaseExpiredError(
                state.req_id, str(peer.ref),
                f"lease ends in less than the {self._policy.write_timeout_s}s write timeout",
            ))
            return
        try:
            if write.layers is None:
                write.handle = self._transport.post_write(peer.transport_name, write.runs, write.notif)
            else:  # the agent's transport (kvtransfer.sharded_transport) splits a write by layers
                write.handle = self._transport.post_write(peer.transport_name, write.runs, write.notif, layers=write.layers)
        except TransportError as e:
            self._count_failure(state)
            cls = PeerLostError if e.peer_lost else TransferFailedError
            self._fail(state, cls(state.req_id, str(peer.ref), str(e)))
            return
        write.posted_at = time.monotonic()
        (state.in_flight if in_flight is None else in_flight).append(write)

    # -- progress ------------------------------------------------------------------------

    def poll(self) -> list[SendEvent]:
        """Check in-flight writes, post deferred ones; return what happened since the last poll."""
        now = time.monotonic()
        for state in list(self._reqs.values()):
            self._progress(state, now)
        self._tombstones.expire(now)
        events, self._events = self._events, []
        return events

    def _progress(self, state: _SendState, now: float) -> None:
        peer = str(state.dest.peer)
        still: list[_Write] = []
        done: list[SendEvent] = []
        for w in state.in_flight:
            status = self._transport.check(w.handle)
            if status is XferState.DONE:
                self._transport.release(w.handle)
                self._count_done(state, w)
                if state.error is None:
                    done.append(SendEvent(state.req_id, peer, w.seq, w.num_valid_blocks, token=state.dest.token))
            elif status is XferState.FAILED:
                if not w.timed_out:
                    self._count_failure(state)
                if not self._transport.release(w.handle):
                    self._fail_still_running(state, w, still, TransferFailedError(
                        state.req_id, peer, f"write {w.seq} failed in the transport, and what runs of it could not be stopped"
                    ))
                elif not self._transport.receiver_lands:
                    # One-sided (NIXL), as at a timeout: a write reported failed (or whose state
                    # could not be read) may have landed, notification and all; posted again, its
                    # bytes could land after the receiver took the blocks or freed them. The
                    # request fails, and the router places it again on a fresh reservation.
                    self._fail(state, TransferFailedError(state.req_id, peer, f"write {w.seq} failed in the transport"))
                elif not self._retry(state, w, "failed in the transport", still):
                    self._fail(state, TransferFailedError(
                        state.req_id, peer, f"write {w.seq} failed in the transport ({w.num_retries} retries)"
                    ))
            elif now - w.posted_at > self._policy.write_timeout_s:
                if not w.timed_out:
                    self._count_failure(state)
                if not self._transport.release(w.handle):
                    self._fail_still_running(state, w, still, TransferTimeoutError(
                        state.req_id, peer, f"write {w.seq} not done after {self._policy.write_timeout_s}s"
                    ))
                elif not self._transport.receiver_lands:
                    # One-sided (NIXL): a write cancelled at its timeout may have landed, with its
                    # notification; posted again, its bytes could land after the receiver took
                    # the blocks (decoding into the last one) or freed them. The request fails,
                    # and the router places it again on a fresh reservation.
                    self._fail(state, TransferTimeoutError(
                        state.req_id, peer, f"write {w.seq} not done after {self._policy.write_timeout_s}s"
                    ))
                elif not self._retry(state, w, f"not done after {self._policy.write_timeout_s}s", still):
                    self._fail(state, TransferTimeoutError(
                        state.req_id, peer,
                        f"write {w.seq} not done after {self._policy.write_timeout_s}s ({w.num_retries} retries)",
                    ))
            else:
                still.append(w)
        state.in_flight = still
        while state.error is None and state.deferred and not self._conflicts(state, state.deferred[0]):
            self._post(state, state.deferred.popleft())
        finished = state.error is None and state.sealed and not state.in_flight and not state.deferred
        if finished:
            if done:
                done[-1].finished = True
            self._tombstones.bury(state.req_id, state.dest.token,
                                  TransferCancelledError(state.req_id, peer, "its final blocks were already pushed"))
            logger.info("req %s: all %d blocks sent to %s", state.req_id, len(state.reserved), peer)
        self._events.extend(done)
        if (finished or state.error is not None) and not state.in_flight:
            del self._reqs[state.req_id, state.dest.token]
            if state.error is not None:
                self.num_quiesced += 1

    def _fail_still_running(self, state: _SendState, write: _Write, still: list[_Write], error: RequestTransferError) -> None:
        """A write that could not be cancelled: it still counts as in flight (a quiesce waits for
        it), for it may yet land, and posting it again could race it. The request fails (once)."""
        if not write.timed_out:
            write.timed_out = True
            self._fail(state, error)
        still.append(write)

    def _retry(self, state: _SendState, write: _Write, why: str, still: list[_Write]) -> bool:
        """Post a write whose handle is released once more; False when its retries are spent.

        The same bytes into the same blocks with the same notification: a receiver that saw
        the first attempt's notification ignores the second as a duplicate.
        """
        if state.error is not None or write.num_retries >= self._policy.max_write_retries:
            return False
        write.num_retries += 1
        logger.warning("req %s: write %d %s; posting it again (retry %d of %d)",
                       state.req_id, write.seq, why, write.num_retries, self._policy.max_write_retries)
        self._post(state, write, in_flight=still)
        return state.error is None

    # -- leases --------------------------------------------------------------------------

    def extend_lease(self, req_id: str, token: int, lease_deadline: float) -> bool:
        """The reserver renewed the lease of reservation ``token``: writes may go on until then.

        Returns whether the request is sending into that reservation here right now.
        """
        state = self._reqs.get((req_id, token))
        if state is None:
            return False
        state.dest.lease_deadline = max(state.dest.lease_deadline, lease_deadline)
        return True

    def has_work(self) -> bool:
        """Whether a write is in flight or waiting, or a request is to be finished or failed:
        someone must keep polling. (A request between two pushes needs nothing: a prefill
        computing its next chunk does not keep the pump polling.)"""
        return bool(self._events) or any(
            state.in_flight or state.deferred or state.sealed or state.error is not None for state in self._reqs.values()
        )

    # -- failure and abort ---------------------------------------------------------------

    def _fail(self, state: _SendState, error: RequestTransferError) -> None:
        if state.error is not None:
            return
        state.error = error
        state.deferred.clear()
        self._tombstones.bury(state.req_id, state.dest.token, error)
        self._events.append(SendEvent(state.req_id, error.peer, state.next_seq - 1, 0, error=error, token=state.dest.token))
        logger.warning("req %s: transfer failed: %s", state.req_id, error)

    def _fail_unstarted(self, req_id: str, dest: KVDestination, error: RequestTransferError) -> None:
        state = self._reqs.get((req_id, dest.token)) or _SendState(req_id=req_id, dest=dest, reserved=frozenset(dest.block_ids))
        self._fail(state, error)
        raise error

    def cancel(self, req_id: str, token: int | None = None) -> QuiesceReport:
        """Refuse later pushes for ``req_id`` now; report the writes still in flight.

        With ``token`` only that reservation is refused, so the same request may be sent
        again into a fresh reservation (a retry elsewhere); without it, every one is.
        """
        states = self._states(req_id, token)
        peer = str(states[0].dest.peer) if states else "-"
        error = self._tombstones.bury(req_id, token, TransferCancelledError(req_id, peer, "cancelled"))
        for state in states:
            state.deferred.clear()
            state.error = state.error or error
            logger.info("req %s: cancelled with %d writes in flight into reservation %d", req_id, len(state.in_flight), state.dest.token)
        return self.quiesce_report(req_id, token)

    def quiesce_report(self, req_id: str, token: int | None = None) -> QuiesceReport:
        """Whether any write for ``req_id`` (into reservation ``token``, if given) is in flight."""
        num = 0
        for state in self._states(req_id, token):
            self._progress(state, time.monotonic())
            num += len(state.in_flight)
        return QuiesceReport(req_id=req_id, writer=self._local, quiesced=num == 0, num_in_flight=num)

    def _states(self, req_id: str, token: int | None) -> list[_SendState]:
        """The request's send states: into reservation ``token``, or (None) into any."""
        if token is not None:
            state = self._reqs.get((req_id, token))
            return [] if state is None else [state]
        return [state for (key, _), state in self._reqs.items() if key == req_id]

    def num_in_flight(self) -> int:
        return sum(len(s.in_flight) + len(s.deferred) for s in self._reqs.values())
