"""Activations between pipeline stages over NIXL (kvtransfer.activations): a chunk written into
the next stage's inbox slot arrives exactly, with its request, attempt and tokens; a closed inbox
or another attempt ignores late writes; too few slots or staging slots send the caller to Ray.

Each test runs in a Ray worker process, as the stages do: NIXL's libraries stay out of the test
process (where they clash with others loaded later)."""

from __future__ import annotations

import threading
import time

import pytest
import ray
import torch

from engine.model import StageActivations


class _NoNixl(Exception):
    pass


def _in_a_worker(scenario):
    """Run ``scenario`` in a Ray worker; skip where NIXL is missing there."""
    outcome = ray.get(ray.remote(num_cpus=0)(_guarded).remote(scenario))
    if outcome is not None:
        pytest.skip(f"nixl is not available here: {outcome}")


def _guarded(scenario):
    try:
        scenario()
    except _NoNixl as exc:
        return str(exc)
    return None


def _channel(name: str, **kwargs):
    from kvtransfer import activations

    try:
        return activations.ActivationChannel(name, 8, torch.float32, torch.device("cpu"), slot_tokens=16, **kwargs)
    except activations.BackendUnavailableError as exc:
        raise _NoNixl(exc) from None


def _wait_for_arrivals(channel, count: int, timeout_s: float = 10.0):
    arrived, deadline = [], time.monotonic() + timeout_s
    while len(arrived) < count and time.monotonic() < deadline:
        arrived.extend(channel.take_arrivals())
        time.sleep(0.002)
    return arrived


def test_chunks_arrive_exactly_in_their_slots(ray_cluster):
    _in_a_worker(_chunks_arrive_exactly)


def _chunks_arrive_exactly():
    woken = threading.Event()
    sender, receiver = _channel("stage-a"), _channel("stage-b", on_arrival=woken.set)
    try:
        slots = receiver.open_inbox("req", 7, num_chunks=3)
        chunks = [StageActivations(torch.randn(n, 8), torch.randn(n, 8)) for n in (16, 16, 5)]
        for index, chunk in enumerate(chunks):
            assert sender.send(slots, index, "req", 7, 16 * index, chunk)
        arrived = sorted(_wait_for_arrivals(receiver, 3), key=lambda a: a.start)
        assert woken.is_set()
        assert [(a.req_id, a.token, a.start, a.num_tokens) for a in arrived] == [("req", 7, 0, 16), ("req", 7, 16, 16), ("req", 7, 32, 5)]
        for a, chunk in zip(arrived, chunks):
            got = a.activations()
            assert torch.equal(got.hidden, chunk.hidden) and torch.equal(got.residual, chunk.residual)
        # No residual (a stage that starts the residual stream later): the flag says so.
        slots = receiver.open_inbox("other", 1, num_chunks=1)
        assert sender.send(slots, 0, "other", 1, 0, StageActivations(torch.ones(3, 8), None))
        (a,) = _wait_for_arrivals(receiver, 1)
        assert a.activations().residual is None and torch.equal(a.activations().hidden, torch.ones(3, 8))
    finally:
        sender.close()
        receiver.close()


def test_a_closed_inbox_or_another_attempt_ignores_writes_and_slots_run_out(ray_cluster):
    _in_a_worker(_closed_inboxes_and_full_slots)


def _closed_inboxes_and_full_slots():
    sender, receiver = _channel("stage-c", num_staging_slots=1), _channel("stage-d", num_inbox_slots=4)
    try:
        slots = receiver.open_inbox("req", 1, num_chunks=3)
        assert receiver.open_inbox("big", 1, num_chunks=2) is None  # 1 free slot left: that request goes over Ray
        assert sender.send(slots, 0, "req", 2, 0, StageActivations(torch.ones(4, 8), torch.ones(4, 8)))  # attempt 2: not this inbox's
        assert _wait_for_arrivals(receiver, 1, timeout_s=0.5) == []
        receiver.close_inbox("req")
        # Its chunks never came: its slots come back once no write to them can be in flight.
        assert receiver.open_inbox("big", 1, num_chunks=4) is None
        from kvtransfer import activations

        quarantine, activations.QUARANTINE_S = activations.QUARANTINE_S, 0.0
        try:
            assert receiver.open_inbox("big", 1, num_chunks=4) is not None
        finally:
            activations.QUARANTINE_S = quarantine
        # A chunk longer than a slot, or beyond the slots given, is not sent this way.
        assert not sender.send(slots, 0, "req", 1, 0, StageActivations(torch.ones(17, 8), torch.ones(17, 8)))
        assert not sender.send(slots, 3, "req", 1, 0, StageActivations(torch.ones(4, 8), torch.ones(4, 8)))
    finally:
        sender.close()
        receiver.close()


def test_a_slot_awaiting_a_write_is_not_reused_until_the_write_landed(ray_cluster):
    _in_a_worker(_slot_quarantine)


def _slot_quarantine():
    """A request cancelled while the previous stage's write to its inbox is in flight: the slot
    that write targets goes to no other request until the write's notification came (it was
    reused at once, and the late write landed in the next request's chunk)."""
    sender, receiver = _channel("stage-e"), _channel("stage-f", num_inbox_slots=3)
    try:
        cancelled = receiver.open_inbox("cancelled", 1, num_chunks=2)
        assert sender.send(cancelled, 0, "cancelled", 1, 0, StageActivations(torch.ones(4, 8), None))
        assert len(_wait_for_arrivals(receiver, 1)) == 1
        receiver.close_inbox("cancelled")  # chunk 1's write is still to come
        pending = cancelled.addresses[1]
        taken = receiver.open_inbox("next", 1, num_chunks=2)
        assert taken is not None and pending not in taken.addresses  # the landed slot and a fresh one
        assert receiver.open_inbox("more", 1, num_chunks=1) is None
        # The late write lands (in the quarantined slot, read by nobody): the slot is free again.
        assert sender.send(cancelled, 1, "cancelled", 1, 16, StageActivations(torch.full((4, 8), 9.0), None))
        deadline = time.monotonic() + 10
        while (again := receiver.open_inbox("more", 1, num_chunks=1)) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert again is not None and again.addresses == [pending]
        assert _wait_for_arrivals(receiver, 1, timeout_s=0.3) == []  # nothing arrived for a live request
    finally:
        sender.close()
        receiver.close()


def test_a_request_that_finished_gives_back_every_slot_at_once(ray_cluster):
    _in_a_worker(_finished_frees_all)


def _finished_frees_all():
    """A stage that computed every chunk closes its inbox as finished: its spare slot and the
    slots of chunks that came over Ray or were cached are free at once (quarantined, every
    pipelined request took one out of use for a minute, and the inbox soon ran dry)."""
    sender, receiver = _channel("stage-g"), _channel("stage-h", num_inbox_slots=4)
    try:
        for attempt in range(12):
            slots = receiver.open_inbox(f"req-{attempt}", 1, num_chunks=3)  # 2 chunks and a spare
            assert slots is not None, attempt
            assert sender.send(slots, 0, f"req-{attempt}", 1, 0, StageActivations(torch.ones(4, 8), None))
            assert len(_wait_for_arrivals(receiver, 1)) == 1  # chunk 1 "came over Ray"
            receiver.close_inbox(f"req-{attempt}", finished=True)
    finally:
        sender.close()
        receiver.close()


def test_a_quarantine_past_its_time_ends_without_another_inbox_opening(ray_cluster):
    _in_a_worker(_quarantine_ends_by_time)


def _quarantine_ends_by_time():
    """A slot quarantined by a cancel whose late write never came was freed by time only when
    another inbox opened: until then an idle actor's poller looked every 16 ms, for good."""
    from kvtransfer import activations

    receiver = _channel("stage-q", num_inbox_slots=2)
    kept, activations.QUARANTINE_S = activations.QUARANTINE_S, 0.2  # (this worker process's module: put back after)
    try:
        assert receiver.open_inbox("cancelled", 1, num_chunks=2) is not None
        receiver.close_inbox("cancelled")  # no chunk landed: both slots wait for writes that never come
        assert receiver._quarantined
        deadline = time.monotonic() + 5
        while receiver._quarantined and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not receiver._quarantined, "the poller ended the quarantine once it was past its time"
    finally:
        receiver.close()
        activations.QUARANTINE_S = kept
