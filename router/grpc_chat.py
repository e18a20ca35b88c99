"""gRPC's ChatPrompt: a conversation read as /v1/chat/completions reads one, and its answer split
as a chat completion's is (thinking apart from the answer, tool calls read out of it).

The request is turned into the chat body's fields and read by the same code as the OpenAI API's
(router/openai_api/protocol.py ``read_conversation``), so a conversation renders to the same
prompt through either API; a problem is named by its place in the GenerateRequest
(``chat.messages[1].role``, ``chat.tools_json[0].function.name``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine import bounded_json
from router.api.pdserve.v1 import generation_pb2 as pb
from router.errors import InvalidArgumentError
from router.openai_api.chat_format import ChatFormat
from router.openai_api.protocol import Conversation, read_conversation
from router.openai_api.reasoning import ReasoningSplitter
from router.openai_api.tool_parsers import ToolCallOutput, content_and_deltas, split_answer
from router.output_stream import OutputChunk, StreamEnd
from router.validation import GenerateInput

# The chat body's names for the fields ChatPrompt carries as JSON text.
_PROTO_NAMES = {"tools": "tools_json", "chat_template_kwargs": "chat_template_kwargs_json"}


def read_chat_prompt(prompt: pb.ChatPrompt, chat: ChatFormat, request: GenerateInput, skip_special_tokens_given: bool) -> Conversation:
    """Read ``prompt`` and make ``request`` (its sampling fields read) its answer."""
    try:
        conversation = read_conversation(_chat_body(prompt), chat.template, chat.tool_call_parser, chat.reasoning)
        conversation.apply(request, skip_special_tokens_given)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(_proto_field(exc.field), exc.problem) from None
    if request.structured is not None and request.structured.field == "tool_choice":
        # A required or named tool's grammar, compiled later: its errors name the proto's field.
        request.structured = dataclasses.replace(request.structured, field=_proto_field("tool_choice"))
    request.text_field = request.ids_field = "chat.messages"
    return conversation


def _proto_field(name: str) -> str:
    head, dot, rest = name.partition(".")
    bracket = head.find("[")
    base, index = (head, "") if bracket < 0 else (head[:bracket], head[bracket:])
    if base == "tool_choice":
        return "chat.tool_choice"  # a string here: the chat body's object form has no fields in it
    return f"chat.{_PROTO_NAMES.get(base, base)}{index}{dot}{rest}"


def _chat_body(prompt: pb.ChatPrompt) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [_message(m) for m in prompt.messages]}
    if prompt.tools_json:
        body["tools"] = _json(prompt.tools_json, "tools")
    if prompt.tool_choice:
        choice = prompt.tool_choice
        named = choice not in ("auto", "none", "required")
        body["tool_choice"] = {"type": "function", "function": {"name": choice}} if named else choice
    if prompt.HasField("parallel_tool_calls"):
        body["parallel_tool_calls"] = prompt.parallel_tool_calls
    if prompt.HasField("add_generation_prompt"):
        body["add_generation_prompt"] = prompt.add_generation_prompt
    body["continue_final_message"] = prompt.continue_final_message
    if prompt.chat_template_kwargs_json:
        body["chat_template_kwargs"] = _json(prompt.chat_template_kwargs_json, "chat_template_kwargs")
    if prompt.reasoning_effort:
        body["reasoning_effort"] = prompt.reasoning_effort
    if prompt.HasField("thinking_token_budget"):
        body["thinking_token_budget"] = prompt.thinking_token_budget
    return body


def _message(message: pb.ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role}
    if message.HasField("content"):
        out["content"] = message.content
    if message.reasoning_content:
        out["reasoning_content"] = message.reasoning_content
    if message.name:
        out["name"] = message.name
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json}}
            for call in message.tool_calls
        ]
    return out


def _json(text: str, name: str) -> Any:
    """A field given as JSON text, parsed (``name``: the chat body's, mapped back by _proto_field)."""
    try:
        return bounded_json.loads(text)  # (nesting thousands deep is refused, not a RecursionError)
    except ValueError as exc:
        raise InvalidArgumentError(name, f"is not JSON: {exc}") from None


class ChatAnswer:
    """One chat request's answer as it streams: its thinking apart (with a reasoning parser) and
    its tool calls read out of the answer's text (with tools)."""

    def __init__(self, conversation: Conversation, chat: ChatFormat):
        self._thinking = ReasoningSplitter(conversation.thinking) if chat.reasoning is not None else None
        self.tools = ToolCallOutput(conversation.calling) if conversation.calling is not None else None
        self.reasoning_tokens = 0  # the thinking's tokens, markers included

    def take(self, chunk: OutputChunk) -> tuple[str, str]:
        """(the answer's text, the thinking's text) of the next chunk."""
        thinking, parts, thinking_tokens = split_answer(self._thinking, self.tools, chunk)
        self.reasoning_tokens += thinking_tokens
        text, _ = content_and_deltas(parts)
        return text, thinking

    def fill_end(self, response: pb.GenerateResponse, end: StreamEnd) -> None:
        """The last message's tool calls, finish reason and reasoning usage."""
        if self._thinking is not None:
            response.usage.reasoning_tokens = self.reasoning_tokens
        if self.tools is None:
            return
        for call in self.tools.runnable_calls:  # (one none may run, cut short, is left out, as chat's whole message leaves it)
            function = call["function"]
            response.tool_calls.add(id=call["id"], name=function["name"], arguments_json=function["arguments"])
        if self.tools.finish_reason_at(end) and response.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_EOS):
            response.finish_reason = pb.FINISH_REASON_TOOL_CALLS
