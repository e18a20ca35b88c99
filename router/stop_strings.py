"""Stop strings over streamed text: find them across token boundaries, never leak their start.

The detokenizer's deltas go through ``StopStringMatcher.feed``. A stop string may arrive split
over several deltas ("\\n" then "\\n"), so text that could be the beginning of a stop string is
held back until it either completes the stop (generation ends, the text is cut before the stop
string, as vLLM does by default, or after it with ``include_stop``) or turns out not to (it is released with the next delta).
Only the text from the earliest point where a stop string could still begin is held, so
ordinary text streams without delay.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class StopCheck:
    """The result of feeding one text delta."""

    text: str  # safe to send to the client now
    matched_stop: str | None = None  # the stop string that ended generation, if one did


class StopStringMatcher:
    """Applies one request's stop strings to its streamed output text."""

    def __init__(self, stop: Sequence[str], include_stop: bool = False) -> None:
        """``include_stop``: the text keeps the stop string that ended it (vLLM's
        include_stop_str_in_output); by default it is cut before it."""
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(dict.fromkeys(stop))  # duplicates would only cost time
        self._max_len = max((len(s) for s in self._stops), default=0)
        self._first_chars = frozenset(s[0] for s in self._stops)
        self._held = ""
        self._matched: str | None = None
        self._include_stop = include_stop

    @property
    def matched_stop(self) -> str | None:
        return self._matched

    @property
    def held_text(self) -> str:
        """Text received but not yet released because it could start a stop string."""
        return self._held

    def feed(self, text: str, match: bool = True) -> StopCheck:
        """Take the next text delta; return what may be sent and whether a stop string matched.

        ``match=False`` (a request short of its minimum length): the text and anything held
        pass unmatched.
        """
        if self._matched is not None:
            return StopCheck("", self._matched)
        if not self._stops:
            return StopCheck(text)
        if not match:
            held, self._held = self._held, ""
            return StopCheck(held + text)
        pending = self._held + text
        match = self._earliest_match(pending)
        if match is not None:
            index, stop = match
            self._held = ""
            self._matched = stop
            return StopCheck(pending[: index + (len(stop) if self._include_stop else 0)], stop)
        split = len(pending) - self._partial_match_len(pending)
        self._held = pending[split:]
        return StopCheck(pending[:split])

    def flush(self) -> str:
        """Release the held text; for when generation ended for another reason (length, EOS)."""
        held, self._held = self._held, ""
        return held if self._matched is None else ""

    def _earliest_match(self, text: str) -> tuple[int, str] | None:
        # The earliest occurrence wins (two stops may complete in the same delta); on a tie the
        # one listed first.
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = text.find(stop)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _partial_match_len(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
        # Scanning from the earliest possible start finds the longest such tail first; every
        # later match of a stop string must start inside it.
        for start in range(max(0, len(text) - self._max_len + 1), len(text)):
            if text[start] not in self._first_chars:
                continue
            tail = text[start:]
            if any(stop.startswith(tail) for stop in self._stops):
                return len(text) - start
        return 0
