"""Run an engine on one dedicated thread; everyone else talks to it by command.

The engine and its scheduler are single-threaded by design. A worker actor receives calls
on other threads (or an event loop); it hands each one to ``call``, which runs it on the
engine thread between two iterations and returns a ``concurrent.futures.Future``. The
worker's ``iterate`` function does one unit of work (poll transfers, one ``step()``,
publish outputs) and says whether it did anything; when idle the thread sleeps until a
command arrives or ``wake`` is called (a transfer landed), so an idle worker costs no CPU.
``idle_wait_s`` bounds that sleep for workers that still need a periodic look.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

logger = logging.getLogger(__name__)


class EngineThread:
    def __init__(self, name: str, iterate: Callable[[], bool] | None = None, idle_wait_s: float | None = None):
        self.name = name
        self._iterate = iterate or _no_work
        self._idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue[tuple[Callable[..., Any], tuple, Future]] = queue.SimpleQueue()
        self._stopping = threading.Event()
        # Held to check for a stop and queue a command as one: a command queued after the
        # thread's last drain would never run, and its caller would wait for good.
        self._queueing = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.last_error: BaseException | None = None
        self._last_beat = time.monotonic()
        self._idle = False  # asleep waiting for a command: not hung, however long ago the last beat

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop after the iteration running now; True once the thread ended (False: that
        iteration still runs after ``timeout_s``)."""
        with self._queueing:
            self._stopping.set()
            self._commands.put((lambda: None, (), Future()))
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def call(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` on the engine thread; its result or exception lands in the future."""
        future: Future = Future()
        with self._queueing:
            if self._stopping.is_set():
                future.set_exception(RuntimeError(f"{self.name} is stopped"))
                return future
            self._commands.put((fn, args, future))
        return future

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the engine thread and wait for its result (e.g. building the engine).

        Build the engine here, not on the caller's thread: torch's CPU kernels (oneDNN's
        packed linears above all) ran a decode step of the 135M shape in 62 ms on a thread
        other than the one that set the model up, against 42 ms on that one.
        """
        return self.call(fn, *args).result()

    def attach(self, iterate: Callable[[], bool]) -> None:
        """Start calling ``iterate`` (once the worker around it is fully built)."""
        self._iterate = iterate
        self.wake()

    def wake(self) -> None:
        """Make an idle thread go round its loop once (something arrived that ``iterate`` handles)."""
        self._commands.put((_nothing, (), Future()))

    def seconds_since_progress(self) -> float:
        """How long ago the thread last went round its loop; large means hung in a step."""
        if self._idle:
            return 0.0
        return time.monotonic() - self._last_beat

    def check_healthy(self, hang_timeout_s: float) -> None:
        """Raise RuntimeError if the thread died, failed an iteration, or is stuck."""
        if not self.alive:
            raise RuntimeError(f"{self.name}: engine thread is not running")
        if self.last_error is not None:
            raise RuntimeError(f"{self.name}: engine iteration failed: {self.last_error!r}")
        if self.seconds_since_progress() > hang_timeout_s:
            raise RuntimeError(f"{self.name}: no progress for {self.seconds_since_progress():.0f}s")

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._last_beat = time.monotonic()
            self._drain_commands()
            try:
                busy = self._iterate()
            except Exception as exc:  # a bug in one iteration must not silently kill the worker
                if self.last_error is None:
                    logger.exception("%s: iteration failed", self.name)
                self.last_error = exc
                self._stopping.wait(0.1)  # the health check replaces this worker; do not spin meanwhile
                busy = False
            if not busy:
                self._idle = True
                try:
                    command = self._commands.get(timeout=self._idle_wait_s)
                except queue.Empty:
                    continue
                finally:
                    self._idle = False
                    self._last_beat = time.monotonic()
                self._run_command(*command)
        self._drain_commands()

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            self._run_command(*command)

    @staticmethod
    def _run_command(fn: Callable[..., Any], args: tuple, future: Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # handed to the caller, who decides what it means
            future.set_exception(exc)


def _nothing() -> None:
    return None


def _no_work() -> bool:
    return False
