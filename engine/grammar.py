"""Structured outputs inside an engine: each constrained sequence's grammar state, and the
token masks its sampled rows are drawn under.

A sequence with ``params.structured`` gets a ``SequenceGrammar`` when it is made
(``Grammars.for_sequence``); it has consumed every output token the sequence holds, including
those a request brings with it: the decode actor's copy starts from the first token the
prefill actor sampled (appended by ``admit_remote``), a stream resumed elsewhere replays the
tokens it already produced (the tail of its prompt, ``num_resumed_tokens``), and a preempted
sequence keeps its state, as it keeps its tokens. ``Sequence.append_token`` advances it.

Masks for a step are computed on a thread of their own while the forward runs
(``Grammars.start_masks``, called before the executor): a decode step knows every row's
state before its forward starts, and llguidance drops the GIL while it computes. A sequence
verifying speculative drafts gets one mask per row, each after the drafts before it (consumed,
then rolled back), so a draft the grammar forbids is rejected like any the target disagrees with.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from engine.errors import InvalidRequestError
from engine.structured_output import StructuredOutput

logger = logging.getLogger(__name__)


class SequenceGrammar:
    """One sequence's grammar matcher: what its next token may be.

    A reasoning model's answer may think first (``StructuredOutput.after_token_id``): while
    ``waiting_for`` is set every token is free and the matcher stays at its start, until the
    output produces that token. ``opener`` (``opened_by_token_id``), before the first token: the
    wait starts only if the output opens with that token; else the grammar applies from the first
    token on (whose mask also allows the opener)."""

    __slots__ = ("matcher", "failed", "waiting_for", "opener", "_closer")

    def __init__(self, matcher, waiting_for: int | None = None, opener: int | None = None) -> None:
        self.matcher = matcher
        self.failed = False
        self._closer = waiting_for
        self.opener = opener if waiting_for is not None else None
        self.waiting_for = waiting_for if self.opener is None else None

    def accept(self, token_id: int) -> None:
        if self.opener is not None:
            opened, self.opener = token_id == self.opener, None
            if opened:
                self.waiting_for = self._closer
                return
        if self.waiting_for is not None:
            if token_id == self.waiting_for:
                self.waiting_for = None  # the constraint applies from the next token on
            return
        if not self.failed and not self.matcher.consume_token(token_id):
            # Only a token drawn without this grammar's mask gets here (a bug, or a prompt
            # tail replayed that the grammar never produced): the sequence may only end now.
            self.failed = True
            logger.warning("a token the grammar forbids was appended: %s", self.matcher.get_error())

    def constrained_drafts(self, drafts: list[int]) -> list[int] | None:
        """For the row after ``drafts`` (a speculative row's, or none): the drafts the matcher
        reads before that row's mask, or None where the row is free (still waiting)."""
        waiting = self.waiting_for
        if self.opener is not None and drafts:
            if drafts[0] != self.opener:
                return drafts
            waiting, drafts = self._closer, drafts[1:]
        if waiting is None:
            return drafts
        if waiting not in drafts:
            return None
        return drafts[drafts.index(waiting) + 1 :]

    @property
    def done(self) -> bool:
        """The grammar is complete and takes nothing more (its answer ended)."""
        return self.waiting_for is None and self.opener is None and self.matcher.is_stopped()

    def fill(self, bitmask: torch.Tensor, row: int, eos_token_ids: list[int], first: bool = False) -> None:
        """Row ``row`` of ``bitmask``: one bit per token id, set where the token is allowed
        (``first``: the row of the output's next token, where the opener may come)."""
        target = bitmask[row]
        if not self.failed and not self.matcher.is_error():
            self.matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())
            if first and self.opener is not None:
                target[self.opener // 32] |= _bit(self.opener % 32)
            if bool(target.any()):
                return
        # Nothing allowed (an error state): only the end, never a row of -inf (no distribution).
        target.zero_()
        for token_id in eos_token_ids:
            target[token_id // 32] |= _bit(token_id % 32)


class Grammars:
    """An engine's grammar side: the model's tokenizer as llguidance reads it (built on the first
    constrained request, about a second for a 49k vocabulary), matchers for sequences, and the
    thread that computes masks beside the forward."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer = None
        self._lock = threading.Lock()
        self._mask_thread: ThreadPoolExecutor | None = None

    def for_sequence(self, structured: StructuredOutput, output_so_far: list[int]) -> SequenceGrammar:
        """A matcher for ``structured`` that has consumed ``output_so_far``; InvalidRequestError
        (naming the request's field) if the grammar does not compile or refuses those tokens."""
        import llguidance

        matcher = llguidance.LLMatcher(self._llg_tokenizer(), structured.to_llguidance(), log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(structured.field, f"cannot be compiled: {matcher.get_error()}")
        grammar = SequenceGrammar(matcher, structured.after_token_id, structured.opened_by_token_id)
        output = list(output_so_far)
        if output:
            constrained = grammar.constrained_drafts(output)
            grammar.opener = None
            if constrained is None:  # still thinking
                grammar.waiting_for = structured.after_token_id
            else:
                grammar.waiting_for = None
                if constrained and not matcher.consume_tokens(constrained):
                    raise InvalidRequestError(structured.field, f"the output so far does not match it: {matcher.get_error()}")
        return grammar

    def start_masks(self, rows: list[tuple[SequenceGrammar | None, list[int]]]) -> Future | None:
        """Compute the masks of a step's sampled rows on the mask thread: per row, the sequence's
        grammar (None: unconstrained) and the drafts before that row. The future's result is
        ``(bitmask, constrained row indices)``; None when there are no rows (none constrained)."""
        if not rows:
            return None
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._mask_thread.submit(self._masks, rows)

    def _masks(self, rows: list[tuple[SequenceGrammar | None, list[int]]]) -> tuple[torch.Tensor, list[int]]:
        bitmask = torch.zeros(len(rows), (self.vocab_size + 31) // 32, dtype=torch.int32)
        constrained = []
        for index, (grammar, drafts) in enumerate(rows):
            if grammar is None:
                continue
            # A row still thinking is free; one after the end of thinking among the drafts
            # before it is constrained from the grammar's start, by the drafts after that end.
            first = not drafts
            drafts = grammar.constrained_drafts(drafts)
            if drafts is None:
                continue
            constrained.append(index)
            if not drafts:
                grammar.fill(bitmask, index, self.eos_token_ids, first)
                continue
            # A draft row: the state after the drafts before it. Drafts past the first the
            # grammar forbids are never emitted (that one is rejected): their rows copy the
            # last reachable mask, which keeps a distribution to sample from.
            matcher = grammar.matcher
            reachable = 0 if grammar.failed else matcher.validate_tokens(drafts)
            if reachable:
                matcher.consume_tokens(drafts[:reachable])
            try:
                if reachable < len(drafts) or matcher.is_stopped():
                    bitmask[index] = bitmask[index - 1]
                else:
                    grammar.fill(bitmask, index, self.eos_token_ids)
            finally:
                if reachable:
                    matcher.rollback(reachable)
        return bitmask, constrained

    def close(self) -> None:
        if self._mask_thread is not None:
            self._mask_thread.shutdown(wait=False)

    def _llg_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance
                import tokenizers

                path = self.model_dir / "tokenizer.json"
                if not path.is_file():
                    raise InvalidRequestError("structured_outputs", f"this model has no tokenizer.json ({self.model_dir}) to constrain its output with")
                backend = tokenizers.Tokenizer.from_file(str(path))
                backend.no_padding()
                backend.no_truncation()
                eos = self.eos_token_ids or None
                self._tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size, eos_token=eos)
            return self._tokenizer


def apply_masks(logits: torch.Tensor, masks: tuple[torch.Tensor, list[int]]) -> torch.Tensor:
    """``logits`` with every token a row's mask forbids at -inf (constrained rows only)."""
    bitmask, rows = masks
    if not rows:  # every constrained sequence still waits for its grammar's start
        return logits
    vocab = logits.shape[-1]
    # Each byte of the mask (little-endian words: byte k of word w holds tokens 32w+8k..+7) looks
    # up its eight addends, 0 or -inf: an add keeps allowed logits exactly and is 4x faster here
    # than masked_fill with the unpacked bits (0.8 against 3.2 ms at 32 rows of 49k).
    table = _BYTE_ADDENDS.to(device=logits.device, dtype=logits.dtype)
    addends = table[bitmask[rows].view(torch.uint8).long().to(logits.device)].flatten(1)[:, :vocab]
    if len(rows) == logits.shape[0]:
        return logits + addends
    out = logits.clone()
    index = torch.tensor(rows, device=logits.device)
    out[index] = out[index] + addends
    return out


_BYTE_ADDENDS = torch.tensor([[0.0 if byte >> bit & 1 else float("-inf") for bit in range(8)] for byte in range(256)])


def _bit(position: int) -> int:
    """The int32 value with only bit ``position`` set (bit 31 is the sign bit)."""
    return -(1 << 31) if position == 31 else 1 << position
