"""The router's OpenAI-compatible HTTP server (aiohttp), beside its gRPC listeners.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` and
``GET /health`` (200 once the pools can serve, 503 before; no token needed, like gRPC health),
and the other front ends on the same port, one module each (``FRONT_END_MODULES``): vLLM's
auxiliary endpoints (router/openai_api/vllm_endpoints.py), OpenAI's Responses API
(router/responses_api/) and Anthropic's Messages API (router/anthropic_api/). A request names the model
by a served name or, as vLLM answers to it, by the path (or hub id) the deployment was started
with.
A generation call reads its body (router/openai_api/protocol.py), validates and tokenizes each
choice like a gRPC request, opens one ``GenerationSession`` per choice, and renders their
chunks (router/openai_api/responses.py): one JSON response, or server-sent events ending in
``data: [DONE]``. The response starts with the first token, so a request refused or failed
before it gets a real HTTP status (429 with Retry-After, 503, ...). A client that disconnects
cancels the handler (``handler_cancellation``); its sessions close and free their blocks.
With ``auth_token`` set every ``/v1/`` route needs ``Authorization: Bearer <token>`` (vLLM's rule).

Browsers may call every route from another origin (CORS), as vLLM's ``--allowed-origins`` lets
them: ``router.allowed_origins`` (vLLM's default, any: "*"). A preflight (``OPTIONS`` with
``Access-Control-Request-Method``) is answered 204 before authentication, which never applies to
``OPTIONS`` (a browser sends no token with it); every response, a stream's too, carries
``Access-Control-Allow-Origin``. Methods and headers: any, as vLLM's defaults.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import re
import ssl
import time
import uuid
from typing import TYPE_CHECKING, Any

from aiohttp import web

from engine import bounded_json
from router import sse
from router.anthropic_api import messages
from router.addresses import bare_host, host_port
from router.responses_api import front_end as responses_front_end
from router.errors import InvalidArgumentError, UnavailableError
from router.openai_api.chat_format import ChatFormat
from router.openai_api.errors import ModelNotFoundError, UnauthenticatedError, error_body, error_response, log_if_internal, request_error_json
from router.openai_api import vllm_endpoints
from router.openai_api.protocol import ApiRequest, is_client_request_id, read_chat, read_completion, render_conversation
from router.openai_api.tool_calls import read_tool_calling
from router.openai_api.responses import ChoiceState, envelope, usage
from router.output_stream import end_failure
from router.read_ahead import merged
from router.session import GenerationSession

if TYPE_CHECKING:
    from router.core import Router

logger = logging.getLogger(__name__)

# A request body may hold the longest prompt the router takes (64 characters per token of
# context, up to 4 bytes each), and JSON's escapes on top.
MAX_BODY_BYTES = 64 * 1024 * 1024
# Front ends served beside completions and chat completions.
FRONT_END_MODULES = (vllm_endpoints, messages, responses_front_end)


REQUEST_ID_HEADER = "X-Request-Id"
# A preflight's answer: any method and (echoing the request's) any header, as vLLM's defaults
# (Starlette's CORS middleware with "*"), cached by the browser for 10 minutes.
_CORS_METHODS = "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"
_CORS_MAX_AGE_S = "600"
# Where a generation's handler leaves the id its response goes by (a typed key: aiohttp warns on
# plain strings; older aiohttp has no RequestKey).
_RESPONSE_ID = web.RequestKey("response_id", str) if hasattr(web, "RequestKey") else "pdserve_response_id"


async def _with_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """A generation's response carries the id it goes by (as vLLM's request id headers do)."""
    if _RESPONSE_ID in request:
        response.headers[REQUEST_ID_HEADER] = request[_RESPONSE_ID]


def _shared_prompt(request) -> tuple | None:
    """What makes choices share a prompt's KV (its tokens, adapter and cache salt); None for one
    that scores its prompt (its log-probabilities need every position computed, none cached)."""
    params = request.sampling_params
    if params.prompt_logprobs is not None:
        return None
    return (tuple(request.prompt_token_ids), params.lora_name, params.cache_salt)


class OpenAIServer:
    def __init__(
        self, router: "Router", host: str, port: int, model_names: list[str], auth_token: str | None = None,
        ssl_context: ssl.SSLContext | None = None, reuse_port: bool = False, model_aliases: list[str] | None = None,
        chat: ChatFormat | None = None,
    ):
        self.router = router
        self.allowed_origins = list(router.config.allowed_origins)  # origins a browser may call from; "*": any
        self.reuse_port = reuse_port  # replicas of the router share one port (SO_REUSEPORT)
        self.host = bare_host(host)
        self.requested_port = port
        self.model_names = list(model_names)
        # Also answered to, not listed: the model as the deployment was started with it.
        self.model_aliases = [alias for alias in (model_aliases or []) if alias not in self.model_names]
        self.auth_token = auth_token
        self.ssl_context = ssl_context
        self.created = int(time.time())
        self.chat = chat or ChatFormat.of(router)
        self.runner: web.AppRunner | None = None
        self.port: int | None = None

    @property
    def chat_template(self):
        """The chat template every front end on this server renders with (None: chat is off)."""
        return self.chat.template

    @property
    def reasoning(self):
        """The deployment's reasoning parser (None: none)."""
        return self.chat.reasoning

    def application(self) -> web.Application:
        """An app with this server's edge (CORS, authentication, errors, the request id header)
        and no route yet."""
        app = web.Application(middlewares=[self._edge], client_max_size=MAX_BODY_BYTES)
        app.on_response_prepare.append(_with_request_id)
        app.on_response_prepare.append(self._allow_origin)
        return app

    async def start(self) -> int:
        app = self.application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        # The other front ends on this port, one module each (each adds its routes; one whose
        # clients expect another error shape names its path prefix and its error_response).
        self.front_ends = {module.__name__: module.add_routes(app, self) for module in FRONT_END_MODULES}
        # handler_cancellation: a client that goes away cancels its handler, which aborts its requests.
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, self.requested_port, ssl_context=self.ssl_context, reuse_port=self.reuse_port)
        await site.start()
        self.port = self.runner.addresses[0][1]
        logger.info("OpenAI API listening on %s://%s (model %s)", "https" if self.ssl_context else "http", host_port(self.host, self.port), ", ".join(self.model_names))
        return self.port

    async def resume_background_responses(self) -> None:
        """Run again the background responses this router's earlier life left in progress
        (router/responses_api/board.py); called once per router process, as it starts."""
        await self.front_ends[responses_front_end.__name__].resume()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    # -- edge: CORS, authentication and errors, in one place ------------------------------

    @web.middleware
    async def _edge(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            if request.method == "OPTIONS" and "Origin" in request.headers and "Access-Control-Request-Method" in request.headers:
                return self._preflight(request)
            if request.path.startswith("/v1/") and request.method != "OPTIONS":
                self._authenticate(request)
            return await handler(request)
        except web.HTTPException as exc:  # unknown route, wrong method
            if exc.status < 400:
                raise
            shaped = _error_shape_of(request.path)  # (an Anthropic client reads Anthropic's shape)
            if shaped is not None:
                return shaped.error_response(exc)
            return web.json_response(request_error_json(f"{request.method} {request.path}: {exc.reason}"), status=exc.status)
        except Exception as exc:
            log_if_internal(exc, f"{request.method} {request.path}")
            shaped = _error_shape_of(request.path)
            return error_response(exc) if shaped is None else shaped.error_response(exc)

    def _preflight(self, request: web.Request) -> web.Response:
        """A browser's CORS preflight: 204 with what it may send (400 for an origin not allowed,
        as vLLM's Starlette answers it)."""
        if self._origin_allowed(request) is None:
            message = f"origin {request.headers['Origin']!r} is not allowed (router.allowed_origins)"[:300]
            return web.json_response(request_error_json(message), status=400)
        headers = {
            "Access-Control-Allow-Methods": _CORS_METHODS,
            "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers") or "*",
            "Access-Control-Max-Age": _CORS_MAX_AGE_S,
        }
        return web.Response(status=204, headers=headers)

    def _origin_allowed(self, request: web.Request) -> str | None:
        """The Access-Control-Allow-Origin a response to ``request`` carries: "*" where any origin
        may call, the request's Origin where it is one allowed; None: none."""
        if "*" in self.allowed_origins:
            return "*"
        origin = request.headers.get("Origin")
        return origin if origin in self.allowed_origins else None

    async def _allow_origin(self, request: web.Request, response: web.StreamResponse) -> None:
        """Every response, as it starts (a stream's too): the origins that may read it."""
        origin = self._origin_allowed(request)
        if origin is None:
            return
        response.headers["Access-Control-Allow-Origin"] = origin
        if origin != "*":  # the answer depends on the Origin: caches must keep one per origin
            vary = response.headers.get("Vary")
            response.headers["Vary"] = f"{vary}, Origin" if vary else "Origin"

    def _authenticate(self, request: web.Request) -> None:
        if self.auth_token is None:
            return
        # (A header's bytes that are no UTF-8 come as surrogates: compared as the bytes they were,
        # not a UnicodeEncodeError answered 500 with a traceback logged.)
        offered = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if hmac.compare_digest(offered, f"Bearer {self.auth_token}".encode()):
            return
        # Anthropic's clients send the key as x-api-key.
        if hmac.compare_digest(request.headers.get("x-api-key", "").encode("utf-8", "surrogateescape"), self.auth_token.encode()):
            return
        raise UnauthenticatedError("missing or wrong token (Authorization: Bearer <token>, or x-api-key: <token>)")

    # -- routes --------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if not self.router.readiness.is_ready:
            return error_response(UnavailableError("the deployment is not ready yet"))
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        info = self.router.model_info
        data = [
            {"id": name, "object": "model", "created": self.created, "owned_by": "pdserve", "root": info.name, "max_model_len": info.max_context_len}
            for name in self.model_names
        ]
        # LoRA adapters as vLLM lists them: their directory as root, the base model as parent.
        data += [
            {"id": name, "object": "model", "created": self.created, "owned_by": "pdserve", "root": directory, "parent": self.model_names[0], "max_model_len": info.max_context_len}
            for name, directory in info.lora_adapters.items()
        ]
        return web.json_response({"object": "list", "data": data})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, read_completion(await _json(request)), chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        api = read_chat(await _json(request), self.chat_template, self.chat.tool_call_parser, self.reasoning)
        return await self._generate(request, api, chat=True)

    # -- what the other front ends on this server share --------------------------------

    async def read_json(self, request: web.Request) -> Any:
        return await _json(request)

    def model_name(self, requested: Any) -> str:
        """The served name a request's ``model`` field names (the first served name when absent)."""
        if requested is not None and not isinstance(requested, str):
            raise InvalidArgumentError("model", f"must be a string, got {type(requested).__name__}")
        return self._model(requested)

    def lora_name(self, model: str) -> str | None:
        """The LoRA adapter a resolved ``model`` name runs through (None: the base model)."""
        return model if model in self.router.model_info.lora_adapters else None

    def render_chat(self, body: dict) -> str:
        """A chat body's prompt text (messages, tools, template options) through the model's template."""
        if self.chat_template is None:
            raise InvalidArgumentError("messages", "this model has no chat template (tokenizer_config.json or chat_template.jinja)")
        template = self.chat_template.for_tools(body.get("tools"))
        calling = read_tool_calling(body, template.text, self.chat.tool_call_parser) if body.get("tools") else None
        return render_conversation(body, template, calling.tools if calling is not None else None)


    # -- generation ----------------------------------------------------------------------

    async def _generate(self, request: web.Request, api: ApiRequest, chat: bool) -> web.StreamResponse:
        created = int(time.time())  # when it was asked, streamed or whole (vLLM's): not when it ended
        model = self._model(api.model)
        # The client's id for the call (its X-Request-Id header, else vLLM's request_id field,
        # vLLM's order) names the response and comes back in the header. A header a proxy set
        # in another form is not ours to refuse: it is passed over. The router's requests add a
        # suffix of their own: calls that share an id (a trace id fanned out) never collide,
        # and no client can hold another's id in flight.
        client_id = request.headers.get(REQUEST_ID_HEADER)
        if client_id is None or not is_client_request_id(client_id):
            client_id = api.request_id
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{client_id or uuid.uuid4().hex}"
        request[_RESPONSE_ID] = client_id or response_id
        unique = uuid.uuid4().hex[:8]
        # Every choice is validated before any is admitted: a bad one admits none. The n choices
        # of a prompt share it: tokenized once (a long prompt, n = 16, was tokenized 16 times).
        validated = []
        remembered = functools.lru_cache(maxsize=None)(self.router.tokenizer.encode)  # (this call's prompts and bad words)

        def encode(*args, **kwargs) -> list[int]:
            return list(remembered(*args, **kwargs))  # each choice its own list of the ids

        sessions: list[GenerationSession] = []
        limit = self.router.config.max_queued_requests
        if len(api.choices) > max(limit, 1):
            # Each choice waits for its first token as a request of its own: more than the router
            # queues at once would be refused (429) at every retry.
            raise InvalidArgumentError("n", f"n x prompts is {len(api.choices)}, more than the {limit} requests this router queues at once (max_queued_requests)")
        try:
            for index, choice in enumerate(api.choices):
                choice.request_id = f"{response_id}.{unique}-{index}" if client_id else f"{response_id}-{index}"
                choice.lora_name = self.lora_name(model)
                validated.append(await self.router.validate_input(choice, encode=encode))

            def client_gone() -> bool:
                return request.transport is None or request.transport.is_closing()

            # The choices of one prompt (n) follow its first: placed once its prompt is computed,
            # where it is cached (router.dispatcher's ActiveRequest.leader), it is computed once.
            leaders: dict[tuple, GenerationSession] = {}
            for one in validated:
                key = _shared_prompt(one) if self.router.config.share_choice_prompts else None
                session = await GenerationSession.open(self.router, one, client_gone, leaders.get(key) if key is not None else None)
                sessions.append(session)
                if key is not None:
                    leaders.setdefault(key, session)
            states = [ChoiceState.of(index, chat, api, one, echo=self._echo(api, one)) for index, one in enumerate(validated)]
            chunks = merged(sessions)
            async with contextlib.aclosing(chunks):
                if api.stream:
                    return await self._stream(request, api, response_id, model, chat, states, chunks, created)
                return await self._whole(api, response_id, model, chat, states, chunks, created)
        finally:
            for one in validated:  # (a choice refused, or a session that did not open, leaves no pin behind)
                self.router.lora.unpin(one.sampling_params.lora_digest, one.req_id)
            await asyncio.gather(*(session.close() for session in sessions))

    def _echo(self, api: ApiRequest, request) -> str:
        """The prompt as a completions choice echoes it (its text, or its token ids decoded)."""
        if not api.echo:
            return ""
        if request.prompt_text is not None:
            return request.prompt_text
        return self.router.tokenizer.decode(request.prompt_token_ids, skip_special_tokens=request.skip_special_tokens)

    def _model(self, requested: str | None) -> str:
        if requested is None:
            return self.model_names[0]
        if requested in self.model_aliases:
            return self.model_names[0]
        if requested not in self.model_names and requested not in self.router.model_info.lora_adapters:
            served = [*self.model_names, *self.router.model_info.lora_adapters]
            raise ModelNotFoundError(f"model {requested!r} is not served here; /v1/models lists {served}")
        return requested

    async def _whole(self, api: ApiRequest, response_id: str, model: str, chat: bool, states: list[ChoiceState], chunks, created: int) -> web.Response:
        async for index, item in chunks:
            if isinstance(item, BaseException):
                raise item
            states[index].add(item, self.router.tokenizer)
        failed = next((s.end for s in states if s.end.reason == "error"), None)
        if failed is not None:
            raise end_failure(failed, failed.completion_tokens)
        body = envelope(response_id, model, chat, stream=False, created=created, service_tier=api.service_tier)
        body["choices"] = [state.whole() for state in states]
        if chat and api.prompt_logprobs is not None:
            body["prompt_logprobs"] = states[0].prompt_logprobs  # vLLM's place for them: one prompt
        if chat and api.return_token_ids:
            body["prompt_token_ids"] = states[0].prompt_token_ids
        body["usage"] = _usage(api, states)
        return web.json_response(body)

    async def _stream(
        self, request: web.Request, api: ApiRequest, response_id: str, model: str, chat: bool, states: list[ChoiceState], chunks, created: int,
    ) -> web.StreamResponse:
        response = sse.event_stream()
        started = False
        try:
            async for index, item in chunks:
                if isinstance(item, BaseException):
                    if not started:
                        raise item  # nothing sent yet: a real status
                    await sse.send(response, error_body(item)[1])
                    break
                if not started:
                    if item.end is not None and item.end.reason == "error":
                        # Failed before anything was sent (the decode actor refused it as it
                        # prefilled it): a real status, as the same request gets unstreamed.
                        raise end_failure(item.end, item.end.completion_tokens)
                    await response.prepare(request)
                    started = True
                state = states[index]
                logprobs = state.add(item, self.router.tokenizer)
                new_prompt_logprobs = state.prompt_logprobs_new and api.prompt_logprobs is not None
                # New tokens go out as a chunk even where their text is held back (part of a
                # character, a possible stop string) or empty, as vLLM streams them: a client
                # sees each step's progress, and times its first token when it came. A tool
                # call being read out of the text is the exception: it goes out once read
                # (its token ids, where asked for, at once).
                new_tokens = bool(item.token_ids) and (state.tools is None or api.return_token_ids)
                if item.end is None and not item.text and not state.reasoning_delta and not state.tool_deltas and logprobs is None and not new_prompt_logprobs and not new_tokens and (state.role_sent or not chat):
                    continue  # nothing new to say
                payload = envelope(response_id, model, chat, stream=True, created=created, service_tier=api.service_tier)
                payload["choices"] = [state.delta(item, logprobs)]
                if chat and new_prompt_logprobs and index == 0:
                    payload["prompt_logprobs"] = state.prompt_logprobs
                if chat and (ids := state.unsent_prompt_ids()) is not None:
                    payload["prompt_token_ids"] = ids
                if api.include_usage:
                    # Continuous: the usage so far of this chunk's choice (its prompt and its own
                    # tokens), as vLLM reports it.
                    payload["usage"] = _usage(api, [state]) if api.continuous_usage else None
                await sse.send(response, payload)
                if item.end is not None and item.end.reason == "error":
                    await sse.send(response, error_body(end_failure(item.end, item.end.completion_tokens))[1])
            if api.include_usage:
                payload = envelope(response_id, model, chat, stream=True, created=created, service_tier=api.service_tier)
                payload["choices"] = []
                payload["usage"] = _usage(api, states)
                await sse.send(response, payload)
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:
            logger.info("%s: the client went away mid-stream", response_id)
        except Exception as exc:
            if not started:
                raise  # nothing sent yet: a real status
            # Mid-stream the status line is gone: the error goes out as an event (as the other
            # streams' do), and the stream ends as streams end (a second response written into
            # this one's body was a protocol error to the client).
            log_if_internal(exc, f"{response_id} mid-stream")
            with contextlib.suppress(ConnectionResetError):
                await sse.send(response, error_body(exc)[1])
                await response.write(b"data: [DONE]\n\n")
                await response.write_eof()
        return response


def _error_shape_of(path: str):
    """The front end whose own error shape a path's errors take (ERROR_SHAPE_PREFIX), or None: OpenAI's."""
    for module in FRONT_END_MODULES:
        prefix = getattr(module, "ERROR_SHAPE_PREFIX", None)
        if prefix is not None and path.startswith(prefix):
            return module
    return None


def _usage(api: ApiRequest, states: list[ChoiceState]) -> dict[str, Any]:
    # A prompt counts once however many choices it has (as in OpenAI's and vLLM's usage).
    firsts = states[:: api.choices_per_prompt]
    prompt = sum(state.prompt_tokens for state in firsts)
    cached = sum(state.end.cached_prompt_tokens for state in firsts if state.end is not None)
    speculated = [state.end.speculation for state in states if state.end is not None and state.end.speculation is not None]
    accepted = sum(spec.accepted_draft_tokens for spec in speculated)
    rejected = sum(spec.draft_tokens - spec.accepted_draft_tokens for spec in speculated)
    reasoning = sum(state.reasoning_tokens for state in states) if api.reasoning is not None else None
    return usage(prompt, sum(state.num_tokens for state in states), cached, accepted, rejected, reasoning)


async def _json(request: web.Request) -> Any:
    raw = await request.read()
    try:
        body = bounded_json.loads(raw)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer past Python's 4,300 digits
        raise InvalidArgumentError("body", f"is not valid JSON: {exc}") from exc
    # JSON may escape half a UTF-16 pair ("\ud83d": an emoji a client cut in two). Such a string
    # is no Unicode text: the tokenizer, the logs and the answer's UTF-8 all refuse it, deep
    # inside. In a UTF-8 body only an escape can hold one: a body without any skips the walk.
    if not json.detect_encoding(raw).startswith("utf-8") or _SURROGATE_ESCAPE.search(raw):
        where = _lone_surrogate(body, "")
        if where is not None:
            raise InvalidArgumentError(where or "body", "holds a lone UTF-16 surrogate (half of a pair), which is not Unicode text")
    return body


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(value: Any, path: str) -> str | None:
    """The path (``messages[0].content``) of the first string in ``value`` holding a lone
    surrogate; None where none does."""
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    if isinstance(value, list):
        items = ((f"{path}[{index}]", item) for index, item in enumerate(value))
    elif isinstance(value, dict):
        if any(_SURROGATE.search(key) for key in value):
            return path  # in a key: named by the object that holds it (the key itself cannot be printed)
        items = ((f"{path}.{key}" if path else key, item) for key, item in value.items())
    else:
        return None
    for where, item in items:
        found = _lone_surrogate(item, where)
        if found is not None:
            return found
    return None
