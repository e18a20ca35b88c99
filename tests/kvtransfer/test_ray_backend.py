"""The Ray object-store backend behind the same interface: bytes, and dropped late writes."""

from __future__ import annotations

import pytest
import ray

from tests.kvtransfer.conftest import connect, start_workers


@pytest.fixture(scope="module")
def ray_pair(ray_session):
    p, d = start_workers(ray, ("RP", {"backend": "ray"}), ("RD", {"backend": "ray"}))
    connect(ray, p, d)
    yield p, d
    for actor in (p, d):
        ray.kill(actor)


def test_ray_backend_moves_scattered_and_repeated_blocks_byte_exact(ray_pair):
    p, d = ray_pair
    dest = ray.get(d.reserve_ids.remote("rb-1", [9, 3, 4, 5, 40, 41, 17]))
    src = [50, 51, 52, 12, 13, 14, 0]
    ray.get(p.fill.remote([b + 100 for b in src], 1))
    want = ray.get(p.fill.remote(src, 2))
    ready = d.wait_ready.remote(["rb-1"])
    # A stale version first, then the real one into the same blocks.
    ray.get(p.step.remote([
        ("rb-1", dest, [b + 100 for b in src], dest.block_ids, 6),
        ("rb-1", dest, src, dest.block_ids, 7),
    ]))
    ray.get(p.drain_sends.remote())
    assert ray.get(ready) == ["rb-1"]
    assert ray.get(d.digests.remote(dest.block_ids)) == want
    assert ray.get(d.state.remote())["progress"]["rb-1"] == [6, 7]
    ray.get(d.complete.remote("rb-1"))


def test_ray_backend_abort_frees_at_once_and_drops_the_late_write(ray_pair):
    p, d = ray_pair
    old = ray.get(d.reserve.remote("rb-old", 4))
    ray.get(p.fill.remote([0, 1, 2, 3], 3))
    ray.get(p.step.remote([("rb-old", old, [0, 1, 2, 3], old.block_ids, 2)]))
    ray.get(p.drain_sends.remote())  # delivered to D's mailbox, not yet landed
    # The receiver lands bytes itself, so an abort frees immediately...
    assert sorted(ray.get(d.abort.remote("rb-old"))) == sorted(old.block_ids)
    new = ray.get(d.reserve_ids.remote("rb-new", old.block_ids))
    want = ray.get(p.fill.remote([20, 21, 22, 23], 4))
    ready = d.wait_ready.remote(["rb-new"])
    ray.get(p.step.remote([("rb-new", new, [20, 21, 22, 23], new.block_ids, 4)]))
    ray.get(p.drain_sends.remote())
    # ...and the old request's payload, drained in the same poll, never touches them.
    assert ray.get(ready) == ["rb-new"]
    assert ray.get(d.digests.remote(new.block_ids)) == want
    ray.get(d.complete.remote("rb-new"))
