"""The engine thread runs commands between iterations and reports a stuck or failed loop."""

from __future__ import annotations

import threading
import time

import pytest

from engine.engine_thread import EngineThread


def test_commands_run_on_the_engine_thread_and_return_results():
    seen = []
    thread = EngineThread("t", lambda: False)
    thread.start()
    try:
        assert thread.call(lambda x: (seen.append(threading.current_thread().name), x * 2)[1], 21).result(5) == 42
        with pytest.raises(ZeroDivisionError):
            thread.call(lambda: 1 / 0).result(5)
        assert seen == ["t"]
        thread.check_healthy(hang_timeout_s=5)
    finally:
        thread.stop()


def test_a_hung_iteration_and_a_failed_one_are_reported():
    release = threading.Event()
    hung = EngineThread("hung", lambda: release.wait(10) and False)
    hung.start()
    try:
        time.sleep(0.3)
        with pytest.raises(RuntimeError, match="no progress"):
            hung.check_healthy(hang_timeout_s=0.1)
    finally:
        release.set()
        hung.stop()
    failing = EngineThread("failing", lambda: 1 / 0)
    failing.start()
    try:
        time.sleep(0.1)
        with pytest.raises(RuntimeError, match="iteration failed"):
            failing.check_healthy(hang_timeout_s=5)
    finally:
        failing.stop()
