"""A failed Responses response's ``error``, as a background response's poller or a stream's
``error`` event shows it: the client's mistakes are ``invalid_prompt`` naming the field, a full
cluster is ``rate_limit_exceeded``, and the server's own faults are ``server_error`` without
their internals."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from engine.errors import InvalidRequestError
from router.errors import InvalidArgumentError, ResourceExhaustedError
from router.responses_api.front_end import response_error


class _RayTaskError(Exception):
    """What a worker's error looks like at the router: wrapped, its cause the original."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"Traceback (most recent call last): ... {cause}")
        self.cause = cause


def test_each_kind_of_failure_gets_its_code_and_a_message_fit_for_the_client():
    refused = response_error(InvalidArgumentError("allowed_token_ids", "holds no token that the requested structured output allows next"))
    assert refused == {"code": "invalid_prompt", "message": "allowed_token_ids: holds no token that the requested structured output allows next"}
    from_a_worker = response_error(_RayTaskError(InvalidRequestError("max_tokens", "prompt plus max_tokens needs 9 KV blocks")))
    assert from_a_worker["code"] == "invalid_prompt" and "max_tokens" in from_a_worker["message"] and "Traceback" not in from_a_worker["message"]
    assert response_error(ResourceExhaustedError("no decode capacity"))["code"] == "rate_limit_exceeded"
    internal = response_error(KeyError("/srv/secrets/path"))
    assert internal["code"] == "server_error" and "secrets" not in internal["message"]


def test_anthropics_refusals_of_a_large_body_and_a_full_queue_are_what_its_client_acts_on():
    """A body past the size limit is Anthropic's 413 request_too_large (it was a 500 api_error,
    logged as the server's fault); a full queue's 429 says when to retry, as the OpenAI routes'."""
    import json

    from aiohttp import web

    from router.anthropic_api.messages import error_response

    too_large = error_response(web.HTTPRequestEntityTooLarge(max_size=64, actual_size=128))
    assert too_large.status == 413 and json.loads(too_large.text)["error"]["type"] == "request_too_large"
    full = error_response(ResourceExhaustedError("the queue is full", retry_after_s=2.5))
    assert full.status == 429 and full.headers["Retry-After"] == "3"


def test_a_stream_that_fails_before_its_first_token_gets_a_real_status_on_every_front_end():
    """A decode actor that refuses a prompt it prefills itself (conditional disaggregation)
    ends the request with an error chunk, not a raised failure: streamed, that was a 200 with an
    error event, where the same request unstreamed (or prefilled elsewhere) is a 400 naming the
    field. Nothing was sent yet, so each front end raises it (its handler answers the status)."""
    import asyncio
    from types import SimpleNamespace

    import pytest

    from router.anthropic_api.messages import MessagesFrontEnd
    from router.openai_api.server import OpenAIServer
    from router.output_stream import OutputChunk, StreamEnd, TimingBreakdown
    from router.responses_api.front_end import ResponsesFrontEnd

    end = StreamEnd(reason="error", prompt_tokens=5, completion_tokens=0, timing=TimingBreakdown(),
                    detail="holds no token that the requested structured output allows next", error_field="allowed_token_ids")

    async def one(item):
        yield item

    unused = SimpleNamespace()  # nothing of the server, request or state is touched before the first send
    streams = [
        OpenAIServer._stream(unused, None, unused, "chatcmpl-1", "m", True, [], one((0, OutputChunk(end=end))), 0),
        MessagesFrontEnd._stream(unused, None, "msg_1", "m", SimpleNamespace(num_tokens=0), 5, one(OutputChunk(end=end)), lambda: 0),
        ResponsesFrontEnd._stream(unused, None, unused, SimpleNamespace(num_tokens=0), one(OutputChunk(end=end)), []),
    ]
    for stream in streams:
        with pytest.raises(InvalidArgumentError) as raised:
            asyncio.run(stream)
        assert raised.value.field == "allowed_token_ids"


def test_response_metadata_is_bounded_as_openai_bounds_it():
    """A stored response keeps its metadata: a 60 MB value, for one generated token, was held for
    an hour, and a few thousand such calls filled the router's memory."""
    from router.responses_api.protocol import read_responses

    assert read_responses({"input": "x", "metadata": {"k" * 64: "v" * 512}}).echo["metadata"] == {"k" * 64: "v" * 512}
    for metadata, field in (({"k": "v" * 513}, "metadata.k"), ({"k" * 65: "v"}, "metadata." + "k" * 64)):
        with pytest.raises(InvalidArgumentError) as refused:
            read_responses({"input": "x", "metadata": metadata})
        assert refused.value.field == field


def test_a_grpc_stream_that_fails_before_its_first_token_ends_with_a_status_naming_the_field(monkeypatch):
    """The gRPC front end, as the HTTP ones above: a request the decode actor refused as it
    prefilled it ended the RPC OK with one FINISH_REASON_ERROR message (which the proto keeps for
    a failure after output started); now INVALID_ARGUMENT naming the field, as when it is
    prefilled elsewhere. The session is closed either way."""
    import asyncio
    from types import SimpleNamespace

    import grpc

    from router import grpc_api
    from router.api.pdserve.v1 import generation_pb2 as pb
    from router.output_stream import OutputChunk, StreamEnd, TimingBreakdown

    end = StreamEnd(reason="error", prompt_tokens=5, completion_tokens=0, timing=TimingBreakdown(),
                    detail="holds no token the grammar allows next", error_field="allowed_token_ids")
    closed = []

    class OneChunkSession:
        request = SimpleNamespace(req_id="r1", stop=[])

        async def chunks(self):
            yield OutputChunk(end=end)

        async def close(self):
            closed.append(True)

    async def opened(router, validated, client_gone):
        return OneChunkSession()

    async def validate(generate_input, time_remaining):
        return SimpleNamespace(req_id="r1")

    class Aborted(Exception):
        pass

    class Context:
        cancelled = staticmethod(lambda: False)
        time_remaining = staticmethod(lambda: None)

        async def abort(self, code, message):
            self.status = (code, message)
            raise Aborted

    monkeypatch.setattr(grpc_api.GenerationSession, "open", opened)
    service = grpc_api.GenerationService(SimpleNamespace(validate_input=validate), chat=None)
    context = Context()

    async def run():
        return [message async for message in service.Generate(pb.GenerateRequest(prompt_text="hi"), context)]

    with pytest.raises(Aborted):
        asyncio.run(run())
    assert context.status[0] == grpc.StatusCode.INVALID_ARGUMENT and "allowed_token_ids" in context.status[1]
    assert closed == [True]


def test_retrieving_a_response_as_a_stream_is_refused_naming_the_field():
    """GET /v1/responses/{id}?stream=true (the SDK's retrieve(stream=True), responses.stream(
    response_id=...)) got the response as JSON, which the SDK's stream decoder reads as no event:
    a loop over it ran zero times and get_final_response raised. It is a 400 naming the field."""
    import asyncio
    from types import SimpleNamespace

    from router.responses_api.front_end import ResponsesFrontEnd

    front_end = SimpleNamespace(background={})
    for query, field in (({"stream": "true"}, "stream"), ({"starting_after": "3"}, "starting_after")):
        request = SimpleNamespace(match_info={"response_id": "resp_1"}, query=query)
        with pytest.raises(InvalidArgumentError) as refused:
            asyncio.run(ResponsesFrontEnd.retrieve(front_end, request))
        assert refused.value.field == field


def test_an_incomplete_function_call_sent_back_as_it_was_answered_is_taken():
    """pdserve answers a call max_output_tokens or a stop string cut short as an incomplete item
    (its arguments no JSON); a client resending its history whole got a 400 for it. A complete
    call's arguments must still be JSON."""
    from router.responses_api.protocol import read_responses

    cut = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Os', "status": "incomplete"}
    request = read_responses({"input": [{"role": "user", "content": "Weather?"}, cut, {"role": "user", "content": "Go on."}]})
    assert request.messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Os'
    with pytest.raises(InvalidArgumentError) as refused:
        read_responses({"input": [{"role": "user", "content": "Weather?"}, {**cut, "status": "completed"}]})
    assert refused.value.field == "input[1].arguments"


def test_a_slow_reader_never_holds_its_sessions_back_and_its_chunks_are_joined_not_kept_one_per_step():
    """A session held back by a reader that stalled found its stop strings only when the reader
    caught up (its decode actor generating on meanwhile, up to max_tokens); before that, the
    router kept every step's chunk of a slow reader's answer. The sessions now read on whatever
    the reader does, and past 16 waiting chunks a session's newer ones join its last: the reader
    gets every token, its text and log-probabilities in order, in at most 17 chunks here, and the
    first chunk's prompt log-probabilities."""
    from types import SimpleNamespace

    from router.read_ahead import merged as _merged
    from router.output_stream import OutputChunk, StreamEnd, TimingBreakdown
    from engine.sampling_params import TokenLogprob

    produced = []

    class Session:
        request = SimpleNamespace(req_id="r")

        async def chunks(self):
            for index in range(50):
                produced.append(index)
                await asyncio.sleep(0)  # the next step's outputs come later
                end = StreamEnd(reason="stop", prompt_tokens=1, completion_tokens=50, timing=TimingBreakdown()) if index == 49 else None
                yield OutputChunk([index], f"<{index}>", [TokenLogprob(index, -float(index), 1)], end=end,
                                  prompt_logprobs=[TokenLogprob(1, -1.0, 1)] if index == 0 else None)

    async def read_after_a_stall():
        read = []
        async with contextlib.aclosing(_merged([Session()])) as merged:
            async for _, chunk in merged:
                if not read:
                    await asyncio.sleep(0.05)  # the reader stalls after its first chunk
                    produced_during_stall = len(produced)
                read.append(chunk)
        return read, produced_during_stall

    read, produced_during_stall = asyncio.run(read_after_a_stall())
    assert produced_during_stall == 50, "the session read on to its end (its stop) while the reader stalled"
    assert len(read) <= 17 and read[-1].end is not None and read[-1].end.reason == "stop"
    assert [t for chunk in read for t in chunk.token_ids] == list(range(50))
    assert "".join(chunk.text for chunk in read) == "".join(f"<{i}>" for i in range(50))
    assert [lp.logprob for chunk in read for lp in chunk.logprobs] == [-float(i) for i in range(50)]
    assert read[0].prompt_logprobs is not None and all(chunk.prompt_logprobs is None for chunk in read[1:])


def test_one_stream_read_ahead_of_its_reader_raises_its_failure_in_place():
    """gRPC, Anthropic and Responses streams with stop strings read their one session ahead of
    the client too (a client that stopped reading held it back behind flow control, its stop
    strings unfound); a session that fails raises where its chunks end."""
    from types import SimpleNamespace

    from router.output_stream import OutputChunk
    from router.read_ahead import read_ahead

    produced = []

    class Session:
        request = SimpleNamespace(req_id="r", stop=["</answer>"])  # (without stop strings it is read as asked)

        async def chunks(self):
            for index in range(40):
                produced.append(index)
                await asyncio.sleep(0)
                yield OutputChunk([index], str(index))
            raise InvalidArgumentError("prompt", "refused midway")

    async def read():
        got = []
        with pytest.raises(InvalidArgumentError, match="refused midway"):
            async with contextlib.aclosing(read_ahead(Session())) as chunks:
                async for chunk in chunks:
                    if not got:
                        await asyncio.sleep(0.05)
                        got.append(len(produced))
                    got.extend(chunk.token_ids)
        return got

    got = asyncio.run(read())
    assert got[0] == 40 and got[1:] == list(range(40))


def test_a_cancellation_raised_inside_a_session_ends_its_stream_with_an_error_not_a_hang():
    """A CancelledError from inside the session (not the reader's) ended its reading task
    silently, and the reader waited for the stream's end for good."""
    from types import SimpleNamespace

    from router.errors import InternalError
    from router.output_stream import OutputChunk
    from router.read_ahead import merged

    class Session:
        request = SimpleNamespace(req_id="r", stop=[])

        async def chunks(self):
            yield OutputChunk([1], "a")
            raise asyncio.CancelledError()  # e.g. an inner wait cancelled by someone else

    async def read():
        async with contextlib.aclosing(merged([Session()])) as items:
            return [item async for _, item in items]

    items = asyncio.run(asyncio.wait_for(read(), 5))
    assert items[0].token_ids == [1] and isinstance(items[1], InternalError)
