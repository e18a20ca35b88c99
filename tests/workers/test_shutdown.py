"""A worker's shutdown with tensor-parallel ranks: it tells them to stop only between steps."""

from __future__ import annotations

import asyncio
import threading
import types

from engine.engine_thread import EngineThread
from workers.base import EngineWorker


class _Record:
    """Stands in for the worker's parts that shutdown only closes; records who was told what."""

    def __init__(self, calls: list[str], name: str):
        self._calls, self._name = calls, name

    def __getattr__(self, method: str):
        return lambda *args: self._calls.append(f"{self._name}.{method}")


def _worker(calls: list[str], iterate) -> types.SimpleNamespace:
    thread = EngineThread("decode-w", iterate)
    thread.start()
    return types.SimpleNamespace(
        _thread=thread, pump=_Record(calls, "pump"), agent=_Record(calls, "agent"), activations=None,
        ranks=_Record(calls, "ranks"), engine=_Record(calls, "engine"), role="decode", worker_id="w",
    )


def test_shutdown_during_a_long_step_ends_the_ranks_without_a_stop_broadcast_beside_it():
    """The STOP broadcast (engine.close) went out from the actor's loop while a step longer than
    the engine thread's 5 s stop wait still ran its collectives on the engine thread: two
    threads on one process group. Now the ranks are ended instead, and told to stop only when
    no step runs."""
    calls: list[str] = []
    release = threading.Event()
    in_step = threading.Event()

    def long_step() -> bool:
        in_step.set()
        release.wait(30)
        return False

    worker = _worker(calls, long_step)
    assert in_step.wait(5)
    try:
        worker._thread.stop = lambda: EngineThread.stop(worker._thread, timeout_s=0.2)
        asyncio.run(EngineWorker.shutdown(worker))
        assert "engine.close" not in calls and "ranks.stop" in calls
    finally:
        release.set()

    calls.clear()
    idle = _worker(calls, lambda: False)
    asyncio.run(EngineWorker.shutdown(idle))
    assert "engine.close" in calls and "ranks.stop" not in calls
