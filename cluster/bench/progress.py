"""A one-line progress bar on a terminal stream (the benchmark's only interactive output)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """``done/total`` with a bar, request rate and failures; redraws at most ten times a second."""

    def __init__(self, total: int, label: str = "", stream: TextIO | None = None, enabled: bool = True, width: int = 30):
        self.total = total
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.width = width
        self.done = 0
        self.failed = 0
        self._start = time.perf_counter()
        self._last_draw = 0.0
        # Not a terminal (a log file, CI): no carriage-return redraws, one line at the end.
        self._interactive = enabled and getattr(self.stream, "isatty", lambda: False)()

    def advance(self, ok: bool = True) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        now = time.perf_counter()
        if self._interactive and (now - self._last_draw >= 0.1 or self.done == self.total):
            self._last_draw = now
            self.stream.write("\r" + self._line(now))
            self.stream.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        self.stream.write(("\r" if self._interactive else "") + self._line(time.perf_counter()) + "\n")
        self.stream.flush()

    def _line(self, now: float) -> str:
        filled = self.width * self.done // max(1, self.total)
        elapsed = now - self._start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        failed = f", {self.failed} failed" if self.failed else ""
        return f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} {elapsed:6.1f}s {rate:5.2f} req/s{failed}"
