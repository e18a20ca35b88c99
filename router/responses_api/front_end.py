"""The OpenAI Responses front end: ``/v1/responses`` on the router's HTTP server, as the official
``openai`` client's ``client.responses`` speaks it.

``POST /v1/responses`` reads a call (router/responses_api/protocol.py), renders its conversation
(a stored ``previous_response_id``'s conversation, then this call's input; ``instructions`` first)
with the model's chat template, and runs it as any other request (``Router.validate_input``,
``GenerationSession``: admission, migration, cancellation when the client goes away, metrics).
Whole, it answers a ``response`` object; streamed, the events the client accumulates:
``response.created``, ``response.in_progress``, per output item ``response.output_item.added`` /
``.done`` around its text (``response.content_part.added``, ``response.output_text.delta``,
``.done``, ``response.content_part.done``) or a function call's arguments
(``response.function_call_arguments.delta`` / ``.done``), then ``response.completed`` (status
``incomplete`` when ``max_output_tokens`` ran out, as vLLM sends it). ``background: true``
answers at once with the response in progress; ``GET /v1/responses/{id}`` polls it and
``POST .../cancel`` stops it. ``store`` (the default) keeps the response and its conversation
(router/responses_api/store.py) for ``GET``, ``DELETE`` and follow-up turns, from its start
(in progress, then its final state); a follow-up's
prompt starts with the previous turn's, so KV-aware routing sends it to the actor whose prefix
cache holds it. They are kept on the router's board (router/responses_api/board.py): its own, or
the one its replicas share, so that any router of the deployment answers for any response.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from engine.structured_output import TOOL_CALLS
from router import sse
from router.errors import ErrorKind, InternalError, InvalidArgumentError, NotFoundError, classify, remote_cause
from router.openai_api.errors import log_if_internal
from router.openai_api.tool_calls import read_tool_calling, template_messages
from router.openai_api.tool_arguments import json_or
from router.openai_api.tool_parsers import ToolCallDelta, ToolCallOutput, split_answer
from router.output_stream import OutputChunk, StreamEnd, end_failure
from router.openai_api.reasoning import ReasoningSplitter
from router.responses_api.board import IN_PROGRESS, ResponseBoard, is_in_progress
from router.responses_api.protocol import ResponsesRequest, read_responses, seal
from router.responses_api.store import StoredResponse
from router.read_ahead import read_ahead
from router.session import GenerationSession
from router.validation import ValidatedRequest

if TYPE_CHECKING:
    from router.openai_api.server import OpenAIServer

logger = logging.getLogger(__name__)

PATH = "/v1/responses"


def add_routes(app: web.Application, server: "OpenAIServer") -> "ResponsesFrontEnd":
    front_end = ResponsesFrontEnd(server)
    app.router.add_post(PATH, front_end.create)
    app.router.add_get(PATH + "/{response_id}", front_end.retrieve)
    app.router.add_delete(PATH + "/{response_id}", front_end.delete)
    app.router.add_post(PATH + "/{response_id}/cancel", front_end.cancel)
    app.router.add_get(PATH + "/{response_id}/input_items", front_end.input_items)
    app.router.add_post(PATH + "/input_tokens", front_end.input_tokens)
    return front_end


class PreviousResponseNotFoundError(InvalidArgumentError):
    """OpenAI's answer to a previous_response_id it does not hold: a 400 its clients recognise
    by the code (and send the whole conversation instead)."""

    error_code = "previous_response_not_found"

    def __init__(self, response_id: str):
        super().__init__("previous_response_id", f"previous response {response_id!r} not found (never stored, expired or deleted)")


class ResponseNotFoundError(NotFoundError):
    def __init__(self, response_id: str):
        super().__init__(f"response {response_id!r} not found (never stored, expired or deleted)")


def usage(end: StreamEnd | None, prompt_tokens: int, output_tokens: int, reasoning_tokens: int = 0) -> dict[str, Any]:
    cached = end.cached_prompt_tokens if end is not None else 0
    return {
        "input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + output_tokens,
    }


# The Responses API's error codes for what the router's errors mean (any other: server_error).
_ERROR_CODES = {
    ErrorKind.INVALID_ARGUMENT: "invalid_prompt",
    ErrorKind.FAILED_PRECONDITION: "invalid_prompt",
    ErrorKind.RESOURCE_EXHAUSTED: "rate_limit_exceeded",
}


def response_error(exc: BaseException) -> dict[str, str]:
    """A failed response's ``error``: its code, and the message written for clients (a generic
    one for an unexpected exception, which is logged where it is caught)."""
    kind, message = classify(exc)
    return {"code": _ERROR_CODES.get(kind, "server_error"), "message": message}


@dataclass(slots=True)
class ResponseState:
    """One response as it is built: its output items, and the stream events that build them."""

    response_id: str
    model: str
    echo: dict[str, Any]
    prompt_tokens: int
    tools: ToolCallOutput | None
    # With a reasoning parser: splits the thinking (a reasoning item) off the answer; the
    # thinking's tokens so far (usage's reasoning_tokens).
    reasoning: ReasoningSplitter | None = None
    reasoning_tokens: int = 0
    seal_reasoning: bool = False  # reasoning items also carry their thinking as encrypted_content
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: str = "in_progress"
    output: list[dict[str, Any]] = field(default_factory=list)
    open_index: int | None = None  # the output item text or arguments are streaming into
    num_tokens: int = 0
    end: StreamEnd | None = None
    error: dict[str, Any] | None = None
    sequence: int = 0
    run: int = 1  # a background response's: runs started (its router died during the earlier ones)
    final_kept: bool = False  # its final state is on the board (or was deleted there first)

    def event(self, kind: str, **body: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **body}

    def obj(self) -> dict[str, Any]:
        """The response object as it stands."""
        incomplete = {"reason": "max_output_tokens"} if self.status == "incomplete" else None
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": self.status, "model": self.model,
            "output": [dict(item) for item in self.output], "error": self.error, "incomplete_details": incomplete,
            "usage": usage(self.end, self.prompt_tokens, self.num_tokens, self.reasoning_tokens) if self.end is not None else None,
            "reasoning": {"effort": None, "summary": None}, "service_tier": "default", **self.echo,
        }

    def take(self, chunk: OutputChunk) -> list[dict[str, Any]]:
        """The stream events for a chunk; the output items grow with it."""
        self.num_tokens += len(chunk.token_ids)
        events: list[dict[str, Any]] = []
        thinking, parts, thinking_tokens = split_answer(self.reasoning, self.tools, chunk)
        self.reasoning_tokens += thinking_tokens
        if thinking:
            events += self._think(thinking)
        for part in parts:  # content and calls, in order
            events += self._text(part) if isinstance(part, str) else self._tool_delta(part)
        if chunk.end is not None:
            self.end = chunk.end
            events += self._close()
            self.status = {"length": "incomplete", "error": "failed", "abort": "cancelled"}.get(chunk.end.reason, "completed")
            if self.status == "failed":
                self.error = response_error(end_failure(chunk.end, self.num_tokens))
        return events

    def _text(self, text: str) -> list[dict[str, Any]]:
        """The answer's next piece, into the open message item (opened after any other)."""
        events: list[dict[str, Any]] = []
        if self.open_index is None or self.output[self.open_index]["type"] != "message":
            events += self._close()
            events += self._open({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "in_progress", "role": "assistant", "content": []})
            item = self.output[self.open_index]
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=self.open_index, content_index=0, part=dict(part)))
        item = self.output[self.open_index]
        item["content"][0]["text"] += text
        events.append(self.event("response.output_text.delta", item_id=item["id"], output_index=self.open_index, content_index=0, delta=text, logprobs=[]))
        return events

    def _think(self, text: str) -> list[dict[str, Any]]:
        """The thinking's next piece, into the reasoning item (opened before the answer's items)."""
        events: list[dict[str, Any]] = []
        if self.open_index is None or self.output[self.open_index]["type"] != "reasoning":
            events += self._close()
            events += self._open({"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [], "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"})
        item = self.output[self.open_index]
        item["content"][0]["text"] += text
        events.append(self.event("response.reasoning_text.delta", item_id=item["id"], output_index=self.open_index, content_index=0, delta=text))
        return events

    def _tool_delta(self, delta: ToolCallDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.id is not None:
            events += self._close()
            events += self._open({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": delta.id, "name": delta.name, "arguments": "", "status": "in_progress"})
        item = self.output[self.open_index]
        if delta.arguments:
            item["arguments"] += delta.arguments
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=self.open_index, delta=delta.arguments))
        return events

    def _open(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.output.append(item)
        self.open_index = len(self.output) - 1
        added = {**item, "content": []} if item["type"] == "message" else json.loads(json.dumps(item))
        return [self.event("response.output_item.added", output_index=self.open_index, item=added)]

    def _close(self) -> list[dict[str, Any]]:
        if self.open_index is None:
            return []
        index, item = self.open_index, self.output[self.open_index]
        self.open_index = None
        # An item the answer's end cut off (max_output_tokens) is "incomplete", as OpenAI's is; so
        # is a function call none may run: its arguments no JSON object (a stop sequence cut it
        # short, the model wrote a trailing comma), or closed where the answer or its reading
        # stopped. "completed", a client ran it with them.
        cut = self.end is not None and self.end.reason == "length"
        if item["type"] == "function_call":
            call = sum(1 for earlier in self.output[:index] if earlier["type"] == "function_call")
            unrunnable = self.tools is not None and call in self.tools.unrunnable
            cut = cut or unrunnable or not isinstance(json_or(item["arguments"], None), dict)
        item["status"] = "incomplete" if cut else "completed"
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events.append(self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0, text=part["text"], logprobs=[]))
            events.append(self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=dict(part)))
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            if self.seal_reasoning:
                item["encrypted_content"] = seal(text)
            events.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0, text=text))
        else:
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index, arguments=item["arguments"], name=item["name"]))
        events.append(self.event("response.output_item.done", output_index=index, item=json.loads(json.dumps(item))))
        return events

    def assistant_messages(self) -> list[dict[str, Any]]:
        """The output as chat-template messages (what a follow-up turn's prompt renders)."""
        text = "".join(part["text"] for item in self.output if item["type"] == "message" for part in item["content"])
        calls = [
            {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
            for item in self.output if item["type"] == "function_call"
        ]
        message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
        thinking = "".join(item["content"][0]["text"] for item in self.output if item["type"] == "reasoning")
        if thinking:
            message["reasoning_content"] = thinking  # where reasoning models' templates read it
        if calls:
            message["tool_calls"] = calls
        return [message]


def _conversation_of(entry: StoredResponse | None) -> list[dict[str, Any]]:
    """A stored response's conversation through its answer (copies: the next turn appends)."""
    return [] if entry is None else [dict(message) for message in entry.conversation]


CANCEL_POLL_S = 30.0  # a running background response's long poll for a cancel through another router
CANCEL_WAIT_S = 30.0  # how long a cancel through another router waits for the response's final state
RESUME_LOOKUP_S = 30.0  # how long a starting router asks the board for what it left in progress
BACKGROUND_RUNS = 3  # runs of a background response whose router died during each, before it is failed


@dataclass(slots=True)
class _Background:
    state: ResponseState
    task: asyncio.Task


class ResponsesFrontEnd:
    def __init__(self, server: "OpenAIServer"):
        self.server = server
        self.router = server.router
        config = self.router.config
        # The deployment's shared board where routers have replicas; else one of its own.
        self.store = self.router.responses_board or ResponseBoard(config)
        self.background: dict[str, _Background] = {}  # the background responses this router runs
        self.answering: dict[str, ResponseState] = {}  # stored responses this router answers now (not background)

    async def create(self, request: web.Request) -> web.StreamResponse:
        body = await self.server.read_json(request)
        api = read_responses(body)
        state, validated, conversation = await self._prepare(api, f"resp_{uuid.uuid4().hex}")
        if api.background:
            await self._start_background(api, body, state, validated, conversation)
            return web.json_response(state.obj())

        def client_gone() -> bool:
            return request.transport is None or request.transport.is_closing()

        session = await GenerationSession.open(self.router, validated, client_gone)
        try:
            chunks = read_ahead(session)
            async with contextlib.aclosing(chunks), self._on_board_while_answered(api, state, conversation):
                if api.stream:
                    return await self._stream(request, api, state, chunks, conversation)
                async for chunk in chunks:
                    state.take(chunk)
                    if chunk.end is not None:
                        break
                await self._keep(api, state, conversation, answered=True)  # a failed one too: GET shows why
                if state.end is not None and state.status == "failed":
                    raise end_failure(state.end, state.num_tokens)
                if state.end is None or state.status == "cancelled":
                    raise InternalError(state.error["message"] if state.error else f"{state.response_id}: the stream ended without a last chunk")
                return web.json_response(state.obj())
        finally:
            await session.close()

    @contextlib.asynccontextmanager
    async def _on_board_while_answered(self, api: ResponsesRequest, state: ResponseState, conversation):
        """A stored response (not background) is on the board from its start, in progress: GET
        through any router finds it (through this one, with its output so far), where it was a
        404 until the answer ended. Its final state replaces that, unless it was deleted
        meanwhile; one that ends without it (the client went away, the stream broke) is kept as
        cancelled or failed, never left in progress."""
        if not api.store:
            yield
            return
        # Known here before it is on the board: a resume() reading the board meanwhile must not
        # take it for one a dead router left.
        self.answering[state.response_id] = state
        try:
            await self._keep(api, state, conversation)
            yield
        except BaseException as exc:
            if state.status in IN_PROGRESS:
                if isinstance(exc, (asyncio.CancelledError, ConnectionResetError)):
                    state.status = "cancelled"
                else:
                    state.status, state.error = "failed", response_error(exc)
            raise
        finally:
            self.answering.pop(state.response_id, None)
            if not state.final_kept:
                if state.status in IN_PROGRESS:
                    state.status, state.error = "failed", {"code": "server_error", "message": "the answer ended before its last chunk"}
                try:
                    await asyncio.shield(self._keep(api, state, conversation, answered=True))
                except Exception:
                    logger.exception("%s: keeping the final state failed", state.response_id)

    async def _prepare(self, api: ResponsesRequest, response_id: str) -> tuple[ResponseState, ValidatedRequest, list[dict[str, Any]]]:
        """The response's state, its validated request and its conversation (a stored previous
        turn's, then this call's input)."""
        model = self.server.model_name(api.model)
        previous = await self._previous(api)
        conversation = _conversation_of(previous) + api.messages
        if previous is not None:
            # What GET .../input_items lists: every item the response was generated from, the
            # earlier turns' inputs and outputs first (OpenAI's list; this call's alone, before).
            api.input_items = [*previous.input_items, *previous.response.get("output", []), *api.input_items]
        prompt, calling = self._render(api, conversation)
        api.generate.prompt_text = prompt
        api.generate.request_id = response_id
        api.generate.lora_name = self.server.lora_name(model)
        validated = await self.router.validate_input(api.generate)
        reasoning = ReasoningSplitter(api.generate.thinking) if self.server.reasoning is not None else None
        state = ResponseState(response_id, model, api.echo, len(validated.prompt_token_ids), ToolCallOutput(calling) if calling is not None else None, reasoning)
        state.seal_reasoning = api.seal_reasoning
        return state, validated, conversation

    async def _start_background(self, api: ResponsesRequest, body: dict[str, Any], state: ResponseState, validated: ValidatedRequest, conversation) -> None:
        """Admit the response and run it in the background (it ends when generation does, or on
        cancel); any router answers GET for it once this returns."""
        session = await GenerationSession.open(self.router, validated, lambda: False)
        state.status = "queued"
        try:
            await self._keep(api, state, conversation, body)
        except BaseException:
            await session.close()
            raise
        task = asyncio.create_task(self._run_background(api, body, session, state, conversation))
        # Known here (so cancellable from here) only once its first step ran, which this wake-up
        # follows: a task cancelled before its first step runs none of its body, and its finally
        # would neither keep its final state nor close its session (the request stayed admitted).
        await asyncio.sleep(0)
        if not task.done():
            self.background[state.response_id] = _Background(state, task)

    async def resume(self) -> None:
        """Run again the background responses this router's earlier life left in progress (it
        died running them: nothing a client asked for is dropped), and, on the managing router,
        those of replicas the deployment no longer runs. Each starts over."""
        try:
            left = await asyncio.wait_for(self.store.in_progress_of(self.router.board_name, self.router.deployment_routers), RESUME_LOOKUP_S)
        except Exception:  # the router serves; what it left stays on the board for its next start
            logger.exception("%s: could not read the background responses left in progress", self.router.board_name)
            return
        for response_id, entry in left:
            if response_id in self.background or response_id in self.answering:
                continue
            if entry.request is None:  # an answer its client was waiting for: that connection died with the router
                failed = dict(entry.response, status="failed", error={"code": "server_error", "message": "its router died while answering it"})
                await self.store.put(response_id, StoredResponse(failed, entry.conversation, input_items=entry.input_items))
                continue
            logger.info("%s: left in progress by this router's earlier life; running it again", response_id)
            task = asyncio.create_task(self._run_again(response_id, entry))
            self.router.background_tasks.add(task)
            task.add_done_callback(self.router.background_tasks.discard)

    async def _run_again(self, response_id: str, entry: StoredResponse) -> None:
        try:
            if entry.runs >= BACKGROUND_RUNS:
                # Its router died during each run: the response may be what ends it (a
                # conversation that runs the router out of memory), run again at every restart.
                raise InternalError(f"its router died during each of its {entry.runs} runs")
            # Counted before anything of it runs: rendering a huge conversation may be what ends
            # the router, and a run not counted would come again at every restart.
            await self.store.put(response_id, dataclasses.replace(entry, runs=entry.runs + 1))
            api = read_responses(entry.request)
            state, validated, conversation = await self._prepare(api, response_id)
            state.created_at = entry.response.get("created_at", state.created_at)
            state.run = entry.runs + 1
            await self._start_background(api, entry.request, state, validated, conversation)
        except Exception as exc:  # e.g. its previous turn expired meanwhile: it fails, saying why
            logger.warning("%s: running it again failed: %s", response_id, exc)
            failed = dict(entry.response, status="failed", error={"code": "server_error", "message": f"its router died, and running it again failed: {exc}"})
            await self.store.put(response_id, StoredResponse(failed, entry.conversation, input_items=entry.input_items))

    async def _prior(self, api: ResponsesRequest) -> list[dict[str, Any]]:
        """The conversation a call continues (its previous response's), as the template takes it."""
        return _conversation_of(await self._previous(api))

    async def _previous(self, api: ResponsesRequest) -> StoredResponse | None:
        """The stored response a call continues (None: it starts a conversation)."""
        if api.previous_response_id is None:
            return None
        entry = await self.store.get(api.previous_response_id)
        if entry is None:
            raise PreviousResponseNotFoundError(api.previous_response_id)
        status = entry.response.get("status")
        if status in IN_PROGRESS:  # its answer is not written yet: the conversation would go on from half a turn
            raise InvalidArgumentError("previous_response_id", f"{api.previous_response_id} is still {status}: wait until it ends (or cancel it)")
        return entry

    def _render(self, api: ResponsesRequest, conversation: list[dict[str, Any]]):
        template = self.server.chat_template
        if template is None:
            raise InvalidArgumentError("input", "this model has no chat template (tokenizer_config.json or chat_template.jinja)")
        template = template.for_tools((api.chat_tools or {}).get("tools"))
        calling = read_tool_calling(api.chat_tools, template.text, self.server.chat.tool_call_parser) if api.chat_tools else None
        if calling is not None and calling.reads_special_tokens:
            api.generate.skip_special_tokens = False
        constraint = calling.constraint(api.generate.structured) if calling is not None else None
        if constraint is not None:
            if api.generate.structured is not None and constraint.kind != TOOL_CALLS:  # (tool calls take text.format in)
                raise InvalidArgumentError("tool_choice", "and text.format both constrain the answer; give one")
            api.generate.structured = constraint
        system = [{"role": "system", "content": api.instructions}] if api.instructions else []
        extra = {"reasoning_effort": api.reasoning_effort} if api.reasoning_effort is not None else None
        prompt = template.render(
            template_messages(system + conversation, template.text), add_generation_prompt=True, tools=calling.tools if calling is not None else None, extra=extra,
        )
        if self.server.reasoning is not None:
            api.generate.thinking = self.server.reasoning.thinking(prompt)
        return prompt, calling

    async def _keep(
        self, api: ResponsesRequest, state: ResponseState, conversation: list[dict[str, Any]], body: dict[str, Any] | None = None, answered: bool = False,
    ) -> None:
        """Store the response as it stands (``api.store``); in progress, with its router's name
        and ``body``, the request a router taking that one's place runs again. ``answered``: a
        response its client waits for (not background), whose final state replaces the one in
        progress only if that is still stored."""
        if not api.store:
            return
        entry = StoredResponse(state.obj(), conversation + state.assistant_messages(), input_items=api.input_items)
        if state.status in IN_PROGRESS:
            entry.owner, entry.request, entry.runs = self.router.board_name, body, state.run
            await self.store.put(state.response_id, entry)
        elif answered:  # in progress on the board since it started: a DELETE meanwhile stays deleted
            await self.store.replace(state.response_id, entry)
            state.final_kept = True
        else:
            await self.store.put(state.response_id, entry)

    async def _stream(self, request: web.Request, api: ResponsesRequest, state: ResponseState, chunks, conversation) -> web.StreamResponse:
        response = sse.event_stream()
        started = False
        try:
            async for chunk in chunks:
                if not started:
                    if chunk.end is not None and chunk.end.reason == "error":
                        raise end_failure(chunk.end, state.num_tokens)  # nothing sent yet: a real status, as unstreamed
                    await response.prepare(request)
                    started = True
                    await sse.send(response, state.event("response.created", response=state.obj()), named=True)
                    await sse.send(response, state.event("response.in_progress", response=state.obj()), named=True)
                for event in state.take(chunk):
                    await sse.send(response, event, named=True)
                if chunk.end is not None:
                    break
            await self._keep(api, state, conversation, answered=True)  # a failed one too: GET shows why, as OpenAI keeps it
            if state.status == "failed":
                await sse.send(response, state.event("response.failed", response=state.obj()), named=True)
            else:
                await sse.send(response, state.event("response.completed", response=state.obj()), named=True)
            await response.write_eof()
        except ConnectionResetError:
            logger.info("%s: the client went away mid-stream", state.response_id)
            if state.status in IN_PROGRESS:
                state.status = "cancelled"
        except Exception as exc:
            if not started:
                raise  # nothing sent yet: a real status
            log_if_internal(exc, f"{state.response_id}: the stream, after it started,")
            error = response_error(exc)
            if state.status in IN_PROGRESS:
                state.status, state.error = "failed", error
            param = getattr(remote_cause(exc), "field", None)
            await sse.send(response, state.event("error", code=error["code"], message=error["message"], param=param), named=True)
        return response

    async def _run_background(self, api: ResponsesRequest, body: dict[str, Any], session: GenerationSession, state: ResponseState, conversation) -> None:
        task = asyncio.current_task()
        watcher = asyncio.create_task(self._cancel_when_asked(state.response_id, task))
        try:
            async with contextlib.aclosing(session.chunks()) as chunks:
                async for chunk in chunks:
                    if state.status == "queued":
                        state.status = "in_progress"
                        await self._keep(api, state, conversation, body)  # what another router's GET shows
                    state.take(chunk)
                    if chunk.end is not None:
                        break
        except asyncio.CancelledError:
            state.status = "cancelled"
        except Exception as exc:
            log_if_internal(exc, f"{state.response_id}: the background response")
            state.status, state.error = "failed", response_error(exc)
        finally:
            watcher.cancel()
            # Kept before the session closes: a cancel arriving during close must not lose it.
            # (A background response is always stored: its final put also ends its waits on the
            # board.)
            try:
                await asyncio.shield(self._keep(api, state, conversation))
            except Exception:
                logger.exception("%s: keeping the final state failed", state.response_id)
            finally:
                self.background.pop(state.response_id, None)
                await session.close()  # shielded inside: the blocks are freed even if cancelled here

    async def _cancel_when_asked(self, response_id: str, task: asyncio.Task) -> None:
        """Cancel ``task`` once a cancel for the response is asked through the board (by
        another router: this one cancels its own task directly)."""
        try:
            while not await self.store.wait_for_cancel(response_id, CANCEL_POLL_S):
                pass
        except Exception:  # the board is gone (the deployment stops): no cancel can come through it
            logger.info("%s: no longer hearing cancels through the board", response_id, exc_info=True)
            return
        logger.info("%s: cancelled through another router", response_id)
        task.cancel()

    async def retrieve(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        # A response's events are not kept to be replayed: refused, not answered as JSON, which
        # the SDK's stream decoder reads as no event at all (a loop over it ran zero times).
        if request.query.get("stream", "false").lower() not in ("false", "0"):
            raise InvalidArgumentError("stream", "a stored or background response is read whole here (its events are not kept): poll GET without stream")
        if "starting_after" in request.query:
            raise InvalidArgumentError("starting_after", "needs stream, which is not served here: poll GET without it")
        running = self.background.get(response_id)
        live = running.state if running is not None else self.answering.get(response_id)
        if live is not None:
            return web.json_response(live.obj())
        entry = await self.store.get(response_id)
        if entry is None:
            raise ResponseNotFoundError(response_id)
        return web.json_response(entry.response)

    async def input_items(self, request: web.Request) -> web.Response:
        """``GET /v1/responses/{id}/input_items``: a stored response's input items, a page at a
        time (``after`` an item's id, ``limit`` 1-100, default 20; ``order`` desc, the default,
        or asc), as OpenAI lists them."""
        response_id = request.match_info["response_id"]
        query = request.query
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise InvalidArgumentError("order", f"must be asc or desc, got {order!r}")
        limit = query.get("limit", "20")
        if not limit.isdigit() or not 1 <= int(limit) <= 100:
            raise InvalidArgumentError("limit", f"must be an integer from 1 to 100, got {limit!r}")
        entry = await self.store.get(response_id)
        if entry is None:
            raise ResponseNotFoundError(response_id)
        items = entry.input_items if order == "asc" else entry.input_items[::-1]
        start = 0
        if "after" in query:
            start = next((index + 1 for index, item in enumerate(items) if item["id"] == query["after"]), None)
            if start is None:
                raise InvalidArgumentError("after", f"{query['after']!r} is no input item of {response_id}")
        page = items[start : start + int(limit)]
        return web.json_response({
            "object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + len(page) < len(items),
        })

    async def input_tokens(self, request: web.Request) -> web.Response:
        """``POST /v1/responses/input_tokens``: how many tokens a call's input would be (its
        instructions, the conversation it continues, its input and tools, through the chat
        template), without running it."""
        api = read_responses(await self.server.read_json(request))
        self.server.model_name(api.model)
        prompt, _ = self._render(api, await self._prior(api) + api.messages)
        return web.json_response({"object": "response.input_tokens", "input_tokens": len(await self.router.encode(prompt, False))})

    async def delete(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        await self._stop_running(response_id)
        # One this router is answering stays deleted here too (its final state is not put back).
        self.answering.pop(response_id, None)
        if not await self.store.delete(response_id):
            raise ResponseNotFoundError(response_id)
        return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})

    async def cancel(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        running = self.background.get(response_id)
        if running is not None:
            await self._stop_running(response_id)
            return web.json_response(running.state.obj())
        entry = await self.store.get(response_id)
        if entry is None:
            raise ResponseNotFoundError(response_id)
        if not entry.response.get("background"):
            raise InvalidArgumentError("response_id", "only a response created with background: true can be cancelled")
        if is_in_progress(entry):  # another router runs it
            entry = await self._stop_running(response_id) or entry
        return web.json_response(entry.response)  # a finished one: cancelling changes nothing

    async def _stop_running(self, response_id: str) -> StoredResponse | None:
        """Stop a background response still generating: this router's own task, or through the
        board the router that runs it; return its final state (None: this router's, or not stored)."""
        running = self.background.get(response_id)
        if running is not None:
            if running.state.end is None:  # still generating (a finished one is only storing itself)
                running.task.cancel()
            await asyncio.gather(running.task, return_exceptions=True)
            return None
        entry = await self.store.get(response_id)
        if not is_in_progress(entry) or not entry.response.get("background"):
            return None  # (an answer being streamed or awaited is its client's to stop)
        await self.store.request_cancel(response_id)
        return await self.store.wait_until_final(response_id, CANCEL_WAIT_S)
