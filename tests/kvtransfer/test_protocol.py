"""Sender and receiver rules over a scripted transport: ordering, timeouts, leases, epochs."""

from __future__ import annotations

import time

import pytest

from kvtransfer.errors import (
    BlockInUseError,
    HandshakeRequiredError,
    IncompatiblePeerError,
    InvalidBlocksError,
    LeaseExpiredError,
    PeerLostError,
    TransferCancelledError,
    TransferTimeoutError,
)
from kvtransfer.handshake import PROTOCOL_VERSION, HandshakeOffer, transport_agent_name
from kvtransfer.layout import KVCompat, KVRegion
from kvtransfer.leases import LeasePolicy
from kvtransfer.messages import KVDestination, PeerRef, TransferNotif
from kvtransfer.receiver import KVReceiver
from kvtransfer.sender import KVSender
from kvtransfer.sharding import whole_shards
from kvtransfer.transport import Incoming, Transport, XferState

COMPAT = KVCompat("m", "bfloat16", 1, 1, 8, 2)
REGION = KVRegion(base_addr=0x1000, bytes_per_block=COMPAT.bytes_per_block, num_blocks=32)


class ScriptedTransport(Transport):
    """Writes stay in flight until the test finishes them; notifications are injected."""

    kind = "scripted"

    def __init__(self) -> None:
        self.posts: list[tuple[str, list, bytes]] = []
        self.states: dict[int, XferState] = {}
        self.inbox: list[Incoming] = []
        self.cancellable = True

    def metadata(self) -> bytes:
        return b"md"

    def add_peer(self, transport_name, metadata, region) -> None:
        pass

    def remove_peer(self, transport_name) -> None:
        pass

    def post_write(self, transport_name, runs, notif, piece=None):
        self.posts.append((transport_name, runs.as_list(), notif))
        self.states[len(self.posts) - 1] = XferState.IN_PROGRESS
        return len(self.posts) - 1

    def check(self, handle):
        return self.states[handle]

    def release(self, handle) -> bool:
        return self.states[handle] is not XferState.IN_PROGRESS or self.cancellable

    def get_incoming(self):
        inbox, self.inbox = self.inbox, []
        return inbox


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def offer(name: str, epoch: str) -> HandshakeOffer:
    peer = PeerRef(name, epoch)
    return HandshakeOffer(PROTOCOL_VERSION, peer, "scripted", transport_agent_name(peer), b"md", COMPAT,
                          COMPAT.compat_hash(), REGION, whole_shards(COMPAT.num_kv_heads), [REGION])


def make_sender(policy=None, clock=time.time):
    transport = ScriptedTransport()
    sender = KVSender(PeerRef("P", "e1"), transport, REGION, policy or LeasePolicy(), wall_clock=clock)
    sender.add_peer(offer("D", "e1"))
    return sender, transport


def dest(req_id, block_ids, deadline=None, epoch="e1", token=1):
    return KVDestination(req_id, PeerRef("D", epoch), block_ids, deadline or time.time() + 60, token)


def make_receiver(policy=None, clock=None):
    transport = ScriptedTransport()
    clock = clock or FakeClock()
    return KVReceiver(PeerRef("D", "e1"), transport, REGION, policy or LeasePolicy(), clock), transport, clock


def notif(req_id, token, seq, valid, spans):
    return Incoming("P@e1", TransferNotif(req_id, token, seq, valid, spans).encode())


def test_out_of_order_notifications_are_applied_in_sequence():
    receiver, transport, _ = make_receiver()
    d = receiver.reserve("r", [0, 1, 2, 3, 4, 5])
    transport.inbox = [notif("r", d.token, 2, 6, [(4, 2)])]
    events = receiver.poll()
    assert events.progress == [] and not receiver.ready("r")
    transport.inbox = [notif("r", d.token, 0, 2, [(0, 2)])]
    assert receiver.poll().progress == [("r", 2)]
    transport.inbox = [notif("r", d.token, 1, 4, [(2, 2)])]
    events = receiver.poll()
    assert events.progress == [("r", 4), ("r", 6)] and events.ready == ["r"]
    assert receiver.complete("r") == [0, 1, 2, 3, 4, 5]


def test_timeout_fails_only_its_request_and_an_uncancellable_write_blocks_quiesce():
    sender, transport = make_sender(LeasePolicy(write_timeout_s=0.05))
    sender.push("slow", dest("slow", [0, 1]), [0, 1], [0, 1], 2)
    sender.push("fast", dest("fast", [2, 3], token=2), [2, 3], [2, 3], 2)
    transport.states[1] = XferState.DONE
    transport.cancellable = False
    time.sleep(0.06)
    events = sender.poll()
    errors = [e.error for e in events if e.error]
    assert [e.req_id for e in events if not e.error] == ["fast"]
    assert len(errors) == 1 and isinstance(errors[0], TransferTimeoutError)
    assert "slow" in str(errors[0]) and "D@e1" in str(errors[0])
    report = sender.cancel("slow")
    assert not report.quiesced and report.num_in_flight == 1  # still counted: it may land
    transport.states[0] = XferState.DONE
    assert sender.quiesce_report("slow").quiesced


def test_a_write_into_a_block_still_being_written_waits_for_the_first():
    sender, transport = make_sender()
    d = dest("r", [0, 1, 2])
    sender.push("r", d, [5, 6], [0, 1], 1)
    sender.push("r", d, [7, 8], [1, 2], 3)
    assert len(transport.posts) == 1
    sender.poll()
    assert len(transport.posts) == 1
    transport.states[0] = XferState.DONE
    events = sender.poll()
    assert len(transport.posts) == 2 and [e.seq for e in events] == [0]
    transport.states[1] = XferState.DONE
    assert [(e.seq, e.finished) for e in sender.poll()] == [(1, True)]


def test_no_write_is_posted_that_could_outlive_the_lease():
    clock = FakeClock()
    sender, transport = make_sender(LeasePolicy(write_timeout_s=10), clock)
    d = dest("r", [0, 1], deadline=clock.now + 15)
    sender.push("r", d, [0], [0], 1)
    clock.now += 6  # 9 s left < 10 s write timeout
    with pytest.raises(LeaseExpiredError, match="req r"):
        sender.push("r", d, [1], [1], 2)
    assert len(transport.posts) == 1
    with pytest.raises(LeaseExpiredError):
        sender.push("r", d, [1], [1], 2)  # the failure sticks
    with pytest.raises(InvalidBlocksError, match="not reserved"):
        sender.push("other", dest("other", [4]), [0], [5], 1)


def test_blocks_have_one_owner_and_come_back_once_after_the_lease():
    receiver, transport, clock = make_receiver(LeasePolicy(lease_s=20, grace_s=2, write_timeout_s=5))
    d = receiver.reserve("r", [0, 1, 2])
    with pytest.raises(BlockInUseError, match="req r"):
        receiver.reserve("s", [2, 3])
    transport.inbox = [notif("r", d.token, 0, 1, [(0, 1)])]
    receiver.poll()
    assert receiver.abort("r") == []  # a write may still be in flight
    clock.now = d.lease_deadline + 1.9
    assert not receiver.poll().freed
    clock.now = d.lease_deadline + 2.0
    freed = receiver.poll().freed
    assert [(f.req_id, f.block_ids) for f in freed] == [("r", [0, 1, 2])]
    assert receiver.confirm_quiesced("r") == [] and receiver.abort("r") == []
    receiver.reserve("s", [2, 3])
    assert receiver.num_reserved_blocks() == 2


def test_abort_frees_ready_requests_at_once_and_others_on_confirmation():
    receiver, transport, _ = make_receiver()
    a = receiver.reserve("a", [0, 1])
    b = receiver.reserve("b", [2, 3])
    transport.inbox = [notif("a", a.token, 0, 2, [(0, 2)])]
    assert receiver.poll().ready == ["a"]
    assert receiver.abort("a") == [0, 1]
    assert receiver.abort("b") == []
    assert receiver.confirm_quiesced("b") == [2, 3]
    transport.inbox = [notif("b", b.token, 0, 2, [(2, 2)])]  # trails the quiesced report: not an alarm
    receiver.poll()
    assert receiver.num_late_writes == 0 and receiver.num_reserved_blocks() == 0


def test_a_new_reservation_of_a_request_sits_beside_its_aborted_one_until_that_is_confirmed_or_expires():
    """The router gives a reservation up (its writer's push failed) and places the request
    again at once, here too: the aborted reservation keeps its blocks until a confirm naming its
    token or its lease, and neither touches the new one; a live reservation is still one per
    request."""
    receiver, transport, clock = make_receiver(LeasePolicy(lease_s=20, grace_s=2, write_timeout_s=5))
    old = receiver.reserve("r", [0, 1])
    with pytest.raises(InvalidBlocksError, match="already holds"):
        receiver.reserve("r", [2, 3])
    assert receiver.abort("r") == []  # its writer may still be writing
    new = receiver.reserve("r", [2, 3])
    assert receiver.num_reserved_blocks() == 4
    transport.inbox = [notif("r", new.token, 0, 2, [(2, 2)]), notif("r", old.token, 0, 1, [(0, 1)])]
    assert receiver.poll().ready == ["r"] and receiver.block_ids("r") == [2, 3]
    assert receiver.confirm_quiesced("r", new.token + 1) == []  # no such reservation
    assert receiver.confirm_quiesced("r", old.token) == [0, 1]  # the old writer's word frees only its blocks
    assert receiver.ready("r") and receiver.num_reserved_blocks() == 2
    # An aborted one nobody confirms comes back at its lease's end, the newer one untouched.
    assert receiver.abort("r") == [2, 3]
    third = receiver.reserve("r", [4, 5])
    assert receiver.abort("r") == []
    clock.now += 10
    assert receiver.reserve("r", [6]).token != third.token
    clock.now = third.lease_deadline + 2.0
    assert [(f.req_id, f.block_ids) for f in receiver.poll().freed] == [("r", [4, 5])]
    assert receiver.block_ids("r") == [6] and receiver.num_reserved_blocks() == 1 and receiver.num_late_writes == 0


def test_a_reservation_given_up_answers_only_to_its_token_or_its_lease():
    """The router gives a reservation up and places the request again; the client may leave
    before the retry holds a reservation, and that ending confirms by name: it must not free
    blocks the given-up attempt's writer may still write into."""
    receiver, transport, clock = make_receiver(LeasePolicy(lease_s=20, grace_s=2, write_timeout_s=5))
    given_up = receiver.reserve("r", [0, 1])
    assert receiver.abort("r", given_up=True) == []
    assert receiver.confirm_quiesced("r") == [] and receiver.abort("r") == [] and receiver.num_reserved_blocks() == 2
    assert receiver.confirm_quiesced("r", given_up.token) == [0, 1]
    # Unconfirmed, its lease frees it.
    again = receiver.reserve("r", [2, 3])
    receiver.abort("r", given_up=True)
    clock.now = again.lease_deadline + 2.0
    assert [(f.req_id, f.block_ids) for f in receiver.poll().freed] == [("r", [2, 3])] and receiver.num_reserved_blocks() == 0


def test_epochs_new_peer_replaces_old_and_old_offers_are_refused():
    sender, transport = make_sender()
    sender.push("r", dest("r", [0]), [0], [0], 0)
    with pytest.raises(HandshakeRequiredError, match="epoch e2"):
        sender.push("s", dest("s", [1], epoch="e2"), [0], [1], 1)
    sender.add_peer(offer("D", "e2"))
    events = sender.poll()
    assert [(e.req_id, type(e.error)) for e in events] == [("r", PeerLostError)]
    assert "restarted" in str(events[0].error)
    with pytest.raises(IncompatiblePeerError, match="epoch"):
        sender.add_peer(offer("D", "e1"))
    sender.push("s", dest("s", [1], epoch="e2"), [0], [1], 1)
    assert transport.posts[-1][0] == "D@e2"


def test_cancel_by_token_refuses_that_attempt_only():
    sender, transport = make_sender()
    first, retry = dest("r", [0, 1], token=11), dest("r", [2, 3], token=12)
    sender.push("r", first, [0], [0], 1)
    report = sender.cancel("r", token=11)
    assert not report.quiesced and report.num_in_flight == 1
    transport.states[0] = XferState.DONE
    assert sender.quiesce_report("r", token=11).quiesced
    sender.poll()
    with pytest.raises(TransferCancelledError):
        sender.push("r", first, [1], [1], 2)
    sender.push("r", retry, [0, 1], [2, 3], 2)  # the retry's reservation is still writable
    assert transport.posts[-1][1][0].dst_start == 2
    assert sender.cancel("r").quiesced is False  # no token: the live attempt is cancelled too
    with pytest.raises(TransferCancelledError):
        sender.push("r", dest("r", [4], token=13), [0], [4], 1)


def test_a_retry_into_a_fresh_reservation_is_sent_while_the_cancelled_attempts_write_is_in_flight():
    """A decode actor dies mid-push; the request comes back to this prefill actor (it holds the
    prompt's prefix) with a new reservation before the old write has finished or timed out. The
    retry is sent at once (it was refused: "still sending into reservation 11"), each
    attempt's writes are counted apart, and the old one's end leaves the retry alone."""
    sender, transport = make_sender()
    first, retry = dest("r", [0, 1], token=11), dest("r", [2, 3], token=12)
    sender.push("r", first, [0], [0], 1)
    assert not sender.cancel("r", token=11).quiesced  # its write is still in flight
    sender.push("r", retry, [0, 1], [2, 3], 2)
    assert [run.dst_start for run in transport.posts[-1][1]] == [2]
    assert sender.quiesce_report("r", token=11).num_in_flight == 1 and sender.quiesce_report("r", token=12).num_in_flight == 1
    assert sender.quiesce_report("r").num_in_flight == 2
    assert sender.extend_lease("r", 12, time.time() + 120) and sender.extend_lease("r", 11, time.time() + 120)
    transport.states[0] = XferState.DONE  # the cancelled attempt's write ends
    sender.poll()
    assert sender.quiesce_report("r", token=11).quiesced and not sender.extend_lease("r", 11, time.time() + 120)
    transport.states[1] = XferState.DONE
    events = sender.poll()
    assert [(e.req_id, e.token, e.error) for e in events] == [("r", 12, None)] and events[-1].finished
    assert sender.quiesce_report("r").quiesced and sender.num_in_flight() == 0


def test_a_renewed_lease_lets_a_slow_prefill_keep_writing():
    clock = FakeClock()
    policy = LeasePolicy(lease_s=12, grace_s=1, write_timeout_s=10)
    receiver, _, _ = make_receiver(policy, clock)
    sender, transport = make_sender(policy, clock)
    d = receiver.reserve("r", [0, 1], lease_s=12)
    sender.push("r", d, [0], [0], 1)
    clock.now += 5  # 7 s left: too little for another 10 s write
    renewed = receiver.renew_lease("r", 30)
    assert renewed.lease_deadline == clock.now + 30 and renewed.token == d.token
    sender.push("r", renewed, [1], [1], 2)
    assert len(transport.posts) == 2
    clock.now = d.lease_deadline + 2  # the old deadline and grace passed: still reserved
    assert not receiver.poll().failed and receiver.num_reserved_blocks() == 2


def test_a_reservation_for_two_writers_is_ready_only_when_both_wrote_every_block():
    """Pipeline stages each write their own layers of every block: the request is ready once
    both have landed all blocks, progress is the slower writer's, a third writer is ignored."""
    receiver, transport, _ = make_receiver()
    d = receiver.reserve("r", [0, 1, 2, 3], num_writers=2)

    def write(sender, seq, valid, spans):
        return Incoming(sender, TransferNotif("r", d.token, seq, valid, spans).encode())

    transport.inbox = [write("S0@e1", 0, 2, [(0, 2)]), write("S0@e1", 1, 4, [(2, 2)])]
    events = receiver.poll()
    assert events.progress == [] and not receiver.ready("r"), "one stage alone makes nothing valid"
    transport.inbox = [write("S1@e1", 1, 4, [(2, 2)]), write("S1@e1", 0, 2, [(0, 2)])]  # out of order
    events = receiver.poll()
    assert events.progress == [("r", 2), ("r", 4)] and events.ready == ["r"]
    transport.inbox = [write("S2@e1", 0, 4, [(0, 4)])]
    assert not receiver.poll(), "a writer beyond the expected two changes nothing"
    assert receiver.complete("r") == [0, 1, 2, 3]


def test_a_two_writer_reservation_whose_lease_runs_out_with_one_writer_done_fails():
    receiver, transport, clock = make_receiver(LeasePolicy(lease_s=10.0, grace_s=1.0, write_timeout_s=2.0))
    d = receiver.reserve("r", [5, 6], num_writers=2)
    transport.inbox = [Incoming("S0@e1", TransferNotif("r", d.token, 0, 2, [(5, 2)]).encode())]
    assert not receiver.poll().ready
    clock.now += 10.5  # past the lease, within its grace
    events = receiver.poll()
    assert [e.req_id for e in events.failed] == ["r"] and "0/2 blocks landed" in str(events.failed[0])
    clock.now += 1
    assert [f.block_ids for f in receiver.poll().freed] == [[5, 6]]
