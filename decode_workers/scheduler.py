"""The decode actor's admission policy for sequences whose KV another worker writes.

A disaggregated request's life here: ``reserve`` asks the engine's scheduler for its prompt's
blocks (plus one token of headroom; cached prefix blocks are reused) within what this policy
lets a new reservation take, and the sequence waits outside the batch in the engine's
WAITING_FOR_REMOTE_KV state. A prefill actor writes the prompt's KV into the blocks it was
given, chunk by chunk. When the last block has landed and the first sampled token is known,
the engine's ``admit_remote`` puts the sequence in the running batch, where it decodes like
any other. Locally prefilled requests (conditional disaggregation, aggregated mode) go
through the ordinary waiting queue. A preempted remote sequence is recomputed locally: the
decode actor has all its tokens.
"""

from __future__ import annotations

import time

from engine.scheduler import RemoteBlocks, Scheduler
from engine.sequence import Sequence

# Share of the cache a new reservation may not take while sequences run: their next decode
# tokens need room, and a reservation that took it would force preemptions (recompute).
WATERMARK_FRACTION = 0.02
# A local prompt waits this long for a seat beside remote admissions before they pause for it
# (a preempted sequence does not wait: it was running).
WAITING_PATIENCE_S = 2.0


class DecodeScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.watermark_blocks = max(1, int(self.allocator.num_blocks * WATERMARK_FRACTION))
        self.waiting_patience_s = WAITING_PATIENCE_S

    def num_reservable_blocks(self) -> int:
        """Free blocks a new reservation may take now (all of them when nothing runs).

        Nothing while a sequence waits here for a seat in the batch that must not wait longer
        (a preempted one, recomputed here; a local prompt past ``waiting_patience_s``), and
        none of the blocks such sequences need: admissions of remote sequences are not bounded
        by ``max_num_seqs``, and a steady stream of them kept the batch full, so that a
        preempted stream never resumed and a local prompt never started. (Local prompts that
        have just come hold nothing back: those keep arriving in conditional disaggregation.)"""
        if not self.running and not self.waiting:
            return self.allocator.num_free
        now = time.monotonic()
        overdue = [seq for seq in self.waiting if seq.num_preemptions or now - seq.arrival_time >= self.waiting_patience_s]
        if overdue and len(self.running) >= self.config.max_num_seqs:
            return 0
        overdue_blocks = sum(max(0, -(-(len(seq.token_ids) + 1) // self.block_size) - len(seq.block_table)) for seq in overdue)
        return max(0, self.allocator.num_free - self.watermark_blocks - overdue_blocks)

    def reserve(self, seq: Sequence) -> RemoteBlocks | None:
        """The blocks a peer writes the prompt's KV into, or None if there is no room now."""
        return self.reserve_remote(seq, self.num_reservable_blocks())
