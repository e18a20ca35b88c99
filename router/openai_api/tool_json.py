"""Tool calls written as JSON objects (hermes, llama3_json, mistral), read in a text that grows
as the answer streams: each call's name, and its arguments object's text so far.

A streamed call is looked for again with every token; ``ObjectEnds`` keeps how far each
object was read, so a token costs what it adds, not the call's length (read from the start
each time, a 128 KB call streamed 4 characters at a time cost 28 s of the router's CPU).

Models write raw newlines and tabs inside strings (a file's content): no JSON, and a client
parsing the arguments fails. An object's text is given with control characters inside its
strings escaped (``\n``, ``\t``, ``\u0001``): each is replaced where it stands, so the text of a
longer read starts with that of a shorter one and what was streamed stays a start of the call.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection

_JSON_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
_JSON_CALL_TAIL = re.compile(r"\s*\}\s*[,;]?")  # a call object's end, after its arguments
_JSON_STRING_REST = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*', re.S)  # a string's characters up to its closing quote
_JSON_STRING_PLAIN = re.compile(r'[^"\\\x00-\x1f]*')  # a string's characters up to a quote, an escape or a control character
_JSON_QUOTE_OR_BRACKET = re.compile(r'["{}\[\]]')
_JSON_SPACE = re.compile(r"[ \t\r\n]*")
_JSON_CONTROL = re.compile(r"[\x00-\x1f]")

ObjectRead = Callable[[str, int], tuple[str, int]]  # (text, start) -> (the object's text so far, where it ends)


def json_calls(text: str, position: int = 0, read_object: ObjectRead | None = None,
               names: Collection[str] | None = None) -> tuple[list[tuple[str, str]], int]:
    """Calls written as JSON objects, ``{"name": ..., "arguments" (or "parameters"): {...}}``, one
    after another (commas, semicolons or whitespace between), from ``position``: each one's name
    and its arguments object's text so far (control characters in its strings escaped), and where
    the reading stopped (the first text that is no such call, or the end). ``read_object``: how an
    arguments object is read (an ``ObjectEnds``' ``read`` where earlier reads of this text, shorter,
    were kept; default: read afresh). ``names``: where given, a call must name one of them (else
    the reading stops before it)."""
    read_object = read_object or json_object
    calls = []
    while True:
        head = _JSON_CALL_HEAD.match(text, position)
        if head is None:
            return calls, position
        try:
            name = json.loads(head.group(1))
        except ValueError:  # a raw control character or an unknown escape in the name: no call
            return calls, position
        if names is not None and name not in names:
            return calls, position
        arguments, end = read_object(text, head.end())
        calls.append((name, arguments))
        after = _JSON_CALL_TAIL.match(text, end)
        if after is None:
            return calls, end
        position = after.end()


def json_object(text: str, start: int) -> tuple[str, int]:
    """The JSON object opening at ``text[start]``: its text so far, control characters in its
    strings escaped, and where it ends (after its closing brace; the text's end if it has not yet)."""
    return _ObjectScan(start).read(text)


class ObjectEnds:
    """The JSON objects of a text that only grows (each text starts with the one before), each
    read once: a streamed call's arguments are looked for again with every token, and reading
    them from their start each time made a call's cost grow with its square (a 128 KB call
    streamed 4 characters at a time: 28 s of the router's CPU)."""

    def __init__(self) -> None:
        self._scans: dict[int, _ObjectScan] = {}

    def read(self, text: str, start: int) -> tuple[str, int]:
        """As ``json_object``, reading on from where the last read of this object stopped."""
        scan = self._scans.get(start)
        if scan is None:
            scan = self._scans[start] = _ObjectScan(start)
        return scan.read(text)


class JsonQuotes:
    """Where the strings of a JSON text that only grows are, read once, left to right; and
    whether they are well formed. A string cannot end but before a comma, a colon or a closing
    bracket: a quote before anything else means the quotes are off (a quote the model left out),
    and from then on nothing is taken for inside a string. A raw control character (a file's
    newline) is taken inside a string: models write them, and the arguments escape them."""

    __slots__ = ("position", "string_start", "broken")

    def __init__(self) -> None:
        self.position = 0  # read up to here
        self.string_start: int | None = None  # where the string being read opened (None: outside one)
        self.broken = False

    def read(self, text: str, upto: int) -> None:
        """Read ``text`` up to ``upto`` (an escape cut there waits for its character)."""
        while self.position < upto and not self.broken:
            if self.string_start is None:
                quote = text.find('"', self.position, upto)
                if quote < 0:
                    self.position = upto
                    return
                self.string_start, self.position = quote, quote + 1
                continue
            self.position = _JSON_STRING_PLAIN.match(text, self.position, upto).end()
            if self.position >= upto:
                return
            mark = text[self.position]
            if mark == '"':
                # A string ends where JSON goes on after one (a comma, a colon, a closing
                # bracket); a quote before anything else was no end of a string.
                after = _JSON_SPACE.match(text, self.position + 1, upto).end()
                if after >= upto:
                    return  # what follows it has not come yet
                if text[after] not in ",:}]":
                    self.broken = True
                    return
                self.string_start, self.position = None, self.position + 1
            elif mark == "\\":
                if self.position + 1 >= upto:
                    return
                self.position += 2
            else:
                self.position += 1  # a raw control character: escaped in the arguments, still inside

    def inside(self, text: str, at: int) -> bool:
        """Whether ``text[at]`` is inside a well-formed string so far (``at`` no earlier than before)."""
        self.read(text, at)
        return not self.broken and self.string_start is not None


class _ObjectScan:
    """How far an object's text was read: where, how deep in brackets, whether in a string; and
    its text up to the last control character found in a string, that one escaped (the rest is
    as written: most objects have none, and cost no copy)."""

    __slots__ = ("start", "position", "depth", "in_string", "end", "escaped", "escaped_to")

    def __init__(self, start: int) -> None:
        self.start = start
        self.position = start
        self.depth = 0
        self.in_string = False
        self.end: int | None = None
        self.escaped = ""  # the text from start to escaped_to, control characters in strings escaped
        self.escaped_to = start

    def read(self, text: str) -> tuple[str, int]:
        """The object's text and its end in ``text`` (its end so far: the text's end if it is still open)."""
        position = self.position
        while self.end is None:
            if self.in_string:
                string_end = _JSON_STRING_REST.match(text, position).end()
                self._escape_controls(text, position, string_end)
                position = string_end
                if position == len(text) or text[position] != '"':
                    break  # still open (or a backslash that waits for the character it escapes)
                position += 1
                self.in_string = False
            found = _JSON_QUOTE_OR_BRACKET.search(text, position)
            if found is None:
                position = len(text)
                break
            position = found.end()
            mark = found.group()
            if mark == '"':
                self.in_string = True
            elif mark in "{[":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth == 0:
                    self.end = position
        self.position = position
        end = len(text) if self.end is None else self.end
        if self.escaped_to == self.start:
            return text[self.start : end], end
        return self.escaped + text[self.escaped_to : end], end

    def _escape_controls(self, text: str, start: int, end: int) -> None:
        """Escapes the control characters of a string's characters ``text[start:end]``."""
        pieces = []
        for control in _JSON_CONTROL.finditer(text, start, end):
            pieces += [text[self.escaped_to : control.start()], json.dumps(control.group())[1:-1]]
            self.escaped_to = control.end()
        if pieces:
            self.escaped += "".join(pieces)
