"""Activations between the stages of a pipelined prefill, over NIXL.

A stage hands the next one, for every chunk, its last layer's output and the residual stream
([tokens, hidden] each). Over Ray that is a call carrying numpy arrays through the object store
(a copy in, a copy out, and on a GPU two trips through host memory); here the previous stage
writes them straight into the next stage's memory with one NIXL write, as the KV blocks go.

Each stage actor owns one ``ActivationChannel``: its own NIXL agent (beside the KV agent), an
inbox of slots that previous stages write into, and a few staging slots its own outgoing chunks
are written from (NIXL writes only from registered memory). A slot holds one chunk: [2,
slot_tokens, hidden], the hidden rows then the residual rows.

- ``open_inbox`` gives a request's receiving stage one slot per chunk it will receive, for the
  request's whole prefill (no flow control to get wrong: a slot is written once), and returns
  where they are (``ActivationSlots``), which the router hands the previous stage. With too few
  free slots it returns None, and that request's activations go over Ray. ``close_inbox`` frees
  the slots whose chunk landed; one still awaiting its write (a cancelled request) is reused only
  once that write's notification came, or after ``QUARANTINE_S``.
- ``send`` copies a chunk into a free staging slot and posts one write of its two row ranges into
  the chunk's inbox slot, with a notification naming the request, the attempt and the tokens;
  False (no staging slot came free within 20 ms, or the write failed to post) tells the caller
  to use Ray for it; a write that fails after it was posted keeps its staging slot until the
  caller takes the chunk back (``take_failed_sends``) and sends it over Ray.
- A poller thread, running while an inbox is open or a write is in flight, turns notifications
  into ``ArrivedChunk``s and wakes the engine thread (also as writes complete: a stage answers
  once ``num_sends_in_flight`` of its request is zero); ``take_arrivals`` hands them over. An
  arrived chunk is read (copied out of its slot) when the stage computes it. Polls that find
  nothing back off from 1 to 16 ms; while the engine thread waits for a chunk (``expect``) they
  start again at 1 ms and back off to 4 ms: a stage computing its own chunk needs no quick look,
  and polling as often for a whole 8k prompt cost more CPU on a 2-core host than the Ray calls
  it replaces (the prompt pipelined over 2 took 4.7% longer than with Ray).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvtransfer.backends.nixl import api as nixl_api
from kvtransfer.errors import BackendUnavailableError
from kvtransfer.messages import ActivationSlots

logger = logging.getLogger(__name__)

# The poller's back-off between polls that find nothing: to 4 ms while the engine thread waits
# for a chunk, to 16 ms while it computes.
FIRST_POLL_S, EXPECTING_POLL_S, LAST_POLL_S = 0.001, 0.004, 0.016
STAGING_WAIT_S = 0.02  # how long ``send`` waits for a staging slot before the chunk goes over Ray
# How long an inbox slot whose chunk never landed stays out of use after its request ended here:
# past any write still in flight to it (UCX fails a write to a live peer well within this).
QUARANTINE_S = 60.0


@dataclass(slots=True)
class ArrivedChunk:
    """A chunk's activations that landed in an inbox slot; read when the stage computes it."""

    req_id: str
    token: int
    start: int
    num_tokens: int
    has_residual: bool
    slot: torch.Tensor  # [2, slot_tokens, hidden], a view of the inbox

    def activations(self, device: Any = None) -> Any:
        """As the engine takes them (copies: the slot is reused); ``device`` is the inbox's own,
        the engine's (the argument is ``workers.pipeline.StageChunk``'s)."""
        from engine.model import StageActivations

        hidden = self.slot[0, : self.num_tokens].clone()
        residual = self.slot[1, : self.num_tokens].clone() if self.has_residual else None
        return StageActivations(hidden, residual)


@dataclass(slots=True)
class _Send:
    """A chunk's write in flight from staging slot ``staging``, and which chunk it is."""

    handle: Any
    staging: int
    req_id: str
    token: int
    start: int
    num_tokens: int
    has_residual: bool


@dataclass(slots=True)
class FailedSend:
    """A chunk whose write failed after it was posted: the next stage heard nothing of it, so
    the sender hands it on over Ray instead (``take_failed_sends``)."""

    req_id: str
    token: int
    start: int
    activations: Any  # engine.model.StageActivations, copied out of the staging slot


@dataclass(slots=True)
class _Inbox:
    slots: list[int]
    token: int
    landed: set[int] = field(default_factory=set)  # chunk indices whose write landed (notified)


@dataclass(slots=True)
class _QuarantinedSlot:
    """An inbox slot of a closed inbox whose chunk never landed: the previous stage's write may
    still be in flight and would land in whatever the slot holds next."""

    slot: int
    req_id: str
    token: int
    index: int
    closed_at: float  # time.monotonic(); reused anyway QUARANTINE_S after


class ActivationChannel:
    def __init__(
        self,
        name: str,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        slot_tokens: int,
        num_inbox_slots: int = 16,
        num_staging_slots: int = 8,
        on_arrival: Callable[[], None] = lambda: None,
    ) -> None:
        try:
            api = nixl_api.load()
        except ImportError as exc:
            raise BackendUnavailableError(f"nixl is not importable here: {exc}") from exc
        self.name = name
        self.slot_tokens = slot_tokens
        self._on_arrival = on_arrival
        self._inbox = torch.zeros(num_inbox_slots, 2, slot_tokens, hidden_size, dtype=dtype, device=device)
        self._staging = torch.zeros(num_staging_slots, 2, slot_tokens, hidden_size, dtype=dtype, device=device)
        self._row_bytes = hidden_size * self._inbox.element_size()
        self._mem_type = "VRAM" if self._inbox.is_cuda else "DRAM"
        self._device_id = self._inbox.device.index or 0
        self._agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"]))
        if "UCX" not in self._agent.backends:
            raise BackendUnavailableError("nixl: the UCX backend could not be created")
        self._registrations = [self._agent.register_memory(self._inbox), self._agent.register_memory(self._staging)]
        self._lock = threading.Lock()
        # Reused oldest-freed first; a closed inbox's slots still awaiting a write wait apart.
        self._free_inbox: deque[int] = deque(range(num_inbox_slots))
        self._quarantined: list[_QuarantinedSlot] = []
        self._free_staging = list(range(num_staging_slots))
        self._inboxes: dict[str, _Inbox] = {}
        self._sends: list[_Send] = []
        self._failed_sends: list[_Send] = []  # their staging slots stay taken until taken over
        self._peers: set[str] = set()
        self._arrivals: list[ArrivedChunk] = []
        self._work = threading.Event()
        self._expecting = False
        self._stopping = threading.Event()
        self._poller = threading.Thread(target=self._poll, name=f"activations-{name}", daemon=True)
        self._poller.start()

    # -- receiving -------------------------------------------------------------------------

    def open_inbox(self, req_id: str, token: int, num_chunks: int) -> ActivationSlots | None:
        """Slots for the ``num_chunks`` chunks request ``req_id`` (attempt ``token``) will receive,
        or None if that many are not free (its activations then go over Ray)."""
        with self._lock:
            self._close(req_id)
            now = time.monotonic()
            self._end_quarantine(lambda q: now - q.closed_at >= QUARANTINE_S)
            if num_chunks > len(self._free_inbox) or num_chunks < 1:
                return None
            slots = [self._free_inbox.popleft() for _ in range(num_chunks)]
            self._inboxes[req_id] = _Inbox(slots, token)
        self._work.set()
        base, stride = self._inbox.data_ptr(), self._inbox[0].numel() * self._inbox.element_size()
        with self._lock:
            metadata = self._agent.get_agent_metadata()
        return ActivationSlots(self.name, metadata, [base + s * stride for s in slots], self.slot_tokens, self._row_bytes, self._device_id, self._mem_type)

    def close_inbox(self, req_id: str, finished: bool = False) -> None:
        """The request's prefill ended here. ``finished``: it ran to its end, so every chunk came
        and no write to its slots is in flight (the slots no write targeted, a spare one or a
        cached or Ray-sent chunk's, are free too). Otherwise (cancelled, failed, restarted) a
        slot whose chunk did not land is quarantined until that write's notification comes, or
        QUARANTINE_S, so that a late write never lands in another request's chunk (reused at
        once, it did: the next stage computed on the wrong rows)."""
        with self._lock:
            self._close(req_id, finished)
        self._work.set()  # the poller watches for the quarantined slots' late notifications

    def _close(self, req_id: str, finished: bool = False) -> None:
        inbox = self._inboxes.pop(req_id, None)
        if inbox is None:
            return
        now = time.monotonic()
        for index, slot in enumerate(inbox.slots):
            if finished or index in inbox.landed:
                self._free_inbox.append(slot)
            else:
                self._quarantined.append(_QuarantinedSlot(slot, req_id, inbox.token, index, now))
        self._arrivals = [a for a in self._arrivals if a.req_id != req_id]

    def _end_quarantine(self, over: Callable[[_QuarantinedSlot], bool]) -> None:
        """Free the quarantined slots ``over`` says are safe again (under the lock)."""
        kept = []
        for entry in self._quarantined:
            if over(entry):
                self._free_inbox.append(entry.slot)
            else:
                kept.append(entry)
        self._quarantined = kept

    def expect(self) -> None:
        """The engine thread waits for a chunk, or for its writes to complete: look every
        millisecond again."""
        self._expecting = True
        self._work.set()

    def take_arrivals(self) -> list[ArrivedChunk]:
        with self._lock:
            arrivals, self._arrivals = self._arrivals, []
        return arrivals

    # -- sending ---------------------------------------------------------------------------

    def send(self, slots: ActivationSlots, index: int, req_id: str, token: int, start: int, activations: Any) -> bool:
        """Write chunk ``index`` of a request (tokens from ``start``) into the next stage's slot;
        False if it could not be posted (the caller sends it over Ray)."""
        hidden, residual = activations.hidden, activations.residual
        num_tokens = hidden.shape[0]
        if index >= len(slots.addresses) or num_tokens > slots.slot_tokens or hidden.shape[1] * hidden.element_size() != slots.row_bytes:
            return False
        staging = self._staging_slot()
        if staging is None:
            return False
        slot = self._staging[staging]
        slot[0, :num_tokens].copy_(hidden)
        if residual is not None:
            slot[1, :num_tokens].copy_(residual)
        if slot.is_cuda:
            torch.cuda.current_stream().synchronize()  # NIXL reads the staging slot once posted
        notif = json.dumps({"r": req_id, "t": token, "s": start, "n": num_tokens, "i": index, "res": residual is not None}).encode()
        length = num_tokens * slots.row_bytes
        target = slots.addresses[index]
        row_stride = slots.slot_tokens * slots.row_bytes
        local = np.array([[slot[0].data_ptr(), length, self._device_id], [slot[1].data_ptr(), length, self._device_id]], dtype=np.uint64)
        remote = np.array([[target, length, slots.device_id], [target + row_stride, length, slots.device_id]], dtype=np.uint64)
        with self._lock:  # the agent is not thread-safe: the poller uses it too
            try:
                if slots.agent_name not in self._peers:
                    self._agent.add_remote_agent(slots.metadata)
                    self._peers.add(slots.agent_name)
                handle = self._agent.initialize_xfer(
                    "WRITE", self._agent.get_xfer_descs(local, self._mem_type), self._agent.get_xfer_descs(remote, slots.mem_type),
                    slots.agent_name, notif,
                )
                if self._agent.transfer(handle) == "ERR":
                    handle.release()
                    raise RuntimeError("transfer returned ERR")
            except Exception as exc:
                logger.warning("activations for req %s to %s: posting a write failed (%s); sending over Ray", req_id, slots.agent_name, exc)
                self._free_staging.append(staging)
                return False
            self._sends.append(_Send(handle, staging, req_id, token, start, num_tokens, residual is not None))
        self._work.set()
        return True

    def _staging_slot(self) -> int | None:
        """A free staging slot, waiting a little for an earlier write to complete (a stage that
        computes chunks faster than a few writes complete would otherwise go over Ray)."""
        deadline = time.monotonic() + STAGING_WAIT_S
        while True:
            with self._lock:
                self._reap_sends()
                if self._free_staging:
                    return self._free_staging.pop()
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.0002)

    def num_sends_in_flight(self, req_id: str, token: int) -> int:
        """Writes of request ``req_id`` (attempt ``token``) not yet complete: posted, or failed and
        not yet taken over by ``take_failed_sends``. The poller wakes the engine thread
        (``on_arrival``) as writes complete."""
        with self._lock:
            return sum(1 for send in (*self._sends, *self._failed_sends) if send.req_id == req_id and send.token == token)

    def _reap_sends(self) -> bool:
        """Free the staging slots of writes that completed; keep those of writes that failed for
        ``take_failed_sends`` (under the lock). Returns whether one failed."""
        still, failed = [], False
        for send in self._sends:
            try:
                state = self._agent.check_xfer_state(send.handle)
            except Exception as exc:  # NIXL raises on a failed write (a peer gone): no "ERR" then
                state = f"ERR: {exc}"
            if state == "PROC":
                still.append(send)
                continue
            try:
                send.handle.release()
            except Exception:
                logger.warning("releasing an activation write of req %s failed", send.req_id, exc_info=True)
            if state == "DONE":
                self._free_staging.append(send.staging)
            else:
                logger.warning("the activations of req %s from token %d, written from %s, failed (%s); they go over Ray",
                               send.req_id, send.start, self.name, state)
                self._failed_sends.append(send)
                failed = True
        self._sends = still
        return failed

    def take_failed_sends(self) -> list[FailedSend]:
        """The chunks whose writes failed since the last call, copied out of their staging
        slots (free again): the caller hands them on over Ray."""
        from engine.model import StageActivations

        with self._lock:
            failed, self._failed_sends = self._failed_sends, []
            out = []
            for send in failed:
                slot = self._staging[send.staging]
                residual = slot[1, : send.num_tokens].clone() if send.has_residual else None
                out.append(FailedSend(send.req_id, send.token, send.start, StageActivations(slot[0, : send.num_tokens].clone(), residual)))
                self._free_staging.append(send.staging)
        return out

    # -- the poller ------------------------------------------------------------------------

    def _poll(self) -> None:
        interval = FIRST_POLL_S
        while not self._stopping.is_set():
            self._work.clear()
            with self._lock:
                idle = not self._inboxes and not self._sends and not self._quarantined
            if idle:
                self._work.wait()
                interval = FIRST_POLL_S
                continue
            try:
                found = self._poll_once()
            except Exception:  # the poller must outlive one bad round: pipelined prompts wait on it
                logger.warning("activations poller of %s failed a round", self.name, exc_info=True)
                found = False
            if found:
                self._expecting = False
            # While the engine thread waits for a chunk, as the KV pump does; else slowly.
            interval = FIRST_POLL_S if found else min(2 * interval, EXPECTING_POLL_S if self._expecting else LAST_POLL_S)
            if self._work.wait(interval) and self._expecting:
                interval = FIRST_POLL_S

    def _poll_once(self) -> bool:
        arrived = []
        with self._lock:
            try:
                notifs = self._agent.get_new_notifs()
            except Exception:
                logger.warning("activations poller of %s failed", self.name, exc_info=True)
                return False
            posted = len(self._sends)
            failed = self._reap_sends()
            completed = len(self._sends) < posted
            if completed:
                # (A stage waiting for its writes expects again if some are left: an actor that
                # only ever sends stayed at the quick pace once it had waited.)
                self._expecting = False
            # Quarantines past their time end here too: only the next inbox opened ended them, and
            # until then an idle actor's poller went on looking every 16 ms.
            now = time.monotonic()
            self._end_quarantine(lambda q: now - q.closed_at >= QUARANTINE_S)
            for messages in notifs.values():
                for message in messages:
                    meta = json.loads(bytes(message))
                    inbox = self._inboxes.get(meta["r"])
                    if inbox is None or inbox.token != meta["t"] or meta["i"] >= len(inbox.slots):
                        # An attempt that ended here: the write it notifies is over, so its slot
                        # (quarantined) may be reused.
                        self._end_quarantine(lambda q: (q.req_id, q.token, q.index) == (meta["r"], meta["t"], meta["i"]))
                        continue
                    inbox.landed.add(meta["i"])
                    arrived.append(ArrivedChunk(meta["r"], meta["t"], meta["s"], meta["n"], meta["res"], self._inbox[inbox.slots[meta["i"]]]))
            self._arrivals.extend(arrived)
        if arrived or failed or completed:
            self._on_arrival()  # wakes the engine thread: to compute a chunk, resend one, or answer a stage
        return bool(arrived)

    def close(self) -> None:
        self._stopping.set()
        self._work.set()
        self._poller.join(2.0)
        try:
            with self._lock:
                for send in self._sends:
                    send.handle.release()
                self._sends = []
            for registration in self._registrations:
                self._agent.deregister_memory(registration)
        except Exception:
            logger.warning("closing the activation channel %s failed", self.name, exc_info=True)
