"""A chat answer read for tool calls as it streams: the content the client sees and the calls,
whole (OpenAI ``tool_calls``) and as streamed deltas, in the model's format (``hermes``,
``llama3_json``, ``mistral``) for ``tool_choice`` auto, or as the JSON a ``required`` or named choice's grammar
made (router/openai_api/tool_calls.py says which is which)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from router.openai_api.tool_calls import HERMES_OPEN, MISTRAL_CALLS, MISTRAL_ID_LENGTH, PYTHON_TAG, ToolCalling, json_or

_HERMES_CLOSE = "</tool_call>"


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
    _buffer: str = ""
    _content_done: bool = False  # the rest is tool calls (hermes after a marker, llama3_json)
    _decided: bool = False  # llama3_json: whether the answer is a call was settled

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
        self._buffer += text
        if choice == "required":
            return "", []
        if self.calling.parser == "hermes":
            return self._feed_hermes()
        if self.calling.parser == "mistral":
            return self._feed_mistral()
        return self._feed_llama3()

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """What is left once the answer ended."""
        choice = self.calling.choice
        if choice in ("none", "named"):
            return "", []
        rest, self._buffer = self._buffer, ""
        if choice == "required":
            return "", self._add([(item["name"], item["parameters"]) for item in json_or(rest, [])])
        if self.calling.parser == "hermes":
            if self._content_done:  # a call the answer did not close
                found = _hermes_call(rest)
                return ("", self._add([found])) if found else (HERMES_OPEN + rest, [])
            return ("" if self.calls and not rest.strip() else rest), []
        if self.calling.parser == "mistral":
            if not self._content_done:
                return rest, []
            calls = _mistral_calls(rest)
            return ("", self._add(calls)) if calls else (MISTRAL_CALLS + rest, [])
        calls = _llama3_calls(rest) if self._content_done else None
        if calls is None:
            return rest, []
        return "", self._add(calls)

    def _feed_hermes(self) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = "", []
        while True:
            if not self._content_done:
                at = self._buffer.find(HERMES_OPEN)
                if at < 0:
                    # Hold back what could be the start of a marker.
                    keep = marker_prefix_len(self._buffer, HERMES_OPEN)
                    return content + self._content(self._buffer[: len(self._buffer) - keep]), deltas
                content += self._content(self._buffer[:at])  # the buffer now starts with the marker
                self._buffer = self._buffer[len(HERMES_OPEN) :]
                self._content_done = True
            end = self._buffer.find(_HERMES_CLOSE)
            if end < 0:
                return content, deltas
            found = _hermes_call(self._buffer[:end])
            self._buffer = self._buffer[end + len(_HERMES_CLOSE) :]
            if found:
                deltas += self._add([found])
            self._content_done = False

    def _content(self, text: str) -> str:
        """Hermes text outside the calls: taken from the buffer; whitespace between calls dropped."""
        self._buffer = self._buffer[len(text) :]
        return "" if self.calls and not text.strip() else text

    def _feed_mistral(self) -> tuple[str, list[ToolCallDelta]]:
        """Content until ``[TOOL_CALLS]``; the rest is calls, read once the answer ends."""
        if self._content_done:
            return "", []
        at = self._buffer.find(MISTRAL_CALLS)
        if at >= 0:
            content, self._buffer = self._buffer[:at], self._buffer[at + len(MISTRAL_CALLS) :]
            self._content_done = True
            return content, []
        keep = marker_prefix_len(self._buffer, MISTRAL_CALLS)
        content, self._buffer = self._buffer[: len(self._buffer) - keep], self._buffer[len(self._buffer) - keep :]
        return content, []

    def _feed_llama3(self) -> tuple[str, list[ToolCallDelta]]:
        if not self._decided:
            stripped = self._buffer.lstrip()
            if not stripped or PYTHON_TAG.startswith(stripped):
                return "", []
            self._decided = True
            self._content_done = stripped.startswith("{") or stripped.startswith(PYTHON_TAG)
        if self._content_done:
            return "", []
        text, self._buffer = self._buffer, ""
        return text, []

    def _add(self, found: list[tuple[str, Any]]) -> list[ToolCallDelta]:
        deltas = []
        for name, arguments in found:
            call = _call(name, arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False), self.calling.parser == "mistral")
            deltas.append(ToolCallDelta(len(self.calls), call["function"]["arguments"], call["id"], name))
            self.calls.append(call)
        return deltas


def _call(name: str, arguments: str, short_id: bool = False) -> dict[str, Any]:
    """A call in OpenAI's shape; ``short_id``: an id of 9 letters and digits, the only ids a
    Mistral template takes back."""
    call_id = uuid.uuid4().hex[:MISTRAL_ID_LENGTH] if short_id else f"call_{uuid.uuid4().hex[:24]}"
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _hermes_call(text: str) -> tuple[str, Any] | None:
    body = json_or(text.strip(), None)
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return None
    return body["name"], body.get("arguments", {})


def _llama3_calls(text: str) -> list[tuple[str, Any]] | None:
    """Every call of a Llama 3 JSON answer, or None if it is not one."""
    text = text.strip().removeprefix(PYTHON_TAG).strip()
    calls = []
    decoder = json.JSONDecoder()
    position = 0
    while position < len(text):
        try:
            body, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return None
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            return None
        calls.append((body["name"], body.get("parameters", body.get("arguments", {}))))
        position = end
        while position < len(text) and text[position] in " \n\t;":
            position += 1
    return calls or None


def _mistral_calls(text: str) -> list[tuple[str, Any]] | None:
    """The calls after ``[TOOL_CALLS]``: a JSON list of ``{"name", "arguments"}`` (or one such
    object), or ``name[ARGS]{...}`` (an optional ``[CALL_ID]id`` before ``[ARGS]``), each after
    its own ``[TOOL_CALLS]``; None where the text is neither. What follows the JSON (the end of
    sequence the kept special tokens bring, ``</s>``) is no part of a call."""
    text = text.strip()
    decoder = json.JSONDecoder()
    if text.startswith(("[", "{")):
        try:
            body, _ = decoder.raw_decode(text)
        except json.JSONDecodeError:
            return None
        items = body if isinstance(body, list) else [body]
        if not items or not all(isinstance(item, dict) and isinstance(item.get("name"), str) for item in items):
            return None
        return [(item["name"], item.get("arguments", item.get("parameters")) or {}) for item in items]
    calls = []
    for part in text.split(MISTRAL_CALLS):
        name, marker, arguments = part.partition("[ARGS]")
        name = name.partition("[CALL_ID]")[0].strip()
        try:
            body, end = decoder.raw_decode(arguments.strip())
        except json.JSONDecodeError:
            return None
        if not marker or not name or not isinstance(body, dict):
            return None
        calls.append((name, arguments.strip()[:end]))
    return calls


def marker_prefix_len(text: str, marker: str) -> int:
    """How many of ``text``'s last characters are a proper start of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


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
