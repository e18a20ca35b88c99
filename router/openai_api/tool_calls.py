"""Tool calling on the chat API: the request's ``tools`` and ``tool_choice`` read and checked,
the grammar that enforces a ``required`` or named choice; the answers are read by
router/openai_api/tool_parsers.py.

- ``none``: the template still sees the tools (as vLLM does); the answer is plain content.
- ``auto``: the model decides; its text is read in the model's format (hermes, qwen3_coder,
  glm45, llama3_json, pythonic, mistral: router/openai_api/tool_formats.py), configured
  (``router.tool_call_parser``) or recognised in the chat template; with
  ``parallel_tool_calls: false`` only the first call it writes is returned (as OpenAI and vLLM do),
  and a grammar in effect (a strict tool's, or beside an answer format: hermes, llama3_json)
  takes one call (hermes: none begins after it), so the model spends no tokens on dropped calls.
  In the hermes and llama3_json formats a grammar holds a ``strict`` tool's calls to its
  parameters, and lets an answer with a JSON format call its tools (``ToolCalling.constraint``;
  Llama 3's calls are JSON too: beside a JSON format, the answer or one call).
- ``required``: a grammar makes the answer a JSON array of ``{"name", "parameters"}`` objects,
  one schema per tool (at most one item without ``parallel_tool_calls``); named
  (``{"type": "function", "function": {"name": ...}}``): the answer is that function's arguments.
  Both are parsed from JSON, whatever the template says.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError
from engine.structured_output import DEFINITION_KEYWORDS, CallTag, StructuredOutput, check_grammar
from router.errors import InvalidArgumentError
from router.openai_api.tool_arguments import json_or
from router.openai_api.parser_names import TOOL_CALL_ALIASES, TOOL_CALL_FORMATS
from router.openai_api.tool_blocks import HERMES_CLOSE, HERMES_OPEN
from router.openai_api.tool_formats import MISTRAL_CALLS, detect_parser

_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MISTRAL_ID_LENGTH = 9  # Mistral's templates refuse other tool call ids


@dataclass(slots=True, frozen=True)
class ToolCalling:
    """How one chat request may call its tools."""

    tools: list[dict[str, Any]]  # as the client sent them: what the template renders
    choice: str  # "none", "auto", "required" or "named"
    name: str | None = None  # the named choice's function
    parser: str | None = None  # auto: the model's format
    parallel: bool = True

    @property
    def reads_special_tokens(self) -> bool:
        """The answer is read for markers its tokenizer calls special (Mistral's ``[TOOL_CALLS]``,
        ``[ARGS]``): its text must keep them (vLLM's Mistral parser asks the same)."""
        return self.choice == "auto" and self.parser == "mistral"

    def constraint(self, answer: StructuredOutput | None = None) -> StructuredOutput | None:
        """The grammar a required or named choice decodes under; under auto, where the model's
        format can be written as one (hermes), the grammar that holds a strict tool's calls to
        its parameters, and with ``answer`` (a response format: a JSON schema or object) the one
        that lets the answer be that or calls (the format alone left no tool callable: the
        OpenAI Agents SDK's agents with an output type never called theirs); either takes a
        single call without ``parallel_tool_calls``. None: nothing to
        hold (the answer's own format, if any, stays as it is)."""
        if self.choice == "auto":
            return self._auto_constraint(answer)
        if self.choice == "named":
            return StructuredOutput("json_schema", json.dumps(_parameters(self._tool(self.name))), field="tool_choice")
        if self.choice != "required":
            return None
        # Each tool's parameters sit deep in the answer's schema, so their definitions (``$defs``,
        # which the openai SDK's tools from nested pydantic models carry, and the older
        # ``definitions``) move to its root, where their references ("#/$defs/...") point.
        definitions: dict[str, dict[str, Any]] = {}
        items = []
        for index, tool in enumerate(self.tools):
            parameters = dict(_parameters(tool))
            for keyword in DEFINITION_KEYWORDS:
                found = parameters.pop(keyword, None) or {}
                if not isinstance(found, dict):
                    raise InvalidArgumentError(f"tools[{index}].function.parameters.{keyword}", "must be an object of named schemas")
                for name, definition in found.items():
                    held = definitions.setdefault(keyword, {})
                    if held.setdefault(name, definition) != definition:
                        raise InvalidArgumentError(
                            f"tools[{index}].function.parameters.{keyword}.{name}",
                            'differs from another tool\'s definition of that name, which tool_choice "required" cannot tell apart',
                        )
            items.append({
                "type": "object",
                "properties": {"name": {"enum": [tool["function"]["name"]]}, "parameters": parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            })
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}, **definitions}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutput("json_schema", json.dumps(schema), field="tool_choice")

    def _auto_constraint(self, answer: StructuredOutput | None) -> StructuredOutput | None:
        shape = _CALL_SHAPES.get(self.parser)
        if shape is None or (answer is not None and answer.kind not in ("json_schema", "json_object")):
            return None  # (a regex, choice or grammar answer stays as the client gave it)
        held = [index for index, tool in enumerate(self.tools) if tool["function"].get("strict") is True and _compiles(_parameters(tool))]
        # parallel_tool_calls false alone makes no grammar: a constrained row is sampled on the host
        # (never overlapped), a cost on every token for calls a model rarely writes twice, whose
        # later ones the reader drops (as vLLM does). Where a grammar holds anyway, it takes one.
        if not (held or answer is not None):
            return None
        calls = []
        for index, tool in enumerate(self.tools):
            begin = shape.begin.format(name=json.dumps(tool["function"]["name"], ensure_ascii=False))
            schema = _parameters(tool) if index in held else {"type": "object"}
            as_json = None
            if shape.arguments_key is not None:
                # The arguments' definitions at the call's root, where their "#/$defs/..." then point.
                arguments = {key: value for key, value in schema.items() if key not in DEFINITION_KEYWORDS}
                as_json = {"type": "object", "properties": {"name": {"const": tool["function"]["name"]}, shape.arguments_key: arguments},
                           "required": ["name", shape.arguments_key], "additionalProperties": False,
                           **{key: schema[key] for key in DEFINITION_KEYWORDS if key in schema}}
            calls.append(CallTag(shape.trigger or begin, begin, schema, shape.end, as_json))
        field = answer.field if answer is not None else "tools"
        opening = None
        if shape.opening is not None:  # a call opens with one of these tools' names: any other JSON answer stays free
            names = "|".join(tool["function"]["name"].replace(".", "\\.") for tool in self.tools)
            opening = shape.opening.format(names=names)
        return StructuredOutput.tool_calls(calls, answer, field, separator=shape.separator, opening=opening, one_call=not self.parallel)

    def _tool(self, name: str | None) -> dict[str, Any]:
        return next(tool for tool in self.tools if tool["function"]["name"] == name)


@dataclass(slots=True, frozen=True)
class _CallShape:
    """How a format writes a call, for the grammar that holds its arguments (``begin``, with the
    tool's name as JSON at ``{name}``, then the arguments, then ``end``). ``trigger``: where
    free text gives way to a call (None: calls are the whole answer, each opening as
    ``opening`` says, a regex a text answer may not start with); ``separator``: between calls;
    ``arguments_key``: where a call is one JSON object, the key of its arguments beside "name"."""

    begin: str
    end: str
    trigger: str | None
    separator: str
    opening: str | None = None
    arguments_key: str | None = None


# The formats whose calls a grammar holds under auto: hermes (Qwen's), calls in free text; Llama
# 3.x's JSON, the whole answer, joined by ";" (a JSON answer that is no call stays free).
_CALL_SHAPES = {
    "hermes": _CallShape(HERMES_OPEN + '\n{{"name": {name}, "arguments": ', "}\n" + HERMES_CLOSE, HERMES_OPEN, r"\s*"),
    "llama3_json": _CallShape('{{"name": {name}, "parameters": ', "}", None, r"\s*;\s*", r'\s*\{{\s*"name"\s*:\s*"({names})"', "parameters"),
}


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
                f"router.tool_call_parser (one of {list(TOOL_CALL_FORMATS)}) or use \"required\" or a named function",
            )
        parser = TOOL_CALL_ALIASES.get(parser, parser)
    return ToolCalling(tools=list(tools), choice=choice, name=name, parser=parser, parallel=parallel is not False)


def template_messages(messages: list[dict[str, Any]], template_text: str) -> list[dict[str, Any]]:
    """Messages as templates expect them: a tool call's ``arguments`` as an object where the
    client's JSON text parses (templates write it with ``tojson``), as vLLM passes them; for a
    Mistral template, tool call ids as 9 letters and digits (the template raises on any other,
    and clients send back ids of every shape): one already so is kept, any other becomes 9
    characters of its digest, the same for the call and its result. A message's reasoning goes
    as ``thinking`` too (gpt-oss templates read it there), as transformers aliases it."""
    short_ids = MISTRAL_CALLS in template_text
    rendered = []
    for message in messages:
        if message.get("reasoning_content") is not None and "thinking" not in message:
            message = {**message, "thinking": message["reasoning_content"]}
        calls = message.get("tool_calls")
        if calls:
            message = dict(message)
            message["tool_calls"] = [_with_parsed_arguments(call, short_ids) for call in calls]
        if short_ids and isinstance(message.get("tool_call_id"), str):
            message = {**message, "tool_call_id": mistral_id(message["tool_call_id"])}
        rendered.append(message)
    return rendered


def mistral_id(call_id: str) -> str:
    """A tool call id as Mistral's templates take it: 9 letters and digits."""
    if len(call_id) == MISTRAL_ID_LENGTH and call_id.isascii() and call_id.isalnum():
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:MISTRAL_ID_LENGTH]


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
            if not isinstance(call["function"].get("name"), str) or not isinstance(call["function"].get("arguments", ""), (str, type(None))):
                raise InvalidArgumentError(f"{where}.function", "needs a name and arguments as JSON text")
        out["tool_calls"] = calls
    call_id = message.get("tool_call_id")
    if call_id is not None:
        if not isinstance(call_id, str):
            raise InvalidArgumentError(f"{name}.tool_call_id", "must be a string")
        out["tool_call_id"] = call_id
    return out


def _check_tool(tool: Any, where: str) -> None:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise InvalidArgumentError(f"{where}.type", 'must be "function"')
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InvalidArgumentError(f"{where}.function", "must be an object with a name")
    unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
    if unknown:
        raise InvalidArgumentError(f"{where}.function.{unknown[0]}", "is not a field of a function")
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise InvalidArgumentError(f"{where}.function.strict", f"must be true or false, got {type(function['strict']).__name__}")
    if not isinstance(function.get("name"), str) or not _NAME_RE.fullmatch(function["name"]):
        raise InvalidArgumentError(f"{where}.function.name", "must be 1-64 characters from [A-Za-z0-9_.-]")
    if function.get("parameters") is not None:
        _check_schema(function["parameters"], f"{where}.function.parameters")


def _check_schema(schema: Any, where: str) -> None:
    """A tool's parameters: a JSON schema object whose ``properties`` (the readers look each
    argument up there) is an object."""
    if not isinstance(schema, dict):
        raise InvalidArgumentError(where, f"must be a JSON schema object, got {type(schema).__name__}")
    if schema.get("properties") is not None and not isinstance(schema["properties"], dict):
        raise InvalidArgumentError(f"{where}.properties", f"must be an object of the parameters' schemas, got {type(schema['properties']).__name__}")


def _compiles(schema: dict[str, Any]) -> bool:
    """Whether a strict tool's parameters make a grammar: one using what llguidance does not
    hold a value to (``uniqueItems``, as pydantic writes a set) is read as written, as before
    strict was held (not refused: a client's strict default would fail every request)."""
    try:
        check_grammar(StructuredOutput("json_schema", json.dumps(schema), field="tools"))
    except InvalidRequestError:
        return False
    return True


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def _with_parsed_arguments(call: dict[str, Any], short_id: bool) -> dict[str, Any]:
    """A past call as templates take it: its arguments an object (none written, as clients send a
    call without arguments: ``""``, ``null``, ``"null"``: an empty one, as vLLM renders them)."""
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    written = arguments.strip() if isinstance(arguments, str) else arguments
    if written in (None, "", "null"):
        function["arguments"] = {}
    elif isinstance(written, str) and isinstance(parsed := json_or(written, None), dict):
        function["arguments"] = parsed
    call = {**call, "function": function}
    if short_id and isinstance(call.get("id"), str):
        call["id"] = mistral_id(call["id"])
    return call


def flat_function_tool(tool: dict[str, Any], where: str, schema_key: str) -> dict[str, Any]:
    """A tool written flat (``name``, ``description``, its schema under ``schema_key``: the
    Responses API's ``parameters``, Anthropic's ``input_schema``) in chat completions' shape,
    with OpenAI's key order (name, description, parameters), since templates render it as JSON."""
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise InvalidArgumentError(f"{where}.name", "must be a non-empty string")
    function: dict[str, Any] = {"name": tool["name"]}
    if tool.get("description") is not None:
        if not isinstance(tool["description"], str):
            raise InvalidArgumentError(f"{where}.description", f"must be a string, got {type(tool['description']).__name__}")
        function["description"] = tool["description"]
    schema = tool.get(schema_key)
    if schema is None and schema_key == "parameters":
        schema = {"type": "object", "properties": {}}  # the Responses API allows a tool without parameters
    _check_schema(schema, f"{where}.{schema_key}")
    function["parameters"] = schema
    return {"type": "function", "function": function}
