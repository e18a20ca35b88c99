"""Turn one request's decode outputs into what its client sees, for any API.

Token ids go through the incremental detokenizer, the text through the stop-string matcher;
the last chunk carries how the request ended: the finish reason, usage and the timing
breakdown that the router, the prefill actor and the decode actor measured. The chunks are
plain data: the gRPC servicer (router/grpc_api.py) and the OpenAI HTTP server
(router/openai_api/) each render them in their own format.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from decode_workers.messages import DecodeTiming, SeqOutput
from engine.sampling_params import TokenLogprob
from prefill_workers.messages import PrefillTiming
from router.detokenizer import IncrementalDetokenizer
from router.errors import InternalError, InvalidArgumentError, RouterError
from router.stop_strings import StopStringMatcher
from router.tokenizer import Tokenizer
from router.validation import ValidatedRequest

FINISH_REASONS = ("length", "stop", "eos", "abort", "error")


@dataclass(slots=True)
class RouterTiming:
    """Timestamps (time.monotonic) the router took for one request."""

    arrival: float
    dispatched: float | None = None
    first_token_sent: float | None = None
    prefill: PrefillTiming | None = None
    decode: DecodeTiming | None = None


@dataclass(slots=True)
class TimingBreakdown:
    """Where one request's time went, in milliseconds (0 where a stage did not happen)."""

    router_queue_ms: float = 0.0
    prefill_queue_ms: float = 0.0
    prefill_compute_ms: float = 0.0
    kv_transfer_ms: float = 0.0
    decode_queue_ms: float = 0.0
    decode_ms: float = 0.0
    time_to_first_token_ms: float = 0.0
    total_ms: float = 0.0
    prompt_tokens_computed: int = 0  # prompt tokens run through the model (the rest: prefix cache)
    kv_bytes_transferred: int = 0  # KV bytes the prefill actor pushed to the decode actor


@dataclass(slots=True)
class Speculation:
    """What speculative decoding did for one request on its decode actor."""

    decode_steps: int  # decode steps the request took part in
    draft_tokens: int  # tokens proposed for it
    accepted_draft_tokens: int  # of those, tokens the model confirmed

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens each decode step emitted: its own, plus the drafts it confirmed."""
        return 1.0 + self.accepted_draft_tokens / self.decode_steps if self.decode_steps else 0.0


@dataclass(slots=True)
class StreamEnd:
    """How a request ended, with what it cost."""

    reason: str  # one of FINISH_REASONS
    prompt_tokens: int
    completion_tokens: int
    timing: TimingBreakdown
    cached_prompt_tokens: int = 0  # prompt tokens whose KV came from a prefix cache
    matched_stop: str = ""  # the stop string that ended it
    matched_stop_token_id: int | None = None  # the stop token id that ended it
    detail: str = ""  # why, for "error" and "abort"
    error_field: str = ""  # for "error": the request field whose values left nothing to compute ("": the server's failure)
    prefill_worker_id: str = ""
    decode_worker_id: str = ""
    speculation: Speculation | None = None  # None: no decode actor reported (it never decoded)


def end_failure(end: StreamEnd | None, num_tokens: int) -> RouterError:
    """The error a front end reports for a request that ended with "error" (or "abort", or no
    last chunk) after ``num_tokens`` tokens: the client's, naming the field, where its own values
    left nothing to compute (``error_field``); else the server's."""
    if end is not None and end.error_field:
        return InvalidArgumentError(end.error_field, end.detail)
    return InternalError(f"generation failed after {num_tokens} tokens: {end.detail if end is not None else 'no last chunk'}")


@dataclass(slots=True)
class OutputChunk:
    """What one request's client receives next: new tokens and their text, and on the last
    chunk, ``end``."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    end: StreamEnd | None = None
    # The first chunk of a request that asked for its prompt's log-probabilities: prompt token
    # i + 1's at i (None on every other chunk).
    prompt_logprobs: list[TokenLogprob] | None = None


class OutputAssembler:
    def __init__(self, request: ValidatedRequest, tokenizer: Tokenizer, eos_token_ids: list[int] = ()):
        self.request = request
        # The tokens that end a request by being drawn (finish "stop", "eos"): their text is no
        # part of its answer.
        self.ending_token_ids = {"stop": set(request.sampling_params.stop_token_ids), "eos": set(eos_token_ids)}
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids=request.prompt_token_ids, skip_special_tokens=request.skip_special_tokens, req_id=request.req_id
        )
        self.stops = StopStringMatcher(request.stop, include_stop=request.include_stop_str)
        self.timing = RouterTiming(arrival=request.arrival_time)
        self.completion_token_ids: list[int] = []  # what the client was sent (a migrated stream resumes after them)
        self._num_text_chars = 0  # characters of text the client was sent
        self.finished = False
        self.prefill_worker_id = ""
        self.decode_worker_id = ""
        # The prompt's log-probabilities, where asked for: from the prefill actor's result or the
        # decode actor that prefilled the prompt (its first output); sent on the first chunk.
        self.prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def awaits_prompt_logprobs(self) -> bool:
        """The request asked for its prompt's log-probabilities, and they have not all come yet."""
        if self.request.sampling_params.prompt_logprobs is None or self.has_sent_tokens:
            return False
        # Every prompt token after the first: a report that covers less is not the answer.
        return len(self.prompt_logprobs or []) < len(self.request.prompt_token_ids) - 1

    @property
    def num_completion_tokens(self) -> int:
        return len(self.completion_token_ids)

    @property
    def has_sent_tokens(self) -> bool:
        return bool(self.completion_token_ids)

    def on_output(self, out: SeqOutput) -> OutputChunk:
        """The chunk for one decode output; ``finished`` turns true on a request's end."""
        if out.prompt_logprobs:
            self.prompt_logprobs = out.prompt_logprobs
        first = not self.has_sent_tokens
        # The EOS or stop token that ended the request is no part of its text (vLLM's rule;
        # it shows where special tokens are kept, skip_special_tokens false), unless the request
        # asks for its stop in the text (include_stop_str_in_output).
        ended_by_token = bool(out.finished and out.token_ids and out.token_ids[-1] in self.ending_token_ids.get(out.finish_reason, ()))
        cut_token = ended_by_token and not self.request.include_stop_str
        text_tokens = out.token_ids[:-1] if cut_token else out.token_ids
        # The text of the first min_tokens tokens passes unmatched (vLLM matches stop strings
        # from the token after min_tokens on), token by token: an output may carry several
        # (stream_interval, speculation), and only its later ones are matched.
        min_tokens = self.request.sampling_params.min_tokens
        unmatched = max(0, min(len(text_tokens), min_tokens - self.num_completion_tokens))
        self.completion_token_ids += out.token_ids
        passed = self.stops.feed(self.detokenizer.add_tokens(text_tokens[:unmatched]), match=False).text if unmatched else ""
        text = self.detokenizer.add_tokens(text_tokens[unmatched:])
        if out.finished:
            text += self.detokenizer.finish()
        check = self.stops.feed(text, match=unmatched < len(text_tokens) or self.num_completion_tokens > min_tokens or not min_tokens)
        chunk = OutputChunk(token_ids=list(out.token_ids), text=passed + check.text, logprobs=list(out.logprobs))
        if first and out.token_ids and self.request.sampling_params.prompt_logprobs is not None:
            chunk.prompt_logprobs = self.prompt_logprobs or []
        if self.timing.first_token_sent is None and out.token_ids:
            self.timing.first_token_sent = time.monotonic()
        if out.timing is not None:  # the first output's so far, the last one's whole
            self.timing.decode = out.timing
        # A stop token kept in the text (include_stop_str_in_output) may complete a stop string
        # there: the token ended the request, and is reported.
        if check.matched_stop is not None and not (ended_by_token and self.request.include_stop_str):
            written = self._num_text_chars + len(chunk.text) + (0 if self.request.include_stop_str else len(check.matched_stop))
            self._drop_tokens_after(written, chunk)
            chunk.end = self._end("stop", matched_stop=check.matched_stop)
        elif out.finished:
            chunk.text += self.stops.flush()
            chunk.end = self._end(out.finish_reason or "error", detail=out.error or "", error_field=out.error_field or "")
            if out.finish_reason == "stop" and out.token_ids:
                chunk.end.matched_stop_token_id = out.token_ids[-1]
        self._num_text_chars += len(chunk.text)
        return chunk

    def _drop_tokens_after(self, num_chars: int, chunk: OutputChunk) -> None:
        """A stop string ended the answer at its ``num_chars``-th character: the tokens generated
        after the one that completed it (an output carries several: steps merged on their way,
        a stream interval, drafts; and a detokenizer holds text back) are no part of the answer,
        its token ids, log-probabilities or usage, as with vLLM, which stops at that token."""
        needed = self.detokenizer.tokens_writing(num_chars)
        before = len(self.completion_token_ids) - len(chunk.token_ids)  # sent with earlier chunks: kept
        keep = max(needed - before, 0)
        if keep < len(chunk.token_ids):
            del self.completion_token_ids[before + keep :]
            chunk.token_ids = chunk.token_ids[:keep]
            chunk.logprobs = chunk.logprobs[:keep]

    def final_chunk(self, reason: str, detail: str = "", error_field: str = "") -> OutputChunk:
        """A last chunk for an end the decode actor did not report (abort, error): with the text
        still held back (the detokenizer's unsettled tail, the possible start of a stop string),
        which no later token can change now. A stop string completing in that tail still cuts
        the text there (the tokens after it went out with earlier chunks: they stay counted)."""
        check = self.stops.feed(self.detokenizer.finish())
        chunk = OutputChunk(text=check.text + self.stops.flush(), end=self._end(reason, detail=detail, error_field=error_field))
        self._num_text_chars += len(chunk.text)
        return chunk

    def _end(self, reason: str, matched_stop: str = "", detail: str = "", error_field: str = "") -> StreamEnd:
        assert reason in FINISH_REASONS, reason
        self.finished = True
        num_prompt = len(self.request.prompt_token_ids)
        cached = self.cached_prompt_tokens()
        timing = self._timing()
        prefilled = self.timing.prefill is not None or self.timing.decode is not None
        timing.prompt_tokens_computed = num_prompt - cached if prefilled else 0
        return StreamEnd(
            reason=reason,
            prompt_tokens=num_prompt,
            completion_tokens=self.num_completion_tokens,
            timing=timing,
            cached_prompt_tokens=cached,
            matched_stop=matched_stop,
            detail=detail,
            error_field=error_field,
            prefill_worker_id=self.prefill_worker_id,
            decode_worker_id=self.decode_worker_id,
            speculation=self._speculation(),
        )

    def _speculation(self) -> Speculation | None:
        decode = self.timing.decode
        if decode is None:
            return None
        return Speculation(decode.num_decode_steps, decode.num_draft_tokens, decode.num_accepted_draft_tokens)

    def cached_prompt_tokens(self) -> int:
        """Prompt tokens not computed: the prefill actor's cache hit, or the decode actor's
        when it prefilled the prompt itself. At most the prompt: a migrated request's last
        prefill was of the prompt and the tokens already sent, and a cache may hold more than
        the prompt of it (a twin that generated the same tokens)."""
        if self.timing.prefill is not None:
            cached = self.timing.prefill.num_cached_tokens
        elif self.timing.decode is not None:
            cached = self.timing.decode.num_cached_tokens
        else:
            cached = 0
        return min(cached, len(self.request.prompt_token_ids))

    def _timing(self) -> TimingBreakdown:
        t = self.timing
        now = time.monotonic()
        out = TimingBreakdown(router_queue_ms=_ms((t.dispatched or now) - t.arrival), total_ms=_ms(now - t.arrival))
        if t.prefill is not None:
            out.prefill_queue_ms = t.prefill.queue_ms
            out.prefill_compute_ms = t.prefill.compute_ms
            out.kv_transfer_ms = t.prefill.transfer_ms
            out.kv_bytes_transferred = t.prefill.num_bytes
        if t.decode is not None:
            out.decode_queue_ms = t.decode.decode_queue_ms
            out.decode_ms = t.decode.decode_ms
            if t.prefill is None:  # prefilled on the decode actor: that was the prefill compute
                out.prefill_compute_ms = t.decode.local_prefill_ms
        if t.first_token_sent is not None:
            out.time_to_first_token_ms = _ms(t.first_token_sent - t.arrival)
        return out


def _ms(seconds: float) -> float:
    return max(0.0, seconds * 1000.0)
