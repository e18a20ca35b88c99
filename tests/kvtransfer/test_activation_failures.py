"""A pipeline stage's activation write that fails after it was posted is not lost: the chunk
comes back out of its staging slot and the prefill actor hands it on over Ray (before, it was
only logged, and the next stage waited for it for good, its leases renewed). NIXL's agent is
replaced by one that says how each write ended; the real one is covered by test_activations."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.model import StageActivations
from kvtransfer.activations import ActivationChannel
from kvtransfer.messages import ActivationSlots


class _Agent:
    """What ``ActivationChannel`` asks of a NIXL agent; each write ends as ``outcome`` says."""

    def __init__(self) -> None:
        self.outcome = "PROC"

    def add_remote_agent(self, metadata):
        pass

    def get_xfer_descs(self, descs, mem_type):
        return descs

    def initialize_xfer(self, op, local, remote, agent_name, notif):
        return SimpleNamespace(release=lambda: None)

    def transfer(self, handle):
        return "PROC"

    def check_xfer_state(self, handle):
        if isinstance(self.outcome, Exception):
            raise self.outcome  # as NIXL's bindings do for a write that failed (a peer gone)
        return self.outcome

    def get_new_notifs(self):
        return {}


def _channel(woken: threading.Event) -> ActivationChannel:
    channel = object.__new__(ActivationChannel)
    channel.name, channel.slot_tokens, channel._on_arrival = "stage-a", 8, woken.set
    channel._inbox = torch.zeros(2, 2, 8, 4)
    channel._staging = torch.zeros(2, 2, 8, 4)
    channel._row_bytes, channel._mem_type, channel._device_id = 16, "DRAM", 0
    channel._agent, channel._lock = _Agent(), threading.Lock()
    channel._free_inbox, channel._free_staging = [0, 1], [0, 1]
    channel._inboxes, channel._sends, channel._failed_sends, channel._peers, channel._arrivals = {}, [], [], set(), []
    channel._quarantined = []
    channel._work, channel._expecting = threading.Event(), False
    return channel


SLOTS = ActivationSlots("stage-b", b"md", [0x1000, 0x2000], 8, 16, 0, "DRAM")


@pytest.mark.parametrize("failure", ["ERR", RuntimeError("nixlRemoteDisconnectError")])
def test_a_write_that_fails_after_posting_gives_its_chunk_back_and_wakes_the_engine(failure):
    """A failed write reads "ERR", or NIXL raises as it is checked: either way its chunk goes over
    Ray (a raise used to end the poller thread, and every later pipelined prompt there waited)."""
    woken = threading.Event()
    channel = _channel(woken)
    sent = StageActivations(torch.randn(5, 4), torch.randn(5, 4))
    assert channel.send(SLOTS, 1, "req", 7, 16, sent)
    assert channel.take_failed_sends() == [] and channel._free_staging == [0]
    channel._agent.outcome = failure
    channel._poll_once()
    assert woken.is_set() and channel._free_staging == [0]  # the slot holds the chunk until it is taken back
    (failed,) = channel.take_failed_sends()
    assert (failed.req_id, failed.token, failed.start) == ("req", 7, 16)
    assert torch.equal(failed.activations.hidden, sent.hidden) and torch.equal(failed.activations.residual, sent.residual)
    assert sorted(channel._free_staging) == [0, 1] and channel.take_failed_sends() == []
    # A write that completes frees its slot and reports nothing.
    channel._agent.outcome = "PROC"
    assert channel.send(SLOTS, 0, "req", 7, 0, StageActivations(torch.randn(3, 4), None))
    channel._agent.outcome = "DONE"
    channel._poll_once()
    assert channel.take_failed_sends() == [] and sorted(channel._free_staging) == [0, 1]


def test_the_prefill_actor_hands_a_failed_chunk_on_over_ray():
    """A chunk whose write failed after it was posted goes over Ray, and its stage answers only
    once that call returned (the next stage has the chunk); a failed write of an attempt no
    longer held here (an older one, cancelled) is dropped: nobody waits for it, and no stage
    ends with a write in flight, so none that ended can have one fail after."""
    from kvtransfer.activations import FailedSend
    from kvtransfer.messages import KVDestination, PeerRef
    from prefill_workers.worker import PrefillWorker, _Job
    from workers.pipeline import PipelineStage

    calls, returned = [], Future()

    def stage_activations(chunk):
        calls.append(chunk)
        return SimpleNamespace(future=lambda: returned)

    next_stage = SimpleNamespace(stage_activations=SimpleNamespace(remote=stage_activations))
    destination = KVDestination("req", PeerRef("decode", "e1"), [1], time.time() + 30, token=7)
    stage = PipelineStage(0, 2, 0, 1, next_stage=next_stage)
    job = _Job(SimpleNamespace(req_id="req", destination=destination, stage=stage), SimpleNamespace(req_id="req"), Future(), 0.0, 0)
    activations = StageActivations(torch.randn(5, 4), torch.randn(5, 4))
    worker = object.__new__(PrefillWorker)
    worker._jobs, worker._num_stage_chunks_over_ray = {"req": job}, 0
    worker._thread = SimpleNamespace(wake=lambda: None)
    worker.scheduler = SimpleNamespace(staged={})  # no chunk of it left to compute
    worker.activations = SimpleNamespace(
        take_arrivals=lambda: [],
        take_failed_sends=lambda: [FailedSend("req", 7, 16, activations), FailedSend("req", 6, 0, activations),  # 6: an older attempt's
                                   FailedSend("done", 3, 32, activations)],  # a request that ended here
        num_sends_in_flight=lambda req_id, token: 0,
    )
    assert worker._run_stage_chunk() is False
    assert [(c.req_id, c.token, c.start, c.num_tokens) for c in calls] == [("req", 7, 16, 5)]
    assert np.array_equal(calls[0].activations().hidden.numpy(), activations.hidden.numpy()) and job.num_chunks_over_ray == 1
    assert worker._handed_on(job) is False, "its chunk's Ray call has not returned"
    returned.set_result(None)
    assert worker._handed_on(job) is True