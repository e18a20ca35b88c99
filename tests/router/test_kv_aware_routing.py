"""KV-aware routing: the router's index follows each worker's cache events, and the selector
weighs a cached prefix against load."""

from __future__ import annotations

import asyncio

import pytest

from engine.block_allocator import BlockAllocator, CacheEvent, chained_block_hashes
from router.capacity import DecodeCapacity
from router.pool import Role, WorkerPool, WorkerRecord
from router.prefix_index import PrefixIndex
from router.routing import KVAware, LeastLoaded
from workers.cache_events import CacheEventLog, CacheUpdate

BLOCK = 4


def _stored(worker_id: str, hashes, cursor: int = 0, reset: bool = False) -> CacheUpdate:
    return CacheUpdate(worker_id, cursor, [CacheEvent(h, stored=True) for h in hashes], reset=reset)


def _pool(role: Role, *loads: int) -> WorkerPool:
    index = PrefixIndex(BLOCK)
    pool = WorkerPool(KVAware(index, weight=1.0))
    for i, load in enumerate(loads):
        record = WorkerRecord(f"{role.value}-{i}", role, handle=None)
        pool.add(record)
        pool.assign(record, f"existing-{i}", load)
    return pool


def test_the_index_matches_only_a_leading_run_of_blocks_and_follows_evictions():
    index = PrefixIndex(BLOCK)
    prompt = list(range(100, 121))  # 21 tokens: 5 full blocks a hit may cover
    hashes = index.prompt_hashes(prompt)
    assert hashes == chained_block_hashes(prompt[:20], BLOCK) and len(hashes) == 5
    index.apply(_stored("w", hashes[:3]))
    index.apply(_stored("w", hashes[4:]))  # a later block without the one before it is no prefix
    assert index.num_cached_tokens("w", hashes) == 3 * BLOCK
    index.apply(CacheUpdate("w", 2, [CacheEvent(hashes[1], stored=False)]))
    assert index.num_cached_tokens("w", hashes) == BLOCK
    index.apply(_stored("w", hashes[:2], reset=True))  # a snapshot replaces what was known
    assert index.num_cached_tokens("w", hashes) == 2 * BLOCK and index.num_hashes("w") == 2
    assert index.num_cached_tokens("other", hashes) == 0


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE])
def test_a_cached_prefix_wins_unless_its_worker_is_busier_by_more_than_it_is_worth(role):
    pool = _pool(role, 0, 30)
    selector: KVAware = pool.selector
    prompt = list(range(1, 42))  # 41 tokens
    hashes = selector.index.prompt_hashes(prompt)
    selector.index.apply(_stored(f"{role.value}-1", hashes))  # worker 1 holds 40 tokens of it
    query = selector.query(prompt)
    assert selector.num_cached_tokens(pool.workers[f"{role.value}-1"], query) == 40
    assert pool.pick(role, query=query).worker_id == f"{role.value}-1", "30 queued tokens < 40 cached"
    pool.assign(pool.workers[f"{role.value}-1"], "more", 20)  # now 50 queued there
    assert pool.pick(role, query=query).worker_id == f"{role.value}-0"
    selector.weight = 0.0  # the weight turns the cache off: least loaded
    pool.release(pool.workers[f"{role.value}-1"], "more")
    assert pool.pick(role, query=query).worker_id == f"{role.value}-0"


def test_decode_capacity_grants_the_actor_with_room_that_the_selector_prefers():
    async def scenario():
        pool = _pool(Role.DECODE, 0, 0, 0)
        for record, room in zip(pool.workers.values(), (100, 100, 2)):
            record.num_reservable_blocks = room
        prompt = list(range(50))
        selector: KVAware = pool.selector
        selector.index.apply(_stored("decode-2", selector.index.prompt_hashes(prompt)))
        selector.index.apply(_stored("decode-1", selector.index.prompt_hashes(prompt)[:3]))
        capacity = DecodeCapacity(pool)
        # decode-2 holds the most but has no room for 13 blocks: decode-1, the next best, wins.
        granted = await capacity.acquire(13, 0, query=selector.query(prompt))
        assert granted.worker_id == "decode-1"

    asyncio.run(scenario())


def test_least_loaded_ignores_caches():
    pool = WorkerPool(LeastLoaded())
    for i, load in enumerate((5, 0)):
        record = WorkerRecord(f"prefill-{i}", Role.PREFILL, handle=None)
        pool.add(record)
        pool.assign(record, "r", load)
    assert pool.pick(Role.PREFILL).worker_id == "prefill-1"
    assert pool.selector.num_cached_tokens(pool.workers["prefill-0"], pool.selector.query([1, 2, 3])) == 0


# -- the worker's event log -----------------------------------------------------------------


def test_followers_get_what_follows_their_cursor_and_a_snapshot_when_the_log_lost_it():
    allocator = BlockAllocator(8)
    allocator.record_events = True
    log = CacheEventLog("w", max_events=4)
    hashes = chained_block_hashes(list(range(24)), BLOCK)
    for block_id, block_hash in zip(allocator.allocate(3), hashes):
        allocator.set_hash(block_id, block_hash)
    log.append(allocator.drain_events())
    assert log.since(-1) is None, "a new follower starts from a snapshot"
    first = log.since(0)
    assert [e.block_hash for e in first.events] == hashes[:3] and first.cursor == 3
    for block_id, block_hash in zip(allocator.allocate(3), hashes[3:]):
        allocator.set_hash(block_id, block_hash)
    log.append(allocator.drain_events())
    assert [e.block_hash for e in log.since(3).events] == hashes[3:6]
    assert log.since(0) is None, "the log keeps 4 events: cursor 0 fell out of it"
    snapshot = log.snapshot(allocator.cached_hashes())
    assert snapshot.reset and snapshot.cursor == 6 and {e.block_hash for e in snapshot.events} == set(hashes[:6])
    # The index built from the snapshot plus what follows equals the cache.
    index = PrefixIndex(BLOCK)
    index.apply(snapshot)
    assert index.num_hashes("w") == 6
    assert log.since(6).events == []


def test_a_waiting_follower_is_woken_by_the_next_append():
    async def scenario():
        log = CacheEventLog("w")
        log.append([CacheEvent(b"a" * 16, stored=True)])
        waiting = asyncio.create_task(log.wait_since(1, timeout_s=5))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await asyncio.get_running_loop().run_in_executor(None, log.append, [CacheEvent(b"b" * 16, stored=True)])
        update = await asyncio.wait_for(waiting, 1)
        assert [e.block_hash for e in update.events] == [b"b" * 16] and update.cursor == 2
        timed_out = await log.wait_since(2, timeout_s=0.05)
        assert timed_out.events == [] and timed_out.cursor == 2

    asyncio.run(scenario())


def test_stopping_the_feed_ends_even_when_a_follower_loses_its_cancellation(monkeypatch):
    """Python 3.11's ``wait_for`` drops a cancellation that arrives as the call it waits on ends
    (it returns the call's result instead). A follower that lost its cancellation so kept polling,
    and the router's stop waited for it for ever (a 30 s stop timeout in a test). Stopping ends
    anyway, and nothing starts following after it."""
    import router.prefix_index as prefix_index
    from router.prefix_index import PrefixFeed

    lost = []

    async def within_losing_the_first_cancellation(call, timeout_s):
        try:
            return await call
        except asyncio.CancelledError:
            if lost:
                raise
            lost.append(True)
            return CacheUpdate("decode-0", 0, [])

    class CacheEvents:
        @staticmethod
        def remote(cursor, poll_s):
            return asyncio.sleep(poll_s, result=CacheUpdate("decode-0", cursor + 1, []))

    class Handle:
        cache_events = CacheEvents

    monkeypatch.setattr(prefix_index, "within", within_losing_the_first_cancellation)
    pool = WorkerPool()
    pool.add(WorkerRecord("decode-0", Role.DECODE, handle=Handle()))

    async def scenario():
        feed = PrefixFeed(pool, PrefixIndex(BLOCK), call_timeout_s=1.0)
        feed.ensure()
        await asyncio.sleep(0.05)  # the follower waits in its long-poll
        await asyncio.wait_for(feed.stop(), timeout=5)
        feed.ensure()
        return feed

    feed = asyncio.run(scenario())
    assert lost == [True], "the first cancellation was lost, as 3.11's wait_for can"
    assert feed._tasks == {}, "no follower left running or started after the stop"
