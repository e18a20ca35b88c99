"""Overlapped steps (``EngineConfig.async_scheduling``): the host prepares the next step while the
device computes this one.

Run one at a time, a step is: schedule, build the inputs and attention metadata, launch the
forward, wait for the sampled tokens, append them and check the stops, then the next step. On a
GPU the device idles through everything but the forward: a decode step's host work (about 0.5 ms
for 64 rows on a server core, ``tools/bench_host_step.py``) is a large part of a step that reads
a 1.5B model's weights in about 1 ms.

Overlapped, step N samples on the device (argmax, or FlashInfer's kernel) and its tokens are
copied to pinned host memory behind an event; the engine schedules step N+1 at once, its decode
rows reading their input tokens from N's samples on the device, launches it, and only then reads
N's tokens and updates the sequences, while the device computes N+1. A sequence has one or two
*pending* tokens meanwhile (``Sequence.num_pending_tokens``): sampled, not yet read.

What the overlap changes, and what keeps it exact:

- A sequence whose token N stops it (EOS, a stop token) was already scheduled in N+1: that row is
  computed and dropped; its blocks are freed once N+1 is done (N+1 still writes them). Stops by
  length are known ahead and never cost a row.
- Scheduling never preempts a sequence the step in flight computes (``DrainFirst``): the engine
  reads that step first, then schedules again.
- Anything else that touches sequences between steps (aborts, pipeline stages) reads the step in
  flight first; its outputs are returned by the next ``step()``.
- Penalties count each sequence's newest token from the step in flight's samples, on the
  device (engine.penalties), and min_tokens counts it too; logit_bias and allowed_token_ids
  apply there as well; logprobs are computed on the device with the tokens and travel with them.
- Sampled rows draw on the device (engine.sampler ``_draw_on_device``), a seeded one keyed by
  its seed and its token's position counted with the unread token, so it draws what a classic
  step draws there. A step with a row whose sampling needs the host between steps (a grammar's
  mask, bad words, speculative drafts) or an engine over several ranks runs the classic way,
  after the step in flight has been read.

Greedy tokens are the same as without overlap, token for token (the tests compare them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.host_to_device import to_host
from engine.model_runner import PendingSamples
from engine.sampler import LogprobTensors
from engine.scheduler import ScheduledBatch
from engine.sequence import TokenLogprob


@dataclass(slots=True)
class InFlightStep:
    """A launched step whose sampled tokens the host has not read yet."""

    batch: ScheduledBatch
    done: list[int]  # per slice, the position its KV reaches (Scheduler.launched)
    samples: PendingSamples  # its tokens on the device, by sequence
    host_tokens: torch.Tensor  # their copy in host memory (pinned on CUDA), valid once ``ready``
    host_logprobs: LogprobTensors | None  # what the rows that ask report, likewise
    ready: torch.cuda.Event | None  # recorded behind the copies (None: they are already done)

    @classmethod
    def launch(cls, batch: ScheduledBatch, done: list[int], token_ids: torch.Tensor, logprobs: LogprobTensors | None, sampled_seqs: list) -> "InFlightStep":
        """Start copying ``token_ids`` (one per sampled sequence, in order) and ``logprobs`` to the host."""
        host_tokens = to_host(token_ids)
        logprobs = logprobs.to_host() if logprobs is not None else None
        ready = None
        if token_ids.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        samples = PendingSamples(token_ids, {id(seq): row for row, seq in enumerate(sampled_seqs)})
        return cls(batch, done, samples, host_tokens, logprobs, ready)

    def read(self) -> list[tuple[int, TokenLogprob | None]]:
        """Each sampled sequence's token and what it reports (waits for the step to be done)."""
        if self.ready is not None:
            self.ready.synchronize()
        tokens = self.host_tokens.tolist()
        return list(zip(tokens, LogprobTensors.by_row(self.host_logprobs, tokens)))

    @property
    def sequence_ids(self) -> set[int]:
        return {id(piece.seq) for piece in self.batch.slices}
