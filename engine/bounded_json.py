"""Reading JSON text that a client or the model wrote, however deeply it nests.

Python's JSON parser recurses once per array or object level, so text nested about a thousand
levels deep (``[[[[...`` is 2 bytes a level) raises RecursionError, not JSONDecodeError, and
the handlers written for bad JSON let it through as an internal error. Here it is a
JSONDecodeError like any other unreadable text, and ``MAX_DEPTH`` bounds what is accepted, so
that the recursive code further on (chat templates' ``tojson``, grammar compilers, schema
walkers) never meets a structure deeper than it can follow either.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

# Deeper than any request or tool call a user writes (a JSON schema nested 40 objects deep is
# about 80 levels) and far below the interpreter's recursion limit (1,000 frames).
MAX_DEPTH = 128

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_PLAIN = json.JSONDecoder()
_OPENERS = np.zeros(256, dtype=np.int8)
_OPENERS[[ord("["), ord("{")]] = 1
_OPENERS[[ord("]"), ord("}")]] = -1
_PIECE_BYTES = 1 << 20


class TooDeepError(json.JSONDecodeError):
    """Text that nests past ``MAX_DEPTH``; its message has no position (the whole text is at fault)."""

    def __init__(self, text: str) -> None:
        super().__init__(f"nests deeper than {MAX_DEPTH} levels", text, 0)

    def __str__(self) -> str:
        return self.msg

    def __reduce__(self):
        return type(self), (self.doc,)


def loads(text: str | bytes, decoder: json.JSONDecoder = _PLAIN) -> Any:
    """``text`` parsed by ``decoder``; json.JSONDecodeError where it is not JSON or nests deeper
    than ``MAX_DEPTH`` levels."""
    if isinstance(text, bytes):
        text = text.decode(json.detect_encoding(text))  # UnicodeDecodeError as json.loads raises it
    try:
        value = decoder.decode(text)
    except RecursionError:
        raise TooDeepError(text) from None
    # Fewer brackets than the bound cannot nest past it: the common case costs two counts.
    if isinstance(value, (list, dict)) and text.count("[") + text.count("{") > MAX_DEPTH and nesting_depth(text) > MAX_DEPTH:
        raise TooDeepError(text)
    return value


def nesting_depth(text: str) -> int:
    """How many arrays and objects deep JSON ``text`` nests at its deepest (brackets inside
    strings are not structure). Vectorised: a long prompt's token ids are one array of
    hundreds of thousands of numbers, read on the router's event loop."""
    data = np.frombuffer(_STRING.sub(b'""', text.encode("utf-8", "surrogatepass")), dtype=np.uint8)
    depth = deepest = 0
    # A piece at a time: a body of 64 MB of brackets took 320 MB more to count in one go.
    for start in range(0, len(data), _PIECE_BYTES):
        running = np.cumsum(_OPENERS[data[start : start + _PIECE_BYTES]], dtype=np.int64) + depth
        deepest, depth = max(deepest, int(running.max())), int(running[-1])
    return deepest
