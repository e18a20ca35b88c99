"""A decode actor's answer to a router that streams several tokens per message gathers that
many steps' outputs, but never holds a request's first output or its last."""

from __future__ import annotations

import asyncio

from decode_workers.messages import SeqOutput
from decode_workers.worker import OutputBox


async def _step(box: OutputBox, *outputs: SeqOutput) -> None:
    box.put("router", list(outputs))
    await asyncio.sleep(0)  # the engine thread's next step comes later


def test_one_answer_carries_n_steps_of_a_running_stream():
    async def scenario():
        box = OutputBox()
        await _step(box, SeqOutput("a", [1]))
        assert [o.token_ids for o in await box.take("router", 1.0, gather_steps=3)] == [[1]], "a first output goes at once"
        taking = asyncio.create_task(box.take("router", 1.0, gather_steps=3))
        for token in (2, 3):
            await _step(box, SeqOutput("a", [token]))
            assert not taking.done()
        await _step(box, SeqOutput("a", [4]))
        assert [o.token_ids for o in await asyncio.wait_for(taking, 1.0)] == [[2], [3], [4]]

    asyncio.run(scenario())


def test_a_new_request_or_a_finished_one_ends_the_gathering_at_once():
    async def scenario():
        box = OutputBox()
        await _step(box, SeqOutput("a", [1]))
        await box.take("router", 1.0, gather_steps=8)
        for urgent in (SeqOutput("b", [7]), SeqOutput("a", [3], finished=True, finish_reason="length")):
            taking = asyncio.create_task(box.take("router", 1.0, gather_steps=8))
            await _step(box, SeqOutput("a", [2]))
            assert not taking.done()
            await _step(box, urgent)
            got = await asyncio.wait_for(taking, 1.0)
            assert got[-1] is urgent

    asyncio.run(scenario())


def test_slow_steps_hold_tokens_no_longer_than_the_limit():
    async def scenario():
        box = OutputBox()
        await _step(box, SeqOutput("a", [1]))
        await box.take("router", 1.0, gather_steps=8)
        await _step(box, SeqOutput("a", [2]))
        loop = asyncio.get_running_loop()
        started = loop.time()
        got = await box.take("router", 1.0, gather_steps=8, gather_limit_s=0.05)
        assert [o.token_ids for o in got] == [[2]] and loop.time() - started < 0.5

    asyncio.run(scenario())


def test_a_requests_first_and_last_outputs_carry_its_timing_and_the_rest_do_not():
    """The router may end a request on a stop string before its last output: the first one
    already says what the decode actor's cache held of the prompt."""
    import time
    from types import SimpleNamespace

    from decode_workers.worker import DecodeWorker, _Tracked
    from engine.sequence import FinishReason

    seq = SimpleNamespace(req_id="a", is_finished=False, finish_reason=None, first_token_time=time.monotonic(), num_cached_tokens=32,
                          num_decode_steps=1, num_draft_tokens=0, num_accepted_draft_tokens=0, first_scheduled_time=time.monotonic())
    tracked = _Tracked(seq, time.monotonic(), remote=False, dest_block_ids=[])
    worker = object.__new__(DecodeWorker)
    first, middle = worker._output(tracked, [1], []), worker._output(tracked, [2], [])
    seq.is_finished, seq.finish_reason = True, FinishReason.LENGTH
    last = worker._output(tracked, [3], [])
    assert first.timing.num_cached_tokens == 32 and middle.timing is None and last.timing.num_cached_tokens == 32 and last.finished


def test_a_request_aborted_mid_stream_is_forgotten_and_a_draining_worker_reports_no_room():
    """A request a router ended by abort (a stop string it matched, a cancel, a migration) gets no
    last output: its id stayed in the box's streaming set for the router's life, one per such
    request. And a draining worker reported its free blocks at every poll: the router granted it
    the head of the queue again and again until its next health round."""
    from types import SimpleNamespace

    from decode_workers.worker import DecodeWorker
    from engine.stats import WorkerState

    async def scenario():
        box = OutputBox()
        for index in range(50):
            await _step(box, SeqOutput(f"r{index}", [1]))
            box.done("router", f"r{index}")
        await box.take("router", 0.1)
        return box._streaming["router"]

    assert asyncio.run(scenario()) == set()

    async def poll(state):
        worker = SimpleNamespace(
            _outputs=OutputBox(), state=state, _heard_from=lambda router_id: None,
            scheduler=SimpleNamespace(num_reservable_blocks=lambda: 40, allocator=SimpleNamespace(num_blocks=64)),
        )
        return await DecodeWorker.poll_outputs(worker, 0.01, "router")

    assert asyncio.run(poll(WorkerState.READY)).num_reservable_blocks == 40
    assert asyncio.run(poll(WorkerState.DRAINING)).num_reservable_blocks == 0


def test_a_router_that_speaks_while_its_requests_are_released_stays_watched(monkeypatch):
    """A router silent past its lease has its requests released; a reservation it makes during
    that release (an engine step long) survives it, and the router stays lease-watched (it was
    forgotten: if it then died, its new request was cleaned up only by the KV lease or max_tokens)."""
    import time
    from types import SimpleNamespace

    import decode_workers.worker as worker_module
    from decode_workers.worker import DecodeWorker

    forgotten, sleeps = [], []
    worker = SimpleNamespace(
        worker_id="d0", _router_lease_s={"r": 1.0}, _router_heard={"r": time.monotonic() - 10.0},
        _outputs=SimpleNamespace(forget=forgotten.append),
    )

    async def call(fn, router_id):
        worker._router_heard[router_id] = time.monotonic()  # a reserve arrived meanwhile
        return 1

    worker._call, worker._release_router = call, None

    async def sleep(seconds):
        sleeps.append(seconds)
        if len(sleeps) > 1:
            worker._router_lease_s.clear()  # (ends the watch after one round)

    monkeypatch.setattr(worker_module.asyncio, "sleep", sleep)
    asyncio.run(DecodeWorker._watch_routers(worker))
    assert forgotten == [] and "r" in worker._router_heard
