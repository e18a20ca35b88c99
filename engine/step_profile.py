"""Per-step timings of an engine, for fitting a step-time model (``cluster/planning``).

Every step a worker runs is recorded with what determines its cost: the prefill tokens it
computed and their attention work (each token attends over the context before it), the
decode rows and the KV tokens they read, and how long the worker's turn took. A fixed-size
ring keeps the latest ``capacity`` steps, so recording costs a few hundred nanoseconds and
no memory growth on a worker that runs for weeks; a reader passes the index it has seen
(``since``) and gets only newer steps.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

STEP_FIELDS = (
    "num_prefill_tokens", "prefill_attention", "num_prefill_seqs", "num_decode_rows", "num_decode_kv_tokens", "duration_s",
    "ended_at",  # time.time() at the step's end: which steps of workers sharing a machine overlapped
)


@dataclass(slots=True)
class StepShape:
    """The work in one step, before it runs."""

    num_prefill_tokens: int = 0
    # Sum over prefill chunks of tokens x mean context they attend over (start + tokens / 2).
    prefill_attention: float = 0.0
    num_prefill_seqs: int = 0
    num_decode_rows: int = 0  # decode tokens, speculative rows included
    num_decode_kv_tokens: int = 0  # KV tokens those rows read, summed over rows


def shape_of(batch) -> StepShape:
    """What a ``ScheduledBatch`` will compute (call before running it: it reads computed counts)."""
    shape = StepShape()
    for piece in batch.slices:
        start = piece.seq.num_computed_tokens
        if piece.is_decode:
            rows = piece.num_tokens
            shape.num_decode_rows += rows
            # Row i (0-based) reads the context up to and including itself.
            shape.num_decode_kv_tokens += rows * (start + 1) + rows * (rows - 1) // 2
        else:
            shape.num_prefill_tokens += piece.num_tokens
            shape.prefill_attention += piece.num_tokens * (start + piece.num_tokens / 2)
            shape.num_prefill_seqs += 1
    return shape


@dataclass(slots=True)
class TransferRecord:
    """One KV write a prefill worker pushed: its size and how long until it completed."""

    num_bytes: int
    num_descriptors: int
    duration_s: float


class StepLog:
    """The latest steps of one worker (and, on a prefill worker, its KV writes)."""

    def __init__(self, capacity: int = 50_000) -> None:
        self._steps: deque[tuple] = deque(maxlen=capacity)
        self._transfers: deque[TransferRecord] = deque(maxlen=capacity)
        self.num_steps = 0  # ever recorded; the index of the next step
        self.num_transfers = 0
        # The engine thread records while a worker's event loop reads: a read between a record's
        # append and its count returned that step twice (and misplaced the first held index).
        self._lock = threading.Lock()

    def record(self, shape: StepShape, duration_s: float) -> None:
        with self._lock:
            self._steps.append((
                shape.num_prefill_tokens, shape.prefill_attention, shape.num_prefill_seqs,
                shape.num_decode_rows, shape.num_decode_kv_tokens, duration_s, time.time(),
            ))
            self.num_steps += 1

    def record_transfer(self, record: TransferRecord) -> None:
        with self._lock:
            self._transfers.append(record)
            self.num_transfers += 1

    def steps_since(self, since: int = 0) -> list[tuple]:
        """Steps with index >= ``since`` still held, as tuples in ``STEP_FIELDS`` order."""
        return self.read(since, 0)[1]

    def transfers_since(self, since: int = 0) -> list[TransferRecord]:
        return self.read(0, since)[3]

    def read(self, since_step: int, since_transfer: int) -> tuple[int, list[tuple], int, list[TransferRecord]]:
        """At one moment: the next step's index, the steps from ``since_step`` on, the next
        transfer's index and the transfers from ``since_transfer`` on."""
        with self._lock:
            steps = list(self._steps)[max(0, since_step - (self.num_steps - len(self._steps))):]
            transfers = list(self._transfers)[max(0, since_transfer - (self.num_transfers - len(self._transfers))):]
            return self.num_steps, steps, self.num_transfers, transfers
