"""The router's exceptions, their API-neutral kinds, and the one place that turns any
exception into a gRPC status.

Code anywhere in the router raises one of these (or lets an engine error through); only the
API edges map them: the gRPC servicer through ``grpc_status`` / ``abort_with``, the OpenAI
HTTP server through ``classify`` and its own status table. Messages of these exceptions are written
for the client; unexpected exceptions map to INTERNAL with a generic message so internals do
not leak, and are meant to be logged in full where they are caught.
"""

from __future__ import annotations

import enum
import math
from typing import NoReturn

import grpc

from engine.errors import EngineError, InvalidRequestError, ModelLoadError, RequestFailedError, UnknownRequestError
from router.addresses import host_port


class RouterError(Exception):
    """Base class of every error the router raises on purpose; the message is safe for clients."""


class InvalidArgumentError(RouterError, ValueError):
    """A request field is invalid; ``field`` is its path in the request, e.g. ``sampling.top_p``."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class ContextLengthError(InvalidArgumentError):
    """The prompt, or the prompt and the tokens asked for, do not fit the model's context. Its
    message says "This model's maximum context length is N tokens", as vLLM's and OpenAI's do:
    clients (LiteLLM's ContextWindowExceededError, agents that then shorten their history)
    recognise the error by that text and by OpenAI's code."""

    error_code = "context_length_exceeded"


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


class ErrorKind(enum.Enum):
    """What went wrong, in terms every API maps to its own status codes (gRPC below, HTTP in
    router/openai_api/errors.py)."""

    INVALID_ARGUMENT = "invalid_argument"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNAVAILABLE = "unavailable"
    NOT_FOUND = "not_found"
    FAILED_PRECONDITION = "failed_precondition"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    INTERNAL = "internal"


# Ordered: the first matching class wins, so subclasses come before their bases.
_KIND_BY_TYPE: tuple[tuple[type[BaseException], ErrorKind], ...] = (
    (InvalidArgumentError, ErrorKind.INVALID_ARGUMENT),
    (InvalidRequestError, ErrorKind.INVALID_ARGUMENT),
    (ResourceExhaustedError, ErrorKind.RESOURCE_EXHAUSTED),
    (UnavailableError, ErrorKind.UNAVAILABLE),
    (ModelLoadError, ErrorKind.UNAVAILABLE),
    (NotFoundError, ErrorKind.NOT_FOUND),
    (FailedPreconditionError, ErrorKind.FAILED_PRECONDITION),
    (UnknownRequestError, ErrorKind.NOT_FOUND),
    (DeadlineExceededError, ErrorKind.DEADLINE_EXCEEDED),
    (InternalError, ErrorKind.INTERNAL),
    (RequestFailedError, ErrorKind.INTERNAL),  # with its message: which request, what raised
)

_GRPC_CODES = {kind: getattr(grpc.StatusCode, kind.name) for kind in ErrorKind}

_GENERIC_INTERNAL_MESSAGE = "internal error; the server log has the details"


def classify(exc: BaseException) -> tuple[ErrorKind, str]:
    """The kind of ``exc`` and its client-facing message (generic for unexpected exceptions)."""
    exc = remote_cause(exc)
    for exc_type, kind in _KIND_BY_TYPE:
        if isinstance(exc, exc_type):
            return kind, _client_message(exc)
    return ErrorKind.INTERNAL, _GENERIC_INTERNAL_MESSAGE


def grpc_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status code and client-facing message for ``exc``."""
    kind, message = classify(exc)
    return _GRPC_CODES[kind], message


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


def cannot_listen(field: str, host: str, port: int) -> str:
    """What a router listener that cannot bind says: the config field, the address, what to do."""
    return (f"router.{field}: cannot listen on {host_port(host, port)} (the port is in use, or the host is not "
            "an address of this machine); give another port, or 0 for any free one")
