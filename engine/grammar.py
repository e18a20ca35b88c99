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
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from engine.errors import InvalidRequestError
from engine.structured_output import StructuredOutput
from engine.thinking import ThinkingState

logger = logging.getLogger(__name__)

_COMPILED_GRAMMARS = 32  # the grammars whose compiled matchers are kept (most recently used)


class SequenceGrammar:
    """One sequence's grammar matcher: what the next token of its answer may be (a reasoning
    model's thinking is not the answer's: engine.thinking)."""

    __slots__ = ("matcher", "failed")

    def __init__(self, matcher) -> None:
        self.matcher = matcher
        self.failed = False

    def accept(self, token_id: int) -> None:
        if not self.failed and not self.matcher.consume_token(token_id):
            # Only a token drawn without this grammar's mask gets here (a bug, or a prompt
            # tail replayed that the grammar never produced): the sequence may only end now.
            self.failed = True
            logger.warning("a token the grammar forbids was appended: %s", self.matcher.get_error())

    @property
    def done(self) -> bool:
        """The grammar is complete and takes nothing more (its answer ended)."""
        return self.matcher.is_stopped()

    def fill(self, bitmask: torch.Tensor, row: int, eos_token_ids: list[int], also: int | None = None) -> None:
        """Row ``row`` of ``bitmask``: one bit per token id, set where the token is allowed
        (``also``: a token allowed beside the grammar's, the thinking's opener)."""
        target = bitmask[row]
        if not self.failed and not self.matcher.is_error():
            self.matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())
            if also is not None:
                target[also // 32] |= _bit(also % 32)
            if bool(target.any()):
                return
        # Nothing allowed (an error state): only the end, never a row of -inf (no distribution).
        target.zero_()
        for token_id in eos_token_ids:
            target[token_id // 32] |= _bit(token_id % 32)


class Grammars:
    """An engine's grammar side: the model's tokenizer as llguidance reads it (built on the first
    constrained request, off the engine thread where a worker calls ``prepare``), matchers for
    sequences, and the thread that computes masks beside the forward."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer = None
        self._lock = threading.Lock()
        self._mask_thread: ThreadPoolExecutor | None = None
        # A compiled matcher per recent grammar, copied for each sequence: clients send one schema
        # with every request (and n choices each carry it), and compiling it ran on the engine
        # thread between steps, stalling every stream (18 ms for a 30 KB schema on the built-in
        # model, a copy 0.01 ms).
        self._compiled: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._compiled_lock = threading.Lock()

    def prepare(self, structured: StructuredOutput) -> None:
        """Build what a sequence of ``structured`` needs (the tokenizer as llguidance reads it, then
        the grammar compiled), kept for ``for_sequence``: callable from any thread, so a worker
        does it off its engine thread, where the first constrained request's tokenizer (0.6 s for
        the built-in model's 4k vocabulary on one core here, longer for larger ones) stalled every
        stream. InvalidRequestError as ``for_sequence``."""
        self._compiled_matcher(structured)

    def for_sequence(self, structured: StructuredOutput, answer_so_far: list[int]) -> SequenceGrammar:
        """A matcher for ``structured`` that has consumed ``answer_so_far`` (the output's answer
        tokens: engine.thinking); InvalidRequestError (naming the request's field) if the grammar
        does not compile or refuses those tokens."""
        matcher = self._compiled_matcher(structured).deep_copy()
        if answer_so_far and not matcher.consume_tokens(list(answer_so_far)):
            raise InvalidRequestError(structured.field, f"the output so far does not match it: {matcher.get_error()}")
        return SequenceGrammar(matcher)

    def _compiled_matcher(self, structured: StructuredOutput):
        """A fresh matcher of ``structured``'s grammar, kept for the next sequence to copy."""
        import llguidance

        key = (structured.kind, structured.value)
        tokenizer = self._llg_tokenizer()
        with self._compiled_lock:
            matcher = self._compiled.get(key)
            if matcher is not None:
                self._compiled.move_to_end(key)
                return matcher
        # Compiled outside the lock: the engine thread's copy of a grammar already kept must not
        # wait behind a worker's thread compiling another (``prepare``); two compiling the same
        # one at once keep the first.
        matcher = llguidance.LLMatcher(tokenizer, structured.to_llguidance(), log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(structured.field, f"cannot be compiled: {matcher.get_error()}")
        with self._compiled_lock:
            matcher = self._compiled.setdefault(key, matcher)
            self._compiled.move_to_end(key)
            while len(self._compiled) > _COMPILED_GRAMMARS:
                self._compiled.popitem(last=False)
            return matcher

    def start_masks(self, rows: list[tuple[SequenceGrammar | None, ThinkingState | None, list[int]]]) -> Future | None:
        """Compute the masks of a step's sampled rows on the mask thread: per row, the sequence's
        grammar (None: unconstrained), its thinking (None: none) and the drafts before that row.
        The future's result is ``(bitmask, constrained row indices)``; None when there are no
        rows (none constrained)."""
        if not rows:
            return None
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._mask_thread.submit(self._masks, rows)

    def allows_any(self, grammar: SequenceGrammar, thinking: ThinkingState | None, token_ids: list[int] | None,
                   excluded: Sequence[int] = ()) -> bool:
        """Whether ``grammar`` lets any of ``token_ids`` (None: of the vocabulary) but
        ``excluded`` be its sequence's next token (inside a reasoning model's thinking every
        token is free). Computed on the caller's thread, so call it when no mask is being
        computed for that sequence."""
        bitmask, constrained = self._masks([(grammar, thinking, [])])
        if not constrained:
            return True
        words = bitmask[0]  # 32 tokens a word (a bad word banned every step: this runs per step)
        if token_ids is not None:
            unwanted = set(excluded)
            token_ids = [token for token in token_ids if token not in unwanted]
            if not token_ids:
                return False
        elif excluded:
            ids = torch.tensor(list(set(excluded)), dtype=torch.long)
            banned = torch.zeros_like(words)
            banned.index_add_(0, ids // 32, (1 << (ids % 32)).to(torch.int32))  # distinct bits: the sum is their OR
            words = words & ~banned
        if token_ids is None:
            return bool(words.any())
        ids = torch.tensor(token_ids, dtype=torch.long)
        return bool(((words[ids // 32] >> (ids % 32)) & 1).any())

    def _masks(self, rows: list[tuple[SequenceGrammar | None, ThinkingState | None, list[int]]]) -> tuple[torch.Tensor, list[int]]:
        bitmask = torch.zeros(len(rows), (self.vocab_size + 31) // 32, dtype=torch.int32)
        constrained = []
        for index, (grammar, thinking, drafts) in enumerate(rows):
            if grammar is None:
                continue
            opener = None
            if thinking is not None:
                # A row inside the thinking is free; the answer's drafts are what the matcher
                # reads before the row; a first row may open the thinking instead.
                if not drafts and thinking.may_open:
                    opener = thinking.thinking.opener
                drafts = thinking.answer_tokens(drafts)
                if drafts is None:
                    continue
            constrained.append(index)
            if not drafts:
                grammar.fill(bitmask, index, self.eos_token_ids, opener)
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
    if not rows:  # every constrained row is still inside its thinking (engine.thinking)
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
