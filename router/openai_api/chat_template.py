"""Render a chat as the model's chat template renders it in transformers.

``apply_chat_template`` compiles the template in a sandboxed Jinja environment with
``trim_blocks`` and ``lstrip_blocks``, the loop-control extension, the ``{% generation %}`` tag
(which marks the assistant's part for training and renders its body), a ``tojson`` filter that
keeps non-ASCII text as it is, and the globals ``raise_exception`` and ``strftime_now``; it
renders with ``messages``, ``tools``, ``documents``, ``add_generation_prompt`` and the named
special tokens (``bos_token``, ``eos_token``, ...), and tokenizes the result without adding
special tokens again. The same here, without importing transformers into the router.
Templates come from model repositories: untrusted code, hence the sandbox.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from router.errors import InvalidArgumentError


class ChatTemplateError(InvalidArgumentError):
    """The template refused the chat (its ``raise_exception``) or failed on it."""


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks what the assistant wrote with
    it (for assistant-only training masks); rendering a prompt, the body is rendered as it is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _render_body(caller) -> str:
        return caller()


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment.from_string(template)


class ChatTemplate:
    def __init__(self, template: str, special_tokens: dict[str, str], defaults: dict[str, Any] | None = None, tool_use: str | None = None):
        """``tool_use``: the model's template for requests with tools, where it has one of its own."""
        self.text = template  # what a tool-call parser is recognised from
        self.special_tokens = dict(special_tokens)
        self.defaults = dict(defaults or {})  # variables every render gets, under its own (router.default_chat_template_kwargs)
        try:
            self._compiled = _compile(template)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ValueError(f"the model's chat template does not compile: {exc}") from exc
        self._tool_use = None if tool_use is None else ChatTemplate(tool_use, special_tokens, defaults)

    def for_tools(self, tools: Any) -> "ChatTemplate":
        """The template a request renders by: with tools, the model's ``tool_use`` template where
        it has one (Hermes-2-Pro and Hermes-3 name two; the default one never shows the model its
        tools), as transformers and vLLM choose."""
        return self._tool_use if tools and self._tool_use is not None else self

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text for ``messages``; ChatTemplateError (field ``messages``) when the
        template refuses them. ``extra``: more template variables (``chat_template_kwargs``)."""
        variables = {**self.special_tokens, **self.defaults, **(extra or {})}
        try:
            return self._compiled.render(
                messages=messages, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError("messages", f"the model's chat template refused them: {exc}") from exc
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ChatTemplateError("messages", f"the model's chat template failed on them: {exc}") from exc
