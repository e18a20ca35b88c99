"""A chat answer read for tool calls as it streams: the content the client sees and the calls,
whole (OpenAI ``tool_calls``) and as streamed deltas, in the model's format for ``tool_choice``
auto (router/openai_api/tool_formats.py), or as the JSON a ``required`` or named choice's
grammar made (router/openai_api/tool_calls.py says which is which)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from router.openai_api.tool_calls import MISTRAL_ID_LENGTH, ToolCalling
from router.openai_api.tool_arguments import json_or
from router.openai_api.tool_blocks import CallPiece
from router.openai_api.tool_formats import READERS, whole_calls


@dataclass(slots=True)
class ToolCallDelta:
    """One streamed piece of a tool call (OpenAI's ``delta.tool_calls[i]``)."""

    index: int
    arguments: str
    id: str | None = None  # on a call's first delta only, with its name
    name: str | None = None

    def to_json(self) -> dict[str, Any]:
        function: dict[str, Any] = {"arguments": self.arguments}
        body: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            body.update(id=self.id, type="function")
            function["name"] = self.name
        body["function"] = function
        return body


@dataclass(slots=True)
class ToolCallOutput:
    """Reads one choice's text as it streams: the content the client sees, and its tool calls."""

    calling: ToolCalling
    calls: list[dict[str, Any]] = field(default_factory=list)  # whole calls so far, OpenAI's shape
    _reader: Any = None  # auto: the model's format's reader (router/openai_api/tool_formats.py)
    _buffer: str = ""  # required: the JSON the grammar made, read once it ends

    def __post_init__(self) -> None:
        if self.calling.choice == "auto":
            self._reader = READERS[self.calling.parser](self.calling.tools)

    @property
    def finish_reason(self) -> str | None:
        """vLLM's: "tool_calls" when calls were made (a named choice keeps "stop")."""
        return "tool_calls" if self.calls and self.calling.choice != "named" else None

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Content to send now, and tool-call deltas, for the next piece of the answer."""
        choice = self.calling.choice
        if choice == "none":
            return text, []
        if choice == "named":
            first = not self.calls
            if first:
                self.calls.append(_call(self.calling.name, ""))
            self.calls[0]["function"]["arguments"] += text
            if not text and not first:
                return "", []
            return "", [ToolCallDelta(0, text, self.calls[0]["id"], self.calling.name) if first else ToolCallDelta(0, text)]
        if choice == "required":
            self._buffer += text
            return "", []
        content, found = self._reader.feed(text)
        return content, self._add(found)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """What is left once the answer ended."""
        choice = self.calling.choice
        if choice in ("none", "named"):
            return "", []
        if choice == "required":
            rest, self._buffer = self._buffer, ""
            return "", self._add(whole_calls([(item["name"], item["parameters"]) for item in json_or(rest, [])]))
        content, found = self._reader.finish()
        return content, self._add(found)

    def _add(self, pieces: list[CallPiece]) -> list[ToolCallDelta]:
        deltas = []
        for piece in pieces:
            if piece.name is not None:  # a new call
                call = _call(piece.name, piece.arguments, self.calling.parser == "mistral")
                deltas.append(ToolCallDelta(len(self.calls), piece.arguments, call["id"], piece.name))
                self.calls.append(call)
            else:  # more of the last call's arguments
                self.calls[-1]["function"]["arguments"] += piece.arguments
                deltas.append(ToolCallDelta(len(self.calls) - 1, piece.arguments))
        return deltas


def _call(name: str, arguments: str, short_id: bool = False) -> dict[str, Any]:
    """A call in OpenAI's shape; ``short_id``: an id of 9 letters and digits, the only ids a
    Mistral template takes back."""
    call_id = uuid.uuid4().hex[:MISTRAL_ID_LENGTH] if short_id else f"call_{uuid.uuid4().hex[:24]}"
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def split_text(tools: ToolCallOutput | None, text: str, last: bool) -> tuple[str, list[ToolCallDelta]]:
    """A chunk's text as (content the client sees, tool-call deltas): all content without tools;
    ``last``: the answer's final chunk, after which what the reader held back is flushed."""
    if tools is None:
        return text, []
    content, deltas = tools.feed(text)
    if last:
        more, rest = tools.finish()
        content, deltas = content + more, deltas + rest
    return content, deltas
