"""A full decode pool queues requests in order; overload is refused at admission, with a hint."""

from __future__ import annotations

import asyncio

import pytest

from engine.sampling_params import SamplingParams
from router.admission import BusyRate, WindowRate, estimate_wait
from router.capacity import DecodeCapacity
from router.config import Disaggregation, RouterConfig
from router.dispatcher import ActiveRequest, Dispatcher
from router.errors import ResourceExhaustedError
from router.pool import Role, WorkerPool, WorkerRecord
from router.validation import ValidatedRequest


def _pool(*reservable: int | None) -> WorkerPool:
    pool = WorkerPool()
    for i, blocks in enumerate(reservable):
        pool.add(WorkerRecord(f"decode-{i}", Role.DECODE, handle=None, num_reservable_blocks=blocks))
    return pool


def test_waiters_are_served_by_priority_then_arrival_and_a_big_head_holds_back_the_rest():
    async def scenario():
        pool = _pool(0)
        capacity = DecodeCapacity(pool)
        pool.on_change = capacity.on_report
        granted: list[str] = []

        async def want(name: str, blocks: int, priority: int = 0):
            await capacity.acquire(blocks, priority)
            granted.append(name)

        tasks = [asyncio.create_task(want("big", 10)), asyncio.create_task(want("small", 1))]
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(want("urgent", 2, priority=5)))
        await asyncio.sleep(0)
        assert granted == [] and capacity.num_waiting == 3 and capacity.num_blocks_waiting == 13
        record = pool.workers["decode-0"]
        record.num_reservable_blocks = 5  # a report: room for "urgent", then not for "big"
        capacity.on_report()
        await asyncio.sleep(0)
        assert granted == ["urgent"], "the small request must not overtake the big one ahead of it"
        assert record.num_reservable_blocks == 3  # debited until the next report
        record.num_reservable_blocks = 11
        capacity.on_report()
        await asyncio.gather(*tasks)
        assert granted == ["urgent", "big", "small"]

    asyncio.run(scenario())


def test_a_prompt_larger_than_every_decode_cache_is_refused_and_lets_the_queue_move():
    """Where the KV cache holds less than the context, a prompt can need more blocks than any
    decode actor has at all: it is refused naming the prompt, not left waiting at the head of
    the queue (with no deadline, for good) holding back every request behind it."""
    from router.errors import InvalidArgumentError

    async def scenario():
        pool = _pool(50, 80)
        for record, size in zip(pool.routable(Role.DECODE), (100, 120)):
            record.num_kv_blocks = size
        capacity = DecodeCapacity(pool)
        big = asyncio.create_task(capacity.acquire(121, 0))
        small = asyncio.create_task(capacity.acquire(60, 0))
        with pytest.raises(InvalidArgumentError) as raised:
            await asyncio.wait_for(big, 1)
        assert raised.value.field == "prompt" and "120 blocks" in raised.value.problem
        assert (await asyncio.wait_for(small, 1)).worker_id == "decode-1"
        # Waiting for room the largest cache has (once it frees up) is not refused.
        fits_later = asyncio.create_task(capacity.acquire(120, 0))
        await asyncio.sleep(0.01)
        assert not fits_later.done()
        pool.workers["decode-1"].num_reservable_blocks = 120
        capacity.on_report()
        assert (await asyncio.wait_for(fits_later, 1)).worker_id == "decode-1"

    asyncio.run(scenario())


@pytest.mark.parametrize("max_wait_s", [None, 0.2])
def test_a_low_priority_waiter_is_served_once_it_has_waited_max_wait_s(max_wait_s):
    """Under a steady stream of urgent requests, strict priority starves a low one; aging bounds its wait."""

    async def scenario():
        pool = _pool(0)
        capacity = DecodeCapacity(pool, max_wait_s=max_wait_s)
        record = pool.workers["decode-0"]
        granted: list[str] = []

        async def want(name: str, priority: int):
            await capacity.acquire(1, priority)
            granted.append(name)

        tasks = [asyncio.create_task(want("patient", -1))]
        for round_index in range(8):  # 0.4 s: a new urgent request and room for one, every 50 ms
            tasks.append(asyncio.create_task(want(f"urgent-{round_index}", 5)))
            await asyncio.sleep(0.05)
            record.num_reservable_blocks = 1
            capacity.on_report()
            await asyncio.sleep(0)
        for task in tasks:
            task.cancel()
        return granted

    granted = asyncio.run(scenario())
    if max_wait_s is None:
        assert "patient" not in granted
    else:
        assert "patient" in granted and granted.index("patient") <= 5, granted


def test_a_waiter_that_gives_up_leaves_the_queue_and_unblocks_the_next():
    async def scenario():
        pool = _pool(3)
        capacity = DecodeCapacity(pool)
        big = asyncio.create_task(capacity.acquire(10, 0))
        small = asyncio.create_task(capacity.acquire(2, 0))
        await asyncio.sleep(0)
        assert not small.done()
        big.cancel()  # its deadline passed, or the client left
        record = await asyncio.wait_for(small, 1)
        assert record.worker_id == "decode-0" and capacity.num_waiting == 0

    asyncio.run(scenario())


def test_unknown_room_counts_as_room_and_the_least_loaded_actor_with_room_wins():
    async def scenario():
        pool = _pool(1, None, 50)
        pool.workers["decode-1"].num_assigned = 3
        capacity = DecodeCapacity(pool)
        assert (await capacity.acquire(4, 0)).worker_id == "decode-2"
        pool.workers["decode-2"].num_assigned = 9
        assert (await capacity.acquire(4, 0)).worker_id == "decode-1"

    asyncio.run(scenario())


def test_rates_are_measured_over_busy_time_only():
    rate = BusyRate(smoothing=1.0)
    rate.done(1000, busy_since=10.0, now=12.0)
    assert rate.per_second == 500
    rate.done(300, busy_since=100.0, now=101.0)  # idle from 12 to 100: not counted as slowness
    assert rate.per_second == 300
    window = WindowRate(window_s=10)
    window.add(5, now=0.0)
    assert window.per_second(now=0.5) is None  # too little history
    window.add(15, now=4.0)
    assert window.per_second(now=5.0) == 4.0
    assert window.per_second(now=13.5) == 1.5  # the first event left the window


def test_estimate_adds_prefill_queue_and_kv_wait_and_knows_when_it_cannot_tell():
    estimate = estimate_wait(3000, 1000.0, 20, 4.0)
    assert (estimate.prefill_s, estimate.kv_s, estimate.total_s) == (3.0, 5.0, 8.0)
    assert estimate_wait(3000, None, 0, None).total_s == 0.0
    assert estimate_wait(3000, None, 5, None).total_s is None


def _active(req_id: str, num_tokens: int) -> ActiveRequest:
    request = ValidatedRequest(req_id, list(range(num_tokens)), None, SamplingParams(), [], True, 0, 0.0, None)

    class _Assembler:
        has_sent_tokens = False
        completion_token_ids: list[int] = []

    return ActiveRequest(request, _Assembler(), outputs=None)


def test_admission_refuses_what_would_wait_past_the_budget_and_says_when_to_retry():
    pool = WorkerPool()
    prefill = WorkerRecord("prefill-0", Role.PREFILL, handle=None, num_assigned_prompt_tokens=9000)
    pool.add(prefill)
    pool.add(WorkerRecord("decode-0", Role.DECODE, handle=None, num_reservable_blocks=1000))
    config = RouterConfig(disaggregation=Disaggregation.ALWAYS, admission_ttft_budget_s=10.0)
    dispatcher = Dispatcher(pool, config, block_size=16)
    dispatcher.admit(_active("unmeasured", 1000))  # no rate measured yet: never refused on a guess
    prefill.prefill_rate.per_second = 500.0  # measured: 9000 queued + 1000 = 20 s of prefill
    with pytest.raises(ResourceExhaustedError, match=r"20\.0s.*over the 10s budget; retry in 10s") as refused:
        dispatcher.admit(_active("late", 1000))
    assert refused.value.retry_after_s == pytest.approx(10.0)
    prefill.num_assigned_prompt_tokens = 3000
    dispatcher.admit(_active("fits", 1000))  # 8 s: admitted


def test_a_request_waiting_for_room_when_the_last_decode_actor_dies_waits_for_the_pool_not_forever():
    """Queued for room on the only decode actor, which then died: no report would ever grant it,
    and with no capacity_wait_s or deadline (HTTP requests have none) it waited forever, holding
    a place in max_queued_requests. It now waits for the decode pool to come back, bounded
    (ready_wait_s: UNAVAILABLE), and is placed once one does."""
    from types import SimpleNamespace

    from router.errors import UnavailableError

    async def scenario(replacement: bool):
        pool = _pool(0)
        pool.add(WorkerRecord("prefill-0", Role.PREFILL, handle=None))
        reserved = []

        async def reserve(request):
            reserved.append(request.req_id)
            raise ResourceExhaustedError("stop here: placed")

        async def decode_ready():
            if not replacement:
                raise UnavailableError("no decode worker is ready (waited 0.1 s)")
            pool.add(WorkerRecord("decode-1", Role.DECODE, handle=SimpleNamespace(reserve=SimpleNamespace(remote=reserve)), num_reservable_blocks=50))

        dispatcher = Dispatcher(pool, RouterConfig(disaggregation=Disaggregation.ALWAYS), decode_ready=decode_ready)
        request = ValidatedRequest("r", [5] * 40, None, SamplingParams(max_tokens=4), [], True, 0, 0.0, None)
        active = ActiveRequest(request, None, outputs=None)
        active.work = request
        placing = asyncio.create_task(dispatcher.dispatch(active))
        await asyncio.sleep(0.05)
        assert not placing.done() and dispatcher.capacity.num_waiting == 1  # queued for room
        dispatcher.on_worker_died(pool.workers["decode-0"])
        with pytest.raises((UnavailableError, ResourceExhaustedError)) as ended:
            await asyncio.wait_for(placing, 5)
        return type(ended.value), reserved

    assert asyncio.run(scenario(replacement=False)) == (UnavailableError, [])
    assert asyncio.run(scenario(replacement=True)) == (ResourceExhaustedError, ["r"])


def test_aged_waiters_go_oldest_first_whatever_their_priority():
    """Aged waiters kept their priority in the queue's key: a newer urgent request that aged too
    went ahead of an older low one, so under sustained overload the low one starved anyway."""

    async def scenario():
        pool = _pool(0)
        capacity = DecodeCapacity(pool, max_wait_s=0.1)
        granted: list[str] = []

        async def want(name: str, priority: int):
            await capacity.acquire(1, priority)
            granted.append(name)

        tasks = [asyncio.create_task(want("old-low", 0))]
        await asyncio.sleep(0.05)
        tasks.append(asyncio.create_task(want("newer-urgent", 5)))
        await asyncio.sleep(0.2)  # both aged
        pool.workers["decode-0"].num_reservable_blocks = 1
        capacity.on_report()
        await asyncio.sleep(0)
        for task in tasks:
            task.cancel()
        return granted

    assert asyncio.run(scenario()) == ["old-low"]


def _measured_dispatcher(**config) -> tuple[Dispatcher, WorkerRecord]:
    pool = WorkerPool()
    prefill = WorkerRecord("prefill-0", Role.PREFILL, handle=None)
    pool.add(prefill)
    pool.add(WorkerRecord("decode-0", Role.DECODE, handle=None, num_reservable_blocks=1000))
    dispatcher = Dispatcher(pool, RouterConfig(disaggregation=Disaggregation.ALWAYS, admission_ttft_budget_s=10.0, **config), block_size=16)
    prefill.prefill_rate.per_second = 100.0
    return dispatcher, prefill


def test_a_prompt_longer_than_the_budget_alone_is_admitted_on_an_idle_deployment():
    """Its own prefill (30 s at 100 tok/s) counted against the budget: refused at every retry, on
    an idle deployment, with a retry hint that could never come true. Then any work ahead of it,
    however little, refused it at every retry under steady traffic: it may wait behind others
    for half the budget. More than that still refuses it, with the hint of when it is done."""
    dispatcher, prefill = _measured_dispatcher()
    dispatcher.admit(_active("long", 3000))
    prefill.num_assigned_prompt_tokens = 100  # 1 s of others' prompts ahead: 31 s
    dispatcher.admit(_active("under steady traffic", 3000))
    prefill.num_assigned_prompt_tokens = 500  # 5 s: half the budget
    dispatcher.admit(_active("behind half the budget", 3000))
    prefill.num_assigned_prompt_tokens = 800  # 8 s ahead: 3 s past half the budget
    with pytest.raises(ResourceExhaustedError, match="retry in 3s") as refused:
        dispatcher.admit(_active("behind", 3000))
    assert refused.value.retry_after_s == pytest.approx(3.0)


def test_prompts_placed_but_not_yet_prefilling_count_in_the_estimate():
    """A burst is admitted before any of it reaches a prefill actor: each was judged against an
    empty queue (50 long prompts in, the last waiting minutes against a 10 s budget)."""
    dispatcher, prefill = _measured_dispatcher()
    dispatcher._prefill_tokens_on_the_way.update({"a": 600, "b": 600})
    assert dispatcher.estimate_wait(_active("next", 100).request).prefill_s == pytest.approx(13.0)


def test_prompts_waiting_for_decode_room_count_in_the_estimate_until_placed():
    """Admitted while the decode pool was full, a burst waited for room before any of it was
    placed: the estimate's prefill queue left all of it out, and every later arrival was judged
    as if the prefill actors had nothing coming. It counts from admission until the request is
    placed (then as placed, once), and not after it is gone."""
    from types import SimpleNamespace

    async def scenario():
        dispatcher, prefill = _measured_dispatcher()
        decode = dispatcher.pool.workers["decode-0"]
        decode.num_reservable_blocks = 0  # full: the burst waits for room
        reserved = asyncio.Event()

        async def reserve(request):
            reserved.set()
            await asyncio.sleep(3600)

        async def nothing(*args):
            return None

        decode.handle = SimpleNamespace(reserve=SimpleNamespace(remote=reserve), abort=SimpleNamespace(remote=nothing),
                                        confirm_quiesced=SimpleNamespace(remote=nothing))
        dispatcher._ensure_collector = lambda record: None
        burst = [_active(name, 600) for name in ("a", "b")]
        for active in burst:
            dispatcher.admit(active)
        placing = [asyncio.create_task(dispatcher.dispatch(active)) for active in burst]
        await asyncio.sleep(0.05)
        assert dispatcher.capacity.num_waiting == 2
        waiting = dispatcher.estimate_wait(_active("next", 100).request).prefill_s
        decode.num_reservable_blocks = 1000  # room for both: their reservations go out
        dispatcher.capacity.on_report()
        await asyncio.wait_for(reserved.wait(), 5)
        await asyncio.sleep(0.05)
        reserving = dispatcher.estimate_wait(_active("next", 100).request).prefill_s
        for task in placing:
            task.cancel()
        await asyncio.gather(*placing, return_exceptions=True)
        for active in burst:
            await dispatcher.finish(active)
        gone = dispatcher.estimate_wait(_active("next", 100).request).prefill_s
        return waiting, reserving, gone

    waiting, reserving, gone = asyncio.run(scenario())
    assert waiting == pytest.approx(13.0), "1200 tokens waiting for room + its own 100, at 100 tok/s"
    assert reserving == pytest.approx(13.0), "counted once while their reservations are in flight"
    assert gone == pytest.approx(1.0)


def test_the_admission_estimate_takes_no_round_robin_turn():
    """The estimate asked the pool's selector for a prefill actor: a round-robin turn spent, so
    with two prefill actors every prompt went to the same one."""
    from router.routing import RoundRobin

    pool = WorkerPool(selector=RoundRobin())
    for name in ("prefill-0", "prefill-1"):
        pool.add(WorkerRecord(name, Role.PREFILL, handle=None))
    pool.add(WorkerRecord("decode-0", Role.DECODE, handle=None, num_reservable_blocks=1000))
    dispatcher = Dispatcher(pool, RouterConfig(disaggregation=Disaggregation.ALWAYS), block_size=16)
    picked = []
    for index in range(4):
        dispatcher.estimate_wait(_active(f"r{index}", 100).request)
        picked.append(pool.pick(Role.PREFILL).worker_id)
    assert picked == ["prefill-0", "prefill-1", "prefill-0", "prefill-1"]


def test_a_worker_whose_room_is_not_reported_yet_takes_one_request_until_it_reports():
    """Unknown room counted as room and was never debited: a decode actor that joined under a
    backlog was granted every waiter at once, and most came back refused (a burst of calls)."""

    async def scenario():
        pool = _pool(None)
        capacity = DecodeCapacity(pool)
        granted: list[int] = []

        async def want(index: int):
            await capacity.acquire(4, 0)
            granted.append(index)

        tasks = [asyncio.create_task(want(index)) for index in range(5)]
        await asyncio.sleep(0.01)
        first = list(granted)
        pool.workers["decode-0"].num_reservable_blocks = 100  # its first report
        capacity.on_report()
        await asyncio.sleep(0.01)
        for task in tasks:
            task.cancel()
        return first, granted

    first, granted = asyncio.run(scenario())
    assert first == [0] and granted == [0, 1, 2, 3, 4]


def test_room_granted_to_a_waiter_that_left_goes_back_to_the_next():
    """A waiter granted room and cancelled before it took the grant (its client left, a
    deadline) kept the room debited: on an actor that had just joined (its room unknown, set to
    0 for the grant) and has no collector to report it, the waiters behind waited for good."""

    async def scenario():
        pool = _pool(0)  # decode-0 full
        capacity = DecodeCapacity(pool)
        tasks = [asyncio.create_task(capacity.acquire(1, 0)) for _ in range(3)]
        await asyncio.sleep(0)
        pool.add(WorkerRecord("decode-1", Role.DECODE, handle=None))  # joined, no report yet
        capacity.on_report()  # the head is granted decode-1
        tasks[0].cancel()  # and leaves before it takes the grant
        await asyncio.sleep(0.01)
        second = tasks[1].result().worker_id if tasks[1].done() else None
        for task in tasks:
            task.cancel()
        return second, capacity.num_waiting

    assert asyncio.run(scenario()) == ("decode-1", 1)


def test_known_room_granted_to_a_waiter_that_left_is_credited_back():
    async def scenario():
        pool = _pool(5)
        capacity = DecodeCapacity(pool)
        pool.workers["decode-0"].num_reservable_blocks = 0
        first = asyncio.create_task(capacity.acquire(3, 0))
        await asyncio.sleep(0)
        pool.workers["decode-0"].num_reservable_blocks = 5
        capacity.on_report()  # granted: 2 left
        first.cancel()
        await asyncio.sleep(0)
        return pool.workers["decode-0"].num_reservable_blocks

    assert asyncio.run(scenario()) == 5


def test_the_kv_freed_rate_runs_on_the_time_requests_waited_for_room():
    """Over wall time, light traffic before a burst (one request freeing 10 blocks in 29 s) made
    the burst that filled the decode pool look minutes from room, and the admission refused it.
    The rate now runs on a clock that moves only while requests wait for room, fed only then."""

    async def scenario():
        pool = _pool(0)
        capacity = DecodeCapacity(pool)
        idle = capacity.short_seconds()
        await asyncio.sleep(0.05)
        assert capacity.short_seconds() == idle  # nobody waits: the clock stands
        waiting = asyncio.create_task(capacity.acquire(1, 0))
        await asyncio.sleep(0.05)
        during = capacity.short_seconds() - idle
        pool.workers["decode-0"].num_reservable_blocks = 1
        capacity.on_report()  # granted: nobody waits any more
        await waiting
        stopped = capacity.short_seconds()
        await asyncio.sleep(0.05)
        return during, capacity.short_seconds() - stopped

    during, after = asyncio.run(scenario())
    assert during >= 0.04 and after == 0.0

    clock = [0.0]
    rate = WindowRate(window_s=30, clock=lambda: clock[0])
    rate.add(10)  # freed while the pool was short
    clock[0] = 2.0  # two seconds of waiting later (whatever the wall time between)
    rate.add(10)
    assert rate.per_second() == 10.0


def test_blocks_freed_while_nobody_waits_for_room_are_not_counted():
    dispatcher, _ = _measured_dispatcher()
    assert dispatcher.kv_freed.clock == dispatcher.capacity.short_seconds
    assert dispatcher.kv_freed.per_second() is None  # no spell of waiting yet: the KV term is unknown, nothing refused on it
