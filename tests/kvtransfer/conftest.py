"""Fixtures for kvtransfer: a prefill/decode pair of real Ray actors talking over real NIXL."""

from __future__ import annotations

import time

import pytest

from kvtransfer import LeasePolicy

# Short timeouts so lease paths run inside a test; both sides must share one policy.
TEST_POLICY = LeasePolicy(lease_s=20.0, grace_s=0.3, write_timeout_s=1.5)


def start_workers(ray, *specs):
    """Start KVWorker actors from (name, kwargs) pairs and wait until all are up."""
    from tests.kvtransfer.actors import KVWorker

    actors = [KVWorker.remote(name, **{"lease": TEST_POLICY, **kwargs}) for name, kwargs in specs]
    ray.get([a.ping.remote() for a in actors])
    return actors


def connect(ray, sender, receiver):
    """Handshake: fetch the receiver's offer over Ray, connect it on the sender."""
    return ray.get(sender.connect.remote(ray.get(receiver.offer.remote())))


def pump(ray, sender, receivers, timeout_s: float = 10.0) -> list:
    """Drive the sender's writes to completion while every receiver keeps polling.

    On CPU, UCX finishes a write only when both sides make progress, so a receiver that
    stops polling would turn a slow machine into spurious write timeouts.
    """
    events, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        (new, in_flight), *_ = ray.get([sender.poll_sends_once.remote()] + [r.poll_for.remote(0.02) for r in receivers])
        events.extend(new)
        if not in_flight:
            break
    return events


@pytest.fixture(scope="session")
def nixl_pair(ray_session):
    """(prefill P0, decode D0) over NIXL, shared by the tests that leave them healthy."""
    ray = ray_session
    p, d = start_workers(ray, ("P0", {}), ("D0", {}))
    connect(ray, p, d)
    yield p, d
    for actor in (p, d):
        ray.kill(actor)


@pytest.fixture(autouse=True)
def shared_pair_left_without_send_events(request):
    """The session's pair serves its tests in any order (two test processes pick modules freely).

    A send event a test leaves on the shared prefill actor is read by the next test as one of its
    own, so each test must take every event its requests caused: this fails the one that does not,
    where the cause is, and takes the events so that the next test still starts clean.
    """
    yield
    if "nixl_pair" not in request.fixturenames:
        return
    import ray

    sender, _ = request.getfixturevalue("nixl_pair")
    leftover = ray.get(sender.drain_sends.remote())
    assert not leftover, f"the test left send events on the shared prefill actor: {leftover}"
