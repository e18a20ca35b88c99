"""Killed peers: only their requests fail, the survivors keep working, blocks come back."""

from __future__ import annotations

import time

import pytest
import ray

from kvtransfer.errors import PeerLostError, RequestTransferError
from tests.kvtransfer.conftest import connect, pump, start_workers


@pytest.fixture(scope="module")
def cluster(nixl_pair):
    """Two prefill and two decode workers; the tests kill P1 and D2, the shared pair survives."""
    p2, d1 = nixl_pair
    p1, d2 = start_workers(ray, ("P1", {}), ("D2", {}))
    connect(ray, p1, d1)
    connect(ray, p2, d2)
    yield p1, p2, d1, d2
    for actor in (p1, d2):
        ray.kill(actor)


def _wait_until_dead(actor, timeout_s: float = 30.0) -> None:
    """ray.kill is asynchronous: a call made right after it may still be served."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get(actor.ping.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            return
        assert time.monotonic() < deadline, "the killed actor kept answering"
        time.sleep(0.1)


def _push_and_pump(sender, pushes, *receivers):
    """Post pushes, then drive them to completion while every receiver polls."""
    out = ray.get(sender.step.remote(pushes))
    assert not out["refused"], out["refused"]
    events = pump(ray, sender, receivers)
    assert not [e.error for e in events if e.error]


def test_killed_prefill_fails_only_its_requests_and_frees_their_blocks(cluster):
    p1, p2, d1, _ = cluster
    free_start = ray.get(d1.num_free.remote())
    a = ray.get(d1.reserve.remote("kp-a", 8))
    b = ray.get(d1.reserve.remote("kp-b", 8))
    c = ray.get(d1.reserve.remote("kp-c", 6, 3.5))
    _push_and_pump(p1, [("kp-a", a, list(range(4)), a.block_ids[:4], 4),
                        ("kp-c", c, list(range(8, 11)), c.block_ids[:3], 3)], d1)
    ray.kill(p1)
    _wait_until_dead(p1)

    # The other prefill worker's request into the same decode worker is untouched.
    want = ray.get(p2.fill.remote(list(range(30, 38)), 5))
    ready = d1.wait_ready.remote(["kp-b"])
    ray.get(p2.step.remote([("kp-b", b, list(range(30, 38)), b.block_ids, 8)]))
    ray.get(p2.drain_sends.remote())
    assert ray.get(ready) == ["kp-b"]
    assert ray.get(d1.digests.remote(b.block_ids)) == want
    ray.get(d1.complete.remote("kp-b"))

    # The router tells D1 to abort P1's requests. Blocks wait for a word from the writer:
    # for kp-a the worker knows P1 is dead (Ray said so) and confirms; kp-c waits out its lease.
    assert ray.get(d1.abort.remote("kp-a")) == []
    ray.get(d1.abort.remote("kp-c"))
    assert ray.get(d1.num_free.remote()) <= free_start - 8
    assert sorted(ray.get(d1.confirm.remote("kp-a"))) == sorted(a.block_ids)
    deadline = time.monotonic() + 10
    while ray.get(d1.num_free.remote()) != free_start and time.monotonic() < deadline:
        ray.get(d1.poll_for.remote(0.2))
    assert ray.get(d1.num_free.remote()) == free_start
    state = ray.get(d1.state.remote())
    assert state["reserved"] == 0 and state["late_writes"] == 0


def test_killed_decode_fails_only_its_requests_and_the_sender_goes_on(cluster):
    _, p2, d1, d2 = cluster
    x = ray.get(d2.reserve.remote("kd-x", 8))
    z = ray.get(d2.reserve.remote("kd-z", 4))
    y = ray.get(d1.reserve.remote("kd-y", 8))
    src_y = list(range(100, 108))
    want_y = ray.get(p2.fill.remote(src_y, 9))
    _push_and_pump(p2, [("kd-x", x, list(range(60, 64)), x.block_ids[:4], 4),
                        ("kd-z", z, list(range(70, 72)), z.block_ids[:2], 2),
                        ("kd-y", y, src_y[:4], y.block_ids[:4], 4)], d1, d2)
    ray.kill(d2)

    # The next write to the dead peer fails that request, naming it and the peer.
    refusal = ray.get(p2.try_push.remote("kd-x", x, list(range(64, 68)), x.block_ids[4:], 8))
    events = ray.get(p2.drain_sends.remote())
    errors = [e for e in [refusal] + [ev.error for ev in events if ev.req_id == "kd-x"] if e is not None]
    assert errors and all(isinstance(e, RequestTransferError) for e in errors), errors
    assert all("kd-x" in str(e) and "D2@" in str(e) for e in errors)

    # The request to the live peer finishes, byte-exact.
    ready = d1.wait_ready.remote(["kd-y"])
    ray.get(p2.step.remote([("kd-y", y, src_y[4:], y.block_ids[4:], 8)]))
    ray.get(p2.drain_sends.remote())
    assert ray.get(ready) == ["kd-y"]
    assert ray.get(d1.digests.remote(y.block_ids)) == want_y
    ray.get(d1.complete.remote("kd-y"))

    # Ray tells the worker D2 died: its remaining request fails and stays refused.
    assert ray.get(p2.disconnect.remote("D2")) == ["kd-z"]
    error = ray.get(p2.try_push.remote("kd-z", z, [72], z.block_ids[2:3], 3))
    assert isinstance(error, PeerLostError) and "kd-z" in str(error)
    assert ray.get(p2.ping.remote()) and ray.get(p2.num_in_flight.remote()) == 0
    # The sender also reported kd-z's loss as a send event, once: the router learns of it there.
    lost = ray.get(p2.drain_sends.remote())
    assert [(e.req_id, type(e.error)) for e in lost] == [("kd-z", PeerLostError)], lost
