"""The Anthropic Messages front end: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``
on the router's HTTP server, as the official ``anthropic`` client speaks them.

A call is read (router/anthropic_api/protocol.py), validated and admitted like any other
(``Router.validate_input``, ``GenerationSession``: admission, migration, cancellation when the
client goes away, metrics), and its chunks rendered as a ``message`` or as Anthropic's stream:
``message_start``, per content block ``content_block_start`` / ``content_block_delta`` (``text_delta``,
``input_json_delta`` for a tool call's input) / ``content_block_stop``, then ``message_delta``
(stop reason, output tokens) and ``message_stop``. Errors have Anthropic's shape
(``{"type": "error", "error": {"type", "message"}}``), also mid-stream as an ``error`` event.
"""

from __future__ import annotations

import contextlib
import hashlib
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from router import sse
from router.anthropic_api.protocol import read_count_tokens, read_messages
from router.errors import ErrorKind, classify
from router.openai_api.errors import ModelNotFoundError, UnauthenticatedError, log_if_internal, retry_after_headers
from router.openai_api.reasoning import ReasoningSplitter
from router.openai_api.tool_arguments import json_or
from router.openai_api.tool_parsers import OutputPart, ToolCallDelta, ToolCallOutput, split_answer
from router.output_stream import OutputChunk, StreamEnd, end_failure
from router.read_ahead import read_ahead
from router.session import GenerationSession

if TYPE_CHECKING:
    from router.openai_api.server import OpenAIServer

PATH_PREFIX = "/v1/messages"
ERROR_SHAPE_PREFIX = PATH_PREFIX  # errors on these paths take Anthropic's shape (router/openai_api/server.py)

# kind -> (HTTP status, Anthropic error type)
_ERRORS = {
    ErrorKind.INVALID_ARGUMENT: (400, "invalid_request_error"),
    ErrorKind.NOT_FOUND: (404, "not_found_error"),
    ErrorKind.FAILED_PRECONDITION: (400, "invalid_request_error"),
    ErrorKind.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    ErrorKind.UNAVAILABLE: (529, "overloaded_error"),
    ErrorKind.DEADLINE_EXCEEDED: (504, "timeout_error"),
    ErrorKind.INTERNAL: (500, "api_error"),
}


def add_routes(app: web.Application, server: "OpenAIServer") -> "MessagesFrontEnd":
    front_end = MessagesFrontEnd(server)
    app.router.add_post(PATH_PREFIX, front_end.messages)
    app.router.add_post(PATH_PREFIX + "/count_tokens", front_end.count_tokens)
    return front_end


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """(status, Anthropic error JSON) for ``exc``; a field's name leads the message."""
    if isinstance(exc, UnauthenticatedError):
        return 401, _error("authentication_error", str(exc))
    if isinstance(exc, ModelNotFoundError):
        return 404, _error("not_found_error", str(exc))
    if isinstance(exc, web.HTTPException):  # aiohttp's own refusal (a body past the size limit: 413, no such route: 404)
        kind = {413: "request_too_large", 404: "not_found_error"}.get(exc.status, "invalid_request_error")
        return exc.status, _error(kind, exc.text or exc.reason)
    kind, message = classify(exc)
    status, error_type = _ERRORS[kind]
    return status, _error(error_type, message)


def error_response(exc: BaseException) -> web.Response:
    status, body = error_body(exc)
    return web.json_response(body, status=status, headers=retry_after_headers(exc))


def _refused(request: web.Request, exc: BaseException) -> web.Response:
    """The error response for ``exc`` (these handlers answer their own errors), logged as the
    edge logs the other front ends' (``log_if_internal``)."""
    log_if_internal(exc, f"{request.method} {request.path}")
    return error_response(exc)


def _error(error_type: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type, "message": message}}


def stop_reason(end: StreamEnd, tool_calls: bool, calls_complete: bool = True) -> str | None:
    """Anthropic's stop_reason for how a message ended (``calls_complete``: every tool call's
    input is a JSON object)."""
    if end.reason == "length":
        return "max_tokens"  # first: a tool call cut off here is not a finished tool_use
    if tool_calls and calls_complete:
        return "tool_use"
    if end.reason == "stop" and end.matched_stop:
        return "stop_sequence"  # a stop sequence inside a call's input cut it short: no tool_use
    if end.reason in ("stop", "eos"):
        return "end_turn"
    return None  # abort / error: reported as an error


def thinking_signature(thinking: str) -> str:
    """A thinking block's ``signature``: Anthropic's is opaque, sent back with the block; here the
    text's SHA-256 (nothing is checked when it comes back: the template just reads the text)."""
    return hashlib.sha256(thinking.encode()).hexdigest()


def usage(end: StreamEnd | None, prompt_tokens: int, output_tokens: int) -> dict[str, Any]:
    cached = end.cached_prompt_tokens if end is not None else 0
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output_tokens, "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


@dataclass(slots=True)
class MessageState:
    """One message's content blocks as they are built: thinking, text, then tool calls."""

    tools: ToolCallOutput | None
    reasoning: ReasoningSplitter | None = None  # with a reasoning parser: the thinking split off
    show_thinking: bool = True
    omit_thinking: bool = False  # thinking.display "omitted": a thinking block's text stays empty
    eager_tools: frozenset[str] = frozenset()  # tools whose calls' input streams as written
    blocks: list[dict[str, Any]] = field(default_factory=list)  # whole blocks, Anthropic's shape
    open_index: int | None = None  # the block a stream is writing into
    open_kind: str = ""
    calls_seen: int = 0
    num_tokens: int = 0
    end: StreamEnd | None = None
    # A call held until its input is whole (its pieces so far), and how many held calls were
    # left out (none may run).
    _held_call: list[ToolCallDelta] = field(default_factory=list)
    _calls_left_out: int = 0

    def stop_reason(self, end: StreamEnd) -> str | None:
        """tool_use only where every call may run: its input an object, none cut short."""
        runnable = all(self._runnable_input(block) is not None for block in self.blocks if block["type"] == "tool_use")
        runnable = runnable and not self._calls_left_out and (self.tools is None or not self.tools.cut_short(end))
        return stop_reason(end, self.calls_seen > 0, runnable)

    def _runnable_input(self, block: dict[str, Any]) -> dict[str, Any] | None:
        """A tool_use block's input, where its call may run (None: it may not)."""
        if self.tools is not None and block["call"] in self.tools.unrunnable:
            return None
        return _tool_input(block)

    def stop_fields(self, end: StreamEnd) -> dict[str, Any]:
        """A finished message's stop_reason and stop_sequence."""
        reason = self.stop_reason(end)
        return {"stop_reason": reason, "stop_sequence": end.matched_stop if reason == "stop_sequence" else None}

    def take(self, chunk: OutputChunk) -> list[dict[str, Any]]:
        """The stream events for a chunk (content block starts, deltas, stops); the whole blocks grow too."""
        self.num_tokens += len(chunk.token_ids)
        events: list[dict[str, Any]] = []
        thinking, parts, _ = split_answer(self.reasoning, self.tools, chunk)
        if thinking and self.show_thinking:
            if self.open_kind != "thinking":
                events += self._open({"type": "thinking", "thinking": "", "signature": "", "omitted": ""}, "thinking")
            if self.omit_thinking:  # kept for its signature only
                self.blocks[-1]["omitted"] += thinking
            else:
                self.blocks[-1]["thinking"] += thinking
                events.append(self._delta({"type": "thinking_delta", "thinking": thinking}))
        for part in self._released(parts, chunk.end is not None):  # content and calls, in order
            events += self._text(part) if isinstance(part, str) else self._tool_delta(part)
        if chunk.end is not None:
            self.end = chunk.end
            events += self._close()
        return events

    def _text(self, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self.open_kind != "text":
            events += self._open({"type": "text", "text": ""}, "text")
        self.blocks[-1]["text"] += text
        events.append(self._delta({"type": "text_delta", "text": text}))
        return events

    def _released(self, parts: list[OutputPart], last: bool) -> list[OutputPart]:
        """The parts to send now. A call to a tool without ``eager_input_streaming`` is held until
        its input is whole (the answer goes on past it: content, another call; or ends), then
        sent in one piece where it may run, or left out (its input no JSON object: the SDK's
        accumulator parses the input at every delta, and raised on a model's trailing comma,
        losing the whole answer). Anthropic streams input so, checked, unless a tool asks for it
        eagerly."""
        out: list[OutputPart] = []
        for part in parts:
            if isinstance(part, ToolCallDelta) and part.id is None:  # more of the last call's input
                (self._held_call if self._held_call else out).append(part)
                continue
            out += self._release_held()  # content, or a new call: the held call's input is whole
            if isinstance(part, ToolCallDelta) and part.name not in self.eager_tools:
                self._held_call.append(part)
            else:
                out.append(part)
        if last:
            out += self._release_held()
        return out

    def _release_held(self) -> list[OutputPart]:
        """The held call, whole, where it may run; nothing where it may not."""
        if not self._held_call:
            return []
        first = self._held_call[0]
        whole = ToolCallDelta(first.index, "".join(piece.arguments for piece in self._held_call), first.id, first.name)
        self._held_call = []
        # (The answer's last parts come once it ended: the calls none may run are known then.)
        if (self.tools is not None and first.index in self.tools.unrunnable) or _input_object(whole.arguments) is None:
            self._calls_left_out += 1
            return []
        return [whole]

    def _tool_delta(self, delta: ToolCallDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.id is not None:  # a new call
            block = {"type": "tool_use", "id": "toolu_" + delta.id.removeprefix("call_"), "name": delta.name, "input": {}}
            events += self._open(block, "tool_use")
            self.blocks[-1].update(partial="", call=delta.index)  # (kept here only: _INTERNAL)
            self.calls_seen += 1
        if delta.arguments:
            self.blocks[-1]["partial"] += delta.arguments
            events.append(self._delta({"type": "input_json_delta", "partial_json": delta.arguments}))
        return events

    def _open(self, block: dict[str, Any], kind: str) -> list[dict[str, Any]]:
        events = self._close()
        self.blocks.append(block)
        self.open_index, self.open_kind = len(self.blocks) - 1, kind
        start = {key: value for key, value in block.items() if key not in _INTERNAL}
        events.append({"type": "content_block_start", "index": self.open_index, "content_block": start})
        return events

    def _close(self) -> list[dict[str, Any]]:
        """The open block's stop (a thinking block's signature first, as Anthropic streams it)."""
        if self.open_index is None:
            return []
        events = []
        if self.open_kind == "thinking":
            block = self.blocks[self.open_index]
            block["signature"] = thinking_signature(block["thinking"] + block["omitted"])
            events.append(self._delta({"type": "signature_delta", "signature": block["signature"]}))
        events.append({"type": "content_block_stop", "index": self.open_index})
        self.open_index, self.open_kind = None, ""
        return events

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.open_index, "delta": delta}

    def content(self) -> list[dict[str, Any]]:
        """The whole message's content blocks (a tool call's input parsed from its JSON). A call
        none may run is left out, as chat completions leave it: its input no JSON object (a stop
        sequence or max_tokens cut it short, the model wrote a trailing comma), or closed where
        the answer or its reading stopped. Its input was {} or part of one, and a client's agent
        loop ran the tool with it. Where no call made may run, the answer as the model wrote it
        (the calls' text included) is its text, as chat completions give it (the calls' text was
        lost)."""
        written = self.tools.text_if_none_runs if self.tools is not None else None
        out = []
        for block in self.blocks:
            if written is not None and block["type"] in ("text", "tool_use"):
                if written:  # in the first answer block's place: after the thinking
                    out.append({"type": "text", "text": written})
                    written = ""
                continue
            if block["type"] == "tool_use":
                arguments = self._runnable_input(block)
                if arguments is None:
                    continue
                block = {**block, "input": arguments}
            out.append({key: value for key, value in block.items() if key not in _INTERNAL})
        return out


# A tool_use block's input so far and its call's index, and an omitted thinking's text: no
# field of Anthropic's.
_INTERNAL = ("partial", "call", "omitted")


def _tool_input(block: dict[str, Any]) -> dict[str, Any] | None:
    """A tool_use block's input, parsed from its JSON; None where that is no object."""
    return _input_object(block["partial"])


def _input_object(text: str) -> dict[str, Any] | None:
    """A call's input parsed from its JSON text (empty: {}); None where that is no object (invalid,
    strict JSON's rules included, as the tool parsers judge a call: NaN is none; or past
    bounded_json's limits: an integer of 5,000 digits)."""
    if not text:
        return {}
    arguments = json_or(text, None)
    return arguments if isinstance(arguments, dict) else None


class MessagesFrontEnd:
    def __init__(self, server: "OpenAIServer"):
        self.server = server
        self.router = server.router

    async def count_tokens(self, request: web.Request) -> web.Response:
        try:
            model, prompt = read_count_tokens(await self.server.read_json(request), self.server.chat_template, self.server.chat.tool_call_parser, self.server.reasoning)
            self.server.model_name(model)
            return web.json_response({"input_tokens": len(await self.router.encode(prompt, False))})
        except Exception as exc:
            return _refused(request, exc)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        try:
            api = read_messages(await self.server.read_json(request), self.server.chat_template, self.server.chat.tool_call_parser, self.server.reasoning)
            model = self.server.model_name(api.model)
            message_id = f"msg_{uuid.uuid4().hex}"
            api.generate.request_id = message_id
            api.generate.lora_name = self.server.lora_name(model)
            validated = await self.router.validate_input(api.generate)
        except Exception as exc:
            return _refused(request, exc)

        def client_gone() -> bool:
            return request.transport is None or request.transport.is_closing()

        try:
            session = await GenerationSession.open(self.router, validated, client_gone)
        except Exception as exc:
            return _refused(request, exc)
        state = MessageState(
            ToolCallOutput(api.tool_calling) if api.tool_calling is not None else None, api.reasoning, api.show_thinking,
            api.omit_thinking, api.eager_tools,
        )
        prompt_tokens = len(validated.prompt_token_ids)
        try:
            chunks = read_ahead(session)
            async with contextlib.aclosing(chunks):
                if api.stream:
                    return await self._stream(request, message_id, model, state, prompt_tokens, chunks, session.active.assembler.cached_prompt_tokens)
                return await self._whole(message_id, model, state, prompt_tokens, chunks)
        except Exception as exc:
            return _refused(request, exc)
        finally:
            await session.close()

    def _message(self, message_id: str, model: str, end: StreamEnd | None, state: MessageState, prompt_tokens: int) -> dict[str, Any]:
        """The message as it stands (``end`` None: it has only started: no content yet)."""
        stop = {"stop_reason": None, "stop_sequence": None} if end is None else state.stop_fields(end)
        content = [] if end is None else state.content()
        return {
            "id": message_id, "type": "message", "role": "assistant", "model": model, "content": content, **stop,
            "usage": usage(end, prompt_tokens, state.num_tokens),
        }

    async def _whole(self, message_id: str, model: str, state: MessageState, prompt_tokens: int, chunks) -> web.Response:
        async for chunk in chunks:
            state.take(chunk)
            if chunk.end is not None:
                break
        end = state.end
        if end is None or end.reason in ("error", "abort"):
            raise end_failure(end, state.num_tokens)
        return web.json_response(self._message(message_id, model, end, state, prompt_tokens))

    async def _stream(
        self, request: web.Request, message_id: str, model: str, state: MessageState, prompt_tokens: int, chunks, cached_now: Callable[[], int],
    ) -> web.StreamResponse:
        """``cached_now``: the prompt tokens a prefix cache held, as known so far (by the first
        chunk, from the prefill's timing: message_start's usage splits the prompt as Anthropic's
        does, where it said the whole prompt was input and the end said otherwise)."""
        response = sse.event_stream()
        started = False
        try:
            async for chunk in chunks:
                if not started:
                    if chunk.end is not None and chunk.end.reason in ("error", "abort"):
                        raise end_failure(chunk.end, state.num_tokens)  # nothing sent yet: a real status, as unstreamed
                    await response.prepare(request)
                    started = True
                    start = self._message(message_id, model, None, state, prompt_tokens)
                    cached = cached_now()
                    start["usage"].update(output_tokens=0, input_tokens=prompt_tokens - cached, cache_read_input_tokens=cached)
                    await sse.send(response, {"type": "message_start", "message": start}, named=True)
                for event in state.take(chunk):
                    await sse.send(response, event, named=True)
                end = chunk.end
                if end is None:
                    continue
                if end.reason in ("error", "abort"):
                    await sse.send(response, error_body(end_failure(end, state.num_tokens))[1], named=True)
                    break
                await sse.send(response, {"type": "message_delta", "delta": state.stop_fields(end), "usage": usage(end, prompt_tokens, state.num_tokens)}, named=True)
                await sse.send(response, {"type": "message_stop"}, named=True)
                break
            await response.write_eof()
        except ConnectionResetError:
            pass
        except Exception as exc:
            if not started:
                raise  # nothing sent yet: a real status
            await sse.send(response, error_body(exc)[1], named=True)
        return response
