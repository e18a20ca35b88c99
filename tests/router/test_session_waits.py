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


def test_a_stream_closed_after_its_last_chunk_is_no_abort(byte_level_tokenizer):
    """The Anthropic and Responses front ends stop reading at the chunk that ends a request,
    which closes the stream there: every such request was also counted (and logged) as aborted
    by its client."""
    from contextlib import aclosing

    from decode_workers.messages import SeqOutput
    from engine.sampling_params import SamplingParams
    from router.output_stream import OutputAssembler
    from router.validation import ValidatedRequest

    async def noop(*_):
        return None

    class Outputs:
        async def get(self, interval):
            return SeqOutput("r", [72], finished=True, finish_reason="length")

    async def scenario():
        request = ValidatedRequest("r", [5], None, SamplingParams(max_tokens=1), [], True, 0, 0.0, None)
        active = SimpleNamespace(req_id="r", request=request, assembler=OutputAssembler(request, byte_level_tokenizer),
                                 outputs=Outputs(), prefill_task=None, attempt=0, first_output=asyncio.Event())
        released = []

        def release(active):
            released.append(active)
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done

        router = SimpleNamespace(wait_ready=noop, dispatcher=SimpleNamespace(dispatch=noop, release=release), metrics=None,
                                 config=SimpleNamespace(stream_interval=1), traffic=SimpleNamespace(on_finished=lambda *_: None))
        session = GenerationSession(router, active)
        failures = []
        session._observe_failure = failures.append
        async with aclosing(session.chunks()) as chunks:
            async for chunk in chunks:
                if chunk.end is not None:
                    assert chunk.end.reason == "length"
                    # Released as the last chunk is made, before the reader has it: a stop string
                    # the router found ends the request on its decode actor at once.
                    assert released == [active]
                    break
        await session.close()  # the front end's close: the same release, not a second one
        return failures, len(released)

    assert asyncio.run(scenario()) == ([], 1)
