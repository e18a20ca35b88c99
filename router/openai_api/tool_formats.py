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
of the calls (``CallPiece``s): a call is announced once its name is read and its arguments follow
as they are written (JSON calls up to their arguments' closing brace; ``pythonic`` calls value by
value, once the call is known to be one). Text that turns out to be no call is given back as
content, markers and all.
"""

from __future__ import annotations

import ast
import re
from abc import ABC, abstractmethod
from typing import Any, Callable

from router.openai_api.parser_names import TOOL_CALL_FORMATS
from router.openai_api.tool_arguments import STRICT_JSON, json_or, json_text, python_expression, python_literal
from router.openai_api.tool_blocks import (
    FUNCTION_OPEN,
    GLM_ARG_KEY,
    HERMES_OPEN,
    PARAMETER_OPEN,
    BlockReader,
    CallsRead,
    Part,
    CallStream,
    Glm45Reader,
    HermesReader,
    Qwen3CoderReader,
)
from router.openai_api.tool_json import ObjectEnds, ObjectRead, json_calls, json_object
from router.openai_api.tool_python import PythonCalls

Found = tuple[str, Any]  # a whole call: its name, its arguments (JSON text, or a value to write as JSON)

PYTHON_TAG = "<|python_tag|>"
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
PYTHONIC_EXAMPLE = "[func_name1("  # what the pythonic templates teach the model to write
MISTRAL_CALLS = "[TOOL_CALLS]"
ARGS_MARKER, CALL_ID_MARKER = "[ARGS]", "[CALL_ID]"
_SPACES = re.compile(r"\s*")
_NEXT_NAMED_CALL = re.compile(r"\s*" + re.escape(MISTRAL_CALLS))


def _streamed_or_whole(text: str, streamed: list[tuple[str, str]], stop: int, whole: list[Found] | None, closer: str = "") -> CallsRead | None:
    """A whole answer's calls: those the JSON parse of all of it found (the ones streamed keep
    their text, the rest written from their values); where it found none, those streamed and,
    as content, what follows them (but the ``closer`` of the list they were in)."""
    if whole:
        calls = [(name, streamed[i][1] if i < len(streamed) and streamed[i][0] == name else json_text(arguments)) for i, (name, arguments) in enumerate(whole)]
        return CallsRead(calls)
    return CallsRead(streamed, text[stop:].strip().removeprefix(closer).strip()) if streamed else None


class WholeAnswerReader(ABC):
    """An answer that is either content or calls: which one is settled by how it starts. Its
    calls stream as they are read (``read``), and are settled once it ends (content again if
    none can be read in it)."""

    starts: tuple[str, ...] = ()  # what a calling answer starts with

    def __init__(self, tools: list[dict[str, Any]]):
        self.tools = tools
        self._buffer = ""
        self._calls: bool | None = None  # None: not settled yet
        self._blank = 0  # how much of the answer's start is known to be whitespace (read once, not with every token)
        self._stream = CallStream()
        self.ends = ObjectEnds()  # the JSON objects of the answer so far (it only grows)
        self.cut_calls: set[int] = set()  # as BlockReader's

    @abstractmethod
    def read(self, text: str, whole: bool) -> CallsRead | None:
        """The calls in the answer's text so far (``whole``: all of it). Each format's reader says."""

    def feed(self, text: str) -> list[Part]:
        self._buffer += text
        if self._calls is None:
            while self._blank < len(self._buffer) and self._buffer[self._blank].isspace():
                self._blank += 1
            head = self._buffer[self._blank : self._blank + 1 + max(map(len, self.starts))]  # enough to tell
            if not head or any(start.startswith(head) for start in self.starts):
                return []
            self._calls = head.startswith(self.starts)
        if self._calls:
            pieces = self._stream.pieces(self.read(self._buffer, False))
            if self._stream.sent or not self.settled_as_content():
                return pieces
            self._calls = False  # no call after all: what came is content, and what follows streams as it comes
        content, self._buffer = self._buffer, ""
        return [content]

    def settled_as_content(self) -> bool:
        """Whether an answer that started as calls do is known, before it ends, to hold none (a
        format that can tell says)."""
        return False

    def finish(self) -> list[Part]:
        rest, self._buffer = self._buffer, ""
        read = self.read(rest, True) if self._calls else None
        if read is None and not self._stream.sent:
            return [rest] if rest else []
        parts: list[Part] = list(self._stream.pieces(read))
        return parts + ([read.rest] if read is not None and read.rest else [])


class Llama3JsonReader(WholeAnswerReader):
    starts = ("{", PYTHON_TAG)

    def read(self, text: str, whole: bool) -> CallsRead | None:
        text = text.strip().removeprefix(PYTHON_TAG).strip()
        names = {tool["function"]["name"] for tool in self.tools}
        streamed, stop = json_calls(text, read_object=None if whole else self.ends.read, names=names)  # the whole answer is read afresh
        if not whole:
            return CallsRead(streamed)
        return _streamed_or_whole(text, streamed, stop, self._parse(text, names))

    @staticmethod
    def _parse(text: str, names: set[str]) -> list[Found] | None:
        """The calls of a whole answer; None where it is any other JSON (an answer in JSON is as
        likely as a call: one is a call only with a tool's name and its arguments, as vLLM asks)."""
        calls = []
        position = 0
        while position < len(text):
            try:
                body, end = STRICT_JSON.raw_decode(text, position)
            except (ValueError, RecursionError):  # not JSON (NaN, 1e999 included), or nested past what the parser follows
                return None
            if not isinstance(body, dict) or body.get("name") not in names or not ("parameters" in body or "arguments" in body):
                return None
            arguments = body.get("parameters", body.get("arguments"))
            calls.append((body["name"], {} if arguments is None else arguments))
            position = end
            while position < len(text) and text[position] in " \n\t;":
                position += 1
        return calls or None


class PythonicReader(WholeAnswerReader):
    """Calls stream as they are read (router/openai_api/tool_python.py); the whole answer, read
    once it ends, settles them."""

    starts = ("[", PYTHON_START)

    def __init__(self, tools: list[dict[str, Any]]):
        super().__init__(tools)
        self._read: PythonCalls | None = None

    def read(self, text: str, whole: bool) -> CallsRead | None:
        if self._read is None:  # the answer's start is settled: it starts with "[" or the tag
            stripped = text.lstrip()
            self._read = PythonCalls(len(text) - len(stripped) + (len(PYTHON_START) if stripped.startswith(PYTHON_START) else 0))
        streamed = self._read.read(text)
        if not whole:
            return CallsRead(streamed)
        found = _python_calls(text.strip().removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip())
        if found is not None:
            return CallsRead(found)
        # No Python list of calls: those streamed stay (one cut short closed where it stands: its
        # arguments must parse, and it is none to run), and what follows them is content.
        streamed, cut = self._read.ended()
        if cut is not None:
            self.cut_calls.add(cut)
        rest = "" if self._read.stop is None else text[self._read.stop :].strip().removesuffix(PYTHON_END).strip()
        return CallsRead(streamed, rest) if streamed else None

    def settled_as_content(self) -> bool:
        # "[Note] ..." is read as content as soon as it reads as no call, not held to the end.
        return self._read is not None and self._read.settled_as_content(self._buffer)


def _python_calls(text: str) -> list[Found] | None:
    """The calls of a whole pythonic answer, or None where it is no list of keyword calls of literals."""
    try:
        tree = python_expression(text)
    except (SyntaxError, RecursionError, MemoryError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        name = _dotted_name(node.func) if isinstance(node, ast.Call) else None
        if name is None or node.args or any(keyword.arg is None for keyword in node.keywords):
            return None  # only name(key=value, ...) says which argument is which
        keys = [keyword.arg for keyword in node.keywords]
        if len(set(keys)) < len(keys):
            return None  # f(s=1, s=2) is no Python call (the parser does not say so)
        try:
            calls.append((name, json_text({keyword.arg: python_literal(keyword.value) for keyword in node.keywords})))
        except (ValueError, RecursionError):
            return None
    return calls


class MistralReader(BlockReader):
    """Content until ``[TOOL_CALLS]``; the rest of the answer is calls, streamed as they come."""

    blocks = ((MISTRAL_CALLS, None),)

    def calls_in(self, opener: str, body: str, closed: bool) -> CallsRead | None:
        text = body.strip()
        if text.startswith(("[", "{")):  # a JSON list of calls (or one)
            streamed, stop = json_calls(text, 1 if text.startswith("[") else 0, None if closed else self.ends.read)
            return _streamed_or_whole(text, streamed, stop, _mistral_list(text), "]" if text.startswith("[") else "") if closed else CallsRead(streamed)
        calls, stop = _named_calls(body, json_object if closed else self.ends.read)  # name[ARGS]{...}, each after its own marker
        if not closed:
            return CallsRead(calls)
        return _streamed_or_whole(body, calls, stop, _whole_named_calls(calls, body[stop:]))


def _named_calls(body: str, read_object: ObjectRead) -> tuple[list[tuple[str, str]], int]:
    """Mistral's ``name[ARGS]{...}`` calls (an optional ``[CALL_ID]id`` before ``[ARGS]``), each
    after its own ``[TOOL_CALLS]`` (the first one's is the block's opener): each one's name and
    its arguments' text so far, and where the reading stopped. The next call is looked for after
    the arguments end: a marker inside an arguments' string starts no call."""
    calls, position, stop = [], 0, 0
    while (at := body.find(ARGS_MARKER, position)) >= 0:
        name = body[position:at].partition(CALL_ID_MARKER)[0].strip()
        start = _SPACES.match(body, at + len(ARGS_MARKER)).end()
        if not name or MISTRAL_CALLS in name or not body.startswith("{", start):
            break
        arguments, stop = read_object(body, start)
        calls.append((name, arguments))
        marker = _NEXT_NAMED_CALL.match(body, stop)
        if marker is None:
            break
        position = marker.end()
    return calls, stop


def _mistral_list(text: str) -> list[Found] | None:
    """The calls of a JSON list of ``{"name", "arguments"}`` after ``[TOOL_CALLS]`` (or of one
    such object); None where the text is none. What follows the JSON (the end of sequence the
    kept special tokens bring, ``</s>``) is no part of a call."""
    try:
        body, _ = STRICT_JSON.raw_decode(text)
    except (ValueError, RecursionError):  # not JSON (NaN, 1e999 included), or nested past what the parser follows
        return None
    items = body if isinstance(body, list) else [body]
    if not items or not all(isinstance(item, dict) and isinstance(item.get("name"), str) for item in items):
        return None
    return [(item["name"], item.get("arguments", item.get("parameters")) or {}) for item in items]


def _whole_named_calls(calls: list[tuple[str, str]], after: str) -> list[Found] | None:
    """The ``name[ARGS]{...}`` calls read in a whole answer, where they are calls: each one's
    arguments a JSON object, and no marker after them that no call follows."""
    if not calls or MISTRAL_CALLS in after:
        return None
    if not all(isinstance(json_or(arguments, None), dict) for _, arguments in calls):
        return None  # not JSON (NaN, 1e999 included)
    return list(calls)


class RequiredListReader:
    """``tool_choice`` required: the grammar writes a JSON list of ``{"name", "parameters"}``
    objects (router/openai_api/tool_calls.py). Each call streams as it is read, as vLLM streams
    them; an answer cut short (max_tokens, a stop string) keeps what was read of its calls, as
    OpenAI's does, where reading the list only once it ended returned nothing of it."""

    def __init__(self) -> None:
        self._text = ""
        self._first_call: int | None = None  # where the list's first item may begin, once "[" is read
        self._stream = CallStream()
        self.ends = ObjectEnds()

    def feed(self, text: str) -> list[Part]:
        self._text += text
        return self._stream.pieces(self._read(whole=False))

    def finish(self) -> list[Part]:
        return self._stream.pieces(self._read(whole=True))

    def _read(self, whole: bool) -> CallsRead | None:
        if self._first_call is None:  # found once: not the whole text looked at again per token
            opening = len(self._text) - len(self._text.lstrip())
            if not self._text.startswith("[", opening):
                return None
            self._first_call = opening + 1
        streamed, _ = json_calls(self._text, self._first_call, None if whole else self.ends.read)
        listed = json_or(self._text, None) if whole else None
        if isinstance(listed, list) and all(isinstance(item, dict) and isinstance(item.get("name"), str) for item in listed):
            found = [(item["name"], item.get("parameters") or {}) for item in listed]
            return _streamed_or_whole(self._text, streamed, 0, found)
        return CallsRead(streamed)  # the grammar writes nothing else: no content beside the calls


READERS: dict[str, Callable[[list[dict[str, Any]]], Any]] = {
    "hermes": HermesReader,
    "qwen3_coder": Qwen3CoderReader,
    "glm45": Glm45Reader,
    "llama3_json": Llama3JsonReader,
    "pythonic": PythonicReader,
    "mistral": MistralReader,
}
assert tuple(READERS) == TOOL_CALL_FORMATS, "router/openai_api/parser_names.py names each format"


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
