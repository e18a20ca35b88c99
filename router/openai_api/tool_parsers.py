"""A chat answer read for tool calls as it streams: the content the client sees and the calls,
whole (OpenAI ``tool_calls``) and as streamed deltas, in the model's format for ``tool_choice``
auto (router/openai_api/tool_formats.py), or as the JSON a ``required`` or named choice's
grammar made (router/openai_api/tool_calls.py says which is which)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from router.openai_api.tool_arguments import json_or, json_valid
from router.openai_api.tool_calls import MISTRAL_ID_LENGTH, ToolCalling
from router.openai_api.tool_blocks import Part
from router.openai_api.tool_formats import READERS, RequiredListReader

if TYPE_CHECKING:
    from router.openai_api.reasoning import ReasoningSplitter
    from router.output_stream import OutputChunk, StreamEnd


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


OutputPart = str | ToolCallDelta  # content the client sees, or a piece of a tool call


@dataclass(slots=True)
class ToolCallOutput:
    """Reads one choice's text as it streams: the content the client sees, and its tool calls."""

    calling: ToolCalling
    calls: list[dict[str, Any]] = field(default_factory=list)  # whole calls so far, OpenAI's shape
    # auto: the model's format's reader; required: the grammar's list's (router/openai_api/tool_formats.py)
    _reader: Any = None
    # parallel_tool_calls false: a call after the first is being left out, as OpenAI and vLLM
    # answer (under auto the model may still write several; required's grammar allows one).
    _dropping: bool = False
    # auto, once the answer ended: the calls made that are none to run (by index): their arguments
    # no JSON (a model's trailing comma, once streamed), or closed where the reading or the answer
    # stopped (pythonic; a text value the answer ended inside).
    unrunnable: set[int] = field(default_factory=set)
    _written: list[str] = field(default_factory=list)  # auto: the answer's text as the model wrote it

    def __post_init__(self) -> None:
        if self.calling.choice == "auto":
            self._reader = READERS[self.calling.parser](self.calling.tools)
        elif self.calling.choice == "required":
            self._reader = RequiredListReader()

    @property
    def finish_reason(self) -> str | None:
        """vLLM's: "tool_calls" when calls were made (a named choice keeps "stop"); under auto not
        where a call made is none to run ("tool_calls" told the client to run it; vLLM reads such
        an answer as content, and ends a stream of it with "stop")."""
        return "tool_calls" if self.calls and self.calling.choice != "named" and not self.unrunnable else None

    @property
    def calls_complete(self) -> bool:
        """Every call's arguments are a JSON object: none was cut short (a stop string matched
        inside them, and a client told to run it would fail parsing them)."""
        return all(isinstance(json_or(call["function"]["arguments"], None), dict) for call in self.calls)

    @property
    def runnable_calls(self) -> list[dict[str, Any]]:
        """The calls made that may be run, as far as the answer's end showed: what a whole
        answer lists. One cut short stays out (vLLM reads such an answer as content; here the
        call's text is no content either: a client sees an answer ended by "stop")."""
        return [call for index, call in enumerate(self.calls) if index not in self.unrunnable]

    @property
    def text_if_none_runs(self) -> str | None:
        """Under auto, where calls were made and none may run: the answer as the model wrote it,
        its calls' text included, which a whole answer gives as its content (as vLLM does with
        an answer its tool parser cannot read); the calls' text was lost, the content empty or
        the text around them alone. None otherwise."""
        if self.calling.choice != "auto" or not self.calls or self.runnable_calls:
            return None
        return "".join(self._written)

    def cut_short(self, end: StreamEnd) -> bool:
        """Whether a stop string (``end.matched_stop``) cut a call short."""
        return bool(end.matched_stop) and not self.calls_complete

    def finish_reason_at(self, end: StreamEnd) -> str | None:
        """``finish_reason`` for an answer that ended so: no calls made where a stop string cut
        one short; vLLM's otherwise, whatever the arguments are."""
        return None if self.cut_short(end) else self.finish_reason

    def feed(self, text: str) -> list[OutputPart]:
        """The next piece of the answer as what to send, in the answer's order: content, and
        tool-call deltas."""
        choice = self.calling.choice
        if choice == "none":
            return [text] if text else []
        if choice == "named":
            # The call opens with the answer's first text: a chunk of only thinking (split off
            # before this) opened it, and the thinking that came next then interrupted it.
            if not text:
                return []
            first = not self.calls
            if first:
                self.calls.append(_call(self.calling.name, ""))
            self.calls[0]["function"]["arguments"] += text
            return [ToolCallDelta(0, text, self.calls[0]["id"], self.calling.name) if first else ToolCallDelta(0, text)]
        if choice == "auto":
            self._written.append(text)
        return self._deltas(self._reader.feed(text))

    def finish(self) -> list[OutputPart]:
        """What is left once the answer ended."""
        choice = self.calling.choice
        if choice in ("none", "named"):
            return []
        parts = self._deltas(self._reader.finish())
        if choice == "auto":
            # Only the calls made count (parallel_tool_calls false drops those after the first).
            self.unrunnable = {
                index for index, call in enumerate(self.calls)
                if index in self._reader.cut_calls or not json_valid(call["function"]["arguments"])
            }
        return parts

    def _deltas(self, parts: list[Part]) -> list[OutputPart]:
        out: list[OutputPart] = []
        for part in parts:
            if isinstance(part, str):
                out.append(part)
            elif part.name is not None:  # a new call
                self._dropping = bool(self.calls) and not self.calling.parallel
                if self._dropping:
                    continue
                call = _call(part.name, part.arguments, self.calling.parser == "mistral")
                out.append(ToolCallDelta(len(self.calls), part.arguments, call["id"], part.name))
                self.calls.append(call)
            elif not self._dropping:  # more of the last call's arguments
                self.calls[-1]["function"]["arguments"] += part.arguments
                out.append(ToolCallDelta(len(self.calls) - 1, part.arguments))
        return out


def _call(name: str, arguments: str, short_id: bool = False) -> dict[str, Any]:
    """A call in OpenAI's shape; ``short_id``: an id of 9 letters and digits, the only ids a
    Mistral template takes back."""
    call_id = uuid.uuid4().hex[:MISTRAL_ID_LENGTH] if short_id else f"call_{uuid.uuid4().hex[:24]}"
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def split_text(tools: ToolCallOutput | None, text: str, last: bool) -> list[OutputPart]:
    """A chunk's text as what the client is sent, in the answer's order: content (all of it
    without tools) and tool-call deltas; ``last``: the answer's final chunk, after which what
    the reader held back is flushed."""
    if tools is None:
        return [text] if text else []
    parts = tools.feed(text)
    return parts + tools.finish() if last else parts


def split_answer(reasoning: ReasoningSplitter | None, tools: ToolCallOutput | None, chunk: OutputChunk) -> tuple[str, list[OutputPart], int]:
    """A chat answer's chunk three ways, as every front end renders it: the thinking's text
    (with a reasoning parser), the answer's content and tool-call pieces in order (with tools:
    read out of its text), and how many of the chunk's tokens are the thinking's."""
    last = chunk.end is not None
    thinking, text, thinking_tokens = "", chunk.text, 0
    if reasoning is not None:
        thinking, text = reasoning.take(text, last)
        thinking_tokens = reasoning.thinking_tokens(chunk.token_ids)
    return thinking, split_text(tools, text, last), thinking_tokens


def content_and_deltas(parts: list[OutputPart]) -> tuple[str, list[ToolCallDelta]]:
    """The parts' content joined and their deltas (for a chat chunk, which carries both side by
    side), one per call: a chunk's pieces of one call join (OpenAI and vLLM send a call's index
    once a chunk; a call's name and its first arguments come as two pieces)."""
    deltas: list[ToolCallDelta] = []
    for part in parts:
        if not isinstance(part, ToolCallDelta):
            continue
        if deltas and deltas[-1].index == part.index and part.id is None:
            deltas[-1] = ToolCallDelta(part.index, deltas[-1].arguments + part.arguments, deltas[-1].id, deltas[-1].name)
        else:
            deltas.append(part)
    return "".join(part for part in parts if isinstance(part, str)), deltas
