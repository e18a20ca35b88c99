"""The router's queue limit: requests without a first token are counted, beyond it refused. And
an admitted request is always let go, however its handler ends."""

from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams
from router.config import RouterConfig
from router.dispatcher import ActiveRequest, Dispatcher
from router.errors import InvalidArgumentError, ResourceExhaustedError
from router.pool import Role, WorkerPool, WorkerRecord
from router.validation import ValidatedRequest


class _Assembler:
    def __init__(self):
        self.has_sent_tokens = False
        self.completion_token_ids: list[int] = []


def _active(req_id: str) -> ActiveRequest:
    request = ValidatedRequest(req_id, [5, 6], None, SamplingParams(), [], True, 0, 0.0, None)
    return ActiveRequest(request, _Assembler(), outputs=None)


def test_requests_beyond_the_queue_limit_are_refused_until_one_starts_streaming():
    dispatcher = Dispatcher(WorkerPool(), RouterConfig(max_queued_requests=2))
    first, second = _active("a"), _active("b")
    dispatcher.admit(first)
    dispatcher.admit(second)
    with pytest.raises(ResourceExhaustedError, match="limit 2"):
        dispatcher.admit(_active("c"))
    first.assembler.has_sent_tokens = True  # streaming requests no longer count as queued
    dispatcher.admit(_active("c"))
    with pytest.raises(InvalidArgumentError, match="request_id"):
        dispatcher.admit(_active("b"))


def test_a_handler_cancelled_as_it_closes_its_session_still_lets_the_request_go():
    # An HTTP handler whose answer is complete closes its sessions in a ``finally``; the client,
    # having read the answer, closes the connection, and aiohttp cancels the handler in the same
    # turn of the event loop. The release must run anyway: else the finished request stays
    # admitted at the router (a slot of the queue limit, a request id in flight) for good.
    import asyncio
    from types import SimpleNamespace

    from router.session import GenerationSession

    async def scenario():
        dispatcher = Dispatcher(WorkerPool(), RouterConfig())
        active = _active("cmpl-1-0")
        dispatcher.admit(active)
        session = GenerationSession(SimpleNamespace(dispatcher=dispatcher), active)

        async def handler():  # its answer went out: what its ``finally`` does
            asyncio.get_running_loop().call_soon(handling.cancel)  # the client's close, handled next
            await asyncio.gather(session.close())

        handling = asyncio.create_task(handler())
        with pytest.raises(asyncio.CancelledError):
            await handling
        await asyncio.wait_for(active.released.wait(), 5)
        return dispatcher

    dispatcher = asyncio.run(scenario())
    assert not dispatcher.active and not dispatcher._releasing


def _dispatchable(req_id: str) -> ActiveRequest:
    """``_active``'s request with what a dispatch writes: its timing and its prefill worker."""
    from types import SimpleNamespace

    active = _active(req_id)
    active.assembler.timing = SimpleNamespace(dispatched=None)
    active.assembler.prefill_worker_id = ""
    return active


class _Call:
    """A fake Ray actor method: ``method.remote(...)`` returns an awaitable."""

    def __init__(self, fn):
        self._fn = fn

    def remote(self, *args):
        return self._fn(*args)


def test_a_prompt_refused_for_room_then_prefilled_locally_is_not_failed_as_unavailable():
    # The decode actor refuses a remote reservation (its room went to another request since its
    # last report); meanwhile the prefill backlog grew past prefill_busy_tokens, so the next
    # attempt prefills the prompt on the decode actor, which queues local prompts itself. That
    # refusal for room must not exclude the only decode actor from the local path.
    import asyncio
    from types import SimpleNamespace

    from decode_workers.messages import DecodeReport
    from decode_workers.messages import DecodeCapacityError
    from router.config import Disaggregation
    from router.pool import Role, WorkerRecord

    pool = WorkerPool()
    prefill = WorkerRecord("prefill-0", Role.PREFILL, handle=None)
    added_locally = []

    async def reserve(request):
        prefill.num_assigned_prompt_tokens = 9000  # the prefill actor got busy meanwhile
        raise DecodeCapacityError("decode-0: 0 KV blocks free for new requests")

    async def add_local(request):
        added_locally.append(request.req_id)

    async def poll_outputs(timeout_s, router_id):
        await asyncio.sleep(timeout_s)
        return DecodeReport([], 1000)

    handle = SimpleNamespace(reserve=_Call(reserve), add_local=_Call(add_local), poll_outputs=_Call(poll_outputs))
    pool.add(prefill)
    pool.add(WorkerRecord("decode-0", Role.DECODE, handle=handle, num_reservable_blocks=1000))
    config = RouterConfig(disaggregation=Disaggregation.AUTO, local_prefill_max_tokens=4, prefill_busy_tokens=8192)
    active = _active("a")
    active.assembler.timing = SimpleNamespace(dispatched=None)
    active.request.prompt_token_ids[:] = list(range(100))  # long enough to go to the prefill actor at first

    async def scenario():
        dispatcher = Dispatcher(pool, config)
        dispatcher.admit(active)
        await asyncio.wait_for(dispatcher.dispatch(active), 5)
        for task in dispatcher._collectors.values():
            task.cancel()

    asyncio.run(scenario())
    assert added_locally == [active.key]
    assert active.decode.worker_id == "decode-0"


def test_a_burst_shares_its_prompts_between_the_prefill_actor_and_the_decode_actor():
    """32 prompts dispatched at once: every decision is made while the first reservations are
    still in flight, so the prompts on their way to the prefill actor must count as its backlog;
    past ``prefill_busy_tokens`` short prompts go to the decode actor, but only while its own
    queue of prompts is the shorter one (not all of them: then the decode actor is the bottleneck)."""
    import asyncio
    from types import SimpleNamespace

    from decode_workers.messages import DecodeReport
    from router.config import Disaggregation
    from router.pool import Role, WorkerRecord

    pool = WorkerPool()
    added_locally, reserved = [], []

    async def reserve(request):
        await asyncio.sleep(0.01)  # a Ray call: every other dispatch decides meanwhile
        reserved.append(request.req_id)
        return SimpleNamespace(token=len(reserved), num_cached_blocks=0)

    async def add_local(request):
        await asyncio.sleep(0.01)
        added_locally.append(request.req_id)

    async def submit(request):
        await asyncio.sleep(3600)  # the prefill actor never finishes within the test

    async def poll_outputs(timeout_s, router_id):
        await asyncio.sleep(timeout_s)
        return DecodeReport([], 100_000)

    pool.add(WorkerRecord("prefill-0", Role.PREFILL, handle=SimpleNamespace(submit=_Call(submit))))
    decode_handle = SimpleNamespace(reserve=_Call(reserve), add_local=_Call(add_local), poll_outputs=_Call(poll_outputs))
    decode = WorkerRecord("decode-0", Role.DECODE, handle=decode_handle, num_reservable_blocks=100_000)
    pool.add(decode)
    config = RouterConfig(disaggregation=Disaggregation.AUTO, prefill_busy_tokens=2000, busy_local_prefill_max_tokens=512)
    actives = [_active(f"r{i}") for i in range(32)]
    for active in actives:
        active.assembler.timing = SimpleNamespace(dispatched=None, prefill=None)
        active.assembler.decode_worker_id = active.assembler.prefill_worker_id = ""
        active.request.prompt_token_ids[:] = list(range(400))

    async def scenario():
        dispatcher = Dispatcher(pool, config)
        for active in actives:
            dispatcher.admit(active)
        await asyncio.wait_for(asyncio.gather(*(dispatcher.dispatch(a) for a in actives)), 10)
        await asyncio.sleep(0.05)  # the prefill tasks took their prompts
        for task in [*dispatcher._collectors.values(), *(a.prefill_task for a in actives if a.prefill_task)]:
            task.cancel()
        return dispatcher

    asyncio.run(scenario())
    assert len(added_locally) + len(reserved) == 32
    # The first prompts go to the idle prefill actor; once 2,000 tokens are on their way, short
    # prompts go to the decode actor while its queue (400 tokens each) is the shorter one.
    assert 6 <= len(added_locally) <= 16, len(added_locally)
    assert decode.num_local_prefill_tokens == 400 * len(added_locally)  # none has come back yet


def test_outputs_of_a_decode_actor_taken_for_dead_mid_poll_are_not_streamed():
    """A health check that timed out declares a busy decode actor dead while its output poll is
    out; its requests restart elsewhere from the tokens already streamed. What that poll then
    brings back must not reach them as well (it was streamed after the Restart: the client saw
    those tokens twice once the new actor resumed from before them)."""
    import asyncio
    from types import SimpleNamespace

    from decode_workers.messages import DecodeReport, SeqOutput
    from router.pool import Role, WorkerRecord

    pool = WorkerPool()
    polled, answer, active = asyncio.Event(), None, _active("a")

    async def poll_outputs(timeout_s, router_id, gather_steps):
        polled.set()
        await answer
        return DecodeReport([SeqOutput(active.key, [105], attempt=1)], 1000)

    decode = WorkerRecord("decode-0", Role.DECODE, handle=SimpleNamespace(poll_outputs=_Call(poll_outputs)), num_reservable_blocks=1000)
    pool.add(decode)

    async def scenario():
        nonlocal answer
        answer = asyncio.get_running_loop().create_future()
        dispatcher = Dispatcher(pool, RouterConfig())
        active.outputs = asyncio.Queue()
        dispatcher.admit(active)
        active.decode, active.attempt = decode, 1
        pool.assign(decode, active.key, 2)
        dispatcher._ensure_collector(decode)
        await asyncio.wait_for(polled.wait(), 5)
        dispatcher.on_worker_died(decode)
        answer.set_result(None)
        await asyncio.sleep(0.05)
        items = []
        while not active.outputs.empty():
            items.append(active.outputs.get_nowait())
        return items

    items = asyncio.run(scenario())
    assert [type(item).__name__ for item in items] == ["Restart"]


def test_a_decode_actor_whose_ping_raises_after_a_failed_write_is_taken_for_dead():
    """A prefill actor's write into a decode actor failed, and that actor's ping raised (its
    engine thread hung, its transfer pump failed): the error escaped the prefill task, which
    ended with nobody reading it, no Restart queued, and the stream stalled until the health
    loop replaced the actor. Now its requests are placed again at once, as for a dead one."""
    import asyncio
    from types import SimpleNamespace

    async def scenario():
        dispatcher = Dispatcher(WorkerPool(), RouterConfig(status_timeout_s=1.0))
        died = []
        dispatcher.on_worker_died = died.append

        async def unhealthy():
            raise RuntimeError("decode-w: no progress for 130s")

        decode = SimpleNamespace(worker_id="w", handle=SimpleNamespace(ping=SimpleNamespace(remote=unhealthy)))
        await dispatcher._on_decode_unreachable(_active("a"), decode, "the connection to decode-0 was lost")
        return died

    assert [w.worker_id for w in asyncio.run(scenario())] == ["w"]


def test_a_request_ended_after_its_decode_actor_died_is_dropped_by_its_prefill_actor():
    """The decode actor's abort raised (it died): the prefill actor still holding the request
    was never told, and computed it for nobody until its first write into the missing peer
    failed, taking token budget from live requests."""
    import asyncio
    from types import SimpleNamespace

    from ray.exceptions import ActorDiedError

    async def scenario():
        dispatcher = Dispatcher(WorkerPool(), RouterConfig())
        cancelled = []

        async def dead_abort(*_):
            raise ActorDiedError()

        async def cancel(key, token):
            cancelled.append((key, token))

        active = _active("a")
        active.key = "router-1/a"
        active.decode = SimpleNamespace(worker_id="d", handle=SimpleNamespace(abort=SimpleNamespace(remote=dead_abort)))
        active.prefill = WorkerRecord("p", Role.PREFILL, SimpleNamespace(cancel=SimpleNamespace(remote=cancel)))
        active.destination = SimpleNamespace(token=77)
        await dispatcher._abort_on_workers(active)
        return cancelled

    assert asyncio.run(scenario()) == [("router-1/a", 77)]


def test_an_unreachable_prefill_actor_is_not_taken_to_have_no_writes_in_flight():
    """Ray's ActorUnavailableError says the actor could not be reached, not that it died: it may
    still be writing into the reservation. It counted as quiesced, and the decode actor freed
    blocks a late write could still land in (another request's KV). Only the lease frees them
    now; an actor that died has nothing in flight."""
    import asyncio
    from types import SimpleNamespace

    from ray.exceptions import ActorDiedError, ActorUnavailableError

    def prefill(error: Exception) -> WorkerRecord:
        async def cancel(key, token):
            raise error

        return WorkerRecord("p", Role.PREFILL, SimpleNamespace(cancel=SimpleNamespace(remote=cancel)))

    async def quiesced(error: Exception) -> bool:
        return await Dispatcher(WorkerPool(), RouterConfig())._quiesce_prefills("router-1/a", [prefill(error)], 7)

    assert asyncio.run(quiesced(ActorUnavailableError("unreachable", None))) is False
    assert asyncio.run(quiesced(ActorDiedError())) is True


def test_a_prefill_actor_found_draining_is_routed_to_no_more():
    """A router replica learns of a drain at its next health round. Until then each long prompt
    tried the draining prefill actor first, was refused, and with no other prefill actor was
    failed as unavailable (after its retries, all refused the same way) within milliseconds. A
    refusal now takes the actor out of routing: the next attempt prefills on the decode actor."""
    import asyncio
    from types import SimpleNamespace

    from engine.stats import WorkerState
    from prefill_workers.messages import PrefillUnavailableError
    from router.config import Disaggregation
    from router.dispatcher import Restart

    submits = []

    async def submit(request):
        submits.append(request.req_id)
        raise PrefillUnavailableError("prefill worker prefill-0 is draining")

    pool = WorkerPool()
    prefill = WorkerRecord("prefill-0", Role.PREFILL, handle=SimpleNamespace(submit=_Call(submit)))
    decode = WorkerRecord("decode-0", Role.DECODE, handle=None, num_reservable_blocks=1000)
    pool.add(prefill)
    pool.add(decode)
    dispatcher = Dispatcher(pool, RouterConfig(disaggregation=Disaggregation.AUTO, local_prefill_max_tokens=4))
    active = _active("a")
    active.request.prompt_token_ids[:] = list(range(100))
    assert not dispatcher._prefill_locally(active.request)

    async def scenario():
        active.outputs, active.decode, active.work = asyncio.Queue(), decode, active.request
        await dispatcher._prefill(active, SimpleNamespace(token=1))
        return active.outputs.get_nowait()

    restart = asyncio.run(scenario())
    assert isinstance(restart, Restart) and submits == ["a"]
    assert prefill.state is WorkerState.DRAINING and not prefill.assigned_tokens
    assert dispatcher._prefill_locally(active.request), "the next attempt tried the draining actor again"


def test_a_decode_actor_granted_then_taken_for_dead_before_the_request_is_placed_there_is_not_used():
    """Room was granted on a decode actor, which was declared dead (another request's failed
    call, a missed ping) before this request was placed there: its death restarted nothing of
    this request's, and no collector reads a dead worker, so the request waited for good. It
    now waits for room again and goes to another."""
    import asyncio
    from types import SimpleNamespace

    from decode_workers.messages import DecodeReport
    from router.config import Disaggregation

    pool = WorkerPool()
    reserved = []
    dispatcher = Dispatcher(pool, RouterConfig(disaggregation=Disaggregation.ALWAYS))

    def handle(worker_id):
        async def reserve(request):
            reserved.append(worker_id)
            return SimpleNamespace(token=1)

        async def poll_outputs(timeout_s, router_id):
            await asyncio.sleep(timeout_s)
            return DecodeReport([], 1000)

        return SimpleNamespace(reserve=_Call(reserve), poll_outputs=_Call(poll_outputs))

    async def submit(request):
        await asyncio.Event().wait()

    pool.add(WorkerRecord("prefill-0", Role.PREFILL, handle=SimpleNamespace(submit=_Call(submit))))
    for worker_id in ("decode-0", "decode-1"):
        pool.add(WorkerRecord(worker_id, Role.DECODE, handle=handle(worker_id), num_reservable_blocks=1000))
    grants = iter(["decode-0", "decode-1"])

    async def wait_for_room(request, order, query):
        granted = pool.workers[next(grants)]
        if granted.worker_id == "decode-0":
            dispatcher.on_worker_died(granted)  # between the grant and the placement
        return granted

    dispatcher._wait_for_room = wait_for_room
    active = _dispatchable("a")

    async def scenario():
        dispatcher.admit(active)
        await asyncio.wait_for(dispatcher.dispatch(active), 5)
        active.prefill_task.cancel()
        for task in dispatcher._collectors.values():
            task.cancel()

    asyncio.run(scenario())
    assert reserved == ["decode-1"] and active.decode.worker_id == "decode-1"


def test_a_decode_actor_taken_for_dead_is_told_to_drop_the_attempts_moved_elsewhere():
    """Taken for dead is not always dead (a missed ping, a moment unreachable). The requests move
    on; a decode actor still alive decoded their old attempts to the end for nobody, holding
    blocks and seats, while the router, finding it alive again, routed new requests to it."""
    import asyncio
    from types import SimpleNamespace

    from router.dispatcher import Restart

    aborted = []

    async def abort(key, attempt, given_up=False):
        aborted.append((key, attempt))

    pool = WorkerPool()
    decode = WorkerRecord("decode-0", Role.DECODE, handle=SimpleNamespace(abort=_Call(abort)))
    pool.add(decode)
    dispatcher = Dispatcher(pool, RouterConfig())
    active = _active("a")

    async def scenario():
        dispatcher.admit(active)
        active.outputs, active.decode, active.decode_attempt = asyncio.Queue(), decode, 7
        pool.assign(decode, active.key, 2)
        dispatcher.on_worker_died(decode)
        await asyncio.gather(*dispatcher._release_tasks)
        return active.outputs.get_nowait()

    assert isinstance(asyncio.run(scenario()), Restart)
    assert aborted == [(active.key, 7)]


@pytest.mark.parametrize("kind", ["stale_epoch", "lease_expired"])
def test_a_write_refused_by_a_restarted_decode_actor_or_its_lease_is_placed_again_saying_why(kind):
    """A reservation from an earlier incarnation of the decode actor (never written) failed the
    request as unavailable instead of placing it again; one whose lease ran out was placed again
    as 'the connection to decode worker X was lost', which the client saw when retries ran out."""
    import asyncio
    from types import SimpleNamespace

    from kvtransfer.errors import LeaseExpiredError, StaleEpochError
    from router.dispatcher import Restart

    class _RemoteError(Exception):  # as Ray raises what a remote call raised: the original is its cause
        def __init__(self, cause):
            super().__init__(str(cause))
            self.cause = cause

    async def ping():
        return "epoch-2"

    error = {"stale_epoch": StaleEpochError, "lease_expired": LeaseExpiredError}[kind]("a", "decode-0", "refused")
    decode = WorkerRecord("decode-0", Role.DECODE, handle=SimpleNamespace(ping=_Call(ping)))
    prefill = WorkerRecord("prefill-0", Role.PREFILL, handle=None)
    dispatcher = Dispatcher(WorkerPool(), RouterConfig())
    active = _active("a")

    async def scenario():
        active.outputs = asyncio.Queue()
        await dispatcher._prefill_raised(active, decode, prefill, _RemoteError(error))
        return active.outputs.get_nowait()

    outcome = asyncio.run(scenario())
    assert isinstance(outcome, Restart) and outcome.prefill_failed
    assert ("restarted" if kind == "stale_epoch" else "lease") in outcome.reason


def test_a_request_dispatched_again_keeps_its_first_dispatch_as_the_end_of_its_router_queue():
    """A stream moved after its decode actor died is dispatched again: its router queue time ran
    to the second dispatch, its whole first attempt counted as waiting at the router (a decode
    pool short of room to the autoscaler's queue correction, seconds in each such stream's
    timing)."""
    import asyncio
    from types import SimpleNamespace

    from decode_workers.messages import DecodeReport

    pool = WorkerPool()
    dispatcher = Dispatcher(pool, RouterConfig())

    def handle():
        async def add_local(request):
            return SimpleNamespace(token=1)

        async def poll_outputs(timeout_s, router_id):
            await asyncio.sleep(timeout_s)
            return DecodeReport([], 1000)

        return SimpleNamespace(add_local=_Call(add_local), reserve=_Call(add_local), poll_outputs=_Call(poll_outputs))

    for worker_id in ("decode-0", "decode-1"):
        pool.add(WorkerRecord(worker_id, Role.DECODE, handle=handle(), num_reservable_blocks=1000))
    grants = iter(["decode-0", "decode-1"])

    async def wait_for_room(request, order, query):
        return pool.workers[next(grants)]

    dispatcher._wait_for_room = wait_for_room
    active = _dispatchable("a")

    async def scenario():
        dispatcher.admit(active)
        await asyncio.wait_for(dispatcher.dispatch(active), 5)
        first = active.assembler.timing.dispatched
        await asyncio.sleep(0.05)
        await asyncio.wait_for(dispatcher.dispatch(active), 5)  # as a migration does
        for task in dispatcher._collectors.values():
            task.cancel()
        return first

    first = asyncio.run(scenario())
    assert first is not None and active.assembler.timing.dispatched == first
