"""The router's queue limit: requests without a first token are counted, beyond it refused."""

from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams
from router.config import RouterConfig
from router.dispatcher import ActiveRequest, Dispatcher
from router.errors import InvalidArgumentError, ResourceExhaustedError
from router.pool import WorkerPool
from router.validation import ValidatedRequest


class _Assembler:
    def __init__(self):
        self.has_sent_tokens = False
        self.completion_token_ids: list[int] = []


def _active(req_id: str) -> ActiveRequest:
    request = ValidatedRequest(req_id, [5, 6], None, SamplingParams(), [], True, 0, 0.0, None)
    return ActiveRequest(request, _Assembler(), outputs=None)


def test_requests_beyond_the_queue_limit_are_refused_until_one_starts_streaming():
    dispatcher = Dispatcher(WorkerPool(), RouterConfig(max_queued_requests=2))
    first, second = _active("a"), _active("b")
    dispatcher.admit(first)
    dispatcher.admit(second)
    with pytest.raises(ResourceExhaustedError, match="limit 2"):
        dispatcher.admit(_active("c"))
    first.assembler.has_sent_tokens = True  # streaming requests no longer count as queued
    dispatcher.admit(_active("c"))
    with pytest.raises(InvalidArgumentError, match="request_id"):
        dispatcher.admit(_active("b"))
