"""Tool-call formats whose calls are blocks between markers, after optional content, read as they
stream: a call is announced as soon as its name is known and its arguments follow piece by
piece, as vLLM streams them (an agent writing a file sees it grow).

- ``hermes`` (Hermes, Qwen2.5/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
  the arguments are the model's JSON text, streamed up to the object's closing brace.
- ``qwen3_coder`` (Qwen3-Coder, Qwen3.5): ``<tool_call><function=NAME><parameter=KEY>
  value</parameter>...</function></tool_call>``.
- ``glm45`` (GLM-4.5/4.6): ``<tool_call>NAME<arg_key>KEY</arg_key><arg_value>value</arg_value>...
  </tool_call>``.

The last two write values as text; router/openai_api/tool_arguments.py types them by the tool's
schema and writes the arguments' JSON as the keys come.
"""

from __future__ import annotations

import json
import logging
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from router.openai_api.tool_arguments import RawArgument, arguments_text, json_or, json_text, parameter_schemas

logger = logging.getLogger(__name__)

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"
GLM_ARG_KEY, GLM_ARG_VALUE, GLM_VALUE_CLOSE = "<arg_key>", "<arg_value>", "</arg_value>"

_JSON_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
_JSON_CALL_TAIL = re.compile(r"\s*\}\s*[,;]?")  # a call object's end, after its arguments
_JSON_STRUCTURE = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(")?|[{}\[\]]', re.S)  # a string (group 1: its closing quote) or a bracket
_FUNCTION_HEAD = re.compile(r"<function=([^>\n]*)>")
_PARAMETER_HEAD = re.compile(r"<parameter=([^>\n]*)>")
_GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>", re.S)
# What may follow a Qwen3-Coder value: a newline of the format's, then the next tag.
_QWEN_VALUE_ENDS = tuple(newline + tag for newline in ("\n", "") for tag in (PARAMETER_CLOSE, PARAMETER_OPEN, FUNCTION_CLOSE, FUNCTION_OPEN, HERMES_CLOSE))


@dataclass(slots=True)
class CallPiece:
    """What a reader found of the calls: a new call (``name`` set, its arguments so far) or more
    of the last call's arguments' JSON text."""

    arguments: str
    name: str | None = None


Part = str | CallPiece  # what a reader says of the answer, in its order: content, or a piece of a call


def _with_text(parts: list[Part], text: str) -> list[Part]:
    if text:
        parts.append(text)
    return parts


@dataclass(slots=True)
class CallsRead:
    """The calls read in a text so far: each one's name and its arguments' JSON text (a start of
    its final text, which only grows as more of the text comes); once the text is whole, what
    follows them that is no call (content)."""

    calls: list[tuple[str, str]]
    rest: str = ""


class CallStream:
    """The calls of one block (or answer) as sent: each new read becomes the pieces that take
    the client from what it has to what was read."""

    def __init__(self) -> None:
        self.sent: list[str] = []  # each call's arguments text as sent

    def pieces(self, read: CallsRead | None) -> list[CallPiece]:
        pieces = []
        for index, (name, arguments) in enumerate(read.calls if read is not None else []):
            if index == len(self.sent):
                pieces.append(CallPiece("", name))
                self.sent.append("")
            sent = self.sent[index]
            if not arguments.startswith(sent):
                # A reader's text only grows by construction; were it not to, the call keeps
                # what was sent (the client has it) rather than contradict it.
                logger.warning("tool call %d's arguments %r no longer start with what was sent, %r", index, arguments[:80], sent[:80])
            elif len(arguments) > len(sent):
                pieces.append(CallPiece(arguments[len(sent) :]))
                self.sent[index] = arguments
        return pieces


def marker_prefix_len(text: str, marker: str) -> int:
    """How many of ``text``'s last characters are a proper start of ``marker`` (the longest such
    tail; only tails that begin with the marker's first character are tried: it runs per token)."""
    at = text.find(marker[0], max(0, len(text) - len(marker) + 1))
    while at >= 0:
        if marker.startswith(text[at:]):
            return len(text) - at
        at = text.find(marker[0], at + 1)
    return 0


class BlockReader(ABC):
    """Content around call blocks (``opener ... closer``; a closer of None: the answer's end),
    each call streamed as it is read. Whitespace between calls or after the last is dropped (it is
    no content the model meant)."""

    blocks: tuple[tuple[str, str | None], ...] = ()  # (opener, closer) pairs

    def __init__(self, tools: list[dict[str, Any]]):
        self.tools = tools
        self.num_found = 0
        self._buffer = ""
        self._open: tuple[str, str | None] | None = None  # the block being read
        self._stream = CallStream()  # the open block's calls
        self._space = ""  # whitespace after a call, shown only if text follows it

    @abstractmethod
    def calls_in(self, opener: str, body: str, closed: bool) -> CallsRead | None:
        """The calls of a block as far as ``body`` goes (every call whole once ``closed``). None:
        no call can be read yet (``closed``: the block is no call). Each format's reader says."""

    def feed(self, text: str) -> list[Part]:
        self._buffer += text
        parts: list[Part] = []
        while True:
            if self._open is None:
                starts = [(at, pair) for pair in self.blocks if (at := self._buffer.find(pair[0])) >= 0]
                if not starts:
                    # Hold back what could be the start of a marker.
                    keep = max(marker_prefix_len(self._buffer, opener) for opener, _ in self.blocks)
                    return _with_text(parts, self._content(len(self._buffer) - keep))
                at, self._open = min(starts, key=lambda start: start[0])
                _with_text(parts, self._content(at))  # the buffer now starts with the opener
                self._space = ""
                self._buffer = self._buffer[len(self._open[0]) :]
            opener, closer = self._open
            end = -1 if closer is None else self._buffer.find(closer)
            if end < 0:
                shown = self._buffer[: len(self._buffer) - (0 if closer is None else marker_prefix_len(self._buffer, closer))]
                return parts + self._stream.pieces(self.calls_in(opener, shown, False))
            block, self._buffer = self._buffer[:end], self._buffer[end + len(closer) :]
            parts += self._close(opener, block, closer)

    def finish(self) -> list[Part]:
        if self._open is not None:  # a block the answer did not close
            rest, self._buffer = self._buffer, ""
            return self._close(self._open[0], rest)
        return _with_text([], self._content(len(self._buffer)))

    def _close(self, opener: str, block: str, closer: str = "") -> list[Part]:
        """A block's end (``closer``: its marker, none where the answer ended): its calls' last
        pieces, then what in it is no call; or (no call read in it) the block as content."""
        read = self.calls_in(opener, block, True)
        self._open = None
        if read is None and not self._stream.sent:
            return [opener + block + closer]
        parts: list[Part] = list(self._stream.pieces(read))
        self.num_found += len(self._stream.sent)
        self._stream = CallStream()
        return _with_text(parts, read.rest if read is not None else "")

    def _content(self, size: int) -> str:
        """The buffer's first ``size`` characters as content; after a call, whitespace waits for
        text to follow it (whitespace that a call or the end follows is dropped)."""
        text, self._buffer = self._buffer[:size], self._buffer[size:]
        if not self.num_found:
            return text
        text = self._space + text
        shown = text.rstrip()
        self._space = text[len(shown) :]
        return shown


def json_calls(text: str, position: int = 0) -> tuple[list[tuple[str, str]], int]:
    """Calls written as JSON objects, ``{"name": ..., "arguments" (or "parameters"): {...}}``, one
    after another (commas, semicolons or whitespace between), from ``position``: each one's name
    and its arguments object's text so far, and where the reading stopped (the first text that
    is no such call, or the end)."""
    calls = []
    while True:
        head = _JSON_CALL_HEAD.match(text, position)
        if head is None:
            return calls, position
        end = json_object_end(text, head.end())
        calls.append((json.loads(head.group(1)), text[head.end() : end]))
        after = _JSON_CALL_TAIL.match(text, end)
        if after is None:
            return calls, end
        position = after.end()


class HermesReader(BlockReader):
    blocks = ((HERMES_OPEN, HERMES_CLOSE),)

    def calls_in(self, opener: str, body: str, closed: bool) -> CallsRead | None:
        calls, stop = json_calls(body)
        if calls:  # {"name": ..., "arguments": {: streamed as it comes
            return CallsRead(calls, body[stop:].strip() if closed else "")
        if not closed:
            return None
        call = json_or(body.strip(), None)  # another shape (arguments as a string, null, none at all)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments")
        return CallsRead([(call["name"], json_text({} if arguments is None else arguments))])


class Qwen3CoderReader(BlockReader):
    """A ``<function=...>`` the model wrote without its ``<tool_call>`` is read too (vLLM reads it)."""

    blocks = ((HERMES_OPEN, HERMES_CLOSE), (FUNCTION_OPEN, FUNCTION_CLOSE))

    def calls_in(self, opener: str, body: str, closed: bool) -> CallsRead | None:
        text = FUNCTION_OPEN + body if opener == FUNCTION_OPEN else body
        heads = list(_FUNCTION_HEAD.finditer(text))
        calls, outside, position = [], [], 0
        for index, head in enumerate(heads):
            name = head.group(1).strip()
            if not name:
                break  # it and what follows come back as content
            outside.append(text[position : head.start()])
            later = heads[index + 1].start() if index + 1 < len(heads) else len(text)
            region = text[head.end() : later]
            end = region.find(FUNCTION_CLOSE)
            complete = closed or end >= 0 or index + 1 < len(heads)
            arguments = self._arguments(region if end < 0 else region[:end], complete)
            calls.append((name, arguments_text(arguments, parameter_schemas(self.tools, name), complete)))
            position = head.end() + (len(region) if end < 0 else end + len(FUNCTION_CLOSE))
        if not calls:
            return None
        return CallsRead(calls, ("".join(outside) + text[position:]).strip() if closed else "")

    @staticmethod
    def _arguments(region: str, complete: bool) -> list[RawArgument]:
        heads = list(_PARAMETER_HEAD.finditer(region))
        arguments = []
        for index, head in enumerate(heads):
            value = region[head.end() : heads[index + 1].start() if index + 1 < len(heads) else len(region)]
            end = value.find(PARAMETER_CLOSE)
            closed = complete or end >= 0 or index + 1 < len(heads)
            if end >= 0:
                value = value[:end]
            # One newline each side is the format's (<parameter=k>\nvalue\n</parameter>); an open
            # value holds back what may yet be that newline or the next tag.
            value = value.removeprefix("\n")
            if closed:
                value = value.removesuffix("\n")
            elif (at := min((at for tag in (PARAMETER_OPEN, FUNCTION_OPEN) if (at := value.find(tag)) >= 0), default=-1)) >= 0:
                # The next tag has begun (a model that leaves out </parameter>): the value ends there.
                value = value[:at].removesuffix("\n")
            else:
                value = value[: len(value) - max(marker_prefix_len(value, end) for end in _QWEN_VALUE_ENDS)]
            arguments.append(RawArgument(head.group(1).strip(), value, closed))
        return arguments


class Glm45Reader(BlockReader):
    """A call is announced once its first key comes (or its block closes): a block whose first
    line is followed by anything else is no call."""

    blocks = ((HERMES_OPEN, HERMES_CLOSE),)

    def calls_in(self, opener: str, body: str, closed: bool) -> CallsRead | None:
        name, marker, _ = body.partition(GLM_ARG_KEY)
        name = name.strip()
        if not (marker or closed) or not name or "\n" in name or "{" in name:
            return None
        heads = list(_GLM_ARGUMENT.finditer(body))
        arguments, outside = [], []
        for index, head in enumerate(heads):
            value = body[head.end() : heads[index + 1].start() if index + 1 < len(heads) else len(body)]
            end = value.find(GLM_VALUE_CLOSE)
            argument_closed = closed or end >= 0 or index + 1 < len(heads)
            if end >= 0:
                value, after = value[:end], value[end + len(GLM_VALUE_CLOSE) :]
                outside.append(after)
            elif (at := value.find(GLM_ARG_KEY)) >= 0:
                value = value[:at]  # a model that leaves out </arg_value>: the next key ends it
            elif not argument_closed:  # hold back what may be the start of the next tag
                value = value[: len(value) - max(marker_prefix_len(value, GLM_VALUE_CLOSE), marker_prefix_len(value, GLM_ARG_KEY))]
            arguments.append(RawArgument(head.group(1).strip(), value, argument_closed))
        rest = "".join(outside).strip() if closed else ""
        return CallsRead([(name, arguments_text(arguments, parameter_schemas(self.tools, name), closed))], rest)


def json_object_end(text: str, start: int) -> int:
    """Where the JSON object opening at ``text[start]`` ends (after its closing brace), or the
    text's end if it has not yet. Read token by token by a regex (strings whole), not character
    by character: a streamed call's text is read again with every token of it."""
    depth = 0
    for token in _JSON_STRUCTURE.finditer(text, start):
        if token.group(0)[0] == '"':
            if token.group(1) is None:
                return len(text)  # a string still open
        elif token.group(0) in "{[":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return token.end()
    return len(text)
