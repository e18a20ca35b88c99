"""The prefill actor's scheduling policy: prompts only, blocks held until pushed.

A request's life here: it waits in the engine's priority queue, is prefilled in chunks
under the shared token budget (split-fuse with other prompts), and when its last chunk
has run the engine samples its first token. The sequence then leaves the running batch
but keeps its blocks: the worker is still pushing them to the decode actor. ``release``
frees them once every write has completed (or the request was aborted and no write is
in flight any more).

A pipeline stage's prompt (``add_stage``) never enters the queues: the worker runs its chunks
itself (``LLMEngine.run_stage``) as the previous stage's activations arrive. It takes all its
blocks at once, its prefix-cache entries are salted with the stage's layers (a block holding
some layers must never serve a prompt that needs them all), ``start_stage_at`` gives back any
cached prefix beyond where the whole pipeline starts, and once its last chunk ran it is held
like any prefilled prompt until its writes are done.
"""

from __future__ import annotations

from engine.block_allocator import OutOfBlocksError
from engine.errors import UnknownRequestError
from engine.scheduler import Scheduler
from engine.sequence import FinishReason, Sequence, SequenceStatus


class PrefillScheduler(Scheduler):
    # A prefilled sequence is held for its KV push the moment its first token is read.
    overlaps_steps = False
    # A prompt takes its blocks at admission and its finished blocks are pushed while later
    # chunks run: preempting it (for a waiting prompt that cannot get its blocks) freed blocks a
    # write was still reading, and the decode actor got another prompt's KV.
    holds_whole_prompts = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.held: dict[str, Sequence] = {}
        self.staged: dict[str, Sequence] = {}  # pipeline stages' prompts being computed

    def add_stage(self, seq: Sequence, salt: bytes) -> None:
        """Take a pipeline stage's prompt: its cached prefix of this stage's layers and blocks for
        the rest, at once (OutOfBlocksError if they are not free: nothing is kept then)."""
        seq.hash_salt = salt + seq.hash_salt  # the stage's layers, of its adapter's KV (engine.lora)
        self._take_cached_prefix(seq)
        needed = -(-seq.num_prompt_tokens // self.block_size) - len(seq.block_table)
        if not self.allocator.can_allocate(needed):
            self._return_cached_prefix(seq)
            raise OutOfBlocksError(f"req {seq.req_id}: a pipeline stage needs {needed} free KV blocks, {self.allocator.num_free} are")
        seq.block_table.extend(self.allocator.allocate(needed))
        seq.status = SequenceStatus.RUNNING
        seq.arrival_order = next(self._arrivals)
        self.requests[seq.req_id] = seq
        self.staged[seq.req_id] = seq

    def computing(self) -> list[Sequence]:
        return [*self.running, *self.staged.values()]  # stages run outside the queues

    def start_stage_at(self, seq: Sequence, num_tokens: int) -> None:
        """The pipeline computes from token ``num_tokens`` (a block boundary no later than what any
        stage holds cached): cached blocks beyond it are given back for fresh ones."""
        keep = num_tokens // self.block_size
        assert keep * self.block_size == num_tokens <= seq.num_computed_tokens, (num_tokens, seq.num_computed_tokens)
        extra = len(seq.block_hashes) - keep
        if extra > 0:
            given_back = seq.block_table[keep : keep + extra]
            # Checked before anything changes: a cached block another prompt shares does not come
            # free, and a failed allocation after the free left the table naming blocks it no
            # longer held (freed again at the abort that followed: another prompt's KV).
            coming_free = sum(self.allocator.ref_count(block) == 1 for block in given_back)
            if not self.allocator.can_allocate(extra - coming_free):
                raise OutOfBlocksError(f"req {seq.req_id}: a pipeline stage starting at token {num_tokens} needs {extra} fresh KV blocks")
            self.allocator.free(given_back)
            # A new list, not a slice assignment: a table changes in place only by growing.
            seq.block_table = [*seq.block_table[:keep], *self.allocator.allocate(extra), *seq.block_table[keep + extra :]]
            del seq.block_hashes[keep:]
        seq.num_computed_tokens = num_tokens
        self._count_prefix_hit(seq, num_tokens)

    def advance_stage(self, seq: Sequence, num_tokens: int) -> None:
        """A stage before the last computed ``num_tokens`` more of the prompt (its layers)."""
        seq.num_computed_tokens += num_tokens
        self._record_full_block_hashes(seq)
        if seq.num_computed_tokens >= seq.num_prompt_tokens:
            self._hold(seq)

    def _hold(self, seq: Sequence) -> None:
        self.staged.pop(seq.req_id, None)
        seq.status = SequenceStatus.FINISHED
        self.held[seq.req_id] = seq

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

    def _after_token(self, seq: Sequence, reason: FinishReason | None) -> None:
        if seq.req_id not in self.staged:
            self.running.remove(seq)
        seq.finish_reason = reason
        self._hold(seq)

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
        self.staged.pop(req_id, None)
        return super().abort(req_id, reason)
