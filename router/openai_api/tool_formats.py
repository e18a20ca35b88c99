"""The formats models write tool calls in, one reader each, by parser name (vLLM's
``--tool-call-parser`` names, and its aliases): what of a streaming answer is content and which
calls it makes.

- Block formats, calls streamed as they are read (router/openai_api/tool_blocks.py): ``hermes``,
  ``qwen3_coder``, ``glm45``.
- ``llama3_json`` (Llama 3.x): the whole answer is ``{"name": ..., "parameters": {...}}``, several
  joined by ``;``, optionally after ``<|python_tag|>``.
- ``pythonic`` (Llama 3.2/4's pythonic templates, Gemma): the whole answer is a Python list of
  calls with keyword arguments, ``[get_weather(city="Paris"), get_time()]``.
- ``mistral``: ``[TOOL_CALLS]`` after optional content, then a JSON list of ``{"name",
  "arguments"}``, or each call as ``name[ARGS]{...}`` in newer Mistral models.

A reader is fed the answer's text as it streams and says what is content now and what it found
of the calls (``CallPiece``s); the last three read their calls once the answer ends. Text that
turns out to be no call is given back as content, markers and all.
"""

from __future__ import annotations

import ast
import json
from typing import Any, Callable

from router.openai_api.tool_arguments import python_literal
from router.openai_api.tool_blocks import (
    FUNCTION_OPEN,
    GLM_ARG_KEY,
    HERMES_OPEN,
    PARAMETER_OPEN,
    CallPiece,
    Glm45Reader,
    HermesReader,
    Qwen3CoderReader,
    marker_prefix_len,
)

Found = tuple[str, Any]  # a whole call: its name, its arguments (JSON text, or a value to write as JSON)

PYTHON_TAG = "<|python_tag|>"
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
PYTHONIC_EXAMPLE = "[func_name1("  # what the pythonic templates teach the model to write
MISTRAL_CALLS = "[TOOL_CALLS]"


def whole_calls(found: list[Found] | None) -> list[CallPiece]:
    return [CallPiece(arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False), name) for name, arguments in found or []]


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

    def feed(self, text: str) -> tuple[str, list[CallPiece]]:
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

    def finish(self) -> tuple[str, list[CallPiece]]:
        rest, self._buffer = self._buffer, ""
        calls = self.parse(rest) if self._calls else None
        return ("", whole_calls(calls)) if calls else (rest, [])


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
                calls.append((name, {keyword.arg: python_literal(keyword.value) for keyword in node.keywords}))
            except ValueError:
                return None
        return calls


class MistralReader:
    """Content until ``[TOOL_CALLS]``; the rest is calls, read once the answer ends."""

    def __init__(self, tools: list[dict[str, Any]]):
        self._buffer = ""
        self._calling = False

    def feed(self, text: str) -> tuple[str, list[CallPiece]]:
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

    def finish(self) -> tuple[str, list[CallPiece]]:
        rest, self._buffer = self._buffer, ""
        if not self._calling:
            return rest, []
        calls = _mistral_calls(rest)
        return ("", whole_calls(calls)) if calls else (MISTRAL_CALLS + rest, [])


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
    if FUNCTION_OPEN in template_text and PARAMETER_OPEN in template_text:
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


def _dotted_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        owner = _dotted_name(node.value)
        return None if owner is None else f"{owner}.{node.attr}"
    return None
