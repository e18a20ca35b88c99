"""TransferPump: drives an agent's transfers on a thread of their own.

Why a thread: without UCX's progress thread (it busy-polls a whole core, so it is off on
CPU), a NIXL write advances only when someone checks it, and notifications are seen only
when someone asks. If the engine thread did that between steps, a step of several seconds
(a long chunk, a slow dtype, a big batch) would stall every write for that long and trip
the write timeout, and leases would be checked late. The pump polls while anything is in
flight, whatever the engine is doing; torch releases the GIL inside its kernels, so the
two threads really overlap.

Idle costs nothing: with no write in flight and no reservation waiting for writes, the
pump sleeps on an event that the worker sets when it pushes or reserves (``kick``).

Events are buffered here and taken by the engine thread (``take_send_events``,
``take_receive_events``); ``on_events`` tells the worker that something arrived, so an
idle engine thread wakes at once instead of polling.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvtransfer.agent import KVAgent
from kvtransfer.messages import ReceiveEvents, SendEvent

logger = logging.getLogger(__name__)


class TransferPump:
    def __init__(
        self, agent: KVAgent, on_events: Callable[[], None] = lambda: None, poll_interval_s: float = 0.001, max_poll_interval_s: float = 0.004
    ):
        self._agent = agent
        self._on_events = on_events
        # Polls that find nothing back off from the first interval to the second: a reservation
        # waiting for a long prompt's KV would otherwise cost a poll every millisecond for its
        # whole prefill (3% of a core per actor, measured, taken from the compute beside it).
        # A kick (a push, a reservation) polls at once and starts again from the first.
        self._poll_interval_s = poll_interval_s
        self._max_poll_interval_s = max(poll_interval_s, max_poll_interval_s)
        self._work = threading.Event()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._sends: list[SendEvent] = []
        self._receives = ReceiveEvents()
        # Requests whose events were discarded while a poll of the agent ran (their abort did
        # not wait for it: on the Ray backend a poll fetches whole payloads), and the poll's
        # events of them dropped when it is gathered.
        self._polling = False
        self._discarded_while_polling: set[str] = set()
        self._thread = threading.Thread(target=self._run, name=f"kv-pump-{agent.ref.name}", daemon=True)
        self.last_error: BaseException | None = None
        self._num_quiesced = 0  # the agent's count of given-up requests quiesced, at the last poll

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        self._work.set()
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def kick(self) -> None:
        """Something was pushed or reserved: start polling if the pump sleeps."""
        self._work.set()

    def take_send_events(self) -> list[SendEvent]:
        with self._lock:
            events, self._sends = self._sends, []
        return events

    def take_receive_events(self) -> ReceiveEvents:
        with self._lock:
            events, self._receives = self._receives, ReceiveEvents()
        return events

    def discard_receive_events(self, req_id: str) -> None:
        """Drop what was gathered of a request's reservation that ended (aborted): its events name
        the request only, and a newer attempt of it may hold a reservation here by the time they
        are taken (its KV taken for ready, or the attempt failed, by the older one's events).
        Freed blocks stay: they are the cache's, whoever held them."""
        with self._lock:
            _drop_events_of(self._receives, {req_id})
            if self._polling:
                self._discarded_while_polling.add(req_id)

    def _run(self) -> None:
        interval = self._poll_interval_s
        while not self._stopping.is_set():
            # Clear before looking: a kick that lands after the look sets it again.
            self._work.clear()
            try:
                if not self._agent.has_pending_work():
                    self._work.wait()
                    interval = self._poll_interval_s
                    continue
                found = self._poll_once()
            except Exception as exc:  # the health check sees it; never spin on a broken agent
                if self.last_error is None:
                    logger.exception("transfer pump of %s failed", self._agent.ref)
                self.last_error = exc
                self._stopping.wait(0.1)
                continue
            interval = self._poll_interval_s if found else min(2 * interval, self._max_poll_interval_s)
            if self._work.wait(interval):  # kicked (or stopping): poll now, from the first interval
                interval = self._poll_interval_s

    def _poll_once(self) -> bool:
        """One poll of sends and receives; whether it found anything."""
        sends = self._agent.poll_sends()
        seen = time.perf_counter()
        for event in sends:
            event.seen_at = seen  # the engine thread takes it later, after its step: not part of the transfer
        with self._lock:
            self._polling = True
        receives = ReceiveEvents()
        try:
            receives = self._agent.poll_receives()  # not under the lock: the engine thread takes events meanwhile
        finally:
            with self._lock:
                self._polling = False
                # A reservation aborted while the poll ran found nothing of it to drop: its
                # events would reach a newer attempt of the request (a failure it never had,
                # its KV "ready" early). Dropped and gathered under one hold, so no abort falls
                # between the two.
                found = bool(receives)
                _drop_events_of(receives, self._discarded_while_polling)
                self._discarded_while_polling = set()
                self._sends.extend(sends)
                _merge_into(self._receives, receives)
        num_quiesced, before = self._agent.num_quiesced(), self._num_quiesced
        self._num_quiesced = num_quiesced
        if not sends and not found:
            if num_quiesced != before:
                # A cancelled or failed request's last write ended, which makes no event: whoever
                # waits for that request to quiesce looks again now, not at its timeout.
                self._on_events()
                return True
            return False
        self._on_events()
        return True


def _drop_events_of(events: ReceiveEvents, req_ids: set[str]) -> None:
    """Drop the progress, ready and failed events of ``req_ids`` (freed blocks stay: they are the
    cache's, whoever held them)."""
    if not req_ids:
        return
    events.progress = [(rid, blocks) for rid, blocks in events.progress if rid not in req_ids]
    events.ready = [rid for rid in events.ready if rid not in req_ids]
    events.failed = [failure for failure in events.failed if failure.req_id not in req_ids]


def _merge_into(into: ReceiveEvents, more: ReceiveEvents) -> None:
    into.progress.extend(more.progress)
    into.ready.extend(more.ready)
    into.failed.extend(more.failed)
    into.freed.extend(more.freed)
