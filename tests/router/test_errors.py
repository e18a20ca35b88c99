"""Every error reaches the client as the right gRPC status, and internals do not leak."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from engine.errors import InvalidRequestError, ModelLoadError, UnknownRequestError
from router import errors

Code = grpc.StatusCode
CASES = [
    (errors.InvalidArgumentError("sampling.top_p", "must be in (0, 1]"), Code.INVALID_ARGUMENT, "sampling.top_p: must be in (0, 1]"),
    (InvalidRequestError("top_k", "bad"), Code.INVALID_ARGUMENT, "top_k: bad"),
    (errors.ResourceExhaustedError("router queue full"), Code.RESOURCE_EXHAUSTED, "router queue full"),
    (errors.UnavailableError("no decode worker is ready"), Code.UNAVAILABLE, "no decode worker is ready"),
    (ModelLoadError("model not loaded"), Code.UNAVAILABLE, "model not loaded"),
    (errors.NotFoundError("no worker decode-9"), Code.NOT_FOUND, "no worker decode-9"),
    (UnknownRequestError("no request r1"), Code.NOT_FOUND, "no request r1"),
    (errors.DeadlineExceededError("deadline passed"), Code.DEADLINE_EXCEEDED, "deadline passed"),
    (errors.InternalError("req_id=r1: block table mismatch"), Code.INTERNAL, "req_id=r1: block table mismatch"),
]


@pytest.mark.parametrize(("exc", "code", "message"), CASES, ids=[type(c[0]).__name__ for c in CASES])
def test_error_maps_to_its_status_with_its_message(exc, code, message):
    assert errors.grpc_status(exc) == (code, message)


def test_unexpected_exception_is_internal_without_leaking_its_text():
    code, message = errors.grpc_status(RuntimeError("secret path /home/x/model.bin"))
    assert code == grpc.StatusCode.INTERNAL
    assert "secret" not in message


def test_abort_with_sends_the_mapped_status():
    class FakeContext:
        async def abort(self, code, details):
            self.sent = (code, details)
            raise grpc.aio.AbortError()

    context = FakeContext()
    with pytest.raises(grpc.aio.AbortError):
        asyncio.run(errors.abort_with(context, errors.InvalidArgumentError("prompt", "empty")))
    assert context.sent == (grpc.StatusCode.INVALID_ARGUMENT, "prompt: empty")
