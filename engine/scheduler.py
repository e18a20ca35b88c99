"""Token-budget scheduling with split-fuse prefill, continuous batching and preemption.

A request's life here: ``add`` puts it in the waiting queue (higher priority first, then
arrival). Each ``schedule`` call first gives every running sequence that is decoding its
one token, preempting the least important running sequences (by recompute: their blocks
are freed and they return to the waiting queue) when the cache cannot hold the new
tokens. The rest of the token budget goes to prefill work in priority order: chunks of
partially prefilled prompts and new prompts from the waiting queue, each capped at
``long_prefill_chunk`` so one long prompt cannot hold the step. After the model ran,
``update`` advances each sequence, appends sampled tokens, decides who finished and frees
their blocks. ``abort`` frees a request's blocks at once.

Sequences whose prompt KV another engine computes (disaggregation) have a state of their
own, WAITING_FOR_REMOTE_KV, and a small protocol the decode actor plugs into:
``reserve_remote`` takes their blocks (reusing cached prefix blocks) outside the batch,
``admit_remote`` puts them in the batch once their KV landed, ``detach_remote`` ends one
whose blocks a write may still target (they stay allocated, owned by no sequence) and
``release_detached`` frees those once no write can land. Every block of the engine is
allocated and freed here, through its ``BlockAllocator``.

The prefill and decode actors reuse this class with different admission rules by
overriding ``_prefill_candidates`` and ``_after_token``.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
import time
from collections.abc import Collection
from dataclasses import dataclass, field

from engine.block_allocator import BlockAllocator, chained_block_hashes, prefix_lookup_hashes
from engine.chunk_sizer import AdaptiveChunkSizer
from engine.config import EngineConfig
from engine.errors import UnknownRequestError
from engine.sequence import FinishReason, Sequence, SequenceStatus, TokenLogprob
from engine.speculation import DraftWindow, Proposer
from engine.step_profile import shape_of

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledSlice:
    """``num_tokens`` of ``seq`` (from its ``num_computed_tokens``) are computed this step.

    What the slice is (its own tokens, whether it completes the sequence, whether it is a decode
    row) is fixed when it is made, from the sequence as it stands before the step: every reader
    (the runner, the sampler, the update after the step) asks about the step, not about the
    sequence it has since become, and a step reads them a dozen times per slice (as properties
    they were a fifth of a 256-row decode step's host work)."""

    seq: Sequence
    num_tokens: int  # drafts included
    # Speculative tokens computed after the sequence's last one (engine.speculation); each
    # row is verified by the sampler.
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: list | None = None  # per draft, the proposer's distribution (None: proposed with certainty)
    num_own_tokens: int = field(init=False)  # the sequence's own tokens in the slice (drafts excluded)
    completes_sequence: bool = field(init=False)  # its last token is the sequence's newest: the step samples after it
    # One token past the prompt (and its drafts): the decode kernel's. A one-token piece of a
    # prompt is a prefill chunk like any other, so a prompt's bits never depend on where it was cut.
    is_decode: bool = field(init=False)

    def __post_init__(self) -> None:
        seq = self.seq
        self.num_own_tokens = self.num_tokens - len(self.draft_token_ids)
        self.completes_sequence = seq.num_computed_tokens + self.num_own_tokens == seq.num_tokens
        self.is_decode = self.num_own_tokens == 1 and seq.is_decoding

    def add_drafts(self, token_ids: list[int], probs: list | None) -> None:
        """Speculative tokens to verify after the slice's own."""
        self.draft_token_ids = token_ids
        self.draft_probs = probs
        self.num_tokens = self.num_own_tokens + len(token_ids)

    @property
    def num_sampled_rows(self) -> int:
        """Rows of logits this slice yields: its last token's and one per draft (0: mid-prompt)."""
        return 1 + len(self.draft_token_ids) if self.completes_sequence else 0


@dataclass(slots=True)
class RemoteBlocks:
    """What a remote-KV reservation asks a peer to write: ``block_ids`` stand for the prompt's
    blocks from index ``num_cached_blocks`` on; the ones before it are here already (cached)."""

    block_ids: list[int]
    num_cached_blocks: int


@dataclass(slots=True)
class ScheduledBatch:
    slices: list[ScheduledSlice] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    # A prompt chunk of it is scored (SamplingParams.prompt_logprobs): the step runs at once,
    # not overlapped (engine.llm_engine). Set by the scheduler as it picks the chunks.
    scores_prompt: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.slices)


class DrainFirst(Exception):
    """Scheduling would preempt a sequence the step in flight computes (engine.overlap): read
    that step's tokens first, then schedule again."""


class Scheduler:
    """Owns the waiting queue, the running set and the block allocator of one engine."""

    overlaps_steps = True  # whether its engine may keep a step in flight between calls (engine.overlap)
    # Whether a running prompt holds every block it will need (a prefill actor's: they may be
    # read by a write in flight). Then it is never preempted, and never waits behind a waiting
    # prompt that cannot get its blocks (it needs none, and finishing it frees some).
    holds_whole_prompts = False

    def __init__(
        self, config: EngineConfig, allocator: BlockAllocator, max_model_len: int, eos_token_ids: list[int], proposer: Proposer | None = None
    ):
        self.config = config
        self.allocator = allocator
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: list[Sequence] = []  # kept sorted by queue_key
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self.num_preemptions = 0
        self.num_prefix_query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hit_tokens = 0  # of those, tokens whose KV the cache held
        self.awaiting_kv: dict[str, Sequence] = {}  # WAITING_FOR_REMOTE_KV, by request
        self.detached_blocks: set[int] = set()  # of ended requests, still a write's target
        self.proposer = proposer  # speculative drafts for decoding sequences (None: none)
        # Overlapped steps (engine.overlap): the sequences the step in flight computes (by id),
        # and the blocks of those that ended meanwhile, freed once that step is done.
        self.in_flight: set[int] = set()
        self._deferred_frees: list[list[int]] = []
        self.chunk_sizer: AdaptiveChunkSizer | None = None
        if config.target_step_ms is not None:
            self.chunk_sizer = AdaptiveChunkSizer(
                config.target_step_ms / 1000, config.block_size, min(config.max_num_batched_tokens, config.long_prefill_chunk or math.inf)
            )
        self.num_draft_tokens = 0  # proposed, since the start
        self.num_accepted_draft_tokens = 0
        # Prompt positions a step may score (SamplingParams.prompt_logprobs): each is a row of
        # float32 logits over the vocabulary and its log-softmax, beside the step's own (set by
        # the engine from the vocabulary; None: no limit).
        self.max_scored_rows: int | None = None

    # -- queue management -------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.arrival_order = next(self._arrivals)
        self.requests[seq.req_id] = seq
        self._push_waiting(seq)

    def abort(self, req_id: str, reason: FinishReason = FinishReason.ABORT) -> Sequence:
        """Remove a request wherever it is and free its blocks now (``reason``: ABORT, or ERROR);
        a remote reservation's blocks too (use ``detach_remote`` if a write may still land)."""
        seq = self.requests.get(req_id)
        if seq is None:
            raise UnknownRequestError(req_id)
        if seq.status is SequenceStatus.WAITING_FOR_REMOTE_KV:
            del self.awaiting_kv[req_id]
        elif seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._finish(seq, reason)
        return seq

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def computing(self) -> list[Sequence]:
        """The sequences being computed (the running batch; a prefill actor adds its pipeline stages)."""
        return self.running

    def _push_waiting(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        # By the order ``_fill`` sorts the queue in (aging included): a sequence preempted in a
        # step is placed among the prompts that step may still admit as it should stand.
        bisect.insort(self.waiting, seq, key=self._order_key())

    # -- one step ---------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        while True:
            self._fill(batch)
            if batch.slices or not self.running or self.holds_whole_prompts:
                break
            # Every running sequence waits for blocks that only another one holds.
            self._preempt(self.running[-1], batch)
        now = time.monotonic()
        for piece in batch.slices:
            if piece.seq.first_scheduled_time is None:
                piece.seq.first_scheduled_time = now
        # Decode slices first: the decode attention kernel batches them together.
        batch.slices.sort(key=lambda s: not s.is_decode)
        return batch

    def _order_key(self):
        """How queues are ordered this step: by priority, with aging when configured."""
        max_wait_s = self.config.priority_max_wait_s
        if max_wait_s is None:
            return Sequence.queue_key
        now = time.monotonic()
        return lambda seq: seq.aged_queue_key(now, max_wait_s)

    def _fill(self, batch: ScheduledBatch) -> None:
        budget = self.config.max_num_batched_tokens
        key = self._order_key()
        self.running.sort(key=key)
        self.waiting.sort(key=key)  # aging moves old ones forward; nearly sorted, so cheap
        decoding = [s for s in self.running if s.is_decoding and self._may_compute(s)]
        decoding = decoding[:budget]
        self._make_room_for(decoding, batch)
        for seq in decoding:
            if seq.status is SequenceStatus.RUNNING:
                if self._at_block_edge(seq):
                    self._grow_blocks(seq, 1)
                batch.slices.append(ScheduledSlice(seq, 1))
                budget -= 1
        if self.proposer is not None:
            budget -= self._add_drafts(batch.slices, budget)
        candidates = self._prefill_candidates(batch, key)
        chunk_cap = self.config.long_prefill_chunk
        if self.chunk_sizer is not None and batch.slices and candidates:
            allowed = self._adaptive_prefill_tokens(batch, candidates[0])
            if allowed is not None:
                budget = min(budget, allowed)
                if len(candidates) > 1:
                    # Split-fuse within the allowance: a long prompt takes at most half of it,
                    # so the prompts queued behind it still move every step.
                    half = max(self.block_size, allowed // 2)
                    chunk_cap = half if chunk_cap is None else min(chunk_cap, half)
        scored_room = self.max_scored_rows
        admitting = True  # no waiting prompt was blocked yet
        for seq in candidates:
            if budget <= 0:
                break
            if seq.status is SequenceStatus.WAITING:
                if not admitting:
                    continue  # strict priority among waiting prompts
                self._take_cached_prefix(seq)
                if self._waits_for_a_twin(seq, batch):
                    self._return_cached_prefix(seq)
                    continue
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            if chunk_cap is not None:
                num_tokens = min(num_tokens, chunk_cap)
            scored = seq.needs_prompt_logprobs and scored_room is not None
            if scored:
                if scored_room <= 0:
                    break  # its chunk waits for the next step (strict priority, as below)
                num_tokens = min(num_tokens, scored_room)
            if not self._try_grow_blocks(seq, num_tokens):
                if seq.status is SequenceStatus.WAITING:
                    self._return_cached_prefix(seq)  # cached again, for it or anyone, next step
                    if self.holds_whole_prompts:
                        admitting = False
                        continue  # the running prompts behind it need no blocks
                break  # strict priority: a less important prompt never jumps a blocked one
            if scored:
                scored_room -= num_tokens  # only once it runs: a blocked prompt takes no scoring room
            if seq.status is SequenceStatus.WAITING:
                self._admit(seq)
            batch.slices.append(ScheduledSlice(seq, num_tokens))
            batch.scores_prompt = batch.scores_prompt or seq.needs_prompt_logprobs
            budget -= num_tokens

    def _waits_for_a_twin(self, seq: Sequence, batch: ScheduledBatch) -> bool:
        """Whether a prompt with the same prefix is computing the next block this waiting one
        would, this step or in the step still in flight (identical prompts arriving together:
        n > 1 choices, a burst of one system prompt): it waits and takes that block from the
        cache once hashed. Admitted together, each computed the whole prompt and held its own
        copy (vLLM shares them). A twin not computing now (of lower priority, the budget spent
        before it) is not waited for."""
        if not self.allocator.enable_prefix_caching or seq.needs_prompt_logprobs:
            return False
        end = (seq.num_computed_tokens // self.block_size + 1) * self.block_size  # its next block's end
        if end > seq.num_tokens - 1:
            return False  # no full block a cache hit may cover is left to compute
        prefix = seq.token_ids[:end]
        scheduled = {id(piece.seq) for piece in batch.slices}

        def computing(twin: Sequence) -> bool:
            if len(twin.block_hashes) * self.block_size >= end:
                return False  # hashed already (found in the cache, or about to be)
            if end <= twin.num_computed_tokens:  # computed in the step in flight (overlapped steps): hashed as it resolves
                return id(twin) in self.in_flight
            return id(twin) in scheduled and end <= twin.num_prompt_tokens - 1

        return any(
            twin.hash_salt == seq.hash_salt and computing(twin) and twin.token_ids[:end] == prefix for twin in self.running
        )

    def _adaptive_prefill_tokens(self, batch: ScheduledBatch, first: Sequence) -> int | None:
        """Prompt tokens this step may carry beside its decode rows (engine.chunk_sizer)."""
        decode = shape_of(batch)  # so far the batch holds its decode rows only
        start = first.num_computed_tokens if first.status is not SequenceStatus.WAITING else 0
        return self.chunk_sizer.prefill_tokens(decode.num_decode_rows, decode.num_decode_kv_tokens, start)

    def _add_drafts(self, decodes: list[ScheduledSlice], budget: int) -> int:
        """Give decode slices the proposer's drafts, within ``budget`` tokens and the free blocks
        (after every decode got its own token: a draft never preempts); return tokens taken."""
        spec = self.config.speculative
        pieces, rooms = [], []
        reserved = 0
        for piece in decodes:
            seq = piece.seq
            limit = spec.num_speculative_tokens
            if spec.adaptive:
                if seq.draft_window is None:
                    seq.draft_window = DraftWindow(limit)
                limit = seq.draft_window.room()
            # Never past what the request may emit: the drafts and the target's token after them.
            room = min(limit, budget - reserved, seq.params.max_tokens - seq.num_output_tokens - 1,
                       self.max_model_len - seq.num_tokens - 1)
            if seq.grammar is not None and (seq.params.allowed_token_ids is not None or seq.params.bad_words_token_ids):
                # The grammar's state after a draft is never checked against these (only the
                # step's own is, naming the field): a draft row they left nothing drew from -inf
                # and ended the answer outside its grammar as a normal stop.
                room = 0
            if self.proposer.max_positions is not None:
                # A draft reads the sequence up to its last token, then its guesses but the last.
                room = min(room, self.proposer.max_positions - seq.num_tokens + 1)
            # Blocks first: a draft model writes its own KV for its guesses into them.
            if room > 0 and self._try_grow_blocks(seq, 1 + room):
                pieces.append(piece)
                rooms.append(room)
                reserved += room
        if not pieces:
            return 0
        try:
            proposals = self.proposer.propose([p.seq for p in pieces], rooms)
        except Exception:
            # Drafts are an optimization: the step goes on without them, and so does every request.
            logger.exception("the %s proposer failed; this step decodes without drafts", type(self.proposer).__name__)
            return 0
        taken = 0
        for piece, proposal in zip(pieces, proposals):
            if proposal.token_ids:
                piece.add_drafts(proposal.token_ids, proposal.probs)
                taken += len(proposal.token_ids)
        return taken

    def _prefill_candidates(self, batch: ScheduledBatch, key) -> list[Sequence]:
        """Running prompts still prefilling and waiting prompts, most important first."""
        scheduled = {id(s.seq) for s in batch.slices}
        partial = [s for s in self.running if id(s) not in scheduled and s.num_uncomputed_tokens > 0 and self._may_compute(s)]
        room = max(self.config.max_num_seqs - len(self.running), 0)
        return sorted(partial + self.waiting[:room], key=key)

    # -- KV computed elsewhere ----------------------------------------------------------

    def blocks_for_remote(self, seq: Sequence) -> int:
        """Blocks a remote reservation takes: the prompt's KV and the first decode token."""
        return -(-(seq.num_prompt_tokens + 1) // self.block_size)

    def reserve_remote(self, seq: Sequence, max_new_blocks: int) -> RemoteBlocks | None:
        """Blocks for a prompt whose KV a peer writes (and for its first decode token), taking no
        more than ``max_new_blocks`` free ones; None if that is too few.

        Leading blocks the prefix cache holds are taken from it: only the rest are written by
        the peer. The last prompt block is always written (``prefix_lookup_hashes`` stops before
        the last token), so the write that completes the prompt can carry the first token.
        """
        num_free = self.allocator.num_free
        self._take_cached_prefix(seq)
        num_cached = len(seq.block_table)
        num_new = self.blocks_for_remote(seq) - num_cached
        # Cached blocks nobody was using came out of the free pool too.
        if num_new + num_free - self.allocator.num_free > max_new_blocks or not self.allocator.can_allocate(num_new):
            self._return_cached_prefix(seq)
            return None
        self._count_prefix_hit(seq, num_cached * self.block_size)
        seq.arrival_order = next(self._arrivals)
        seq.block_table.extend(self.allocator.allocate(num_new))
        seq.num_computed_tokens = 0  # set to the whole prompt once its KV landed (admit_remote)
        seq.status = SequenceStatus.WAITING_FOR_REMOTE_KV
        self.requests[seq.req_id] = seq
        self.awaiting_kv[seq.req_id] = seq
        num_prompt_blocks = -(-seq.num_prompt_tokens // self.block_size)
        return RemoteBlocks(seq.block_table[num_cached:num_prompt_blocks], num_cached)

    def admit_remote(self, req_id: str, first_token: int, logprob: TokenLogprob | None = None) -> Sequence:
        """Every block landed: the sequence joins the running batch with its first token."""
        seq = self.awaiting_kv.pop(req_id, None)
        if seq is None:
            raise UnknownRequestError(req_id)
        seq.num_computed_tokens = seq.num_prompt_tokens
        self._record_full_block_hashes(seq)
        seq.append_token(first_token, logprob)
        reason = self.stop_reason(seq, first_token)
        if reason is not None:
            self._finish(seq, reason)
        else:
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return seq

    def detach_remote(self, req_id: str, still_targeted: Collection[int] = ()) -> None:
        """End a reservation whose KV may still be arriving. Its blocks in ``still_targeted``
        stay allocated until ``release_detached`` (a write may still land in them); the rest
        are freed now."""
        seq = self.awaiting_kv.pop(req_id, None)
        if seq is None:
            raise UnknownRequestError(req_id)
        kept = [b for b in seq.block_table if b in still_targeted]
        seq.block_table = [b for b in seq.block_table if b not in still_targeted]
        self._finish(seq, FinishReason.ABORT)
        self.detached_blocks.update(kept)

    def release_detached(self, block_ids: list[int]) -> None:
        """No write can land in these blocks of ended reservations any more: free them."""
        unknown = [b for b in block_ids if b not in self.detached_blocks]
        if unknown:
            raise ValueError(f"blocks {unknown[:8]} are not held for a write")
        self.detached_blocks.difference_update(block_ids)
        self.allocator.free(block_ids)

    # -- prefix cache ------------------------------------------------------------------

    def _take_cached_prefix(self, seq: Sequence) -> None:
        """Start a sequence with the longest prefix the cache holds, computed already."""
        if seq.block_table or not self.allocator.enable_prefix_caching or seq.needs_prompt_logprobs:
            return  # (a prompt whose log-probabilities are asked for needs logits at every position)
        hashes = prefix_lookup_hashes(seq.token_ids, self.block_size, seq.hash_salt)
        block_ids = self.allocator.take_cached(hashes)
        seq.block_table = block_ids
        seq.block_hashes = hashes[: len(block_ids)]
        seq.num_computed_tokens = len(block_ids) * self.block_size

    def _return_cached_prefix(self, seq: Sequence) -> None:
        if seq.block_table:
            self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def _count_prefix_hit(self, seq: Sequence, num_cached_tokens: int) -> None:
        """Prompt tokens asked of the cache and found there, once per sequence (as vLLM counts)."""
        if seq.num_cached_tokens is not None:
            return
        seq.num_cached_tokens = num_cached_tokens
        if self.allocator.enable_prefix_caching:
            self.num_prefix_query_tokens += seq.num_prompt_tokens
            self.num_prefix_hit_tokens += seq.num_cached_tokens

    def _admit(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        self._count_prefix_hit(seq, seq.num_computed_tokens)  # at admission: what the cache held
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _make_room_for(self, decoding: list[Sequence], batch: ScheduledBatch) -> None:
        """Preempt the least important running sequences until every decode fits."""
        while True:
            needed = sum(1 for s in decoding if self._at_block_edge(s) and s.status is SequenceStatus.RUNNING)
            if needed <= self.allocator.num_free or not self.running:
                return
            self._preempt(self.running[-1], batch)

    def _may_compute(self, seq: Sequence) -> bool:
        """False for a sequence whose pending tokens already end it by length (engine.overlap):
        it waits for them to be read and finish it, instead of computing a token past its end."""
        if not seq.num_pending_tokens:
            return True
        return seq.num_output_tokens + seq.num_pending_tokens < seq.params.max_tokens and seq.num_tokens < self.max_model_len

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        if id(seq) in self.in_flight:
            raise DrainFirst(seq.req_id)  # before changing anything: schedule() starts again after
        logger.info("req %s: preempted (recompute), %d blocks freed", seq.req_id, len(seq.block_table))
        self.running.remove(seq)
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        batch.preempted_req_ids.append(seq.req_id)
        self._push_waiting(seq)

    def _at_block_edge(self, seq: Sequence) -> bool:
        """Whether a decode row's token needs a new block (its blocks are full)."""
        return seq.num_computed_tokens >= len(seq.block_table) * self.block_size

    def _new_blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        total = -(-(seq.num_computed_tokens + num_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    def _try_grow_blocks(self, seq: Sequence, num_tokens: int) -> bool:
        needed = self._new_blocks_needed(seq, num_tokens)
        if not self.allocator.can_allocate(needed):
            return False
        seq.block_table.extend(self.allocator.allocate(needed))
        return True

    def _grow_blocks(self, seq: Sequence, num_tokens: int) -> None:
        grown = self._try_grow_blocks(seq, num_tokens)
        assert grown, "room was made before growing"

    # -- after the forward pass -------------------------------------------------------

    def update(
        self, batch: ScheduledBatch, samples: list[list[tuple[int, TokenLogprob | None]]]
    ) -> list[tuple[Sequence, list[int]]]:
        """Advance every scheduled sequence; return (seq, new tokens) for those that got any.

        ``samples`` has one list per slice that completes its sequence, in slice order: the
        tokens it emits (one, or with drafts, the accepted ones and the target's token after them)."""
        results: list[tuple[Sequence, list[int]]] = []
        sample_iter = iter(samples)
        now = time.monotonic()
        for piece in batch.slices:
            seq = piece.seq
            if not piece.completes_sequence:
                seq.num_computed_tokens += piece.num_tokens
                self._record_full_block_hashes(seq)
                continue
            results.append((seq, self._take_tokens(piece, next(sample_iter), now, kv_upto=None)))
        return results

    def launched(self, batch: ScheduledBatch) -> list[int]:
        """The batch is being computed, its tokens sampled on the device (engine.overlap): each
        sequence counts its slice as computed and a completing one gains a pending token. Returns
        per slice the position its KV reaches once the step is done."""
        done = []
        for piece in batch.slices:
            seq = piece.seq
            seq.num_computed_tokens += piece.num_tokens
            done.append(seq.num_computed_tokens)
            if piece.completes_sequence:
                seq.num_pending_tokens += 1
        return done

    def resolve(self, batch: ScheduledBatch, done: list[int], samples: list[tuple[int, TokenLogprob | None]]) -> list[tuple[Sequence, list[int]]]:
        """A launched batch's sampled tokens were read (one, with what it reports, per completing
        slice, in order): what ``update`` does for a step run at once. A sequence that ended
        meanwhile (a token of the step before stopped it) drops its token."""
        results: list[tuple[Sequence, list[int]]] = []
        tokens = iter(samples)
        now = time.monotonic()
        for piece, upto in zip(batch.slices, done):
            seq = piece.seq
            sample = next(tokens) if piece.completes_sequence else None
            if seq.is_finished:
                continue
            if sample is None:
                self._record_full_block_hashes(seq, upto)
                continue
            seq.num_pending_tokens -= 1
            results.append((seq, self._take_tokens(piece, [sample], now, kv_upto=upto)))
        return results

    def _take_tokens(self, piece: ScheduledSlice, samples: list[tuple[int, TokenLogprob | None]], now: float, kv_upto: int | None) -> list[int]:
        """Append a completing slice's sampled tokens (up to the first that ends the request) and
        advance its sequence; ``kv_upto``: the position its KV reaches (None: a step run at once,
        every token but the newest). Returns the tokens emitted."""
        seq = piece.seq
        if piece.is_decode:  # fixed before the new tokens changed what the sequence is
            seq.num_decode_steps += 1
        emitted, reason = self._emit(seq, samples)
        if piece.draft_token_ids:
            # Each sample before the last matched its draft (those past a token that ended the
            # request matched too, though they are not emitted: the acceptance counts them).
            accepted = len(samples) - 1
            seq.num_draft_tokens += len(piece.draft_token_ids)
            seq.num_accepted_draft_tokens += accepted
            self.num_draft_tokens += len(piece.draft_token_ids)
            self.num_accepted_draft_tokens += accepted
            self.proposer.after_verify(seq)
            if seq.draft_window is not None:
                seq.draft_window.update(len(piece.draft_token_ids), accepted)
        if kv_upto is None:  # the slice's own tokens and the accepted drafts' have their KV now
            seq.num_computed_tokens = kv_upto = len(seq.token_ids) - 1
        if kv_upto // self.block_size > len(seq.block_hashes):  # most steps fill no block
            self._record_full_block_hashes(seq, kv_upto)
        if seq.first_token_time is None:
            seq.first_token_time = now
        self._after_token(seq, reason)
        return emitted

    def release_deferred(self) -> None:
        """Free the blocks of sequences that ended while a step still wrote them (it is done)."""
        for blocks in self._deferred_frees:
            self.allocator.free(blocks)
        self._deferred_frees = []

    def _emit(self, seq: Sequence, samples: list[tuple[int, TokenLogprob | None]]) -> tuple[list[int], FinishReason | None]:
        """Append a slice's sampled tokens, up to the first that ends the request (and why it ends)."""
        emitted = []
        reason = None
        for token_id, logprob in samples:
            seq.append_token(token_id, logprob)
            emitted.append(token_id)
            reason = self.stop_reason(seq, token_id)
            if reason is not None:
                break
        return emitted, reason

    def _after_token(self, seq: Sequence, reason: FinishReason | None) -> None:
        """A sequence got its tokens; ``reason``: why its last one ends it (None: it goes on)."""
        if reason is not None:
            self.running.remove(seq)
            self._finish(seq, reason)

    def stop_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        """Why ``token_id``, just appended, ends ``seq`` (None: it goes on). Counts what the host
        has read: a token still pending behind it does not count."""
        length = len(seq.token_ids)
        if seq.grammar is not None and seq.grammar.done and (seq.thinking is None or seq.thinking.answering):
            return FinishReason.EOS  # the answer its grammar describes is complete: nothing may follow
        if seq.num_output_tokens < seq.params.min_tokens:
            return FinishReason.LENGTH if length >= self.max_model_len else None
        if token_id in seq.params.stop_token_ids:
            return FinishReason.STOP
        if not seq.params.ignore_eos and token_id in self.eos_token_ids:
            return FinishReason.EOS
        if seq.num_output_tokens >= seq.params.max_tokens or length >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _record_full_block_hashes(self, seq: Sequence, upto: int | None = None) -> None:
        """Hash the blocks full of computed KV (below position ``upto``; default all computed)."""
        num_full = min(seq.num_computed_tokens if upto is None else upto, len(seq.token_ids)) // self.block_size
        if num_full <= len(seq.block_hashes):
            return
        start = len(seq.block_hashes)
        parent = seq.block_hashes[-1] if seq.block_hashes else seq.hash_salt
        tokens = seq.token_ids[start * self.block_size : num_full * self.block_size]
        for offset, block_hash in enumerate(chained_block_hashes(tokens, self.block_size, parent)):
            seq.block_hashes.append(block_hash)
            self.allocator.set_hash(seq.block_table[start + offset], block_hash)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq.block_table:
            if id(seq) in self.in_flight:  # a step in flight still writes them
                self._deferred_frees.append(seq.block_table)
            else:
                self.allocator.free(seq.block_table)
            seq.block_table = []
        self.requests.pop(seq.req_id, None)
