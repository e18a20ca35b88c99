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

import logging
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from router.openai_api.tool_arguments import TEXT, RawArgument, ValueTypes, arguments_text, escaped, is_text, json_or, json_text, parameter_types
from router.openai_api.tool_json import JsonQuotes, ObjectEnds, json_calls

logger = logging.getLogger(__name__)

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"
GLM_ARG_KEY, GLM_ARG_VALUE, GLM_VALUE_CLOSE = "<arg_key>", "<arg_value>", "</arg_value>"

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
    lead: str = ""  # content the block holds before its first call: it goes out before the call


class CallStream:
    """The calls of one block (or answer) as sent: each new read becomes the pieces that take
    the client from what it has to what was read."""

    def __init__(self) -> None:
        self.sent: list[str] = []  # each call's arguments text as sent

    def pieces(self, read: CallsRead | None) -> list[Part]:
        pieces: list[Part] = []
        if read is not None and read.calls and not self.sent and read.lead:
            pieces.append(read.lead)  # the content before the first call, in the answer's order
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


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many of ``text``'s last characters may be the start of one of ``markers`` (they wait
    for the next token to say)."""
    return max((marker_prefix_len(text, marker) for marker in markers), default=0)


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
    # A block's body is JSON: a closer inside one of its strings is text of the call (an agent
    # writing code about tool markup), not the block's end.
    json_body = False
    tags: tuple[str, ...] = ()  # the tags inside a block (that may be cut off where the answer ends)

    def __init__(self, tools: list[dict[str, Any]]):
        self.tools = tools
        self.num_found = 0
        # Calls (by their order in the answer) cut short, their arguments closed where the reading
        # stopped: streamed, so still calls, but none to run (router/openai_api/tool_parsers.py
        # ends such an answer with "stop"). Of the formats only pythonic cuts calls so; a JSON
        # call that does not parse is seen as such without the reader's word.
        self.cut_calls: set[int] = set()
        self._buffer = ""
        self._space = ""  # whitespace after a call, shown only if text follows it
        self._openers = tuple(opener for opener, _ in self.blocks)  # looked for per token
        self._open_block(None)

    def _open_block(self, pair: tuple[str, str | None] | None) -> None:
        """The block being read (None: none) and what is read of it: its body only grows until it closes."""
        self._open = pair
        self._stream = CallStream()  # its calls as sent
        self.ends = ObjectEnds()  # its JSON objects
        self.open_value: OpenTextValue | None = None  # the text value its last call is writing
        self._closer_searched = 0  # its buffer holds no closer before this
        self._quotes = JsonQuotes()  # where its JSON strings are (json_body)
        # json_body: the first closer found inside a string that has not closed yet. Nothing past
        # it is shown until that string closes well (it was text of the call) or turns out no
        # string (the quotes are off: a quote the model left out): then the block ends there.
        self._held: int | None = None

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
                    keep = held_back(self._buffer, self._openers)
                    return _with_text(parts, self._content(len(self._buffer) - keep))
                at, pair = min(starts, key=lambda start: start[0])
                _with_text(parts, self._content(at))  # the buffer now starts with the opener
                self._space = ""
                self._buffer = self._buffer[len(pair[0]) :]
                self._open_block(pair)
            opener, closer = self._open
            end = -1 if closer is None else self._closer_at(closer)
            if end < 0:
                self._closer_searched = len(self._buffer)
                shown = self._buffer[: len(self._buffer) - (0 if closer is None else marker_prefix_len(self._buffer, closer))]
                if self._held is not None:
                    shown = shown[: self._held]
                return parts + self._stream.pieces(self.calls_in(opener, shown, False))
            block, self._buffer = self._buffer[:end], self._buffer[end + len(closer) :]
            parts += self._close(opener, block, closer)

    def _closer_at(self, closer: str) -> int:
        """Where the open block's closer is in the buffer, or -1."""
        # Looked for only in what came since the last look (a long call's buffer is long).
        at = self._buffer.find(closer, max(0, self._closer_searched - len(closer) + 1))
        if not self.json_body:
            return at
        quotes = self._quotes
        while at >= 0:
            inside = quotes.inside(self._buffer, at)
            if quotes.broken:
                return at if self._held is None else self._held
            self._settle_held()
            if not inside:
                return at
            if self._held is None:
                self._held = at
            at = self._buffer.find(closer, at + 1)
        quotes.read(self._buffer, len(self._buffer))
        if quotes.broken and self._held is not None:
            return self._held
        self._settle_held()
        return -1

    def _settle_held(self) -> None:
        quotes = self._quotes
        if self._held is not None and (quotes.string_start is None or quotes.string_start > self._held):
            self._held = None  # the string it was in closed well: it was text of the call

    def finish(self) -> list[Part]:
        if self._open is not None and self._held is not None:
            # The answer ended inside the string that held a closer back: no string after all.
            opener, closer = self._open
            block, self._buffer = self._buffer[: self._held], self._buffer[self._held + len(closer) :]
            return self._close(opener, block, closer) + self.feed("") + self.finish()
        if self._open is not None:  # a block the answer did not close
            (opener, closer), rest, self._buffer = self._open, self._buffer, ""
            found = self.num_found
            parts = self._close(opener, rest[: len(rest) - self.unfinished_tail(rest, closer)])
            if self.num_found > found and self.ends_inside_a_call(opener, rest):
                self.cut_calls.add(self.num_found - 1)  # closed where the answer stopped: none to run
            return parts
        return _with_text([], self._content(len(self._buffer)))

    def ends_inside_a_call(self, opener: str, rest: str) -> bool:
        """Whether a block the answer ended in (``rest`` of it) stops inside its last call, which
        a whole read then closes as if complete (a text value cut off reads as a shorter one).
        JSON formats need not say: a call cut off is no JSON."""
        return False

    def unfinished_tail(self, rest: str, closer: str | None) -> int:
        """How many of the last characters of a block the answer ended in are a tag it began and
        never finished (``</``, ``<arg_``: what ``feed`` held back): no text of a call, nor content."""
        return held_back(rest, self.tags + ((closer,) if closer else ()))

    def _close(self, opener: str, block: str, closer: str = "") -> list[Part]:
        """A block's end (``closer``: its marker, none where the answer ended): its calls' last
        pieces, then what in it is no call; or (no call read in it) the block as content."""
        read = self.calls_in(opener, block, True)
        stream = self._stream
        self._open_block(None)
        if read is None and not stream.sent:
            return [opener + block + closer]
        parts: list[Part] = list(stream.pieces(read))
        self.num_found += len(stream.sent)
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


class HermesReader(BlockReader):
    blocks = ((HERMES_OPEN, HERMES_CLOSE),)
    json_body = True

    def calls_in(self, opener: str, body: str, closed: bool) -> CallsRead | None:
        calls, stop = json_calls(body, read_object=None if closed else self.ends.read)  # a closed block is read afresh
        if calls:  # {"name": ..., "arguments": {: streamed as it comes
            return CallsRead(calls, body[stop:].strip() if closed else "")
        if not closed:
            return None
        call = json_or(body.strip(), None)  # another shape (arguments as a string, null, none at all)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments")
        return CallsRead([(call["name"], json_text({} if arguments is None else arguments))])


class OpenTextValue:
    """The text value a streamed call is in the middle of writing (a file's content, say), read on
    from where the last read left it: each token read the whole call again before, and a long
    call cost the square of its length (a 128 KB qwen3_coder call, 4 characters a token: 16 s of
    the router's CPU). Any tag in what comes hands the block back to a whole read."""

    def __init__(self, calls: list[tuple[str, str]], argument: RawArgument, ends: tuple[str, ...], held: tuple[str, ...]):
        self.calls = calls[:-1]
        self.name, arguments = calls[-1]
        self.escaped = escaped(argument.text)
        self.head = arguments[: len(arguments) - len(self.escaped)]  # the arguments' text before the value's characters
        self.start, self.size = argument.start, len(argument.text)  # the value's characters so far, in the block's body
        self.ends, self.held = ends, held
        self.searched = self.start + self.size

    def read_on(self, body: str) -> list[tuple[str, str]] | None:
        """The block's calls as far as ``body`` goes, or None where a tag came (a whole read decides)."""
        if any(body.find(tag, max(self.start, self.searched - len(tag) + 1)) >= 0 for tag in self.ends):
            return None
        self.searched = len(body)
        end = len(body) - held_back(body, self.held)  # what may be the start of a tag waits
        shown = self.start + self.size
        if end < shown:
            return None  # a held-back tail that reaches into what was shown: let a whole read say
        if end > shown:
            self.escaped += escaped(body[shown:end])
            self.size = end - self.start
        return [*self.calls, (self.name, self.head + self.escaped)]


class TextValueReader(BlockReader):
    """A format whose calls' values are text between tags: a value still being written is read on
    from where the last read left it (OpenTextValue), the rest by a whole read of the block."""

    value_ends: tuple[str, ...] = ()  # tags that end a value or begin another part of the call
    value_held: tuple[str, ...] = ()  # what an open value's end holds back (what may begin a tag)

    def __init__(self, tools: list[dict[str, Any]]):
        super().__init__(tools)
        self._types: dict[str, dict[str, ValueTypes]] = {}  # each function's parameters' types, read once

    def parameter_types(self, name: str) -> dict[str, ValueTypes]:
        """Function ``name``'s parameters' value types (router/openai_api/tool_arguments.py)."""
        types = self._types.get(name)
        if types is None:
            types = self._types[name] = parameter_types(self.tools, name)
        return types

    def calls_in(self, opener: str, body: str, closed: bool) -> CallsRead | None:
        if not closed and self.open_value is not None and (calls := self.open_value.read_on(body)) is not None:
            return CallsRead(calls)
        read, writing = self.read_block(opener, body, closed)
        self.open_value = None
        if read is not None and writing is not None and not closed:
            self.open_value = OpenTextValue(read.calls, writing, self.value_ends, self.value_held)
        return read

    @abstractmethod
    def read_block(self, opener: str, body: str, closed: bool) -> tuple[CallsRead | None, RawArgument | None]:
        """The block's calls as far as ``body`` goes (as ``calls_in``), and the text value its last
        call is writing where one is shown (open, of a text parameter, not empty)."""

    def writing(self, name: str, arguments: list[RawArgument], complete: bool) -> RawArgument | None:
        """The last argument, where it is a text value the call's arguments show as it grows."""
        if complete or not arguments or arguments[-1].closed or not arguments[-1].text:
            return None
        return arguments[-1] if is_text(self.parameter_types(name).get(arguments[-1].key, TEXT)) else None


class Qwen3CoderReader(TextValueReader):
    """A ``<function=...>`` the model wrote without its ``<tool_call>`` is read too (vLLM reads it)."""

    blocks = ((HERMES_OPEN, HERMES_CLOSE), (FUNCTION_OPEN, FUNCTION_CLOSE))
    value_ends = (PARAMETER_CLOSE, PARAMETER_OPEN, FUNCTION_CLOSE, FUNCTION_OPEN, HERMES_CLOSE)
    # At the answer's end a tag cut off is dropped, but not the format's newline before it: the
    # value's last newline is dropped as the format's once it is read whole (and an open value held
    # back only that one, so no newline it showed is taken back).
    tags = value_ends
    value_held = _QWEN_VALUE_ENDS

    def ends_inside_a_call(self, opener: str, rest: str) -> bool:
        text = FUNCTION_OPEN + rest if opener == FUNCTION_OPEN else rest
        return text.rfind(FUNCTION_OPEN) > text.rfind(FUNCTION_CLOSE)  # its last function never closed

    def read_block(self, opener: str, body: str, closed: bool) -> tuple[CallsRead | None, RawArgument | None]:
        shift = len(FUNCTION_OPEN) if opener == FUNCTION_OPEN else 0
        text = FUNCTION_OPEN + body if shift else body
        heads = list(_FUNCTION_HEAD.finditer(text))
        calls, outside, position, writing = [], [], 0, None
        for index, head in enumerate(heads):
            name = head.group(1).strip()
            if not name:
                break  # it and what follows come back as content
            outside.append(text[position : head.start()])
            later = heads[index + 1].start() if index + 1 < len(heads) else len(text)
            region = text[head.end() : later]
            end = region.find(FUNCTION_CLOSE)
            complete = closed or end >= 0 or index + 1 < len(heads)
            arguments = self._arguments(region if end < 0 else region[:end], complete, head.end() - shift)
            calls.append((name, arguments_text(arguments, self.parameter_types(name), complete)))
            writing = self.writing(name, arguments, complete)
            position = head.end() + (len(region) if end < 0 else end + len(FUNCTION_CLOSE))
        if not calls:
            return None, None
        # Text before the first call goes out before it; text between and after calls, after them.
        lead = outside[0].lstrip()
        return CallsRead(calls, ("".join(outside[1:]) + text[position:]).strip() if closed else "", lead), writing

    @staticmethod
    def _arguments(region: str, complete: bool, offset: int) -> list[RawArgument]:
        """The parameters of a call whose region (after its head) starts at ``offset`` in the body."""
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
            start = offset + head.end() + value.startswith("\n")
            value = value.removeprefix("\n")
            if closed:
                value = value.removesuffix("\n")
            elif (at := min((at for tag in (PARAMETER_OPEN, FUNCTION_OPEN) if (at := value.find(tag)) >= 0), default=-1)) >= 0:
                # The next tag has begun (a model that leaves out </parameter>): the value ends there.
                value = value[:at].removesuffix("\n")
            else:
                value = value[: len(value) - held_back(value, _QWEN_VALUE_ENDS)]
            arguments.append(RawArgument(head.group(1).strip(), value, closed, start))
        return arguments


class Glm45Reader(TextValueReader):
    """A call is announced once its first key comes (or its block closes): a block whose first
    line is followed by anything else is no call."""

    blocks = ((HERMES_OPEN, HERMES_CLOSE),)
    value_ends = (GLM_VALUE_CLOSE, GLM_ARG_KEY)
    value_held = (GLM_VALUE_CLOSE, GLM_ARG_KEY)
    tags = value_ends

    def ends_inside_a_call(self, opener: str, rest: str) -> bool:
        return True  # a call ends with its block: cut after a value, it may lack the next arguments

    def unfinished_tail(self, rest: str, closer: str | None) -> int:
        # A key whose value never began ("<arg_key>city</arg_"): no argument, nor content after one.
        at = rest.rfind(GLM_ARG_KEY)
        if at >= 0 and GLM_ARG_VALUE not in rest[at:]:
            return len(rest) - at
        return super().unfinished_tail(rest, closer)

    def read_block(self, opener: str, body: str, closed: bool) -> tuple[CallsRead | None, RawArgument | None]:
        name, marker, _ = body.partition(GLM_ARG_KEY)
        name = name.strip()
        if not (marker or closed) or not name or "\n" in name or "{" in name:
            return None, None
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
                value = value[: len(value) - held_back(value, self.value_held)]
            arguments.append(RawArgument(head.group(1).strip(), value, argument_closed, head.end()))
        rest = "".join(outside).strip() if closed else ""
        read = CallsRead([(name, arguments_text(arguments, self.parameter_types(name), closed))], rest)
        return read, self.writing(name, arguments, closed)
