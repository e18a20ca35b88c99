"""The decode actor's scheduling policy: admit sequences whose KV another worker wrote.

A disaggregated request's life here: ``reserve`` allocates blocks for its prompt (plus one
token of headroom) and parks it in WAITING_FOR_REMOTE_KV, outside the batch. A prefill
actor writes the prompt's KV into those blocks chunk by chunk. When the last block has
landed and the first sampled token is known, ``admit_remote`` marks the prompt computed,
appends that token and puts the sequence in the running batch, where it decodes like any
other. Locally prefilled requests (conditional disaggregation, aggregated mode) go through
the ordinary waiting queue. A preempted remote sequence is recomputed locally: the decode
actor has all its tokens.
"""

from __future__ import annotations

from engine.errors import UnknownRequestError
from engine.scheduler import Scheduler
from engine.sequence import FinishReason, Sequence, SequenceStatus, TokenLogprob


# Share of the cache a new reservation may not take while sequences run: their next decode
# tokens need room, and a reservation that took it would force preemptions (recompute).
WATERMARK_FRACTION = 0.02


class DecodeScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.awaiting_kv: dict[str, Sequence] = {}
        self.watermark_blocks = max(1, int(self.allocator.num_blocks * WATERMARK_FRACTION))

    def blocks_to_reserve(self, seq: Sequence) -> int:
        """Blocks a reservation takes: the prompt's KV and the first decode token."""
        return -(-(seq.num_prompt_tokens + 1) // self.block_size)

    def num_reservable_blocks(self) -> int:
        """Free blocks a new reservation may take now (all of them when nothing runs)."""
        if not self.running and not self.waiting:
            return self.allocator.num_free
        return max(0, self.allocator.num_free - self.watermark_blocks)

    def reserve(self, seq: Sequence) -> list[int] | None:
        """Blocks for the prompt's KV (and the first decode token), or None if they are not free."""
        num_blocks = self.blocks_to_reserve(seq)
        if num_blocks > self.num_reservable_blocks():
            return None
        seq.arrival_order = next(self._arrivals)
        seq.block_table = self.allocator.allocate(num_blocks)
        seq.status = SequenceStatus.WAITING_FOR_REMOTE_KV
        self.requests[seq.req_id] = seq
        self.awaiting_kv[seq.req_id] = seq
        return seq.block_table[: -(-seq.num_prompt_tokens // self.block_size)]

    def admit_remote(self, req_id: str, first_token: int, logprob: TokenLogprob | None = None) -> Sequence:
        """Every block landed: the sequence joins the running batch with its first token."""
        seq = self.awaiting_kv.pop(req_id, None)
        if seq is None:
            raise UnknownRequestError(req_id)
        seq.num_computed_tokens = seq.num_prompt_tokens
        self._record_full_block_hashes(seq)
        seq.token_ids.append(first_token)
        if logprob is not None:
            seq.output_logprobs.append(logprob)
        reason = self.stop_reason(seq, first_token)
        if reason is not None:
            self._finish(seq, reason)
        else:
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return seq

    def detach(self, req_id: str) -> list[int]:
        """Drop a reservation whose KV may still be arriving; return its blocks unfreed.

        The caller frees them once no write into them can still land.
        """
        seq = self.awaiting_kv.pop(req_id, None)
        if seq is None:
            raise UnknownRequestError(req_id)
        block_ids, seq.block_table = seq.block_table, []
        self._finish(seq, FinishReason.ABORT)
        return block_ids

    def abort(self, req_id: str, reason: FinishReason = FinishReason.ABORT) -> Sequence:
        seq = self.awaiting_kv.pop(req_id, None)
        if seq is not None:
            self._finish(seq, reason)
            return seq
        return super().abort(req_id, reason)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
