"""vLLM's auxiliary HTTP endpoints, as operators script against them on vLLM's API port.

``POST /tokenize`` (a ``prompt``, or chat ``messages`` rendered with the model's template) and
``POST /detokenize``; ``GET /version``; ``GET|POST /ping`` (200 once the deployment can serve,
503 before, as ``/health``); ``GET /load`` (requests in flight at this router: vLLM's
``server_load``); ``GET /metrics`` (the deployment's Prometheus registry, the same series as
``router.metrics_port`` serves); ``POST /v1/load_lora_adapter`` (``lora_name``, ``lora_path``,
``load_inplace``) and ``POST /v1/unload_lora_adapter`` (``lora_name``) where
``router.allow_runtime_lora_updating`` is set (router.lora_adapters). Bodies and answers have
vLLM's fields; an unknown field is a 400 naming it, as on the other endpoints. As in vLLM, only
``/v1/`` routes need the bearer token.
"""

from __future__ import annotations

import importlib.metadata
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router.errors import InvalidArgumentError, NotFoundError, UnavailableError
from router.lora_adapters import lora_name_problem
from router.openai_api.errors import error_response
from router.openai_api.fields import boolean, is_int, json_object, refuse_unknown, type_name
from router.validation import check_prompt_chars

if TYPE_CHECKING:
    from router.openai_api.server import OpenAIServer

_TOKENIZE_PROMPT_FIELDS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
_TOKENIZE_CHAT_FIELDS = {
    "model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template_kwargs",
    "tools", "return_token_strs",
}


def add_routes(app: web.Application, server: "OpenAIServer") -> "VllmEndpoints":
    endpoints = VllmEndpoints(server)
    app.router.add_post("/tokenize", endpoints.tokenize)
    app.router.add_post("/detokenize", endpoints.detokenize)
    app.router.add_get("/version", endpoints.version)
    app.router.add_get("/ping", endpoints.ping)
    app.router.add_post("/ping", endpoints.ping)
    app.router.add_get("/load", endpoints.load)
    app.router.add_get("/metrics", endpoints.metrics)
    app.router.add_post("/v1/load_lora_adapter", endpoints.load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", endpoints.unload_lora_adapter)
    return endpoints


def pdserve_version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class VllmEndpoints:
    def __init__(self, server: "OpenAIServer"):
        self.server = server
        self.router = server.router

    async def tokenize(self, request: web.Request) -> web.Response:
        body = json_object(await self.server.read_json(request), "body")
        self.server.model_name(body.get("model"))
        tokenizer = self.router.tokenizer
        if "messages" in body:
            refuse_unknown(body, _TOKENIZE_CHAT_FIELDS)
            prompt = self.server.render_chat(body)
            add_special = boolean(body, "add_special_tokens", False)  # the template wrote them
        else:
            refuse_unknown(body, _TOKENIZE_PROMPT_FIELDS)
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise InvalidArgumentError("prompt", f"must be a string (or give messages), got {type_name(prompt)}")
            add_special = boolean(body, "add_special_tokens", True)
        check_prompt_chars(prompt, self.router.limits, "prompt")  # bounded as a generation's prompt is
        tokens = await self.router.encode(prompt, add_special)
        # The vocabulary's pieces, as vLLM's convert_ids_to_tokens gives them (a token's text alone may be half a character).
        strings = [tokenizer.id_to_token(token) for token in tokens] if boolean(body, "return_token_strs", False) else None
        return web.json_response(
            {"count": len(tokens), "max_model_len": self.router.model_info.max_context_len, "tokens": tokens, "token_strs": strings}
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        body = json_object(await self.server.read_json(request), "body")
        refuse_unknown(body, {"model", "tokens"})
        self.server.model_name(body.get("model"))
        tokens = body.get("tokens")
        vocab = self.router.model_info.vocab_size
        if not isinstance(tokens, list) or not all(is_int(t) for t in tokens):
            raise InvalidArgumentError("tokens", "must be a list of token ids")
        context = self.router.model_info.max_context_len
        if len(tokens) > context:  # decoded on the event loop: bounded as a prompt is
            raise InvalidArgumentError("tokens", f"has {len(tokens)} ids; at most {context} (the model's context) are decoded")
        if any(not 0 <= t < vocab for t in tokens):
            raise InvalidArgumentError("tokens", f"token ids must be in [0, {vocab})")
        return web.json_response({"prompt": self.router.tokenizer.decode(tokens, skip_special_tokens=False)})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": pdserve_version()})

    async def ping(self, request: web.Request) -> web.Response:
        if not self.router.readiness.is_ready:
            return error_response(UnavailableError("the deployment is not ready yet"))
        return web.Response(status=200)

    async def load(self, request: web.Request) -> web.Response:
        return web.json_response({"server_load": len(self.router.dispatcher.active)})

    async def metrics(self, request: web.Request) -> web.Response:
        metrics, shared = self.router.metrics, self.router.shared_metrics
        if shared is not None:  # routers on one port: every router's series, each labelled with its router
            text = await shared.exposition()
        else:
            text = b"" if metrics is None else generate_latest(metrics.registry)
        return web.Response(body=text, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        body = self._lora_body(await self.server.read_json(request), {"lora_name", "lora_path", "load_inplace"})
        if (problem := lora_name_problem(body["lora_name"])) is not None:  # (an unload only looks the name up)
            raise InvalidArgumentError("lora_name", problem)
        path = body.get("lora_path")
        if not isinstance(path, str) or not path:
            raise InvalidArgumentError("lora_path", f"must be the adapter's directory, got {path!r}")
        name, replace = body["lora_name"], boolean(body, "load_inplace", False)
        if name in self.server.model_names or name in self.server.model_aliases:
            raise InvalidArgumentError("lora_name", f"{name!r} is the base model's name")
        await self.router.lora.load(name, path, replace)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        body = self._lora_body(await self.server.read_json(request), {"lora_name", "lora_int_id"})
        await self.router.lora.unload(body["lora_name"])
        return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")

    def _lora_body(self, raw, fields: set[str]) -> dict:
        if not self.router.config.allow_runtime_lora_updating:
            raise NotFoundError("runtime LoRA updating is off: start the deployment with router.allow_runtime_lora_updating (--allow-runtime-lora-updating)")
        body = json_object(raw, "body")
        refuse_unknown(body, fields)
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError("lora_name", f"must be a non-empty string, got {name!r}"[:300])
        return body

