"""Turn one request's decode outputs into the GenerateResponse messages its client sees.

Token ids go through the incremental detokenizer, the text through the stop-string matcher;
the last message carries the finish reason, usage and the timing breakdown that the router,
the prefill actor and the decode actor measured.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from decode_workers.messages import DecodeTiming, SeqOutput
from engine.sequence import TokenLogprob
from prefill_workers.messages import PrefillTiming
from router.api.pdserve.v1 import generation_pb2 as pb
from router.detokenizer import IncrementalDetokenizer
from router.stop_strings import StopStringMatcher
from router.tokenizer import Tokenizer
from router.validation import ValidatedRequest

FINISH_REASONS = {
    "length": pb.FINISH_REASON_LENGTH,
    "stop": pb.FINISH_REASON_STOP,
    "eos": pb.FINISH_REASON_EOS,
    "abort": pb.FINISH_REASON_ABORT,
    "error": pb.FINISH_REASON_ERROR,
}


@dataclass(slots=True)
class RouterTiming:
    """Timestamps (time.monotonic) the router took for one request."""

    arrival: float
    dispatched: float | None = None
    first_token_sent: float | None = None
    prefill: PrefillTiming | None = None
    decode: DecodeTiming | None = None


class OutputAssembler:
    def __init__(self, request: ValidatedRequest, tokenizer: Tokenizer):
        self.request = request
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=request.skip_special_tokens, req_id=request.req_id)
        self.stops = StopStringMatcher(request.stop)
        self.timing = RouterTiming(arrival=request.arrival_time)
        self.completion_token_ids: list[int] = []  # what the client was sent (a migrated stream resumes after them)
        self.finished = False
        self.prefill_worker_id = ""
        self.decode_worker_id = ""

    @property
    def num_completion_tokens(self) -> int:
        return len(self.completion_token_ids)

    @property
    def has_sent_tokens(self) -> bool:
        return bool(self.completion_token_ids)

    def on_output(self, out: SeqOutput) -> pb.GenerateResponse:
        """The message for one decode output; ``finished`` turns true on a request's end."""
        self.completion_token_ids += out.token_ids
        text = self.detokenizer.add_tokens(out.token_ids)
        if out.finished:
            text += self.detokenizer.finish()
        check = self.stops.feed(text)
        text = check.text
        response = pb.GenerateResponse(request_id=self.request.req_id, token_ids=out.token_ids, text=text)
        response.logprobs.extend(_logprobs(out.logprobs))
        if self.timing.first_token_sent is None and out.token_ids:
            self.timing.first_token_sent = time.monotonic()
        if check.matched_stop is not None:
            self._finish(response, "stop", matched_stop=check.matched_stop)
        elif out.finished:
            self.timing.decode = out.timing
            response.text += self.stops.flush()
            self._finish(response, out.finish_reason or "error", detail=out.error or "")
            if out.finish_reason == "stop" and out.token_ids:
                response.matched_stop_token_id = out.token_ids[-1]
        return response

    def final_message(self, reason: str, detail: str = "") -> pb.GenerateResponse:
        """A last message for an end the decode actor did not report (abort, error)."""
        response = pb.GenerateResponse(request_id=self.request.req_id)
        self._finish(response, reason, detail=detail)
        return response

    def _finish(self, response: pb.GenerateResponse, reason: str, matched_stop: str = "", detail: str = "") -> None:
        self.finished = True
        response.finish_reason = FINISH_REASONS[reason]
        response.matched_stop_string = matched_stop
        response.finish_detail = detail
        response.usage.prompt_tokens = len(self.request.prompt_token_ids)
        response.usage.completion_tokens = self.num_completion_tokens
        response.prefill_worker_id = self.prefill_worker_id
        response.decode_worker_id = self.decode_worker_id
        self._fill_timing(response.timing)

    def _fill_timing(self, out: pb.Timing) -> None:
        t = self.timing
        now = time.monotonic()
        out.router_queue_ms = _ms((t.dispatched or now) - t.arrival)
        if t.prefill is not None:
            out.prefill_queue_ms = t.prefill.queue_ms
            out.prefill_compute_ms = t.prefill.compute_ms
            out.kv_transfer_ms = t.prefill.transfer_ms
        if t.decode is not None:
            out.decode_queue_ms = t.decode.decode_queue_ms
            out.decode_ms = t.decode.decode_ms
            if t.prefill is None:  # prefilled on the decode actor: that was the prefill compute
                out.prefill_compute_ms = t.decode.local_prefill_ms
        if t.first_token_sent is not None:
            out.time_to_first_token_ms = _ms(t.first_token_sent - t.arrival)
        out.total_ms = _ms(now - t.arrival)


def _logprobs(entries: list[TokenLogprob]) -> list[pb.TokenLogprobs]:
    return [
        pb.TokenLogprobs(logprob=e.logprob, top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in e.top])
        for e in entries
    ]


def _ms(seconds: float) -> float:
    return max(0.0, seconds * 1000.0)
