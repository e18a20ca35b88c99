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
import logging
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from router.errors import InvalidArgumentError

logger = logging.getLogger(__name__)


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
        self._tool_use = None
        if tool_use is not None:
            try:
                self._tool_use = ChatTemplate(tool_use, special_tokens, defaults)
            except ValueError as exc:  # the default one still serves every request
                logger.warning("the model's tool_use chat template is not used: %s", exc)

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
        continue_final_message: bool = False,
    ) -> str:
        """The prompt text for ``messages``; ChatTemplateError (field ``messages``) when the
        template refuses them. ``extra``: more template variables (``chat_template_kwargs``).
        ``continue_final_message``: the prompt ends inside the last message, after its text."""
        variables = {**self.special_tokens, **self.defaults, **(extra or {})}
        final = None
        if continue_final_message:
            messages, final = _tagged_final(messages)
        try:
            prompt = self._compiled.render(
                messages=messages, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError("messages", f"the model's chat template refused them: {exc}") from exc
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ChatTemplateError("messages", f"the model's chat template failed on them: {exc}") from exc
        return prompt if final is None else _cut_at_tag(prompt, final)


# As transformers' apply_chat_template continues a final message (vLLM renders through it): a
# tag after the message's text marks where the prompt ends, so a template's closing text never
# passes for the message's (a cut at the text's last occurrence, the older way, left
# "<|im_end" after a message "end"), and spacing the template keeps stays ("Sure:\n\n").
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tagged_final(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """``messages`` with the tag after the last message's text (its last text part), and that text."""
    if not messages:
        raise ChatTemplateError("messages", "continue_final_message needs a message to continue")
    last = dict(messages[-1])
    content = last.get("content")
    if isinstance(content, str) and content.strip():
        final, last["content"] = content, content + _CONTINUE_TAG
    elif isinstance(content, list) and any(isinstance(part, dict) and isinstance(part.get("text"), str) for part in content):
        parts = [dict(part) if isinstance(part, dict) else part for part in content]
        part = next(p for p in reversed(parts) if isinstance(p, dict) and isinstance(p.get("text"), str))
        final, part["text"] = part["text"], part["text"] + _CONTINUE_TAG
        last["content"] = parts
    else:
        raise ChatTemplateError("messages", "continue_final_message needs a last message with text")
    return [*messages[:-1], last], final


def _cut_at_tag(prompt: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if tag not in prompt or final.strip() not in prompt:
        raise ChatTemplateError("messages", "the chat template drops the final message's text: it cannot be continued")
    at = prompt.rindex(tag)
    if prompt[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return prompt[:at]  # the template kept the message's spacing
    return prompt[:at].rstrip()  # it trimmed the message's end (and the tag's space with it)
