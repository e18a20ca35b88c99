"""One stream's inbox between the router's output collector and the stream's session.

The collector puts every decode output of the stream here, and the dispatcher its restarts
and failures; the session takes them in order. Decode outputs that arrive while the session
is still busy with the previous message (a router falling behind) merge into one, and a
session that asks for at least N tokens is woken only once they are there (or the stream
ended, or something else arrived behind them): a message and a wake-up cost the router
about as much per stream as the tokens they carry, so fewer, fuller ones are what lets one
router carry more streams. The stream's first output never takes later ones in: the client
sees its first token on its own, however far behind the router is (a CI run on a loaded
host once sent the first three tokens as one message).
"""

from __future__ import annotations

import asyncio
from collections import deque

from decode_workers.messages import SeqOutput


class OutputInbox:
    """FIFO of a stream's outputs, restarts and failures; consecutive outputs merge."""

    __slots__ = ("_items", "_waiter", "_min_tokens", "_first_output")

    def __init__(self) -> None:
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None
        self._min_tokens = 1
        self._first_output: SeqOutput | None = None

    def put_nowait(self, item) -> None:
        last = self._items[-1] if self._items else None
        if isinstance(item, SeqOutput) and isinstance(last, SeqOutput) and not last.finished and last is not self._first_output:
            _append(last, item)
        else:
            self._items.append(item)
            if self._first_output is None and isinstance(item, SeqOutput):
                self._first_output = item
        if self._waiter is not None and not self._waiter.done() and self._ready():
            self._waiter.set_result(None)

    async def get(self, min_tokens: int = 1):
        """The next item; a decode output once it holds ``min_tokens`` tokens, finished, or is
        followed by something else."""
        self._min_tokens = min_tokens
        while not self._ready():
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    def empty(self) -> bool:
        return not self._items

    def _ready(self) -> bool:
        if not self._items:
            return False
        first = self._items[0]
        return (
            not isinstance(first, SeqOutput) or first.finished or len(first.token_ids) >= self._min_tokens or len(self._items) > 1
        )


def _append(output: SeqOutput, later: SeqOutput) -> None:
    """``output`` carries ``later``'s tokens after its own, and ``later``'s end if it has one."""
    # (In place: a reader that waits has every step merged here, and a copy each time was
    # quadratic in the answer's length.)
    output.token_ids.extend(later.token_ids)
    output.logprobs.extend(later.logprobs)
    output.finished, output.finish_reason, output.error = later.finished, later.finish_reason, later.error
    output.timing = later.timing or output.timing  # a first output's timing outlives the middle ones merged after it
    output.error_field = later.error_field
