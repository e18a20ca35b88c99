"""Real NIXL between real Ray actors: bytes, progress, readiness, handshake and restarts."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest
import ray

from kvtransfer import KVCompat
from kvtransfer.handshake import PROTOCOL_VERSION
from kvtransfer.errors import (
    HandshakeRequiredError,
    IncompatiblePeerError,
    PeerLostError,
    RequestTransferError,
    StaleEpochError,
    TransferFailedError,
)
from tests.kvtransfer.actors import SMALL_COMPAT
from tests.kvtransfer.conftest import connect, pump, start_workers


def _split(pairs, rng, num_chunks):
    cuts = sorted(rng.sample(range(1, len(pairs)), num_chunks - 1))
    return [pairs[a:b] for a, b in zip([0, *cuts], [*cuts, len(pairs)])]


def _contiguous_run(free_ids, n):
    free = sorted(free_ids)
    for i in range(len(free) - n + 1):
        if free[i + n - 1] - free[i] == n - 1:
            return free[i : i + n]
    raise AssertionError(f"no {n} adjacent free blocks")


@pytest.mark.parametrize("pattern", ["scattered", "adjacent", "reversed", "repeated"])
@pytest.mark.parametrize("seed", [1, 2])
def test_block_patterns_arrive_byte_exact(nixl_pair, pattern, seed):
    p, d = nixl_pair
    rng = random.Random(f"{pattern}-{seed}")
    req_id = f"pattern-{pattern}-{seed}"
    n = rng.randint(8, 40)
    free = ray.get(d.free_ids.remote())
    if pattern == "scattered":
        src, dst = rng.sample(range(256), n), rng.sample(free, n)
    elif pattern == "adjacent":
        start = rng.randrange(0, 256 - n)
        src, dst = list(range(start, start + n)), _contiguous_run(free, n)
    else:  # reversed (and repeated, which also rewrites every block once more)
        start = rng.randrange(0, 128 - n)
        src, dst = list(range(start, start + n)), _contiguous_run(free, n)[::-1]
    dest = ray.get(d.reserve_ids.remote(req_id, dst))
    want = ray.get(p.fill.remote(src, seed))

    chunks = _split(list(zip(src, dst)), rng, 3)
    pushes, valid = [], 0
    for chunk in chunks:
        valid += len(chunk)
        pushes.append((req_id, dest, [s for s, _ in chunk], [t for _, t in chunk], valid))
    if pattern == "repeated":
        # First a stale version of every block, then the real one into the same blocks,
        # posted back to back: the second must not race the first.
        stale = [b + 128 for b in src]
        ray.get(p.fill.remote(stale, seed + 100))
        pushes = [(req_id, dest, stale, dst, n - 1), (req_id, dest, src, dst, n)]
    out = ray.get(p.step.remote(pushes))
    assert not out["refused"]
    # The receiver polls while the sender drains: on CPU, UCX completes writes only
    # when both sides make progress, as the decode loop will.
    ready = d.wait_ready.remote([req_id])
    ray.get(p.drain_sends.remote())
    assert ray.get(ready) == [req_id]
    assert ray.get(d.digests.remote(dst)) == want
    ray.get(d.complete.remote(req_id))


def test_progress_is_reported_in_order_and_ready_only_at_the_end(nixl_pair):
    p, d = nixl_pair
    req_id = "progress"
    dest = ray.get(d.reserve.remote(req_id, 12))
    src = list(range(200, 212))
    want = ray.get(p.fill.remote(src, 7))
    chunks = [(req_id, dest, src[i : i + 3], dest.block_ids[i : i + 3], i + 3) for i in range(0, 12, 3)]

    ray.get(p.step.remote(chunks[:3]))  # three chunks in flight at once
    pump(ray, p, [d])
    ray.get(d.poll_for.remote(0.1))
    assert not ray.get(d.is_ready.remote(req_id))
    assert ray.get(d.state.remote())["progress"][req_id] == [3, 6, 9]

    ray.get(p.step.remote(chunks[3:]))
    ready = d.wait_ready.remote([req_id])
    ray.get(p.drain_sends.remote())
    assert ray.get(ready) == [req_id]
    state = ray.get(d.state.remote())
    assert state["progress"][req_id] == [3, 6, 9, 12]
    assert (req_id, 12) in state["ready"]
    assert ray.get(d.digests.remote(dest.block_ids)) == want
    ray.get(d.complete.remote(req_id))


def test_not_ready_while_a_block_is_missing_and_lease_returns_blocks(nixl_pair):
    p, d = nixl_pair
    req_id = "missing-block"
    free_before = ray.get(d.num_free.remote())
    dest = ray.get(d.reserve.remote(req_id, 6, 3.0))
    # The writer claims all 6 valid but only wrote 5: never ready.
    out = ray.get(p.step.remote([(req_id, dest, [0, 1, 2, 3, 4], dest.block_ids[:5], 6)]))
    assert not out["refused"]
    pump(ray, p, [d])
    ray.get(d.poll_for.remote(0.1))
    assert not ray.get(d.is_ready.remote(req_id))
    assert ray.get(d.state.remote())["progress"][req_id] == [6]

    end = time.monotonic() + 10  # past the deadline (3 s) and the grace (0.3 s)
    while ray.get(d.num_free.remote()) != free_before and time.monotonic() < end:
        ray.get(d.poll_for.remote(0.2))
    state = ray.get(d.state.remote())
    assert "lease ran out with 5/6 blocks landed" in state["failed"][req_id]
    assert ray.get(d.num_free.remote()) == free_before


def _raised(ref):
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        ray.get(ref)
    return info.value.cause


def test_incompatible_peer_is_refused_naming_the_differences(nixl_pair):
    p, d = nixl_pair
    other = KVCompat("test/tiny", "float16", num_layers=2, num_kv_heads=2, head_dim=32, block_size=8)
    error = _raised(p.connect.remote(ray.get(d.foreign_offer.remote("DX", other))))
    assert isinstance(error, IncompatiblePeerError)
    assert "dtype: 'bfloat16' != 'float16'" in str(error) and "block_size: 4 != 8" in str(error)
    assert "DX@" in str(error)

    offer = dataclasses.replace(ray.get(d.offer.remote()), protocol_version=99)
    error = _raised(p.connect.remote(offer))
    assert isinstance(error, IncompatiblePeerError) and f"protocol_version: {PROTOCOL_VERSION} != 99" in str(error)
    assert SMALL_COMPAT.compat_hash() != other.compat_hash()


def test_restarted_peer_is_rehandshaken_and_stale_destinations_refused(ray_session, nixl_pair):
    p, _ = nixl_pair
    (old,) = start_workers(ray, ("DR", {}))
    connect(ray, p, old)
    old_dest = ray.get(old.reserve.remote("before-restart", 4))
    ray.get(p.step.remote([("before-restart", old_dest, [10, 11, 12, 13], old_dest.block_ids, 4)]))
    ready = old.wait_ready.remote(["before-restart"])
    ray.get(p.drain_sends.remote())
    assert ray.get(ready) == ["before-restart"]
    ray.kill(old)

    # Writing into the dead incarnation fails that request, naming peer and request.
    half = old_dest.block_ids[:2]
    dead_dest = dataclasses.replace(old_dest, req_id="to-dead")
    refusal = ray.get(p.try_push.remote("to-dead", dead_dest, [1, 2], half, 2))
    events = ray.get(p.drain_sends.remote())
    errors = [refusal] + [e.error for e in events if e.req_id == "to-dead" and e.error]
    assert any(isinstance(e, (PeerLostError, TransferFailedError)) for e in errors), errors
    assert all("to-dead" in str(e) and "DR@" in str(e) for e in errors if e is not None)

    (new,) = start_workers(ray, ("DR", {}))
    new_ref, old_ref = ray.get(new.ref.remote()), old_dest.peer
    assert new_ref.name == old_ref.name and new_ref.epoch > old_ref.epoch
    dest = ray.get(new.reserve.remote("after-restart", 4))
    assert isinstance(ray.get(p.try_push.remote("after-restart", dest, [20, 21, 22, 23], dest.block_ids, 4)),
                      HandshakeRequiredError)
    connect(ray, p, new)
    want = ray.get(p.fill.remote([20, 21, 22, 23], 3))
    ray.get(p.push.remote("after-restart", dest, [20, 21, 22, 23], dest.block_ids, 4))
    ready = new.wait_ready.remote(["after-restart"])
    ray.get(p.drain_sends.remote())
    assert ray.get(ready) == ["after-restart"]
    assert ray.get(new.digests.remote(dest.block_ids)) == want

    stale = dataclasses.replace(old_dest, req_id="stale")
    error = ray.get(p.try_push.remote("stale", stale, [1], stale.block_ids[:1], 1))
    assert isinstance(error, StaleEpochError) and isinstance(error, RequestTransferError)
    assert "stale" in str(error) and "DR@" in str(error)
    # The refusal is also an event of the shared prefill actor: taken here, so that the next test
    # to use the pair (in whatever order the modules run) finds no event of this one.
    leftover = ray.get(p.drain_sends.remote())
    assert all(e.req_id == "stale" and isinstance(e.error, StaleEpochError) for e in leftover), leftover
    ray.kill(new)
