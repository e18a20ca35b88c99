"""Tool-call arguments the XML formats (qwen3_coder, glm45: router/openai_api/tool_formats.py)
write as text, key by key: each value typed by the tool's JSON schema, the whole written as the
call's JSON arguments as it streams.

``arguments_text`` renders the keys read so far; what it gives for a call only ever grows (each
text starts with the one before), so a stream sends the difference: an open string value goes
out character by character (JSON escapes one character at a time), any other when it closes.
Keys and values are written as ``json.dumps`` writes an object (``", "``, ``": "``), so a whole
call's text is what the streamed pieces add up to.
"""

from __future__ import annotations

import ast
import json
import math
import warnings
from dataclasses import dataclass
from typing import Any

from engine import bounded_json


@dataclass(slots=True)
class RawArgument:
    """One key the model wrote and its value's text so far (all of it once ``closed``)."""

    key: str
    text: str
    closed: bool
    start: int = 0  # where the value's text starts in the block read (a long open value is read on from there)


def arguments_text(arguments: list[RawArgument], schemas: dict[str, Any], complete: bool) -> str:
    """The call's JSON arguments as far as ``arguments`` go (``complete``: the call ended, and with
    it every value). A value still open shows only if its parameter is a string, as written so far."""
    items = []
    for argument in arguments:
        schema = schemas.get(argument.key)
        if argument.closed or complete:
            items.append(json_member(argument.key, typed_value(argument.text, schema)))
        elif is_text(schema):  # the last key, its value still coming
            items.append(open_string_member(argument.key) + escaped(argument.text))  # no closing quote yet
    return "{" + ", ".join(items) + ("}" if complete else "")


def parameter_schemas(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """Function ``name``'s parameters' schemas by name ({} for a function no tool declares)."""
    for tool in tools:
        function = tool.get("function") or {}
        if function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties")
            return properties if isinstance(properties, dict) else {}
    return {}


def is_text(schema: Any) -> bool:
    """Whether a parameter's value is its text as written (a string, or undeclared)."""
    types = _schema_types(schema)
    return not types or types == {"string"}


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is no JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        _not_json(text)  # 1e999
    return value


# JSON as the spec has it: Python's parser also takes NaN and Infinity (and makes 1e999 one),
# which no JSON parser a client runs reads back.
STRICT_JSON = json.JSONDecoder(parse_constant=_not_json, parse_float=_finite)


def json_or(text: str, default: Any) -> Any:
    """``text`` as (strict) JSON, or ``default``."""
    try:
        return bounded_json.loads(text, STRICT_JSON)
    except (ValueError, TypeError):
        return default


def json_text(arguments: Any) -> str:
    """A call's arguments as JSON text: a text as it is (the model's own JSON), a value written."""
    return arguments if isinstance(arguments, str) else _dump(arguments)


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def json_member(key: str, value: Any) -> str:
    """One key of a call's arguments and its value, as ``json.dumps`` writes them in an object
    (so the members of a streamed call add up to its whole arguments' text)."""
    return f"{_dump(key)}: {_dump(value)}"


def open_string_member(key: str) -> str:
    """The start of ``json_member`` for a string value still being written: its characters follow, escaped."""
    return f'{_dump(key)}: "'


def escaped(text: str) -> str:
    """``text`` as it reads inside a JSON string here (each character escaped on its own, so the
    escaped text of a longer text starts with that of the shorter)."""
    return _dump(text)[1:-1]


_TYPE_ALIASES = {  # names clients write for JSON schema types (vLLM reads them too)
    "str": "string", "text": "string", "int": "integer", "long": "integer", "float": "number",
    "double": "number", "bool": "boolean", "dict": "object", "list": "array", "tuple": "array",
}


def typed_value(raw: str, schema: Any) -> Any:
    """A parameter the model wrote as text, as the value its schema types it: a string parameter
    (or one the tool does not declare) as written; any other as the JSON (or Python literal) it
    spells where that is of a type the schema allows; else as written."""
    if is_text(schema):
        return raw
    types = _schema_types(schema)
    text = raw.strip()
    parsed = json_or(text, _MISSING)
    if parsed is _MISSING and "boolean" in types and text.lower() in ("true", "false"):
        parsed = text.lower() == "true"  # Python's True/False
    if parsed is _MISSING and types & {"object", "array"}:
        try:
            parsed = python_literal(python_expression(text))  # a Python dict or list
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
        if not math.isfinite(value):
            return set()  # 1e999: no JSON number
        return {"number", "integer"} if value.is_integer() else {"number"}
    if isinstance(value, str):
        return {"string"}
    return {"array"} if isinstance(value, list) else {"object"} if isinstance(value, dict) else set()


_JSON_NAMES = {"true": True, "false": False, "null": None}


def python_expression(text: str) -> ast.expr:
    """``text`` read as one Python expression (SyntaxError where it is none). The warnings Python
    gives for escapes it does not know (a model's ``"C:\\dir"``) are the model's, not the server's: they are not printed."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return ast.parse(text, mode="eval").body
        except ValueError as exc:  # a lone surrogate (UnicodeEncodeError), which is no Python either
            raise SyntaxError(str(exc)) from None


def python_literal(node: ast.expr) -> Any:
    """A Python literal as a JSON value (tuples as lists; JSON's true/false/null taken too);
    ValueError for anything else (a name, a call, an operation)."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float, bool))):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise ValueError(f"{node.value} is no JSON number")
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) and isinstance(node.operand, ast.Constant):
        value = node.operand.value
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [python_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict) and all(isinstance(key, ast.Constant) and isinstance(key.value, str) for key in node.keys):
        return {key.value: python_literal(value) for key, value in zip(node.keys, node.values)}
    raise ValueError(f"not a literal: {ast.dump(node)[:80]}")
