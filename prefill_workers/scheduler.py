"""The prefill actor's scheduling policy: prompts only, blocks held until pushed.

A request's life here: it waits in the engine's priority queue, is prefilled in chunks
under the shared token budget (split-fuse with other prompts), and when its last chunk
has run the engine samples its first token. The sequence then leaves the running batch
but keeps its blocks: the worker is still pushing them to the decode actor. ``release``
frees them once every write has completed (or the request was aborted and no write is
in flight any more).
"""

from __future__ import annotations

from engine.errors import UnknownRequestError
from engine.scheduler import Scheduler
from engine.sequence import FinishReason, Sequence, SequenceStatus


class PrefillScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.held: dict[str, Sequence] = {}

    def _try_grow_blocks(self, seq: Sequence, num_tokens: int) -> bool:
        # The whole prompt's blocks are taken at admission, so a running prompt never needs
        # more and is never preempted: preemption would free blocks a write may still read.
        needed = -(-seq.num_tokens // self.block_size) - len(seq.block_table)  # beyond a cached prefix
        if needed <= 0:
            return True
        if not self.allocator.can_allocate(needed):
            return False
        seq.block_table.extend(self.allocator.allocate(needed))
        return True

    def _after_token(self, seq: Sequence, token_id: int) -> None:
        self.running.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = self.stop_reason(seq, token_id)
        self.held[seq.req_id] = seq

    def release(self, req_id: str) -> None:
        """Free a prefilled sequence's blocks: nothing reads them any more."""
        seq = self.held.pop(req_id, None)
        if seq is None:
            raise UnknownRequestError(req_id)
        self.allocator.free(seq.block_table)
        seq.block_table = []
        self.requests.pop(req_id, None)

    def abort(self, req_id: str, reason: FinishReason = FinishReason.ABORT) -> Sequence:
        if req_id in self.held:
            seq = self.held[req_id]
            self.release(req_id)
            return seq
        return super().abort(req_id, reason)
