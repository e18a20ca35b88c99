"""Session chunks rendered as OpenAI completions and chat completions, whole or as SSE chunks.

One ``ChoiceState`` per choice keeps what its rendering needs across chunks: the text offset
(completions' ``text_offset``), whether the chat role was sent, and, for a whole response,
the text and log-probabilities so far.

With a reasoning parser and vLLM's ``include_reasoning: false`` the thinking is left out of
everything a client reads: its text, and its tokens' logprobs entries and ``token_ids`` (vLLM
drops those fields whole; here only the thinking's entries go). That is exact: the thinking's
tokens, counted by id as the engine reads them (engine.thinking), are the output's first ones,
so they are each chunk's first ``thinking_tokens``. Usage still counts them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import TokenLogprob
from router.detokenizer import REPLACEMENT_CHAR
from router.openai_api.protocol import ApiRequest
from router.openai_api.reasoning import ReasoningSplitter
from router.openai_api.tool_parsers import ToolCallDelta, ToolCallOutput, content_and_deltas, split_answer
from router.output_stream import OutputChunk, StreamEnd
from router.tokenizer import Tokenizer
from router.validation import ValidatedRequest

# JSON has no -inf; vLLM sends this for a log-probability of 0.
_LOGPROB_FLOOR = -9999.0


def finish_reason(end: StreamEnd) -> str:
    """OpenAI's finish_reason: "stop" for a stop string, stop token or EOS; "length"; "abort"."""
    return {"eos": "stop", "stop": "stop", "length": "length"}.get(end.reason, end.reason)


def stop_reason(end: StreamEnd) -> str | int | None:
    """vLLM's stop_reason: the stop string or stop token id that ended the choice, else None."""
    if end.matched_stop:
        return end.matched_stop
    return end.matched_stop_token_id


@dataclass(slots=True)
class ChoiceState:
    index: int
    chat: bool
    num_logprobs: int | None
    prompt_tokens: int
    text: list[str] = field(default_factory=list)
    # completions' text_offset of the next token: each token's text after the one before it (an
    # echoed prompt's first), whatever messages the tokens came in
    next_offset: int = 0
    role_sent: bool = False
    completion_logprobs: dict[str, list] = field(default_factory=lambda: {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []})
    chat_logprobs: list[dict[str, Any]] = field(default_factory=list)
    end: StreamEnd | None = None
    echo: str = ""  # completions' echo: the prompt, sent before the first chunk's text
    # The prompt's log-probabilities: the prompt's ids, how many alternatives the vLLM field
    # shows (None: not asked), whether echo shows them before the answer's (legacy logprobs),
    # and their rendering once they came (on the first chunk).
    prompt_token_ids: list[int] = field(default_factory=list)
    num_prompt_logprobs: int | None = None
    echo_logprobs: bool = False
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    prompt_logprobs_new: bool = False  # came with the latest chunk (a stream sends them with it)
    prompt_only: bool = False  # max_tokens 0: the one token drawn is no part of the answer
    # vLLM's return_token_ids: the prompt's and the answer's token ids beside the text (the answer's
    # so far in ``token_ids``); return_tokens_as_token_ids: logprobs name tokens "token_id:<id>".
    return_token_ids: bool = False
    tokens_as_ids: bool = False
    token_ids: list[int] = field(default_factory=list)
    prompt_ids_sent: bool = False  # streamed: on the choice's first chunk (unsent_prompt_ids)
    tools: ToolCallOutput | None = None  # chat with tools: reads the calls out of the text
    tool_deltas: list[ToolCallDelta] = field(default_factory=list)  # the latest chunk's
    # Chat with a reasoning parser: splits the thinking off the answer (which the tools read);
    # the thinking so far, and the latest chunk's. ``show_reasoning``: include_reasoning.
    reasoning: ReasoningSplitter | None = None
    show_reasoning: bool = True
    reasoning_text: list[str] = field(default_factory=list)
    reasoning_delta: str = ""
    reasoning_tokens: int = 0  # the thinking's tokens (usage's completion_tokens_details)
    # include_reasoning false: the thinking's tokens, the first of ``token_ids``, which no
    # logprobs entry or token_ids field shows; and the latest chunk's tokens that it does show.
    num_hidden_tokens: int = 0
    shown_token_ids: list[int] = field(default_factory=list)
    role: str = "assistant"  # chat: the answer's role (ApiRequest.role)

    @classmethod
    def of(cls, index: int, chat: bool, api: ApiRequest, request: ValidatedRequest, echo: str = "") -> ChoiceState:
        """Choice ``index`` of ``api``, validated as ``request``; ``echo``: the prompt a completions
        choice starts with (its text)."""
        return cls(
            index, chat, api.logprobs, len(request.prompt_token_ids), echo=echo,
            tools=ToolCallOutput(api.tool_calling) if api.tool_calling is not None else None,
            prompt_token_ids=request.prompt_token_ids, num_prompt_logprobs=api.prompt_logprobs,
            echo_logprobs=api.echo and api.logprobs is not None, prompt_only=api.prompt_only,
            return_token_ids=api.return_token_ids, tokens_as_ids=api.tokens_as_ids,
            reasoning=ReasoningSplitter(request.sampling_params.thinking) if api.reasoning is not None else None,
            show_reasoning=api.include_reasoning, role=api.role,
        )

    def add(self, chunk: OutputChunk, tokenizer: Tokenizer) -> dict[str, Any] | None:
        """Take a chunk; return its rendered logprobs (None when not asked for). With tools the
        chunk's text becomes the content the client sees, its calls ``tool_deltas``."""
        prompt_entries = self._take_prompt_logprobs(chunk, tokenizer)
        if self.prompt_only:
            chunk.token_ids, chunk.text, chunk.logprobs = [], "", []
        if self.echo:
            chunk.text, self.echo = self.echo + chunk.text, ""
        hidden = 0  # the chunk's first tokens that are thinking left out
        if self.reasoning is not None or self.tools is not None:
            thinking, parts, thinking_tokens = split_answer(self.reasoning, self.tools, chunk)
            self.reasoning_tokens += thinking_tokens
            self.reasoning_delta = thinking if self.show_reasoning else ""
            if not self.show_reasoning:
                hidden = thinking_tokens
            if self.reasoning is not None:
                self.reasoning_text.append(self.reasoning_delta)
            chunk.text, self.tool_deltas = content_and_deltas(parts)
        self.shown_token_ids = chunk.token_ids[hidden:]
        logprobs = None
        if self.num_logprobs is not None:
            if self.chat:
                if chunk.logprobs[hidden:]:
                    entries = [_chat_entry(t, e, self.tokens_as_ids, tokenizer) for t, e in zip(self.shown_token_ids, chunk.logprobs[hidden:])]
                    self.chat_logprobs.extend(entries)
                    logprobs = {"content": entries}
            elif chunk.logprobs or prompt_entries:
                logprobs = self._completion_logprobs(prompt_entries + list(zip(chunk.token_ids, chunk.logprobs)), tokenizer)
        self.token_ids += chunk.token_ids
        self.num_hidden_tokens += hidden
        self.text.append(chunk.text)
        if chunk.end is not None:
            self.end = chunk.end
        return logprobs

    def _take_prompt_logprobs(self, chunk: OutputChunk, tokenizer: Tokenizer) -> list[tuple[int, TokenLogprob | None]]:
        """Render the prompt's log-probabilities where ``chunk`` carries them (the first chunk);
        return what an echo with logprobs puts before the answer's: each prompt token with its
        entry (None for the first token, which has none)."""
        self.prompt_logprobs_new = chunk.prompt_logprobs is not None
        if chunk.prompt_logprobs is None:
            return []
        entries: list[TokenLogprob | None] = [None, *chunk.prompt_logprobs]
        if self.num_prompt_logprobs is not None:
            name = self._namer(tokenizer)
            self.prompt_logprobs = [
                None if entry is None else _prompt_entry(token_id, entry, self.num_prompt_logprobs, name)
                for token_id, entry in zip(self.prompt_token_ids, entries)
            ]
        return list(zip(self.prompt_token_ids, entries)) if self.echo_logprobs else []

    @property
    def num_tokens(self) -> int:
        """Answer tokens so far (what usage counts)."""
        return len(self.token_ids)

    def unsent_prompt_ids(self) -> list[int] | None:
        """return_token_ids, streamed: the prompt's ids the first time a chunk asks (None after,
        and without the field); a completions choice carries them, a chat chunk's envelope."""
        if not self.return_token_ids or self.prompt_ids_sent:
            return None
        self.prompt_ids_sent = True
        return self.prompt_token_ids

    def _namer(self, tokenizer: Tokenizer) -> Callable[[int], str]:
        """How logprobs name a token: its text, or with return_tokens_as_token_ids "token_id:<id>"
        (a token that is not a whole character still names itself exactly)."""
        if self.tokens_as_ids:
            return _id_name
        return lambda token_id: _token_text(token_id, tokenizer)

    def _completion_logprobs(self, tokens: list[tuple[int, TokenLogprob | None]], tokenizer: Tokenizer) -> dict[str, list]:
        """Legacy completions logprobs of ``tokens`` (an echoed prompt's first has no entry: null)."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = self.next_offset
        name = self._namer(tokenizer)
        for token_id, entry in tokens:
            token = name(token_id)
            out["tokens"].append(token)
            out["token_logprobs"].append(None if entry is None else _logprob(entry.logprob))
            # The chosen token first, then the most likely: OpenAI's legacy API always returns
            # the sampled token's (up to logprobs + 1 entries), and vLLM's does.
            out["top_logprobs"].append(None if entry is None else _top_by_text([(token_id, entry.logprob), *entry.top[: self.num_logprobs]], name))
            out["text_offset"].append(offset)
            offset += len(token if not self.tokens_as_ids else _token_text(token_id, tokenizer))  # offsets count the text
        self.next_offset = offset
        for key, values in out.items():
            self.completion_logprobs[key].extend(values)
        return out

    def whole(self) -> dict[str, Any]:
        """This choice in a non-streamed response (after its last chunk)."""
        assert self.end is not None
        text = "".join(self.text)
        choice: dict[str, Any] = {"index": self.index}
        if self.chat:
            message: dict[str, Any] = {"role": self.role, "content": text}
            if self.reasoning is not None:
                thinking = "".join(self.reasoning_text) or None
                # vLLM's field, and its older name that DeepSeek's API and many clients read.
                message.update(reasoning=thinking, reasoning_content=thinking)
                if thinking is not None and not text:
                    message["content"] = None  # thinking cut off: no answer yet
            if self.tools is not None and self.tools.runnable_calls:
                message.update(content=text or None, tool_calls=self.tools.runnable_calls)
            elif self.tools is not None and (written := self.tools.text_if_none_runs) is not None:
                message["content"] = written
            choice["message"] = message
            choice["logprobs"] = {"content": self.chat_logprobs} if self.num_logprobs is not None else None
        else:
            choice["text"] = text
            choice["logprobs"] = self.completion_logprobs if self.num_logprobs is not None else None
            if self.num_prompt_logprobs is not None:
                choice["prompt_logprobs"] = self.prompt_logprobs
            if self.return_token_ids:
                choice["prompt_token_ids"] = self.prompt_token_ids
        if self.return_token_ids:
            choice["token_ids"] = self.token_ids[self.num_hidden_tokens :]
        choice["finish_reason"] = self._finish_reason(self.end)
        choice["stop_reason"] = None if self.prompt_only else stop_reason(self.end)  # the dropped token's stop is none of the answer's
        return choice

    def _finish_reason(self, end: StreamEnd) -> str:
        if self.prompt_only and end.reason != "error":
            return "length"  # the answer was to be 0 tokens long
        reason = finish_reason(end)
        if reason == "stop" and self.tools is not None and self.tools.finish_reason_at(end):
            return self.tools.finish_reason
        return reason

    def delta(self, chunk: OutputChunk, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        """This choice's entry in a streamed chunk."""
        choice: dict[str, Any] = {"index": self.index}
        if self.chat:
            delta: dict[str, Any] = {}
            if not self.role_sent:
                delta["role"] = self.role
                self.role_sent = True
            if self.reasoning_delta:
                delta["reasoning"] = delta["reasoning_content"] = self.reasoning_delta
            # New tokens whose text is held back say so with empty content, as vLLM's chunks do.
            if chunk.text or (not self.tool_deltas and not self.reasoning_delta and ("role" in delta or (chunk.token_ids and self.tools is None))):
                delta["content"] = chunk.text
            if self.tool_deltas:
                delta["tool_calls"] = [d.to_json() for d in self.tool_deltas]
            choice["delta"] = delta
        else:
            choice["text"] = chunk.text
            if self.prompt_logprobs_new and self.num_prompt_logprobs is not None:
                choice["prompt_logprobs"] = self.prompt_logprobs
            if (ids := self.unsent_prompt_ids()) is not None:
                choice["prompt_token_ids"] = ids
        if self.return_token_ids:
            choice["token_ids"] = list(self.shown_token_ids)
        choice["logprobs"] = logprobs
        choice["finish_reason"] = None if chunk.end is None else self._finish_reason(chunk.end)
        if chunk.end is not None:
            choice["stop_reason"] = None if self.prompt_only else stop_reason(chunk.end)
        return choice


def envelope(response_id: str, model: str, chat: bool, stream: bool, created: int | None = None, service_tier: str | None = None) -> dict[str, Any]:
    """An answer's or a chunk's fields around its choices; ``service_tier``: the tier served, where the request named one."""
    if chat:
        kind = "chat.completion.chunk" if stream else "chat.completion"
    else:
        kind = "text_completion"
    body = {"id": response_id, "object": kind, "created": int(time.time()) if created is None else created, "model": model}
    if service_tier is not None:
        body["service_tier"] = service_tier
    return body


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, accepted_drafts: int = 0, rejected_drafts: int = 0, reasoning_tokens: int | None = None,
) -> dict[str, Any]:
    """OpenAI's usage; ``reasoning_tokens`` (a reasoning parser's: the thinking's tokens) in
    completion_tokens_details where given."""
    body = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},  # served by the prefix cache
        # OpenAI's fields for predicted tokens the model confirmed or not: here, the decode
        # actor's speculative drafts.
        "completion_tokens_details": {"accepted_prediction_tokens": accepted_drafts, "rejected_prediction_tokens": rejected_drafts},
    }
    if reasoning_tokens is not None:
        body["completion_tokens_details"]["reasoning_tokens"] = reasoning_tokens
    return body


def _token_text(token_id: int, tokenizer: Tokenizer) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _logprob(value: float) -> float:
    return max(value, _LOGPROB_FLOOR)


def _top_by_text(top: list[tuple[int, float]], name: Callable[[int], str]) -> dict[str, float]:
    """Legacy top_logprobs, keyed by text: where two tokens read the same (bytes of one
    character, each "\ufffd" alone), the more likely one's stays."""
    out: dict[str, float] = {}
    for token_id, logprob in top:
        text, value = name(token_id), _logprob(logprob)
        out[text] = max(out.get(text, value), value)  # the chosen token comes first, not by likelihood
    return out


def _prompt_entry(token_id: int, entry: TokenLogprob, num_top: int, name: Callable[[int], str]) -> dict[str, Any]:
    """vLLM's prompt_logprobs entry: by token id, the prompt's token and the ``num_top`` most
    likely there, each with its log-probability, rank and text."""
    def one(logprob: float, rank: int, token: int) -> dict[str, Any]:
        return {"logprob": _logprob(logprob), "rank": rank, "decoded_token": name(token)}

    out = {str(token_id): one(entry.logprob, entry.rank, token_id)}
    for rank, (alt_id, alt_logprob) in enumerate(entry.top[:num_top], start=1):
        out.setdefault(str(alt_id), one(alt_logprob, rank, alt_id))
    return out


def _id_name(token_id: int) -> str:
    """return_tokens_as_token_ids' name of a token."""
    return f"token_id:{token_id}"


def _chat_entry(token_id: int, entry: TokenLogprob, tokens_as_ids: bool, tokenizer: Tokenizer) -> dict[str, Any]:
    def one(token: int, logprob: float) -> dict[str, Any]:
        text = _token_text(token, tokenizer)  # (once: the name and the bytes both come from it)
        name = _id_name(token) if tokens_as_ids else text
        return {"token": name, "logprob": _logprob(logprob), "bytes": _token_bytes(token, tokenizer, text)}

    return {**one(token_id, entry.logprob), "top_logprobs": [one(alt_id, alt_logprob) for alt_id, alt_logprob in entry.top]}


def _token_bytes(token_id: int, tokenizer: Tokenizer, text: str | None = None) -> list[int]:
    """OpenAI's ``bytes`` of a token (``text``: its decoding, if already made): its text's UTF-8,
    or for a token that holds part of a character (its text alone is U+FFFD) the bytes it
    stands for, which a client joins with its neighbours' into the character."""
    text = _token_text(token_id, tokenizer) if text is None else text
    if REPLACEMENT_CHAR in text and (raw := tokenizer.token_bytes(token_id)) is not None:
        return list(raw)
    return list(text.encode("utf-8"))
