"""A failed Responses response's ``error``, as a background response's poller or a stream's
``error`` event shows it: the client's mistakes are ``invalid_prompt`` naming the field, a full
cluster is ``rate_limit_exceeded``, and the server's own faults are ``server_error`` without
their internals."""

from __future__ import annotations

from engine.errors import InvalidRequestError
from router.errors import InvalidArgumentError, ResourceExhaustedError
from router.responses_api.front_end import response_error


class _RayTaskError(Exception):
    """What a worker's error looks like at the router: wrapped, its cause the original."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"Traceback (most recent call last): ... {cause}")
        self.cause = cause


def test_each_kind_of_failure_gets_its_code_and_a_message_fit_for_the_client():
    refused = response_error(InvalidArgumentError("allowed_token_ids", "holds no token that the requested structured output allows next"))
    assert refused == {"code": "invalid_prompt", "message": "allowed_token_ids: holds no token that the requested structured output allows next"}
    from_a_worker = response_error(_RayTaskError(InvalidRequestError("max_tokens", "prompt plus max_tokens needs 9 KV blocks")))
    assert from_a_worker["code"] == "invalid_prompt" and "max_tokens" in from_a_worker["message"] and "Traceback" not in from_a_worker["message"]
    assert response_error(ResourceExhaustedError("no decode capacity"))["code"] == "rate_limit_exceeded"
    internal = response_error(KeyError("/srv/secrets/path"))
    assert internal["code"] == "server_error" and "secrets" not in internal["message"]


def test_anthropics_refusals_of_a_large_body_and_a_full_queue_are_what_its_client_acts_on():
    """A body past the size limit is Anthropic's 413 request_too_large (it was a 500 api_error,
    logged as the server's fault); a full queue's 429 says when to retry, as the OpenAI routes'."""
    import json

    from aiohttp import web

    from router.anthropic_api.messages import error_response

    too_large = error_response(web.HTTPRequestEntityTooLarge(max_size=64, actual_size=128))
    assert too_large.status == 413 and json.loads(too_large.text)["error"]["type"] == "request_too_large"
    full = error_response(ResourceExhaustedError("the queue is full", retry_after_s=2.5))
    assert full.status == 429 and full.headers["Retry-After"] == "3"
