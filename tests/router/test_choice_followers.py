"""The choices of one prompt (``n``) after the first follow it: placed on its decode actor once
its first output came, as local prompts that decode actor's prefix cache holds (a block or two
computed there), so the prompt is prefilled and moved once and its blocks are shared. Where that
actor does not hold the prompt (prefix caching off, evicted) a follower is placed as any other;
a follower of a leader that ended without output never waits for good."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from decode_workers.messages import PrefixCachingOffError, PrefixNotHeldError
from engine import EngineConfig, LLMEngine, SamplingParams
from router.config import Disaggregation, RouterConfig
from router.dispatcher import ActiveRequest, Dispatcher
from router.pool import Role, WorkerPool, WorkerRecord
from router.validation import ValidatedRequest
from tests.checkpoints import build_checkpoint, random_prompts


class _Assembler:
    def __init__(self, sent: list[int]):
        self.completion_token_ids = sent
        self.has_sent_tokens = bool(sent)
        self.timing = SimpleNamespace(dispatched=None)
        self.decode_worker_id = self.prefill_worker_id = ""


def _active(req_id: str, prompt: list[int], sent: list[int] = ()) -> ActiveRequest:
    request = ValidatedRequest(req_id, prompt, None, SamplingParams(max_tokens=4), [], True, 0, 0.0, None)
    active = ActiveRequest(request, _Assembler(list(sent)), outputs=None)
    active.work, active.key = request, req_id
    return active


def _decode(worker_id: str, holds_prefix: bool, calls: list, caching: bool = True):
    async def add_local(request):
        calls.append((worker_id, "local", request.only_if_cached))
        if request.only_if_cached and not caching:
            raise PrefixCachingOffError(f"{worker_id} keeps no prefix cache")
        if request.only_if_cached and not holds_prefix:
            raise PrefixNotHeldError(f"{worker_id} lacks it")

    async def reserve(request):
        calls.append((worker_id, "reserve", request.only_if_cached))
        raise asyncio.CancelledError  # stop once placed: the prefill is not this test's

    async def nothing(*args):
        return None

    handle = SimpleNamespace(add_local=SimpleNamespace(remote=add_local), reserve=SimpleNamespace(remote=reserve),
                             abort=SimpleNamespace(remote=nothing), confirm_quiesced=SimpleNamespace(remote=nothing))
    return WorkerRecord(worker_id, Role.DECODE, handle=handle, num_reservable_blocks=1000)


@pytest.mark.parametrize("holds_prefix", [True, False])
def test_a_follower_goes_where_its_leaders_prompt_is_cached_or_is_placed_as_any_other(holds_prefix):
    async def scenario():
        calls: list = []
        pool = WorkerPool()
        pool.add(WorkerRecord("prefill-0", Role.PREFILL, handle=None))
        for name in ("decode-0", "decode-1"):
            pool.add(_decode(name, holds_prefix, calls))
        dispatcher = Dispatcher(pool, RouterConfig(disaggregation=Disaggregation.ALWAYS), block_size=16)
        dispatcher._ensure_collector = lambda record: None
        prompt = list(range(3, 203))
        leader = _active("lead", prompt, sent=[7])
        leader.decode = pool.workers["decode-1"]  # where its prompt was computed
        follower = _active("follow", prompt)
        follower.leader = leader
        placing = asyncio.create_task(dispatcher.dispatch(follower))
        await asyncio.sleep(0.05)
        assert calls == [] and not placing.done(), "it waits for its leader's first output"
        leader.first_output.set()
        await asyncio.gather(placing, return_exceptions=True)
        return calls, follower

    calls, follower = asyncio.run(scenario())
    if holds_prefix:
        assert calls == [("decode-1", "local", True)] and follower.decode.worker_id == "decode-1"
    else:  # refused: placed as any other (disaggregated: a reservation)
        assert calls[0] == ("decode-1", "local", True) and [(kind, promised) for _, kind, promised in calls[1:]] == [("reserve", False)]


def test_decode_actors_without_a_prefix_cache_end_following_after_one_refusal():
    """With prefix caching off on the decode pool a follower only waited for its leader and was
    refused: after the first such refusal, choices are placed at once as any other."""

    async def scenario():
        calls: list = []
        pool = WorkerPool()
        pool.add(WorkerRecord("prefill-0", Role.PREFILL, handle=None))
        pool.add(_decode("decode-0", False, calls, caching=False))
        dispatcher = Dispatcher(pool, RouterConfig(disaggregation=Disaggregation.ALWAYS), block_size=16)
        dispatcher._ensure_collector = lambda record: None
        prompt = list(range(3, 203))
        leader = _active("lead", prompt, sent=[7])
        leader.decode = pool.workers["decode-0"]
        leader.first_output.set()
        first = _active("follow-1", prompt)
        first.leader = leader
        await asyncio.gather(dispatcher.dispatch(first), return_exceptions=True)
        waiting_leader = _active("lead-2", prompt)  # no first output yet: a follower of it must not wait
        second = _active("follow-2", prompt)
        second.leader = waiting_leader
        await asyncio.wait_for(asyncio.gather(dispatcher.dispatch(second), return_exceptions=True), 5)
        return calls, dispatcher.decode_caches_prefixes

    calls, caches = asyncio.run(scenario())
    assert caches is False
    assert [(kind, promised) for _, kind, promised in calls] == [("local", True), ("reserve", False), ("reserve", False)]


def test_a_follower_of_a_leader_that_ended_without_output_is_placed_as_any_other():
    async def scenario():
        calls: list = []
        pool = WorkerPool()
        pool.add(WorkerRecord("prefill-0", Role.PREFILL, handle=None))
        pool.add(_decode("decode-0", True, calls))
        dispatcher = Dispatcher(pool, RouterConfig(disaggregation=Disaggregation.ALWAYS), block_size=16)
        dispatcher._ensure_collector = lambda record: None
        prompt = list(range(3, 203))
        leader = _active("lead", prompt)  # it failed before any token
        leader.decode = pool.workers["decode-0"]
        follower = _active("follow", prompt)
        follower.leader = leader
        await dispatcher.finish(leader)
        await asyncio.wait_for(asyncio.gather(dispatcher.dispatch(follower), return_exceptions=True), 5)
        return calls

    assert asyncio.run(scenario()) == [("decode-0", "reserve", False)]


def test_an_engine_says_how_much_of_a_prompt_its_prefix_cache_holds(tmp_path):
    """What a decode actor checks before it takes a follower on that promise."""
    build_checkpoint("llama", tmp_path)
    engine = LLMEngine(tmp_path, EngineConfig(num_kv_blocks=64, dtype="float32"))
    prompt = random_prompts([70], engine.model_config.vocab_size, seed=3)[0]
    fresh = engine.make_sequence("probe", prompt, SamplingParams(max_tokens=1))
    assert engine.num_cached_prefix_tokens(fresh) == 0
    engine.add_request("first", prompt, SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.num_cached_prefix_tokens(engine.make_sequence("probe", prompt, SamplingParams(max_tokens=1))) == 64  # 4 full blocks of 69
    scored = engine.make_sequence("probe", prompt, SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert engine.num_cached_prefix_tokens(scored) == 0, "a prompt it scores is computed whole"
