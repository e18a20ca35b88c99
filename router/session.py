"""One generation request's life at the router, whatever API carried it.

An API edge (the gRPC servicer, the OpenAI HTTP server) validates its own message into a
``ValidatedRequest``, opens a session, renders the session's ``OutputChunk``s in its own
format, and maps the router's exceptions to its own status codes in one place. Everything
between is here: admission, the wait for a ready deployment, dispatch, migration of a stream
whose decode actor died, the last chunk of a stream that fails after tokens were sent, the
latency metrics, and, however the stream ends, the release of what the request holds on
every worker.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from decode_workers.messages import SeqOutput
from engine.errors import InvalidRequestError
from router.dispatcher import ActiveRequest, Failure, Restart
from router.errors import InvalidArgumentError, UnavailableError, remote_cause
from router.output_stream import OutputAssembler, OutputChunk
from router.validation import ValidatedRequest

if TYPE_CHECKING:
    from router.core import Router

logger = logging.getLogger(__name__)

PREFILL_REPORT_WAIT_S = 2.0  # how long a finished request's last chunk waits for its prefill's answer
# How long a first chunk waits for the prompt log-probabilities that answer carries (its decode
# actor may start from the blocks a moment before the router hears from the prefill actor).
PROMPT_LOGPROBS_WAIT_S = 30.0


class GenerationSession:
    """Admitted at construction (``open``); ``chunks`` streams it; ``close`` always runs."""

    def __init__(self, router: "Router", active: ActiveRequest):
        self.router = router
        self.active = active
        self._release: asyncio.Future | None = None  # the release, once started (``close``)

    @classmethod
    async def open(
        cls, router: "Router", request: ValidatedRequest, client_gone: Callable[[], bool], leader: "GenerationSession | None" = None,
    ) -> "GenerationSession":
        """Admit ``request``: ResourceExhaustedError beyond the queue limit, InvalidArgumentError
        for an id still in use. ``leader``: a session of the same prompt (a choice of an ``n``
        request) this one is placed after, where that one's prompt is cached then
        (``ActiveRequest.leader``)."""
        try:
            await router.dispatcher.wait_for_id(request.req_id)
            active = ActiveRequest(request, OutputAssembler(request, router.tokenizer, router.model_info.eos_token_ids), client_gone=client_gone)
            active.leader = leader.active if leader is not None else None
            router.traffic.on_arrival()  # demand, whether admitted or refused as overload
            router.dispatcher.admit(active)
        finally:  # in flight now (its adapter version held as such), or never
            router.lora.unpin(request.sampling_params.lora_digest, request.req_id)
        return cls(router, active)

    @property
    def request(self) -> ValidatedRequest:
        return self.active.request

    async def chunks(self) -> AsyncIterator[OutputChunk]:
        """The request's output, until a chunk with ``end``; raises the router's errors for a
        request that fails before any token was sent."""
        router, active = self.router, self.active
        try:
            await router.wait_ready()
            await router.dispatcher.dispatch(active)
            while True:
                item = await self._next_item()
                if isinstance(item, SeqOutput):
                    if active.assembler.awaits_prompt_logprobs and not item.prompt_logprobs:
                        if item.token_ids and not await self._await_prefill_report(PROMPT_LOGPROBS_WAIT_S):
                            # Its prefill was cancelled: its decode actor died, and the Restart
                            # queued behind places the request again (the scores come then).
                            continue
                        if active.assembler.awaits_prompt_logprobs:
                            if item.attempt != active.attempt:
                                # Decoded before its prefill actor died unanswered (its answer had
                                # the prompt's scores): the request was placed again, a Restart follows.
                                continue
                            if item.token_ids:
                                raise UnavailableError("the prompt's log-probabilities did not arrive from its prefill worker; try again")
                    if item.finished:
                        await self._await_prefill_report(PREFILL_REPORT_WAIT_S)
                    chunk = active.assembler.on_output(item)
                    if item.token_ids:
                        active.first_output.set()  # its followers (choices of its prompt) may go
                    self._observe(chunk)
                    if chunk.end is not None:
                        # Released now, not once the client has read the end: a stop string the
                        # router found ends the request on its decode actor at once (a client
                        # reading slowly kept it generating, up to max_tokens, until it caught up).
                        self._start_release()
                    yield chunk
                    if chunk.end is not None:
                        return
                    continue
                if isinstance(item, Restart):
                    try:
                        await router.dispatcher.restart(active, item)
                        continue
                    except Exception as exc:
                        if not active.assembler.has_sent_tokens:
                            raise
                        item = Failure(remote_cause(exc))
                if active.assembler.has_sent_tokens:
                    # The client has part of its answer: it ends with a last chunk that says
                    # why, with the usage so far, rather than a bare error.
                    if isinstance(item.error, (InvalidRequestError, InvalidArgumentError)):  # the client's, as a prefill run again found it
                        chunk = active.assembler.final_chunk("error", item.error.problem, error_field=item.error.field)
                    else:
                        chunk = active.assembler.final_chunk("error", str(item.error))
                    self._observe(chunk)
                    yield chunk
                    return
                self._observe_failure("error")
                raise item.error
        except (asyncio.CancelledError, GeneratorExit):
            if active.assembler.finished:
                raise  # closed after its last chunk (front ends stop reading there): no abort
            logger.info("req %s: cancelled by the client or its deadline", active.req_id)
            self._observe_failure("abort")
            raise
        except Exception as exc:
            logger.warning("req %s: ended with %r", active.req_id, remote_cause(exc))
            raise

    async def _next_item(self):
        """The next output, restart or failure. Outputs queued behind one another arrive merged
        (router/output_inbox.py); after the first token, an output waits for
        ``stream_interval`` tokens, unless the stream ends first."""
        interval = self.router.config.stream_interval if self.active.assembler.has_sent_tokens else 1
        return await self.active.outputs.get(interval)

    async def _await_prefill_report(self, wait_s: float) -> bool:
        """A short request can finish decoding before the prefill actor's answer (sent once it
        saw its last write complete) reaches the router: the last chunk waits for it briefly,
        so that its timing carries the prefill and the KV bytes moved (seen: a 6-token request
        ended with no prefill timing on a loaded host). The first chunk of a request that asked
        for its prompt's log-probabilities waits for them likewise: that answer carries them.

        False when the prefill was cancelled: only ``Dispatcher.on_worker_died`` does that while
        the stream runs, with a Restart queued behind (``restart`` runs inside this stream)."""
        task = self.active.prefill_task
        if task is None:
            return True
        if not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), wait_s)
            except asyncio.CancelledError:
                # The shield passes the prefill task's cancel on; only a cancel of this stream
                # itself (its client gone) ends it. (Python 3.10 cannot tell the two apart when
                # both come at once: the prefill's is taken, and the stream reads its Restart.)
                if not task.cancelled() or (sys.version_info >= (3, 11) and asyncio.current_task().cancelling()):
                    raise
            except Exception:  # late or failed: the chunk goes without it
                logger.debug("req %s: finished before its prefill report arrived", self.active.req_id)
        return not task.cancelled()

    def close(self) -> "asyncio.Future[None]":
        """Start releasing what the request holds on every worker, now (``Dispatcher.release``
        says why not at the caller's first await), once however often it is called (``chunks``
        starts it at the last chunk, the front end's ``finally`` again); await the result for
        the end of it. Shielded: a cancelled caller still frees the request's blocks."""
        return asyncio.shield(self._start_release())

    def _start_release(self) -> asyncio.Future:
        """The request's release, started at the first call (what ``close`` shields)."""
        if self._release is None:
            self._release = self.router.dispatcher.release(self.active)
        return self._release

    def _observe(self, chunk: OutputChunk) -> None:
        """Record a chunk's latencies (and the request's, on its last chunk)."""
        metrics, active = self.router.metrics, self.active
        now = time.monotonic()
        if chunk.end is not None:
            end = chunk.end
            self.router.traffic.on_finished(
                end.prompt_tokens, end.completion_tokens, end.timing.router_queue_ms, end.timing.prefill_queue_ms, end.timing.decode_queue_ms
            )
        if metrics is None:
            return
        timing = active.assembler.timing
        if chunk.token_ids:
            metrics.generation_tokens.inc(len(chunk.token_ids))
            if active.last_message_at is None:  # the first tokens
                metrics.observe_first_token(now - timing.arrival, len(active.request.prompt_token_ids))
            else:
                # Per token: a message carrying several (merged outputs, a stream interval)
                # counts each at its share of the gap.
                num_tokens = len(chunk.token_ids)
                gap = (now - active.last_message_at) / num_tokens
                for _ in range(num_tokens):
                    metrics.itl.observe(gap)
            active.last_message_at = now
        if chunk.end is not None:
            ttft = None if timing.first_token_sent is None else timing.first_token_sent - timing.arrival
            if active.last_message_at is None:  # no token ever went out (echo of a prompt alone): its prompt still counts
                metrics.prompt_tokens.inc(chunk.end.prompt_tokens)
            metrics.observe_finished(
                chunk.end.reason, ttft, now - timing.arrival, active.assembler.num_completion_tokens,
                chunk.end.timing, chunk.end.prompt_tokens, active.request.sampling_params.max_tokens,
            )
            speculation = chunk.end.speculation
            if speculation is not None and speculation.draft_tokens:
                metrics.observe_speculation(speculation.acceptance_rate, speculation.tokens_per_step)

    def _observe_failure(self, reason: str) -> None:
        if self.router.metrics is not None:
            self.router.metrics.requests(reason).inc()

