"""A stream's chunks read ahead of its client: a session never waits for the reader.

A front end that wrote each chunk as its session made it held the session back whenever the
client read slowly (aiohttp's drain, gRPC's flow control): the session's outputs then waited in
its inbox unread, and with them its stop strings, which only the session's assembler finds, so
the decode actor generated on, up to max_tokens, for a client that had stalled. Here the sessions
run in tasks of their own and their chunks wait for the reader, the newest joined into the last
one waiting past a few, so a stalled reader's answer is kept in a few chunks, not one per step.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from router.errors import InternalError
from router.output_stream import OutputChunk

if TYPE_CHECKING:
    from router.session import GenerationSession


# Chunks a session may have waiting for its reader before the newest ones are joined into its
# last waiting chunk: a reader's pauses cost nothing, and a reader that stalls has its answer kept
# in a few chunks, not one per step, while its session reads on.
_CHUNKS_AHEAD = 16


async def merged(sessions: list[GenerationSession]) -> AsyncIterator[tuple[int, OutputChunk | BaseException]]:
    """Every session's chunks as they come, tagged with the session's index; a session that
    fails yields its exception in place of its end. Sessions never wait for the reader: their
    stop strings must be found as the tokens come (a session held back by a stalled reader found
    them only when the reader caught up, the decode actor generating on meanwhile, up to
    max_tokens); past ``_CHUNKS_AHEAD`` waiting chunks a session's newer chunks are joined into
    its last waiting one (unbounded, the router kept every step's chunk of a slow reader's
    answer)."""
    boxes: list[collections.deque] = [collections.deque() for _ in sessions]
    order: collections.deque[int] = collections.deque()  # the session of each waiting item, oldest first
    arrived = asyncio.Event()
    ending = False  # set before the pumps are cancelled: a cancellation then is ours

    def offer(index: int, item: OutputChunk | BaseException) -> None:
        box = boxes[index]
        last = box[-1] if box else None
        if len(box) >= _CHUNKS_AHEAD and isinstance(item, OutputChunk) and isinstance(last, (OutputChunk, _Joining)) and last.end is None:
            if isinstance(last, OutputChunk):
                last = box[-1] = _Joining.of(last)
            last.add(item)
        else:
            box.append(item)
            order.append(index)
        arrived.set()

    async def pump(index: int, session: GenerationSession) -> None:
        ended = False
        try:
            async with contextlib.aclosing(session.chunks()) as chunks:
                async for chunk in chunks:
                    ended = chunk.end is not None
                    offer(index, chunk)
            if not ended:
                offer(index, InternalError(f"{session.request.req_id}: the stream ended without a last chunk"))
        except asyncio.CancelledError:
            if ending:
                raise
            # Raised inside the session, not aimed at this task: ended silently, the reader
            # would wait for its end for good.
            offer(index, InternalError(f"{session.request.req_id}: the stream was cancelled inside the router"))
        except Exception as exc:
            offer(index, exc)

    tasks = [asyncio.create_task(pump(index, session)) for index, session in enumerate(sessions)]
    try:
        remaining = len(tasks)
        while remaining:
            while not order:
                arrived.clear()
                await arrived.wait()
            index = order.popleft()
            item = boxes[index].popleft()
            if isinstance(item, _Joining):
                item = item.chunk()
            if isinstance(item, BaseException) or item.end is not None:
                remaining -= 1
            yield index, item
    finally:
        ending = True
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Joining:
    """Consecutive chunks of one session being joined into one: lists extended and text parts
    kept apart until it is handed out (joining into a new chunk each time copied the whole
    answer so far at every step: quadratic, on the router's event loop)."""

    __slots__ = ("token_ids", "text_parts", "logprobs", "end", "prompt_logprobs")

    @classmethod
    def of(cls, first: OutputChunk) -> "_Joining":
        joining = cls()
        joining.token_ids, joining.text_parts, joining.logprobs = list(first.token_ids), [first.text], list(first.logprobs)
        joining.end, joining.prompt_logprobs = first.end, first.prompt_logprobs
        return joining

    def add(self, then: OutputChunk) -> None:
        self.token_ids.extend(then.token_ids)
        self.text_parts.append(then.text)
        self.logprobs.extend(then.logprobs)
        self.end = then.end
        if self.prompt_logprobs is None:
            self.prompt_logprobs = then.prompt_logprobs

    def chunk(self) -> OutputChunk:
        return OutputChunk(self.token_ids, "".join(self.text_parts), self.logprobs, self.end, self.prompt_logprobs)


def read_ahead(session: GenerationSession) -> AsyncIterator[OutputChunk]:
    """``session.chunks()``, read ahead of the caller (``merged``) where the request has stop
    strings: a failure raises in place. Without any, nothing the router finds ends the request
    early (the decode actor stops at EOS, stop tokens and max_tokens itself), so its chunks are
    read as the caller asks for them, without a task of their own (a hop per chunk)."""
    if not session.request.stop:
        return session.chunks()
    return _read_ahead(session)


async def _read_ahead(session: GenerationSession) -> AsyncIterator[OutputChunk]:
    async with contextlib.aclosing(merged([session])) as items:
        async for _, item in items:
            if isinstance(item, BaseException):
                raise item
            yield item
