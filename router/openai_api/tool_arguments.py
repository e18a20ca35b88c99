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
from engine.structured_output import local_ref_target


@dataclass(slots=True)
class RawArgument:
    """One key the model wrote and its value's text so far (all of it once ``closed``)."""

    key: str
    text: str
    closed: bool
    start: int = 0  # where the value's text starts in the block read (a long open value is read on from there)


# The JSON schema types a parameter's value may have; None: any value (a schema that says nothing
# of its type). A parameter the tool does not declare is text.
ValueTypes = frozenset[str] | None
TEXT: frozenset[str] = frozenset({"string"})


def arguments_text(arguments: list[RawArgument], types: dict[str, ValueTypes], complete: bool) -> str:
    """The call's JSON arguments as far as ``arguments`` go (``complete``: the call ended, and with
    it every value), each typed by ``types`` (``parameter_types``). A value still open shows only if
    its parameter is a string, as written so far."""
    items = []
    for argument in arguments:
        value_types = types.get(argument.key, TEXT)
        if argument.closed or complete:
            items.append(json_member(argument.key, typed_value(argument.text, value_types)))
        elif is_text(value_types):  # the last key, its value still coming
            items.append(open_string_member(argument.key) + escaped(argument.text))  # no closing quote yet
    return "{" + ", ".join(items) + ("}" if complete else "")


def parameter_types(tools: list[dict[str, Any]], name: str) -> dict[str, ValueTypes]:
    """Function ``name``'s parameters' value types by name ({} for a function no tool declares),
    read from their schemas as pydantic writes them too: references into the parameters'
    ``$defs`` (``{"$ref": "#/$defs/Address"}``), allOf, anyOf and oneOf looked through."""
    for tool in tools:
        function = tool.get("function") or {}
        if function.get("name") == name:
            parameters = function.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            if not isinstance(properties, dict):
                return {}
            reader = _SchemaTypes(parameters)
            return {key: reader.of_parameter(schema) for key, schema in properties.items()}
    return {}


def is_text(types: ValueTypes) -> bool:
    """Whether a parameter's value is its text as written (a string, or undeclared)."""
    return types is not None and (not types or types == TEXT)


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


def json_valid(text: str) -> bool:
    """Whether ``text`` is (strict) JSON. Text nested past what is parsed here counts: its call
    is kept as the model wrote it (a client's parser may follow it)."""
    try:
        bounded_json.loads(text, STRICT_JSON)
    except bounded_json.TooDeepError:
        return True
    except (ValueError, TypeError):
        return False
    return True


def json_text(arguments: Any) -> str:
    """A call's arguments as JSON text: a text that is a JSON object as it is (the model's own
    JSON, or arguments it wrote as a string of JSON), any other value written as JSON (a string
    that is no object's text too: a call's arguments must parse)."""
    if isinstance(arguments, str) and arguments.lstrip().startswith("{") and json_valid(arguments):
        return arguments
    return _dump(arguments)


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


def typed_value(raw: str, types: ValueTypes) -> Any:
    """A parameter the model wrote as text, as the value its schema types it (``types``): a string
    parameter (or one the tool does not declare) as written; one of any type as the JSON it spells,
    else as written; any other as the JSON (or Python literal) it spells where that is of a type
    the schema allows; else as written."""
    if is_text(types):
        return raw
    text = raw.strip()
    parsed = json_or(text, _MISSING)
    if types is None:
        return raw if parsed is _MISSING else parsed
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


_MAX_REFERENCE_CHAIN = 64


class _SchemaTypes:
    """Reads the value types of schemas inside one tool's parameters (``root``, where their local
    references point), each referenced schema once: references that refer on, or back to
    themselves, cost what they hold, not what they unfold to."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self._by_ref: dict[str, ValueTypes] = {}
        self._reading: set[str] = set()  # references being read: one met again refers back to itself

    def of_parameter(self, schema: Any) -> ValueTypes:
        """A parameter's value types: an empty (or no) schema is text, as an undeclared parameter;
        one that says nothing of types (a description, properties) is of any type."""
        if not isinstance(schema, dict) or not schema:
            return TEXT
        return self.of(schema)

    def of(self, schema: Any) -> ValueTypes:
        """The types ``schema`` allows: those its own keywords, its reference and the schemas it
        combines each allow (allOf: all of them; anyOf, oneOf: any one). None: nothing says."""
        if not isinstance(schema, dict):
            return None
        found = [types for types in (_own_types(schema), self._referenced(schema.get("$ref"))) if types is not None]
        for keyword in ("anyOf", "oneOf"):
            options = schema.get(keyword)
            if isinstance(options, list) and options:
                option_types = [self.of(option) for option in options]
                if None not in option_types:  # an option of any type says nothing of the value's
                    found.append(frozenset().union(*option_types))
        if isinstance(schema.get("allOf"), list):
            found += [types for option in schema["allOf"] if (types := self.of(option)) is not None]
        return frozenset.intersection(*found) if found else None

    def _referenced(self, ref: Any) -> ValueTypes:
        # A chain of references longer than any a generator writes says nothing (followed on, a
        # tool's thousands of definitions each naming the next would recurse past Python's limit).
        if not isinstance(ref, str) or ref in self._reading or len(self._reading) >= _MAX_REFERENCE_CHAIN:
            return None
        if ref not in self._by_ref:
            self._reading.add(ref)
            self._by_ref[ref] = self.of(local_ref_target(self.root, ref))
            self._reading.discard(ref)
        return self._by_ref[ref]


def _own_types(schema: dict[str, Any]) -> frozenset[str] | None:
    """The types a schema's own "type" (else its enum, else its const) allows; None: it has none."""
    declared = schema.get("type")
    if isinstance(declared, str):
        return frozenset({_TYPE_ALIASES.get(declared, declared)})
    if isinstance(declared, list):
        return frozenset(_TYPE_ALIASES.get(t, t) for t in declared if isinstance(t, str))
    if "enum" in schema and isinstance(schema["enum"], list):
        return frozenset().union(*(_value_types(v) for v in schema["enum"]))
    if "const" in schema:
        return frozenset(_value_types(schema["const"]))
    return None


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
