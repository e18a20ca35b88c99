"""How this deployment turns a chat into a prompt and reads the answer: the chat template (the
configured router.chat_template, else the model's), the reasoning parser (router.reasoning_parser)
and the tool-call parser (router.tool_call_parser). Loaded once per router and shared by every
front end that takes chats: the OpenAI, Anthropic and Responses APIs and gRPC's ChatPrompt."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from router.openai_api.chat_template import ChatTemplate
from router.openai_api.reasoning import ReasoningFormat, reasoning_format

if TYPE_CHECKING:
    from router.core import Router

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ChatFormat:
    template: ChatTemplate | None  # None: this model has no (working) chat template
    reasoning: ReasoningFormat | None  # None: no reasoning parser
    tool_call_parser: str | None  # None: recognised from the template

    @classmethod
    def of(cls, router: "Router") -> "ChatFormat":
        """The router's; a configured template or parser that does not work stops the start
        (ValueError naming the field), a model's template that does not compile turns chat off."""
        # router.reasoning_parser over this model's tokenizer (a config error stops the start).
        reasoning = reasoning_format(router.config.reasoning_parser, router.tokenizer)
        return cls(_load_template(router), reasoning, router.config.tool_call_parser)


def _load_template(router: "Router") -> ChatTemplate | None:
    tokenizer, config = router.tokenizer, router.config
    text = config.chat_template or tokenizer.chat_template
    if text is None:
        return None
    # (A configured template replaces the model's, its tool_use one too.)
    tool_use = None if config.chat_template is not None else tokenizer.chat_templates.get("tool_use")
    try:
        return ChatTemplate(text, tokenizer.special_tokens_map, config.default_chat_template_kwargs, tool_use)
    except ValueError as exc:
        if config.chat_template is not None:
            raise ValueError(f"chat_template: {exc}") from exc
        logger.warning("chat is off: %s", exc)
        return None
