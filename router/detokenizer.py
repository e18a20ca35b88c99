"""Incremental detokenization: one request's output token ids in, text deltas out.

Decoding each new token on its own is wrong twice over: a byte-level BPE token can hold part of
a UTF-8 character (an emoji often spans several tokens), and decoders that treat the first
token specially (SentencePiece-style leading-space stripping) would strip every token's space.
So each step decodes a short window of recent tokens, of which the first one or two are
context whose text was already sent, and sends only the window's new text. A window ending in
U+FFFD may be a character still missing bytes: that tail is held back until more tokens arrive
or the request ends. ``finish`` reconciles against one full decode, so the concatenated deltas
equal ``Tokenizer.decode(all_ids)``.

A request's text continues its prompt: the detokenizer starts with the prompt's last few tokens as
context whose text counts as sent (as vLLM does), so a decoder that strips the first token's
leading space (SentencePiece's Metaspace) keeps the space before the answer's first word, and
``echo`` joins prompt and answer as one text.

That holds for decoders whose text for a token sequence extends their text for its prefix once
the prefix ends on a whole character: byte-level BPE, SentencePiece-style Metaspace, WordPiece,
and ByteFallback as long as the bytes form valid UTF-8. ByteFallback turns a whole run of byte
tokens into U+FFFDs when the run is invalid, retroactively; text already sent cannot follow,
and ``finish`` logs the divergence.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from router.tokenizer import CLEANUP_UNSTABLE_TAIL, Tokenizer, clean_up_tokenization

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
# The window is re-anchored once it holds this many tokens; a small window keeps each step's
# decode cheap whatever the output length.
_MAX_WINDOW_TOKENS = 8
# Tokens kept as context when re-anchoring, tried shortest first.
_MAX_CONTEXT_TOKENS = 4
# The most prompt tokens tried as the answer's first context (the last ones may write no text:
# special tokens skipped, a character's missing bytes).
_MAX_PROMPT_CONTEXT_TOKENS = 24


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas, never splitting a character."""

    def __init__(
        self, tokenizer: Tokenizer, *, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True, req_id: str = ""
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._req_id = req_id
        # The prompt's last tokens, then the output's: the context's text is not the answer's.
        context, self._context_text = self._prompt_context(prompt_token_ids)
        self._num_context = len(context)
        # The context's text with a last character still missing bytes (None: it has none): the
        # answer's first tokens complete it (its text is then the answer's), or leave it so
        # (its U+FFFDs are then the prompt's, not the answer's).
        self._raw_context_text = self._decode_raw(context) if context else ""
        self._unfinished_context: str | None = self._raw_context_text if self._raw_context_text != self._context_text else None
        self._token_ids: list[int] = list(context)
        self._window_start = 0  # index of the window's first token
        self._window_sent = len(self._context_text)  # characters of the window's decoded text already passed on
        self._raw_parts: list[str] = []  # decoder output passed on so far (before clean-up)
        self._sent_parts: list[str] = []  # text returned to the caller so far
        self._num_sent_chars = 0
        self._finished = False

    @property
    def token_ids(self) -> list[int]:
        """The output tokens so far."""
        return self._token_ids[self._num_context :]

    @property
    def text(self) -> str:
        """All text returned so far."""
        return "".join(self._sent_parts)

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Append new output tokens; return the text they complete (possibly empty)."""
        if self._finished:
            raise RuntimeError(f"req_id={self._req_id}: detokenizer already finished")
        if not token_ids:
            return ""
        self._token_ids.extend(token_ids)
        window_text = self._decode_raw(self._token_ids[self._window_start :])
        stable_end = len(window_text) - _count_trailing(window_text, REPLACEMENT_CHAR)
        if self._unfinished_context is not None and stable_end > self._window_sent:
            if window_text.startswith(self._unfinished_context):  # left unfinished: not the answer's to send
                self._window_sent = len(self._unfinished_context)
            self._unfinished_context = None
        raw_delta = ""
        if stable_end > self._window_sent:
            raw_delta = window_text[self._window_sent : stable_end]
            self._window_sent = stable_end
        if stable_end == len(window_text) and len(self._token_ids) - self._window_start >= _MAX_WINDOW_TOKENS:
            self._reanchor()
        return self._pass_on(raw_delta)

    def finish(self) -> str:
        """Return whatever text is still held back; call once, when the request ends."""
        if self._finished:
            return ""
        self._finished = True
        full_text = self._output_text(len(self._token_ids))
        sent = self.text
        if not full_text.startswith(sent):
            # Only a decoder whose output for a window is not a suffix of its output for the
            # whole sequence gets here; what was sent cannot be taken back. What was held back
            # still goes, from the sent text's length (a character the decoder replaced keeps
            # it; the answer's end is not lost with the divergence).
            logger.warning(
                "req_id=%s: streamed text diverged from the full decode after %d characters",
                self._req_id, _common_prefix_len(full_text, sent),
            )
        return self._record(full_text[len(sent) :])

    def tokens_writing(self, num_chars: int) -> int:
        """How many of the tokens so far it takes to write the text's first ``num_chars``
        characters (all of them if they write fewer): where a stop string ended the answer.
        A few decodes of prefixes (a binary search), once per request."""
        low, high = 0, len(self._token_ids) - self._num_context
        while low < high:
            middle = (low + high) // 2
            text = self._output_text(self._num_context + middle)
            if len(text.rstrip(REPLACEMENT_CHAR)) >= num_chars:  # a character still missing bytes is not written yet
                high = middle
            else:
                low = middle + 1
        return low

    def _output_text(self, end: int) -> str:
        """The text of the output tokens before ``end`` (an index into the context and output),
        as one decode after the context writes it, cleaned as ``Tokenizer.decode`` cleans."""
        text = self._decode_raw(self._token_ids[:end])
        # (The context's unfinished character left so is the prompt's; finished, the answer's.)
        context_text = next((c for c in (self._raw_context_text, self._context_text) if text.startswith(c)), None)
        if context_text is not None:
            text = text[len(context_text) :]
        else:  # the context's own text changed with what followed it: the output's alone
            text = self._decode_raw(self._token_ids[self._num_context : end])
        return clean_up_tokenization(text) if self._tokenizer.cleans_up_spaces else text

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> tuple[list[int], str]:
        """The fewest last prompt tokens that write whole characters, but for a last one still
        missing bytes (the answer may complete it), and their text without that character
        (empty if none do). Text, or a token the decoder does not skip: a decoder's first-token
        treatment then falls on the context (a lone "▁" writes nothing, its space stripped)."""
        for num_tokens in range(1, min(len(prompt_token_ids), _MAX_PROMPT_CONTEXT_TOKENS) + 1):
            context = list(prompt_token_ids[-num_tokens:])
            raw = self._decode_raw(context)
            text = raw.rstrip(REPLACEMENT_CHAR)
            if REPLACEMENT_CHAR not in text and (text or (not raw and self._tokenizer.writes_any(context, self._skip_special_tokens))):
                return context, text
        return [], ""

    def _decode_raw(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode_raw(token_ids, self._skip_special_tokens)

    def _reanchor(self) -> None:
        # The new window starts a few tokens back so those tokens' already-sent text is the
        # context. It must decode to whole characters (not a character's tail bytes) and be
        # non-empty, else the decoder's first-token treatment would hit the next new token.
        end = len(self._token_ids)
        for num_context in range(1, _MAX_CONTEXT_TOKENS + 1):
            start = end - num_context
            if start <= self._window_start:
                return
            context_text = self._decode_raw(self._token_ids[start:])
            if context_text and not context_text.startswith(REPLACEMENT_CHAR):
                self._window_start = start
                self._window_sent = len(context_text)
                return

    def _pass_on(self, raw_delta: str) -> str:
        if not self._tokenizer.cleans_up_spaces:
            return self._record(raw_delta)
        # transformers' clean-up rewrites " ." to "." and similar, so the end of the cleaned
        # text can still change when more text arrives: hold back its unstable tail.
        self._raw_parts.append(raw_delta)
        cleaned = clean_up_tokenization("".join(self._raw_parts))
        # (Held whole while shorter than the tail: a negative end counted from the text's end
        # and let out what the clean-up could still rewrite.)
        releasable = max(self._num_sent_chars, len(cleaned) - CLEANUP_UNSTABLE_TAIL)
        return self._record(cleaned[self._num_sent_chars : releasable])

    def _record(self, delta: str) -> str:
        if delta:
            self._sent_parts.append(delta)
            self._num_sent_chars += len(delta)
        return delta


def _count_trailing(text: str, char: str) -> int:
    return len(text) - len(text.rstrip(char))


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
