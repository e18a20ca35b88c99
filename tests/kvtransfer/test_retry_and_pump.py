"""Write retries, lease renewal in bulk, and the transfer pump that runs while the engine computes."""

from __future__ import annotations

import os
import threading
import time

import torch

from kvtransfer import KVCompat, LeasePolicy
from kvtransfer.agent import KVAgent
from kvtransfer.errors import TransferFailedError, TransferTimeoutError
from kvtransfer.pump import TransferPump
from kvtransfer.transport import XferState
from tests.kvtransfer.test_protocol import FakeClock, dest, make_receiver, make_sender


def test_a_write_that_fails_in_the_transport_is_posted_again_before_the_request_fails_where_the_receiver_lands_the_bytes():
    sender, transport = make_sender(LeasePolicy(max_write_retries=2))
    transport.receiver_lands = True  # (the Ray backend: a late duplicate is dropped whole by the receiver)
    sender.push("r", dest("r", [0, 1]), [0, 1], [0, 1], 2)
    transport.states[0] = XferState.FAILED
    assert sender.poll() == [] and len(transport.posts) == 2  # retried, nothing reported yet
    assert transport.posts[1] == transport.posts[0]  # the same blocks and the same notification
    transport.states[1] = XferState.DONE
    (event,) = sender.poll()
    assert event.error is None and event.finished

    sender.push("s", dest("s", [2], token=2), [2], [2], 1)
    for attempt in range(3):
        transport.states[len(transport.posts) - 1] = XferState.FAILED
        events = sender.poll()
    assert len(transport.posts) == 5  # two of "r", the first post of "s" and its two retries
    assert len(events) == 1 and isinstance(events[0].error, TransferFailedError)
    assert "2 retries" in str(events[0].error)


def test_a_one_sided_write_that_fails_in_the_transport_is_not_posted_again_its_request_fails():
    """NIXL's write reported failed (or its state unreadable: the transport says failed) may have
    landed, notification and all, as one cancelled at its timeout may: posted again, its bytes
    could land in blocks the receiver took or freed meanwhile."""
    sender, transport = make_sender(LeasePolicy(max_write_retries=2))
    assert not transport.receiver_lands
    sender.push("r", dest("r", [0]), [0], [0], 1)
    transport.states[0] = XferState.FAILED
    (event,) = sender.poll()
    assert isinstance(event.error, TransferFailedError) and len(transport.posts) == 1


def test_a_timed_out_write_that_could_be_cancelled_is_retried_where_the_receiver_lands_the_bytes():
    sender, transport = make_sender(LeasePolicy(write_timeout_s=0.02, max_write_retries=1))
    transport.receiver_lands = True  # (the Ray backend: a late duplicate is dropped whole by the receiver)
    sender.push("r", dest("r", [0]), [0], [0], 1)
    time.sleep(0.03)
    assert sender.poll() == [] and len(transport.posts) == 2
    time.sleep(0.03)
    (event,) = sender.poll()
    assert isinstance(event.error, TransferTimeoutError) and "1 retries" in str(event.error)


def test_a_timed_out_one_sided_write_is_not_posted_again_its_request_fails():
    """NIXL's writes land in the receiver's memory on their own: one cancelled at its timeout may
    have landed, notification and all, and the receiver taken the blocks (decoding into the last
    one) or freed them; posted again, its bytes landed there once more."""
    sender, transport = make_sender(LeasePolicy(write_timeout_s=0.02, max_write_retries=2))
    assert not transport.receiver_lands
    sender.push("r", dest("r", [0]), [0], [0], 1)
    time.sleep(0.03)
    (event,) = sender.poll()
    assert isinstance(event.error, TransferTimeoutError) and len(transport.posts) == 1


def test_leases_renew_in_bulk_and_the_writer_may_post_past_the_first_deadline():
    clock = FakeClock()
    policy = LeasePolicy(lease_s=12, grace_s=1, write_timeout_s=10)
    receiver, _, _ = make_receiver(policy, clock)
    sender, transport = make_sender(policy, clock)
    first = receiver.reserve("a", [0, 1], lease_s=12)
    second = receiver.reserve("b", [2], lease_s=12)
    sender.push("a", first, [0], [0], 1)
    clock.now += 8  # 4 s left: too little for another 10 s write
    renewed = receiver.renew_leases(["a", "b", "gone"], 30)
    assert [(d.req_id, d.lease_deadline) for d in renewed] == [("a", clock.now + 30), ("b", clock.now + 30)]
    assert sender.extend_lease("a", first.token, renewed[0].lease_deadline)
    assert not sender.extend_lease("b", second.token, renewed[1].lease_deadline)  # nothing sent yet
    sender.push("a", first, [1], [1], 2)  # the stale copy in hand does not shorten the lease
    assert len(transport.posts) == 2


def _thread_cpu_seconds(native_id: int) -> float:
    fields = open(f"/proc/self/task/{native_id}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_for(take, done, timeout_s: float = 10.0) -> list:
    seen, deadline = [], time.monotonic() + timeout_s
    while not done(seen) and time.monotonic() < deadline:
        seen += take()
        time.sleep(0.01)
    return seen


def _pump_round_trip() -> dict:
    """Two real NIXL agents, each with its pump; nobody else ever polls them."""
    compat = KVCompat("m", "float32", 2, 1, 4, 8)
    sender_kv = torch.randn(16, *compat.block_shape())
    sender = KVAgent("P-pump", sender_kv, compat)
    receiver_kv = torch.zeros(16, *compat.block_shape())
    receiver = KVAgent("D-pump", receiver_kv, compat)
    sender.connect(receiver.handshake_offer())
    arrived = threading.Event()
    pumps = [TransferPump(sender), TransferPump(receiver, on_events=arrived.set)]
    for pump in pumps:
        pump.start()
    send_pump, receive_pump = pumps
    try:
        destination = receiver.reserve("r", [3, 4])
        receive_pump.kick()
        sender.push("r", destination, [1, 2], [3, 4], 2, payload="first-token")
        send_pump.kick()
        result = {"notified": arrived.wait(10)}
        result["ready"] = _wait_for(lambda: receive_pump.take_receive_events().ready, bool)
        result["payload"] = receiver.payload("r") if result["ready"] else ""
        sends = _wait_for(send_pump.take_send_events, lambda seen: any(e.finished or e.error for e in seen))
        result["sent"] = [(e.finished, e.error is None) for e in sends]
        result["bytes_equal"] = bool(torch.equal(receiver_kv[3:5], sender_kv[1:3]))
        receiver.complete("r")
        result["pending"] = (sender.has_pending_work(), receiver.has_pending_work())
        time.sleep(0.1)  # let both pumps reach their idle wait
        before = [_thread_cpu_seconds(p._thread.native_id) for p in pumps]
        time.sleep(1.0)
        after = [_thread_cpu_seconds(p._thread.native_id) for p in pumps]
        result["idle_cpu_s"] = [b - a for a, b in zip(before, after)]
        return result
    finally:
        for pump in pumps:
            pump.stop()
        sender.close()
        receiver.close()


def test_the_pump_completes_writes_while_nobody_else_polls_and_sleeps_when_idle(ray_session):
    # In a worker process: NIXL's native libraries must not share the test process with
    # grpc_tools' protoc extension (loading both in one process crashes it).
    result = ray_session.get(ray_session.remote(_pump_round_trip).remote())
    assert result["notified"], "the receiving pump saw no notification"
    assert result["ready"] == ["r"] and result["payload"] == "first-token"
    assert result["bytes_equal"], "the blocks landed byte for byte"
    assert (True, True) in result["sent"] and all(ok for _, ok in result["sent"])
    assert result["pending"] == (False, False)
    assert all(cpu <= 0.02 for cpu in result["idle_cpu_s"]), f"an idle pump must not spin: {result['idle_cpu_s']}"


def test_the_last_write_of_a_cancelled_request_ending_wakes_whoever_waits_for_it_to_quiesce():
    """A cancelled request's write that ends makes no event, and the pump told nobody: the
    prefill actor's wait_quiesced slept its whole timeout (2 s) while the decode actor held the
    reservation's blocks and every pipeline retry waited."""
    from types import SimpleNamespace

    from kvtransfer.messages import ReceiveEvents

    sender, transport = make_sender(LeasePolicy())
    sender.push("r", dest("r", [0]), [0], [0], 1)
    assert not sender.cancel("r").quiesced
    woken = threading.Event()
    agent = SimpleNamespace(  # the KVAgent's face the pump polls, over the real sender
        ref=SimpleNamespace(name="P"), poll_sends=sender.poll, poll_receives=ReceiveEvents,
        num_quiesced=lambda: sender.num_quiesced, has_pending_work=lambda: sender.num_in_flight() > 0,
    )
    pump = TransferPump(agent, on_events=woken.set)
    pump.start()
    try:
        time.sleep(0.05)
        woken.clear()  # whatever the cancel itself reported
        transport.states[0] = XferState.DONE
        assert woken.wait(1.0), "nobody was told the request quiesced"
    finally:
        pump.stop()
    assert sender.quiesce_report("r").quiesced


def test_an_aborted_requests_gathered_receive_events_are_dropped_but_freed_blocks_kept():
    """Receive events name the request only: gathered for an attempt the decode actor aborted,
    they were taken for a newer attempt of the request reserved there meanwhile (its KV taken
    for ready, or it failed with the older one's error). Freed blocks are the cache's: kept."""
    from kvtransfer.errors import RequestTransferError
    from kvtransfer.messages import FreedBlocks, ReceiveEvents
    from kvtransfer.pump import _merge_into

    agent = type("Agent", (), {"ref": type("Ref", (), {"name": "d"})()})()
    pump = TransferPump(agent)  # (not started)
    _merge_into(pump._receives, ReceiveEvents(
        progress=[("old", 2), ("other", 1)], ready=["old", "other"], failed=[RequestTransferError("old", "P", "lost")],
        freed=[FreedBlocks("old", [3, 4], "lease")],
    ))
    pump.discard_receive_events("old")
    events = pump.take_receive_events()
    assert events.progress == [("other", 1)] and events.ready == ["other"] and events.failed == []
    assert [f.block_ids for f in events.freed] == [[3, 4]]


def test_a_reservation_aborted_while_the_pump_polls_has_its_events_dropped_all_the_same():
    """The pump polled the agent, let go of it, and gathered the events a moment later: an abort
    on the engine thread in between (``discard_receive_events``) found nothing to drop, and the
    aborted attempt's events reached the next attempt of the request reserved there."""
    from kvtransfer.errors import RequestTransferError
    from kvtransfer.messages import ReceiveEvents

    class PollingAgent:  # the engine thread aborts "r" while the pump's poll of the agent runs
        ref = type("Ref", (), {"name": "d"})()

        def __init__(self):
            self.pump: TransferPump | None = None
            self.abort: threading.Thread | None = None

        def poll_sends(self):
            return []

        def poll_receives(self):
            self.abort = threading.Thread(target=self.pump.discard_receive_events, args=("r",))
            self.abort.start()
            self.abort.join(0.2)  # (it waits for the pump to have gathered, or it is done)
            return ReceiveEvents(ready=["r"], failed=[RequestTransferError("r", "P", "the older attempt's lease ran out")])

        def num_quiesced(self):
            return 0

    agent = PollingAgent()
    pump = agent.pump = TransferPump(agent)
    assert pump._poll_once()
    agent.abort.join(5.0)
    events = pump.take_receive_events()
    assert events.ready == [] and events.failed == [], "the aborted attempt's events are dropped"


def test_the_engine_thread_takes_events_while_a_slow_poll_of_the_agent_runs():
    """The pump held its lock across the agent's poll, which on the Ray backend fetches whole
    payloads (a prompt's KV, maybe from another node): the decode engine thread, which takes the
    events every turn, waited that long, and every running stream's step with it."""
    from kvtransfer.messages import ReceiveEvents

    class SlowAgent:
        ref = type("Ref", (), {"name": "d"})()

        def poll_sends(self):
            return []

        def poll_receives(self):
            time.sleep(0.5)  # fetching a payload
            return ReceiveEvents(ready=["r"])

        def num_quiesced(self):
            return 0

    pump = TransferPump(SlowAgent())
    pump._receives.ready.append("earlier")
    poller = threading.Thread(target=pump._poll_once)
    poller.start()
    time.sleep(0.05)
    started = time.perf_counter()
    taken = pump.take_receive_events()
    waited = time.perf_counter() - started
    poller.join(5.0)
    assert taken.ready == ["earlier"] and waited < 0.2
    assert pump.take_receive_events().ready == ["r"]
