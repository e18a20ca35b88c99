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
        # How much of ``_held`` came in unmatched feeds: a stop string lying wholly inside it
        # never matches, one that begins there and ends in matched text does (vLLM's look-back).
        self._held_unmatched = 0
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

        ``match=False`` (a request short of its minimum length): no stop string ends the text,
        but its tail that could begin one is still held back, so that a stop string that begins
        in it and ends in the text after the minimum still matches (as vLLM's does).
        """
        if self._matched is not None:
            return StopCheck("", self._matched)
        if not self._stops:
            return StopCheck(text)
        pending = self._held + text
        unmatched = len(pending) if not match else self._held_unmatched
        found = self._earliest_match(pending, unmatched) if match else None
        if found is not None:
            index, stop = found
            self._held, self._held_unmatched = "", 0
            self._matched = stop
            return StopCheck(pending[: index + (len(stop) if self._include_stop else 0)], stop)
        split = len(pending) - self._partial_match_len(pending)
        self._held = pending[split:]
        self._held_unmatched = max(0, unmatched - split)
        return StopCheck(pending[:split])

    def flush(self) -> str:
        """Release the held text; for when generation ended for another reason (length, EOS)."""
        held, self._held, self._held_unmatched = self._held, "", 0
        return held if self._matched is None else ""

    def _earliest_match(self, text: str, unmatched: int = 0) -> tuple[int, str] | None:
        """The earliest stop string in ``text`` that ends past its first ``unmatched`` characters."""
        # The earliest occurrence wins (two stops may complete in the same delta); on a tie the
        # one listed first.
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = text.find(stop, max(0, unmatched - len(stop) + 1))
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
