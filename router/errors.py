"""The router's exceptions, and the one place that turns any exception into a gRPC status.

Code anywhere in the router raises one of these (or lets an engine error through); only the
servicer edge calls ``grpc_status`` / ``abort_with``. Messages of these exceptions are written
for the client; unexpected exceptions map to INTERNAL with a generic message so internals do
not leak, and are meant to be logged in full where they are caught.
"""

from __future__ import annotations

import math
from typing import NoReturn

import grpc

from engine.errors import EngineError, InvalidRequestError, ModelLoadError, RequestFailedError, UnknownRequestError


class RouterError(Exception):
    """Base class of every error the router raises on purpose; the message is safe for clients."""


class InvalidArgumentError(RouterError, ValueError):
    """A request field is invalid; ``field`` is its path in the request, e.g. ``sampling.top_p``."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class ResourceExhaustedError(RouterError):
    """The cluster cannot take this request now (queue full, no KV room); the client may retry later.

    ``retry_after_s``, when known, travels to gRPC clients as the ``retry-after`` trailer.
    """

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UnavailableError(RouterError):
    """No worker can serve the request (none ready, or the one serving it died)."""


class NotFoundError(RouterError):
    """A named entity (worker id, request id) does not exist."""


class FailedPreconditionError(RouterError):
    """The cluster is not in a state where this operation makes sense (it would leave nothing
    serving; the resources it needs are not there)."""


class DeadlineExceededError(RouterError):
    """The request's deadline passed before it finished."""


class InternalError(RouterError):
    """A broken invariant inside the cluster; the message still says which request and what failed."""


# Ordered: the first matching class wins, so subclasses come before their bases.
_STATUS_BY_TYPE: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (UnavailableError, grpc.StatusCode.UNAVAILABLE),
    (ModelLoadError, grpc.StatusCode.UNAVAILABLE),
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (FailedPreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (UnknownRequestError, grpc.StatusCode.NOT_FOUND),
    (DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (InternalError, grpc.StatusCode.INTERNAL),
    (RequestFailedError, grpc.StatusCode.INTERNAL),  # with its message: which request, what raised
)

_GENERIC_INTERNAL_MESSAGE = "internal error; the server log has the details"


def grpc_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status code and client-facing message for ``exc``."""
    exc = remote_cause(exc)
    for exc_type, code in _STATUS_BY_TYPE:
        if isinstance(exc, exc_type):
            return code, _client_message(exc)
    return grpc.StatusCode.INTERNAL, _GENERIC_INTERNAL_MESSAGE


def remote_cause(exc: BaseException) -> BaseException:
    """The engine's or router's own error behind a Ray task error, else ``exc`` itself.

    An error raised in an actor reaches the caller wrapped (``RayTaskError``, its ``str`` the
    remote traceback); its ``cause`` is the original, whose message is written for clients.
    """
    cause = getattr(exc, "cause", None)
    if isinstance(cause, (RouterError, EngineError)):
        return cause
    return exc


def _client_message(exc: BaseException) -> str:
    # KeyError's str() wraps the message in quotes; take the argument itself.
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])
    if isinstance(exc, (RouterError, EngineError)):
        return str(exc) or type(exc).__name__
    return _GENERIC_INTERNAL_MESSAGE


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> NoReturn:
    """End the RPC with the status ``exc`` maps to (``context.abort`` raises, so this never returns)."""
    code, message = grpc_status(exc)
    retry_after_s = getattr(exc, "retry_after_s", None)
    if retry_after_s is not None:
        # Whole seconds, at least 1, as HTTP's Retry-After.
        context.set_trailing_metadata((("retry-after", str(max(1, math.ceil(retry_after_s)))),))
    await context.abort(code, message)
    raise AssertionError("grpc.aio context.abort returned")  # abort always raises
