"""A stream's short waits for its prefill actor's answer: a cancelled prefill (its decode actor
died, and the request is placed again) does not end the stream; the client going away does."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from router.session import GenerationSession


def _session(prefill_task: asyncio.Task) -> GenerationSession:
    return GenerationSession(SimpleNamespace(), SimpleNamespace(prefill_task=prefill_task, req_id="cmpl-1-0"))


def test_a_prefill_cancelled_while_the_stream_waits_for_its_answer_leaves_the_stream_going():
    # Before: the cancel reached the stream through the shield, as if its client had gone. The
    # OpenAI server's merged streams then waited forever on a queue nothing would fill.
    async def scenario():
        prefill = asyncio.create_task(asyncio.sleep(60))
        session = _session(prefill)
        waiting = asyncio.create_task(session._await_prefill_report(30))
        await asyncio.sleep(0.01)
        prefill.cancel()  # what Dispatcher.on_worker_died does for a decode actor's requests
        # It returns, saying so: the stream reads the Restart queued behind next.
        assert await asyncio.wait_for(waiting, 5) is False

    asyncio.run(scenario())


def test_a_prefill_that_answers_or_is_late_lets_the_chunk_go():
    async def scenario():
        answered = asyncio.create_task(asyncio.sleep(0.01))
        assert await _session(answered)._await_prefill_report(5) is True
        late = asyncio.create_task(asyncio.sleep(60))
        assert await _session(late)._await_prefill_report(0.05) is True
        assert not late.done()
        late.cancel()

    asyncio.run(scenario())


def test_the_stream_itself_cancelled_while_it_waits_ends_cancelled_and_leaves_the_prefill_alone():
    async def scenario():
        prefill = asyncio.create_task(asyncio.sleep(60))
        waiting = asyncio.create_task(_session(prefill)._await_prefill_report(30))
        await asyncio.sleep(0.01)
        waiting.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert not prefill.done(), "the shield keeps the prefill task running (finish cancels it)"
        prefill.cancel()

    asyncio.run(scenario())
