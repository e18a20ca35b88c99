"""Tool calling on the chat API: the request's ``tools`` and ``tool_choice`` read and checked,
the grammar that enforces a ``required`` or named choice, and the parsers that turn a model's
own tool-call format into OpenAI ``tool_calls``, whole or as streamed deltas.

- ``none``: the template still sees the tools (as vLLM does); the answer is plain content.
- ``auto``: the model decides; its text is parsed by the model's tool-call parser: ``hermes``
  (Hermes, Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks after
  optional content) or ``llama3_json`` (Llama 3.x: the whole answer is ``{"name": ...,
  "parameters": {...}}``, several joined by ``;``, optionally after ``<|python_tag|>``). The
  parser is configured (``router.tool_call_parser``) or recognised in the chat template.
- ``required``: a grammar makes the answer a JSON array of ``{"name", "parameters"}`` objects,
  one schema per tool (at most one item without ``parallel_tool_calls``); named
  (``{"type": "function", "function": {"name": ...}}``): the answer is that function's arguments.
  Both are parsed from JSON, whatever the template says.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.structured_output import StructuredOutput
from router.errors import InvalidArgumentError

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


@dataclass(slots=True, frozen=True)
class ToolCalling:
    """How one chat request may call its tools."""

    tools: list[dict[str, Any]]  # as the client sent them: what the template renders
    choice: str  # "none", "auto", "required" or "named"
    name: str | None = None  # the named choice's function
    parser: str | None = None  # auto: the model's format
    parallel: bool = True

    def constraint(self) -> StructuredOutput | None:
        """The grammar a required or named choice decodes under."""
        if self.choice == "named":
            return StructuredOutput("json_schema", json.dumps(_parameters(self._tool(self.name))), field="tool_choice")
        if self.choice != "required":
            return None
        items = [
            {
                "type": "object",
                "properties": {"name": {"enum": [tool["function"]["name"]]}, "parameters": _parameters(tool)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for tool in self.tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutput("json_schema", json.dumps(schema), field="tool_choice")

    def _tool(self, name: str | None) -> dict[str, Any]:
        return next(tool for tool in self.tools if tool["function"]["name"] == name)


def read_tool_calling(body: dict, template_text: str, configured_parser: str | None) -> ToolCalling | None:
    """The request's tools and tool_choice, checked; None when it has no tools."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidArgumentError("parallel_tool_calls", f"must be true or false, got {type(parallel).__name__}")
    if not tools:
        if choice not in (None, "none"):
            raise InvalidArgumentError("tool_choice", "needs tools")
        return None
    if not isinstance(tools, list):
        raise InvalidArgumentError("tools", "must be a list of tools")
    names: list[str] = []
    for index, tool in enumerate(tools):
        _check_tool(tool, f"tools[{index}]")
        name = tool["function"]["name"]
        if name in names:
            raise InvalidArgumentError(f"tools[{index}].function.name", f"{name!r} is given twice")
        names.append(name)
    name = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("function"), dict):
            raise InvalidArgumentError("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')
        name = choice["function"].get("name")
        if name not in names:
            raise InvalidArgumentError("tool_choice.function.name", f"{name!r} is not one of the tools ({names})")
        choice = "named"
    elif choice not in ("none", "auto", "required"):
        raise InvalidArgumentError("tool_choice", f'must be "none", "auto", "required" or a named function, got {choice!r}')
    parser = None
    if choice == "auto":
        parser = configured_parser or detect_parser(template_text)
        if parser is None:
            raise InvalidArgumentError(
                "tool_choice",
                '"auto" needs a tool-call parser and this model\'s chat template shows no known format; set '
                f"router.tool_call_parser (one of {list(TOOL_CALL_PARSERS)}) or use \"required\" or a named function",
            )
    return ToolCalling(tools=list(tools), choice=choice, name=name, parser=parser, parallel=parallel is not False)


def detect_parser(template_text: str) -> str | None:
    """The tool-call format a chat template teaches its model, where it shows one."""
    if _HERMES_OPEN in template_text:
        return "hermes"
    if _PYTHON_TAG in template_text or "ipython" in template_text:
        return "llama3_json"
    return None


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as templates expect them: a tool call's ``arguments`` as an object where the
    client's JSON text parses (templates write it with ``tojson``), as vLLM passes them."""
    rendered = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = dict(message)
            message["tool_calls"] = [_with_parsed_arguments(call) for call in calls]
        rendered.append(message)
    return rendered


def check_message_tool_fields(message: dict, name: str) -> dict[str, Any]:
    """An assistant message's ``tool_calls`` or a tool message's ``tool_call_id``, checked."""
    out: dict[str, Any] = {}
    calls = message.get("tool_calls")
    if calls not in (None, []):
        if not isinstance(calls, list):
            raise InvalidArgumentError(f"{name}.tool_calls", "must be a list of tool calls")
        for index, call in enumerate(calls):
            where = f"{name}.tool_calls[{index}]"
            if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
                raise InvalidArgumentError(where, 'must be {"id", "type": "function", "function": {"name", "arguments"}}')
            if not isinstance(call["function"].get("name"), str) or not isinstance(call["function"].get("arguments", ""), str):
                raise InvalidArgumentError(f"{where}.function", "needs a name and arguments as JSON text")
        out["tool_calls"] = calls
    call_id = message.get("tool_call_id")
    if call_id is not None:
        if not isinstance(call_id, str):
            raise InvalidArgumentError(f"{name}.tool_call_id", "must be a string")
        out["tool_call_id"] = call_id
    return out


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
        return self._feed_llama3()

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """What is left once the answer ended."""
        choice = self.calling.choice
        if choice in ("none", "named"):
            return "", []
        rest, self._buffer = self._buffer, ""
        if choice == "required":
            return "", self._add([(item["name"], item["parameters"]) for item in _json_or(rest, [])])
        if self.calling.parser == "hermes":
            if self._content_done:  # a call the answer did not close
                found = _hermes_call(rest)
                return ("", self._add([found])) if found else (_HERMES_OPEN + rest, [])
            return ("" if self.calls and not rest.strip() else rest), []
        calls = _llama3_calls(rest) if self._content_done else None
        if calls is None:
            return rest, []
        return "", self._add(calls)

    def _feed_hermes(self) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = "", []
        while True:
            if not self._content_done:
                at = self._buffer.find(_HERMES_OPEN)
                if at < 0:
                    # Hold back what could be the start of a marker.
                    keep = _marker_prefix_len(self._buffer, _HERMES_OPEN)
                    return content + self._content(self._buffer[: len(self._buffer) - keep]), deltas
                content += self._content(self._buffer[:at])  # the buffer now starts with the marker
                self._buffer = self._buffer[len(_HERMES_OPEN) :]
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

    def _feed_llama3(self) -> tuple[str, list[ToolCallDelta]]:
        if not self._decided:
            stripped = self._buffer.lstrip()
            if not stripped or _PYTHON_TAG.startswith(stripped):
                return "", []
            self._decided = True
            self._content_done = stripped.startswith("{") or stripped.startswith(_PYTHON_TAG)
        if self._content_done:
            return "", []
        text, self._buffer = self._buffer, ""
        return text, []

    def _add(self, found: list[tuple[str, Any]]) -> list[ToolCallDelta]:
        deltas = []
        for name, arguments in found:
            call = _call(name, arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))
            deltas.append(ToolCallDelta(len(self.calls), call["function"]["arguments"], call["id"], name))
            self.calls.append(call)
        return deltas


def _check_tool(tool: Any, where: str) -> None:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise InvalidArgumentError(f"{where}.type", 'must be "function"')
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InvalidArgumentError(f"{where}.function", "must be an object with a name")
    unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
    if unknown:
        raise InvalidArgumentError(f"{where}.function.{unknown[0]}", "is not a field of a function")
    if not isinstance(function.get("name"), str) or not _NAME_RE.fullmatch(function["name"]):
        raise InvalidArgumentError(f"{where}.function.name", "must be 1-64 characters from [A-Za-z0-9_.-]")
    if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
        raise InvalidArgumentError(f"{where}.function.parameters", "must be a JSON schema object")


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": arguments}}


def _with_parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        parsed = _json_or(arguments, None)
        if isinstance(parsed, dict):
            function["arguments"] = parsed
    return {**call, "function": function}


def _json_or(text: str, default: Any) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return default


def _hermes_call(text: str) -> tuple[str, Any] | None:
    body = _json_or(text.strip(), None)
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return None
    return body["name"], body.get("arguments", {})


def _llama3_calls(text: str) -> list[tuple[str, Any]] | None:
    """Every call of a Llama 3 JSON answer, or None if it is not one."""
    text = text.strip().removeprefix(_PYTHON_TAG).strip()
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


def _marker_prefix_len(text: str, marker: str) -> int:
    """How many of ``text``'s last characters are a proper start of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
