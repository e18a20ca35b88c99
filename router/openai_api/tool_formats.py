"""The formats models write tool calls in, one reader each, by parser name (vLLM's
``--tool-call-parser`` names): what of a streaming answer is content and which calls it makes.

- ``hermes`` (Hermes, Qwen2.5/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks after optional content.
- ``qwen3_coder`` (Qwen3-Coder, Qwen3.5): ``<tool_call><function=NAME><parameter=KEY>value
  </parameter>...</function></tool_call>``; values are raw text, typed by the tool's schema.
- ``glm45`` (GLM-4.5/4.6): ``<tool_call>NAME<arg_key>KEY</arg_key><arg_value>value</arg_value>...
  </tool_call>``; values typed likewise.
- ``llama3_json`` (Llama 3.x): the whole answer is ``{"name": ..., "parameters": {...}}``, several
  joined by ``;``, optionally after ``<|python_tag|>``.
- ``pythonic`` (Llama 3.2/4's pythonic templates, Gemma): the whole answer is a Python list of
  calls with keyword arguments, ``[get_weather(city="Paris"), get_time()]``.
- ``mistral``: ``[TOOL_CALLS]`` after optional content, then a JSON list of ``{"name",
  "arguments"}``, or each call as ``name[ARGS]{...}`` in newer Mistral models.

A reader is fed the answer's text as it streams and says what is content now and which calls
it found (``Found``: a name and the arguments, as JSON text or a value to write as JSON); a block
format's call is found as its block closes, a whole-answer format's once the answer ends. Text
that turns out to be no call is given back as content, markers and all.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any, Callable

Found = tuple[str, Any]

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
GLM_ARG_KEY = "<arg_key>"
PYTHON_TAG = "<|python_tag|>"
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
PYTHONIC_EXAMPLE = "[func_name1("  # what the pythonic templates teach the model to write
MISTRAL_CALLS = "[TOOL_CALLS]"

_QWEN_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)(?:</function>|$)", re.S)
_QWEN_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)
_GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)(?:</arg_value>|$)", re.S)


def marker_prefix_len(text: str, marker: str) -> int:
    """How many of ``text``'s last characters are a proper start of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def json_or(text: str, default: Any) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return default


class BlockReader:
    """Content around call blocks (``opener ... closer``); each block is read as it closes.
    Whitespace between or after calls is dropped (it is no content the model meant)."""

    blocks: tuple[tuple[str, str], ...] = ()  # (opener, closer) pairs

    def __init__(self, tools: list[dict[str, Any]]):
        self.tools = tools
        self.num_found = 0
        self._buffer = ""
        self._open: tuple[str, str] | None = None  # the block being read

    def parse(self, opener: str, body: str) -> list[Found] | None:
        """The calls of one block (its text between the markers); None: it is no call."""
        raise NotImplementedError

    def feed(self, text: str) -> tuple[str, list[Found]]:
        self._buffer += text
        content, found = "", []
        while True:
            if self._open is None:
                starts = [(at, pair) for pair in self.blocks if (at := self._buffer.find(pair[0])) >= 0]
                if not starts:
                    # Hold back what could be the start of a marker.
                    keep = max(marker_prefix_len(self._buffer, opener) for opener, _ in self.blocks)
                    return content + self._content(len(self._buffer) - keep), found
                at, self._open = min(starts, key=lambda start: start[0])
                content += self._content(at)  # the buffer now starts with the opener
                self._buffer = self._buffer[len(self._open[0]) :]
            end = self._buffer.find(self._open[1])
            if end < 0:
                return content, found
            calls = self.parse(self._open[0], self._buffer[:end])
            if calls is None:  # not a call after all: the block is content
                content += self._open[0] + self._buffer[: end + len(self._open[1])]
            else:
                found += calls
                self.num_found += len(calls)
            self._buffer, self._open = self._buffer[end + len(self._open[1]) :], None

    def finish(self) -> tuple[str, list[Found]]:
        rest, self._buffer = self._buffer, ""
        if self._open is not None:  # a block the answer did not close
            calls = self.parse(self._open[0], rest)
            return ("", calls) if calls else (self._open[0] + rest, [])
        return ("" if self.num_found and not rest.strip() else rest), []

    def _content(self, size: int) -> str:
        text, self._buffer = self._buffer[:size], self._buffer[size:]
        return "" if self.num_found and not text.strip() else text


class HermesReader(BlockReader):
    blocks = ((HERMES_OPEN, HERMES_CLOSE),)

    def parse(self, opener: str, body: str) -> list[Found] | None:
        call = json_or(body.strip(), None)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        return [(call["name"], call.get("arguments", {}))]


class Qwen3CoderReader(BlockReader):
    """A ``<function=...>`` the model wrote without its ``<tool_call>`` is read too (vLLM reads it)."""

    blocks = ((HERMES_OPEN, HERMES_CLOSE), (FUNCTION_OPEN, FUNCTION_CLOSE))

    def parse(self, opener: str, body: str) -> list[Found] | None:
        text = FUNCTION_OPEN + body if opener == FUNCTION_OPEN else body
        calls = []
        for match in _QWEN_FUNCTION.finditer(text):
            name = match.group(1).strip()
            if not name:
                return None
            schemas = _parameter_schemas(self.tools, name)
            arguments = {key.strip(): typed_value(_strip_one_newline(value), schemas.get(key.strip())) for key, value in _QWEN_PARAMETER.findall(match.group(2))}
            calls.append((name, arguments))
        return calls or None


class Glm45Reader(BlockReader):
    blocks = ((HERMES_OPEN, HERMES_CLOSE),)

    def parse(self, opener: str, body: str) -> list[Found] | None:
        name, _, _ = body.partition(GLM_ARG_KEY)
        name = name.strip()
        if not name or "\n" in name or "{" in name:
            return None
        schemas = _parameter_schemas(self.tools, name)
        arguments = {key.strip(): typed_value(value, schemas.get(key.strip())) for key, value in _GLM_ARGUMENT.findall(body)}
        return [(name, arguments)]


class WholeAnswerReader:
    """An answer that is either content or, whole, calls: which one is settled by how it starts;
    calls are read once it ends (and given back as content if they do not parse)."""

    starts: tuple[str, ...] = ()  # what a calling answer starts with

    def __init__(self, tools: list[dict[str, Any]]):
        self.tools = tools
        self._buffer = ""
        self._calls: bool | None = None  # None: not settled yet

    def parse(self, text: str) -> list[Found] | None:
        raise NotImplementedError

    def feed(self, text: str) -> tuple[str, list[Found]]:
        self._buffer += text
        if self._calls is None:
            stripped = self._buffer.lstrip()
            if not stripped or any(start.startswith(stripped) for start in self.starts):
                return "", []
            self._calls = stripped.startswith(self.starts)
        if self._calls:
            return "", []
        content, self._buffer = self._buffer, ""
        return content, []

    def finish(self) -> tuple[str, list[Found]]:
        rest, self._buffer = self._buffer, ""
        calls = self.parse(rest) if self._calls else None
        return ("", calls) if calls else (rest, [])


class Llama3JsonReader(WholeAnswerReader):
    starts = ("{", PYTHON_TAG)

    def parse(self, text: str) -> list[Found] | None:
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


class PythonicReader(WholeAnswerReader):
    starts = ("[", PYTHON_START)

    def parse(self, text: str) -> list[Found] | None:
        text = text.strip().removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip()
        try:
            tree = ast.parse(text, mode="eval").body
        except SyntaxError:
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            name = _dotted_name(node.func) if isinstance(node, ast.Call) else None
            if name is None or node.args or any(keyword.arg is None for keyword in node.keywords):
                return None  # only name(key=value, ...) says which argument is which
            try:
                calls.append((name, {keyword.arg: _literal(keyword.value) for keyword in node.keywords}))
            except ValueError:
                return None
        return calls


class MistralReader:
    """Content until ``[TOOL_CALLS]``; the rest is calls, read once the answer ends."""

    def __init__(self, tools: list[dict[str, Any]]):
        self._buffer = ""
        self._calling = False

    def feed(self, text: str) -> tuple[str, list[Found]]:
        self._buffer += text
        if self._calling:
            return "", []
        at = self._buffer.find(MISTRAL_CALLS)
        if at >= 0:
            content, self._buffer = self._buffer[:at], self._buffer[at + len(MISTRAL_CALLS) :]
            self._calling = True
            return content, []
        keep = len(self._buffer) - marker_prefix_len(self._buffer, MISTRAL_CALLS)
        content, self._buffer = self._buffer[:keep], self._buffer[keep:]
        return content, []

    def finish(self) -> tuple[str, list[Found]]:
        rest, self._buffer = self._buffer, ""
        if not self._calling:
            return rest, []
        calls = _mistral_calls(rest)
        return ("", calls) if calls else (MISTRAL_CALLS + rest, [])


def _mistral_calls(text: str) -> list[Found] | None:
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


READERS: dict[str, Callable[[list[dict[str, Any]]], Any]] = {
    "hermes": HermesReader,
    "qwen3_coder": Qwen3CoderReader,
    "glm45": Glm45Reader,
    "llama3_json": Llama3JsonReader,
    "pythonic": PythonicReader,
    "mistral": MistralReader,
}
# vLLM's other names for the same formats.
ALIASES = {"qwen3_xml": "qwen3_coder", "llama4_json": "llama3_json", "llama4_pythonic": "pythonic"}
TOOL_CALL_PARSERS = (*READERS, *ALIASES)


def detect_parser(template_text: str) -> str | None:
    """The tool-call format a chat template teaches its model, where it shows one (the most
    specific markers first: Qwen3-Coder's and GLM's templates show ``<tool_call>`` too)."""
    if MISTRAL_CALLS in template_text:
        return "mistral"
    if FUNCTION_OPEN in template_text and "<parameter=" in template_text:
        return "qwen3_coder"
    if GLM_ARG_KEY in template_text:
        return "glm45"
    if HERMES_OPEN in template_text:
        return "hermes"
    if PYTHONIC_EXAMPLE in template_text:
        return "pythonic"
    if PYTHON_TAG in template_text or "ipython" in template_text:
        return "llama3_json"
    return None


# --- values the XML formats write as text, typed by the tool's JSON schema -----------------

_TYPE_ALIASES = {  # names clients write for JSON schema types (vLLM reads them too)
    "str": "string", "text": "string", "int": "integer", "long": "integer", "float": "number",
    "double": "number", "bool": "boolean", "dict": "object", "list": "array", "tuple": "array",
}


def typed_value(raw: str, schema: Any) -> Any:
    """A parameter the model wrote as text, as the value its schema types it: a string parameter
    (or one the tool does not declare) as written; any other as the JSON (or Python literal) it
    spells where that is of a type the schema allows; else as written."""
    types = _schema_types(schema)
    if not types or types == {"string"}:
        return raw
    text = raw.strip()
    parsed = json_or(text, _MISSING)
    if parsed is _MISSING and "boolean" in types and text.lower() in ("true", "false"):
        parsed = text.lower() == "true"  # Python's True/False
    if parsed is _MISSING and types & {"object", "array"}:
        try:
            parsed = _literal(ast.parse(text, mode="eval").body)  # a Python dict or list
        except (SyntaxError, ValueError):
            pass
    if parsed is not _MISSING and _value_types(parsed) & types:
        return parsed
    return raw


_MISSING = object()


def _schema_types(schema: Any) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    declared = schema.get("type")
    if isinstance(declared, str):
        return {_TYPE_ALIASES.get(declared, declared)}
    if isinstance(declared, list):
        return {_TYPE_ALIASES.get(t, t) for t in declared if isinstance(t, str)}
    if "enum" in schema and isinstance(schema["enum"], list):
        return set().union(*(_value_types(v) for v in schema["enum"])) if schema["enum"] else set()
    if "const" in schema:
        return _value_types(schema["const"])
    options = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(options, list):
        return set().union(*(_schema_types(option) for option in options)) if options else set()
    return set()


def _value_types(value: Any) -> set[str]:
    """The JSON schema types ``value`` satisfies."""
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number", "integer"} if value.is_integer() else {"number"}
    if isinstance(value, str):
        return {"string"}
    return {"array"} if isinstance(value, list) else {"object"} if isinstance(value, dict) else set()


def _parameter_schemas(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    for tool in tools:
        function = tool.get("function") or {}
        if function.get("name") == name:
            return (function.get("parameters") or {}).get("properties") or {}
    return {}


def _strip_one_newline(value: str) -> str:
    """A parameter as the template writes it (``<parameter=k>\\nvalue\\n</parameter>``): one newline
    each side is the format's, the rest the value's."""
    return value.removeprefix("\n").removesuffix("\n")


def _dotted_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        owner = _dotted_name(node.value)
        return None if owner is None else f"{owner}.{node.attr}"
    return None


_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.expr) -> Any:
    """A Python literal as a JSON value (tuples as lists; JSON's true/false/null taken too);
    ValueError for anything else (a name, a call, an operation)."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float, bool))):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) and isinstance(node.operand, ast.Constant):
        value = node.operand.value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict) and all(isinstance(key, ast.Constant) and isinstance(key.value, str) for key in node.keys):
        return {key.value: _literal(value) for key, value in zip(node.keys, node.values)}
    raise ValueError(f"not a literal: {ast.dump(node)[:80]}")
