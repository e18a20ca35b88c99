"""Tool calls written as a Python list of keyword calls (the ``pythonic`` format:
``[get_weather(city="Paris"), get_time()]``), read in a text that grows as the answer streams:
each call's name and its arguments' JSON text so far.

A value is written out once it is whole (its ``,`` or ``)`` read), as ``json.dumps`` writes it in
an object, so what a call's text gives only grows and adds up to the arguments the whole answer
is read into (router/openai_api/tool_formats.py). A plain string value streams as it is written,
its escapes decoded as each one completes (an agent writing a file sees it grow). A call is shown
once it is known to be one: it closed, a value of it was read whole and what follows it too (a
key not given before, or the ``)``), or its first value is a string being written. Text that
reads as no such call (a comment included) stops the reading: what was shown stays, and the whole
answer decides the rest. A call shown whose reading stopped (``f(city="Paris", unit=celsius)``),
or that the answer ended in, keeps what was shown of its arguments, closed (``{"city": "Paris"}``):
a client never gets arguments that do not parse (the call is marked cut: none to run).

Each piece of the text is read once (strings by regular expression), so a long call costs what it
adds per token, not its length.
"""

from __future__ import annotations

import ast
import re
import unicodedata
from dataclasses import dataclass, field

from router.openai_api.tool_arguments import escaped, json_member, open_string_member, python_expression, python_literal

_SPACES = re.compile(r"\s*")
# Names start as Python's do, with any letter or "_" ([^\W\d]): "éf" is a name.
_CALL_HEAD = re.compile(r"\s*([^\W\d]\w*(?:\s*\.\s*[^\W\d]\w*)*)\s*\(")
_CALL_HEAD_START = re.compile(r"\s*(?:[^\W\d]\w*(?:\s*\.\s*(?:[^\W\d]\w*)?)*\s*)?")  # a head not yet whole
_KEYWORD = re.compile(r"\s*([^\W\d]\w*)\s*=(?=[^=])\s*")
_KEYWORD_START = re.compile(r"\s*(?:[^\W\d]\w*\s*=?)?")  # a keyword not yet whole ("=" waits: "==" is none)
# What Python reads on past where this reading stops: a comment, a backslash that continues a line.
_READ_ON_BY_PYTHON = re.compile(r"[#\\]")
_VALUE_MARK = re.compile(r"""[()\[\]{},'"#]""")
_MAX_WAITING = 1024  # characters a name or key not yet whole may take before the reading gives up
# A string's body up to its closing quote: a one-line string's, or a triple-quoted one's.
_STRING_BODY = {quote: re.compile(rf"(?:[^\\\n{quote}]|\\.)*", re.S) for quote in "'\""} | {
    quote * 3: re.compile(rf"(?:[^\\{quote}]|\\.|{quote}(?!{quote}{quote}))*", re.S) for quote in "'\""
}
# A string body's pieces that decode on their own: plain characters, or whole escapes (an octal
# one once a character that is no octal digit follows it); a "\r" once what follows it says whether
# it is a "\r\n", which Python reads as one line end.
_UNIT = r"(?:[^\\\r]|\\?(?:\r\n|\r(?=[^\n]))|\\(?:x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|N\{[^}]*\}|[0-7]{3}|[0-7]{1,2}(?=[^0-7])|[^xuUN0-7\r]))"
_DECODABLE, _DECODABLE_UNIT = re.compile(_UNIT + "+"), re.compile(_UNIT)


def _identifier(name: str) -> str:
    """A name as Python reads it (NFKC-normalised: "ﬁ" is "fi")."""
    return name if name.isascii() else unicodedata.normalize("NFKC", name)


def _closer_start(text: str, start: int, quote: str) -> int:
    """Where the quotes ending ``text`` (from ``start`` on) start, but for one a backslash escapes."""
    end = len(text)
    while end > start and text[end - 1] == quote:
        end -= 1
    backslashes = 0
    while backslashes < end and text[end - backslashes - 1] == "\\":
        backslashes += 1
    return end + 1 if backslashes % 2 and end < len(text) else end


@dataclass(slots=True)
class _Call:
    name: str
    items: list[str] = field(default_factory=list)  # its keyword arguments read whole, each '"key": value'
    keys: set[str] = field(default_factory=set)
    open_text: str = ""  # the string value being written: '"key": "' and its characters so far
    # The last value read whole, shown once what follows it is read (the next key, not one given
    # before, or the call's ")"): f(a=1, a=2) is no call, and is not shown as one.
    pending: str | None = None
    closed: bool = False

    def confirm(self) -> None:
        if self.pending is not None:
            self.items.append(self.pending)
            self.pending, self.open_text = None, ""

    @property
    def shown(self) -> bool:
        return self.closed or bool(self.items) or bool(self.open_text)

    def arguments(self, cut: bool = False) -> str:
        """Its arguments' JSON text as read; ``cut``: the reading of it ended, and what was shown
        is closed (a string being written ends where it stands, a value not yet shown is left out)."""
        items = self.items + [self.open_text] if self.open_text else self.items
        if self.closed or not cut:
            return "{" + ", ".join(items) + ("}" if self.closed else "")
        return "{" + ", ".join(items) + ('"' if self.open_text else "") + "}"


class _OpenString:
    """A plain string value being written: its body's characters decoded as far as they go."""

    __slots__ = ("quote", "decoded_to", "text")

    def __init__(self, quote: str, start: int, head: str):
        self.quote = quote
        self.decoded_to = start  # its body is decoded up to here
        self.text = head  # '"key": "' and the body's characters so far, JSON-escaped

    def read_on(self, text: str, end: int, whole: bool) -> bool:
        """Decodes the body up to ``end`` (``whole``: the body ends there, at its closing quote or
        at a line end no one-line string takes); False where Python refuses an escape in it (what
        comes before that is decoded)."""
        if whole:
            found = self.decoded_to, end
        else:
            match = _DECODABLE.match(text, self.decoded_to, end)
            if match is None:
                return True  # an escape not yet whole
            found = match.span()
        value = _decoded(text[found[0] : found[1]], self.quote)
        if value is None:
            return self._read_unit_by_unit(text, end)
        self.text += escaped(value)
        self.decoded_to = found[1]
        return True

    def _read_unit_by_unit(self, text: str, end: int) -> bool:
        """Decodes up to the escape Python refuses, so the text shown does not depend on how the
        answer was cut into pieces; always False."""
        while (unit := _DECODABLE_UNIT.match(text, self.decoded_to, end)) is not None:
            value = _decoded(unit.group(), self.quote)
            if value is None:
                break
            self.text += escaped(value)
            self.decoded_to = unit.end()
        return False


def _decoded(body: str, quote: str) -> str | None:
    """A string body's characters (None: Python refuses an escape in it, or a character: a NUL, a
    lone surrogate)."""
    if not body.isascii():
        try:
            body.encode("utf-8")
        except UnicodeEncodeError:
            return None
    if "\x00" in body:
        return None
    if "\\" not in body and "\r" not in body:  # no escape, and no line end Python's reader rewrites
        return body
    try:
        # A space before the closing quote, taken off after: a triple-quoted body may end with one quote.
        node = python_expression(quote + body + " " + quote)
    except SyntaxError:
        return None
    return node.value[:-1] if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


class PythonCalls:
    """The calls of a pythonic answer read as it grows (``read``, with the text so far: each text
    starts with the one before) from ``start``, where its ``[`` is."""

    def __init__(self, start: int) -> None:
        self.calls: list[_Call] = []
        self._start = start
        self._settled: bool | None = None  # settled_as_content, once the reading stopped
        # Where the reading stopped: after the list's "]", or where text that is no call starts. A
        # call not yet shown is then no call (its text is content); one shown stays a call, and the
        # text from its failing argument on is content.
        self.stop: int | None = None
        self._position = start
        self._call_start = self._argument_start = start
        self._state = "list"  # what is read next: "list" ("["), "call", "argument", "value", "after_call"
        self._key = ""
        self._value_start = 0
        self._depth = 0
        self._quote: str | None = None  # the quote of the string the value's scan is in
        self._open: _OpenString | None = None

    def read(self, text: str) -> list[tuple[str, str]]:
        """The calls known to be calls so far, in order: each one's name and arguments' text."""
        while self.stop is None and self._step(text):
            pass
        return [(call.name, call.arguments()) for call in self._shown()]

    def ended(self) -> tuple[list[tuple[str, str]], int | None]:
        """Once the answer ended (and is no list of calls): the calls shown, the last one's
        arguments closed where they stand if it did not close, and its index then (cut)."""
        shown = self._shown()
        cut = len(shown) - 1 if shown and not shown[-1].closed else None
        return [(call.name, call.arguments(cut=index == cut)) for index, call in enumerate(shown)], cut

    def settled_as_content(self, text: str) -> bool:
        """Whether the answer is no list of calls whatever follows: the reading stopped before a
        call was shown, and nothing Python reads on past came before (where one did, the whole
        answer's parse decides). Looked at once, when the reading stopped: the text read then
        holds what stopped it."""
        if self.stop is not None and self._settled is None:
            self._settled = not self._shown() and _READ_ON_BY_PYTHON.search(text, self._start) is None
        return bool(self._settled)

    def _shown(self) -> list[_Call]:
        shown = []
        for call in self.calls:
            if not call.shown:
                break
            shown.append(call)
        return shown

    def _step(self, text: str) -> bool:
        """Reads the next thing in ``text``; False where the text ends before it is whole."""
        state = self._state
        if state == "value":
            return self._scan_value(text)
        position = self._position = _SPACES.match(text, self._position).end()  # read once, not again with every token
        if position == len(text):
            return False
        if text[position] == "#":
            return self._fail()  # a comment: the whole answer's parse reads it
        if state == "list":
            return self._went(position + 1, "call") if text[position] == "[" else self._fail()
        if state in ("call", "after_call") and text[position] == "]":
            self.stop = position + 1
            return False
        if state == "after_call":
            return self._went(position + 1, "call") if text[position] == "," else self._fail()
        if state == "call":
            head = _CALL_HEAD.match(text, position)
            if head is None:
                return False if self._may_be_whole_later(text, position, _CALL_HEAD_START) else self._fail()
            self.calls.append(_Call(_identifier(re.sub(r"\s", "", head.group(1)))))
            return self._went(head.end(), "argument")
        call = self.calls[-1]  # state "argument"
        if text[position] == ")":
            call.confirm()
            call.closed = True
            return self._went(position + 1, "after_call")
        keyword = _KEYWORD.match(text, position)
        if keyword is None:
            return False if self._may_be_whole_later(text, position, _KEYWORD_START) else self._fail()
        self._key = _identifier(keyword.group(1))
        if self._key in call.keys:
            return self._fail()  # f(a=1, a=2) is no Python call
        call.confirm()
        self._value_start, self._depth, self._quote, self._open = keyword.end(), 0, None, None
        return self._went(keyword.end(), "value")

    @staticmethod
    def _may_be_whole_later(text: str, position: int, start: re.Pattern) -> bool:
        """Whether the text from ``position`` is the start of a name or key (no longer than any:
        read again with every token, a runaway one would cost the square of its length)."""
        return len(text) - position <= _MAX_WAITING and start.fullmatch(text, position) is not None

    def _scan_value(self, text: str) -> bool:
        """Reads on in a keyword's value, up to the ``,`` or ``)`` that ends it."""
        position = self._position
        while True:
            if self._quote is not None:
                position = _STRING_BODY[self._quote].match(text, position).end()
                if not text.startswith(self._quote, position):
                    if position < len(text) - 1 or (position == len(text) - 1 and text[position] != "\\"):
                        self._show_open_string(text, position, whole=True)
                        return self._fail()  # a newline in a one-line string
                    if position == len(text) and len(self._quote) == 3:  # one or two quotes at the end may start its closer
                        position = _closer_start(text, max(self._position, position - 2), self._quote[0])
                    self._position = position
                    return False if self._show_open_string(text, position, whole=False) else self._fail()
                if not self._show_open_string(text, position, whole=True):
                    return self._fail()  # an escape Python refuses: the answer is no Python
                self._open = None  # the value may go on ("a" "b"); what was shown of it stays a start of it
                position += len(self._quote)
                self._quote = None
            mark = _VALUE_MARK.search(text, position)
            if mark is None:
                self._position = len(text)
                return False
            char, position = mark.group(), mark.end()
            if char in "'\"":
                opening = text[mark.start() : mark.start() + 3]
                if len(opening) < 3 and opening == char * len(opening):
                    self._position = mark.start()  # a string, an empty one, or a triple-quoted one
                    return False
                self._quote = char * 3 if text.startswith(char * 3, mark.start()) else char
                position = mark.start() + len(self._quote)
                if _SPACES.match(text, self._value_start).end() == mark.start():
                    # The value starts as a plain string (not r"...", f"..."): it streams as it is written.
                    self._open = _OpenString(self._quote, position, open_string_member(self._key))
                self._position = position
            elif char == "#":
                return self._fail()  # a comment: the whole answer's parse reads it
            elif char in "([{":
                self._depth += 1
            elif self._depth > 0 and char in ")]}":
                self._depth -= 1
            elif char in "]}":
                return self._fail()
            elif self._depth == 0:  # the "," or ")" that ends the value
                return self._end_value(text, mark.start(), char)

    def _show_open_string(self, text: str, end: int, whole: bool) -> bool:
        """Shows the string value being written as far as it decodes; False where it does not all."""
        if self._open is None:
            return True
        read = self._open.read_on(text, end, whole)
        self.calls[-1].open_text = self._open.text
        return read

    def _end_value(self, text: str, end: int, char: str) -> bool:
        call = self.calls[-1]
        try:
            value = python_literal(python_expression(text[self._value_start : end].strip()))
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return self._fail()
        item = json_member(self._key, value)
        if not item.startswith(call.open_text):
            return self._fail()  # ("ab")[0]: what was shown is no start of the value
        call.pending = item
        call.keys.add(self._key)
        if char == ")":
            call.confirm()
            call.closed = True
            return self._went(end + 1, "after_call")
        return self._went(end + 1, "argument")

    def _went(self, position: int, state: str) -> bool:
        self._position, self._state = position, state
        if state == "call":
            self._call_start = position
        elif state == "argument":
            self._argument_start = position
        return True

    def _fail(self) -> bool:
        self.stop = self._position
        if self._state in ("argument", "value"):
            if self.calls[-1].shown:
                self.stop = self._argument_start
            else:
                self.stop = self._call_start
                self.calls.pop()
        return False
