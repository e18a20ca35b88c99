"""The one place the OpenAI HTTP server turns an exception into a status and OpenAI's error JSON.

OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``; the official client reads
it into ``BadRequestError`` (400), ``AuthenticationError`` (401), ``NotFoundError`` (404),
``RateLimitError`` (429) and ``InternalServerError`` (5xx).
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from aiohttp import web

from router.errors import ErrorKind, NotFoundError, RouterError, classify, remote_cause

logger = logging.getLogger(__name__)

# kind -> (HTTP status, OpenAI error type)
_HTTP = {
    ErrorKind.INVALID_ARGUMENT: (400, "invalid_request_error"),
    ErrorKind.NOT_FOUND: (404, "invalid_request_error"),
    ErrorKind.FAILED_PRECONDITION: (400, "invalid_request_error"),
    ErrorKind.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    ErrorKind.UNAVAILABLE: (503, "service_unavailable"),
    ErrorKind.DEADLINE_EXCEEDED: (504, "timeout"),
    ErrorKind.INTERNAL: (500, "internal_error"),
}


class UnauthenticatedError(RouterError):
    """No bearer token, or the wrong one."""


class ModelNotFoundError(NotFoundError):
    """The request names a model this server does not serve."""


def error_body(exc: BaseException) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, OpenAI error JSON, extra headers) for ``exc``."""
    if isinstance(exc, UnauthenticatedError):
        return 401, request_error_json(str(exc), "invalid_request_error", None, "invalid_api_key"), {"WWW-Authenticate": "Bearer"}
    if isinstance(exc, ModelNotFoundError):
        return 404, request_error_json(str(exc), "invalid_request_error", "model", "model_not_found"), {}
    kind, message = classify(exc)
    status, error_type = _HTTP[kind]
    cause = remote_cause(exc)
    code = getattr(cause, "error_code", None)  # an error's own code where the API names one
    return status, request_error_json(message, error_type, getattr(cause, "field", None), code if isinstance(code, str) else kind.value), retry_after_headers(exc)


def retry_after_headers(exc: BaseException) -> dict[str, str]:
    """A Retry-After header where the refusal says when to come back (a full queue), which the
    official clients' retries wait for; else none."""
    retry_after_s = getattr(remote_cause(exc), "retry_after_s", None)
    return {} if retry_after_s is None else {"Retry-After": str(max(1, math.ceil(retry_after_s)))}


def log_if_internal(exc: BaseException, what: str) -> None:
    """Log that ``what`` failed, with ``exc``'s traceback, where it is the server's own fault: the
    message its client gets says the server log has the details."""
    if isinstance(exc, (UnauthenticatedError, web.HTTPException)):
        return  # the client's (a body too large is aiohttp's HTTPRequestEntityTooLarge)
    if classify(exc)[0] is ErrorKind.INTERNAL:
        logger.error("%s failed", what, exc_info=exc)


def error_response(exc: BaseException) -> web.Response:
    status, body, headers = error_body(exc)
    return web.Response(status=status, text=json.dumps(body), content_type="application/json", headers=headers)


def request_error_json(message: str, error_type: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}
