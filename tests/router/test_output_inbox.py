"""A stream's inbox: outputs queued behind each other merge, a session asking for N tokens
wakes only when they are there, and restarts and failures keep their place in line."""

from __future__ import annotations

import asyncio

import pytest

from decode_workers.messages import DecodeTiming, SeqOutput
from engine.sampling_params import TokenLogprob
from router.dispatcher import Failure, Restart
from router.output_inbox import OutputInbox


def _run(coro):
    return asyncio.run(coro)


def test_outputs_queued_while_the_session_is_busy_arrive_as_one():
    async def scenario():
        inbox = OutputInbox()
        inbox.put_nowait(SeqOutput("r", [0], [TokenLogprob(1, -0.9, 1)]))
        inbox.put_nowait(SeqOutput("r", [1], [TokenLogprob(1, -0.5, 1)]))
        inbox.put_nowait(SeqOutput("r", [2, 3], [TokenLogprob(1, -0.1, 1), TokenLogprob(1, -0.2, 1)]))
        timing = DecodeTiming(decode_ms=7.0)
        inbox.put_nowait(SeqOutput("r", [4], [TokenLogprob(1, -0.3, 1)], finished=True, finish_reason="length", timing=timing))
        assert (await inbox.get()).token_ids == [0], "the first token goes on its own"
        merged = await inbox.get()
        assert merged.token_ids == [1, 2, 3, 4]
        assert [e.logprob for e in merged.logprobs] == [-0.5, -0.1, -0.2, -0.3]
        assert merged.finished and merged.finish_reason == "length" and merged.timing is timing
        assert inbox.empty()

    _run(scenario())


def test_an_output_that_carries_timing_keeps_it_when_later_ones_merge_into_it():
    """A request's first output carries the decode actor's timing so far (a stop string may end
    the request before its last); after a restart it need not go alone, and the middle outputs
    merged after it carry none."""
    async def scenario():
        inbox = OutputInbox()
        inbox.put_nowait(SeqOutput("r", [0]))
        await inbox.get()  # the stream's first output went long ago
        timing = DecodeTiming(num_cached_tokens=16)
        inbox.put_nowait(SeqOutput("r", [1], timing=timing))  # a migrated attempt's first
        inbox.put_nowait(SeqOutput("r", [2]))
        merged = await inbox.get()
        assert merged.token_ids == [1, 2] and merged.timing is timing

    _run(scenario())


def test_an_end_queued_behind_tokens_keeps_the_field_that_its_error_names():
    async def scenario():
        inbox = OutputInbox()
        inbox.put_nowait(SeqOutput("r", [0]))
        inbox.put_nowait(SeqOutput("r", [1]))
        inbox.put_nowait(SeqOutput("r", [], finished=True, finish_reason="error", error="holds no token", error_field="allowed_token_ids"))
        await inbox.get()
        merged = await inbox.get()
        assert (merged.token_ids, merged.finish_reason, merged.error, merged.error_field) == ([1], "error", "holds no token", "allowed_token_ids")

    _run(scenario())


def test_a_session_asking_for_n_tokens_is_woken_once_they_are_there():
    async def scenario():
        inbox = OutputInbox()
        inbox.put_nowait(SeqOutput("r", [0]))
        assert (await inbox.get()).token_ids == [0]
        waiting = asyncio.create_task(inbox.get(min_tokens=3))
        for token in (1, 2):
            inbox.put_nowait(SeqOutput("r", [token]))
            await asyncio.sleep(0)
            assert not waiting.done(), "two tokens of three: still held"
        inbox.put_nowait(SeqOutput("r", [3]))
        assert (await asyncio.wait_for(waiting, 1)).token_ids == [1, 2, 3]

    _run(scenario())


@pytest.mark.parametrize("end", ["finished", "restart"])
def test_a_held_output_goes_at_once_when_the_stream_ends_or_restarts(end):
    async def scenario():
        inbox = OutputInbox()
        inbox.put_nowait(SeqOutput("r", [0]))
        assert (await inbox.get()).token_ids == [0]
        waiting = asyncio.create_task(inbox.get(min_tokens=8))
        inbox.put_nowait(SeqOutput("r", [1]))
        await asyncio.sleep(0)
        assert not waiting.done()
        if end == "finished":
            inbox.put_nowait(SeqOutput("r", [2], finished=True, finish_reason="eos"))
            assert (await asyncio.wait_for(waiting, 1)).token_ids == [1, 2]
        else:
            restart = Restart("decode worker d died", attempt=1)
            inbox.put_nowait(restart)
            assert (await asyncio.wait_for(waiting, 1)).token_ids == [1], "the tokens first, then the restart"
            assert await inbox.get(min_tokens=8) is restart

    _run(scenario())


def test_nothing_merges_across_a_failure_or_past_a_finished_output():
    async def scenario():
        inbox = OutputInbox()
        failure = Failure(RuntimeError("gone"))
        inbox.put_nowait(SeqOutput("r", [1], finished=True, finish_reason="eos"))
        inbox.put_nowait(SeqOutput("r", [9]))  # a stale output after the end: its own item
        inbox.put_nowait(failure)
        inbox.put_nowait(SeqOutput("r", [5]))
        assert (await inbox.get()).token_ids == [1]
        assert (await inbox.get()).token_ids == [9]
        assert await inbox.get() is failure
        assert (await inbox.get()).token_ids == [5]

    _run(scenario())
