"""Anthropic Messages request bodies (``/v1/messages``, ``/v1/messages/count_tokens``) read into
the router's neutral request.

The conversation becomes the chat template's messages the way OpenAI's does (so a Messages call
and a chat completion of the same conversation render the same prompt): ``system`` as a system
message, text blocks joined, an assistant's ``tool_use`` blocks as its ``tool_calls``, a user's
``tool_result`` blocks as ``tool`` messages (one with ``is_error`` reads "Error: " first). ``tools`` (``input_schema``) and ``tool_choice``
(``auto``, ``any``, ``tool`` by name, ``none``) go through the same tool calling as chat
completions (router/openai_api/tool_calls.py). Every field is checked here; a problem raises
``InvalidArgumentError`` naming it as the client wrote it (``messages[1].content[0].input``),
and a field the API defines that pdserve does not serve (images, ...) is refused, never dropped.

Extended thinking is served where the deployment has a reasoning parser (router.reasoning_parser):
``thinking`` ``enabled``/``adaptive`` or ``disabled`` becomes the template's ``enable_thinking``
(Qwen3's switch), the answer's thinking comes back as a ``thinking`` block
(router/anthropic_api/messages.py), and an assistant's ``thinking`` blocks sent back reach the
template as its ``reasoning_content``. Without one, only ``disabled`` is taken.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.structured_output import TOOL_CALLS, StructuredOutput
from router.errors import InvalidArgumentError
from router.openai_api.chat_template import ChatTemplate
from router.openai_api.fields import boolean, integer, is_int, json_object, number, refuse_unknown, type_name
from router.openai_api.reasoning import ReasoningFormat, ReasoningSplitter, as_written
from router.openai_api.tool_calls import ToolCalling, flat_function_tool, read_tool_calling, template_messages
from router.validation import GenerateInput

_MESSAGES_FIELDS = {
    "model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature", "top_p", "top_k",
    "tools", "tool_choice", "metadata", "thinking", "service_tier", "output_config",
    "cache_control",  # a prompt-caching breakpoint: every prompt's blocks are cached here (prefix caching)
    "ignore_eos", "seed",  # vLLM's extensions
}
_COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config", "cache_control"}
_NULL_WHEN_SENT_BACK = {"caller", "toolset_name"}  # fields of a tool_use block pdserve never sets
_BLOCK_FIELDS = {
    "thinking": {"type", "thinking", "signature"},
    "redacted_thinking": {"type", "data"},
    "text": {"type", "text", "cache_control", "citations"},
    "tool_use": {"type", "id", "name", "input", "cache_control"},
    "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
}


@dataclass(slots=True)
class MessagesRequest:
    """One Messages call, read and checked."""

    model: str
    stream: bool
    generate: GenerateInput
    tool_calling: ToolCalling | None
    # With a reasoning parser: how the answer starts (router/openai_api/reasoning.py); None:
    # no parser. ``show_thinking``: false where the request turned thinking off.
    reasoning: ReasoningSplitter | None = None
    show_thinking: bool = True
    omit_thinking: bool = False  # thinking.display "omitted": thinking blocks come with their signature only
    # Tools whose input streams as the model writes it (``eager_input_streaming``); every other
    # call's input is sent once whole and checked, as Anthropic streams it by default.
    eager_tools: frozenset[str] = frozenset()


def read_messages(body: Any, template: ChatTemplate | None, tool_call_parser: str | None, reasoning: ReasoningFormat | None = None) -> MessagesRequest:
    body = json_object(body, "body")
    refuse_unknown(body, _MESSAGES_FIELDS)
    model = _model(body)
    if body.get("max_tokens") is None:
        raise InvalidArgumentError("max_tokens", "is required")
    max_tokens = integer(body, "max_tokens", None, 1, None)
    thinking, budget = _thinking(body, reasoning, max_tokens)
    effort = _effort(body)
    _cache_control(body)
    if body.get("service_tier") not in (None, "auto", "standard_only"):
        raise InvalidArgumentError("service_tier", "must be auto or standard_only")
    metadata = body.get("metadata")
    if metadata is not None:
        metadata = json_object(metadata, "metadata")
        refuse_unknown(metadata, {"user_id"}, prefix="metadata.")
    prompt, calling, continued = render_prompt(body, template, tool_call_parser, thinking, effort)
    stop = body.get("stop_sequences")
    if stop is None:
        stop = []
    elif not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise InvalidArgumentError("stop_sequences", "must be a list of non-empty strings")
    generate = GenerateInput(
        prompt_text=prompt,
        add_special_tokens=False,  # the template wrote them
        text_field="messages",
        ids_field="messages",
        max_tokens=max_tokens,
        temperature=number(body, "temperature", None),
        top_p=number(body, "top_p", None),
        top_k=integer(body, "top_k", None, -1, None),
        stop=list(stop),
        ignore_eos=boolean(body, "ignore_eos", False),
        seed=integer(body, "seed", None, None, None),
        sampling_prefix="",
        field_names={"stop": "stop_sequences"},
        structured=_prefill_alone(_constraint(body, calling), thinking, continued is not None),
        skip_special_tokens=not (calling is not None and calling.reads_special_tokens),
    )
    request = MessagesRequest(
        model=model, stream=boolean(body, "stream", False), generate=generate, tool_calling=calling,
        omit_thinking=_thinking_display(body) == "omitted", eager_tools=_eager_tools(body),
    )
    if reasoning is not None:
        generate.thinking = reasoning.thinking(prompt, budget, continued)
        request.reasoning, request.show_thinking = ReasoningSplitter(generate.thinking), thinking is not False
    return request


def read_count_tokens(body: Any, template: ChatTemplate | None, tool_call_parser: str | None, reasoning: ReasoningFormat | None = None) -> tuple[str, str]:
    """(model, prompt text) of a count_tokens call."""
    body = json_object(body, "body")
    refuse_unknown(body, _COUNT_FIELDS)
    model = _model(body)
    thinking, _ = _thinking(body, reasoning, None)
    _cache_control(body)
    prompt, _, _ = render_prompt(body, template, tool_call_parser, thinking, _effort(body))
    return model, prompt


def render_prompt(
    body: dict, template: ChatTemplate | None, tool_call_parser: str | None, thinking: bool | None = None, effort: str | None = None,
) -> tuple[str, ToolCalling | None, str | None]:
    """The prompt text of a Messages body through the model's chat template, its tool calling,
    and the prefill it continues as its model wrote it (None: none). ``thinking``: the request's
    switch, as the template's ``enable_thinking``; ``effort`` (``output_config.effort``) as its
    ``reasoning_effort``, as chat passes OpenAI's."""
    if template is None:
        raise InvalidArgumentError("messages", "this model has no chat template (tokenizer_config.json or chat_template.jinja)")
    template = template.for_tools(body.get("tools"))
    calling = read_tool_calling(_openai_tools(body), template.text, tool_call_parser)
    messages = _system(body) + _conversation(body)
    prefill = _prefill(messages)
    extra = {name: value for name, value in (("enable_thinking", thinking), ("reasoning_effort", effort)) if value is not None} or None
    # (With a prefill, the answer goes on from its last character, inside the turn the template
    # would close.)
    prompt = template.render(
        template_messages(messages, template.text), add_generation_prompt=prefill is None, tools=calling.tools if calling is not None else None, extra=extra,
        continue_final_message=prefill is not None,
    )
    return prompt, calling, None if prefill is None else as_written(messages[-1])


def _prefill(messages: list[dict[str, Any]]) -> str | None:
    """The text of a final assistant message (Anthropic's prefill: the answer continues it, and
    leaves it out of its content); None where the conversation ends with the user."""
    final = messages[-1] if messages else None
    if final is None or final["role"] != "assistant" or final.get("tool_calls") or not final.get("content"):
        return None
    text = final["content"]
    if text != text.rstrip():
        raise InvalidArgumentError("messages", "final assistant content cannot end with trailing whitespace")  # Anthropic's 400
    return text


def _prefill_alone(structured: StructuredOutput | None, thinking: bool | None, prefilled: bool) -> StructuredOutput | None:
    """A prefill is refused beside what it cannot go with: a grammar would constrain the answer
    from after the prefill, not the prefill itself (its JSON written twice), and extended
    thinking comes before the answer a prefill begins (Anthropic refuses both)."""
    if not prefilled:
        return structured
    if structured is not None:
        raise InvalidArgumentError("messages", f"a final assistant message (a prefill) cannot be combined with {structured.field}")
    if thinking:
        raise InvalidArgumentError("messages", "a final assistant message (a prefill) cannot be combined with extended thinking")
    return structured


def _constraint(body: dict, calling: ToolCalling | None) -> StructuredOutput | None:
    """The grammar the answer decodes under: ``output_config.format`` (a JSON schema), a forced
    tool, or under auto the one that holds strict tools' calls (and takes the format in)."""
    answer = _answer_format(body)
    tools = calling.constraint(answer) if calling is not None else None
    if tools is None:
        return answer
    if answer is not None and tools.kind != TOOL_CALLS:
        raise InvalidArgumentError("output_config.format", "and a forced tool_choice both constrain the answer; give one")
    return tools


def _answer_format(body: dict) -> StructuredOutput | None:
    """``output_config.format``: the JSON schema the answer is written in (None: none)."""
    config = body.get("output_config")
    if config is None:
        return None
    config = json_object(config, "output_config")
    refuse_unknown(config, {"format", "effort"}, prefix="output_config.")
    if config.get("format") is None:
        return None
    fmt = json_object(config["format"], "output_config.format")
    refuse_unknown(fmt, {"type", "schema"}, prefix="output_config.format.")
    if fmt.get("type") != "json_schema":
        raise InvalidArgumentError("output_config.format.type", f"must be \"json_schema\", got {fmt.get('type')!r}")
    schema = json_object(fmt.get("schema"), "output_config.format.schema")
    return StructuredOutput.build("json_schema", json.dumps(schema), "output_config.format.schema")


def _effort(body: dict) -> str | None:
    """``output_config.effort`` as the template's ``reasoning_effort``: templates know low, medium
    and high, so Anthropic's xhigh and max are high there."""
    config = body.get("output_config")
    effort = json_object(config, "output_config").get("effort") if config is not None else None
    if effort is not None and effort not in _EFFORTS:
        raise InvalidArgumentError("output_config.effort", f"must be one of {', '.join(_EFFORTS)}, got {effort!r}")
    return _EFFORTS.get(effort)


_EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


def _cache_control(body: dict) -> None:
    """The top-level prompt-caching breakpoint: checked, and otherwise nothing to do (every
    prompt's full blocks are cached, and a repeated prefix is read from the cache)."""
    control = body.get("cache_control")
    if control is not None:
        control = json_object(control, "cache_control")
        refuse_unknown(control, {"type", "ttl"}, prefix="cache_control.")
        if control.get("type") != "ephemeral":
            raise InvalidArgumentError("cache_control.type", f"must be \"ephemeral\", got {control.get('type')!r}")


def _thinking_display(body: dict) -> str | None:
    """``thinking.display`` (``summarized``: shown, as without it; ``omitted``: signatures only)."""
    thinking = body.get("thinking")
    if not isinstance(thinking, dict) or thinking.get("display") is None:
        return None
    display = thinking["display"]
    if display not in ("summarized", "omitted"):
        raise InvalidArgumentError("thinking.display", f"must be summarized or omitted, got {display!r}")
    return display


def _model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidArgumentError("model", "is required: a non-empty string")
    return model


def _thinking(body: dict, reasoning: ReasoningFormat | None, max_tokens: int | None) -> tuple[bool | None, int | None]:
    """The request's extended-thinking switch, True (enabled, adaptive), False (disabled) or None
    (not given), and its token budget. ``enabled`` needs a reasoning parser and a
    ``budget_tokens`` as Anthropic checks it (at least 1024, below max_tokens): the engine closes
    the thinking once it has spent them (engine.thinking)."""
    thinking = body.get("thinking")
    if thinking is None:
        # Anthropic thinks only when asked: a model that thinks by default (Qwen3's template) is
        # told not to, and its thinking is not shown (a client's content[0] is the answer's text).
        return (False if reasoning is not None else None), None
    thinking = json_object(thinking, "thinking")
    kind = thinking.get("type")
    if kind == "disabled":
        refuse_unknown(thinking, {"type"}, prefix="thinking.")
        return False, None
    if kind not in ("enabled", "adaptive"):
        raise InvalidArgumentError("thinking.type", f"must be \"enabled\", \"adaptive\" or \"disabled\", got {kind!r}")
    if reasoning is None:
        raise InvalidArgumentError("thinking", "extended thinking needs a reasoning model served with router.reasoning_parser; omit it or give {\"type\": \"disabled\"}")
    refuse_unknown(thinking, {"type", "budget_tokens", "display"} if kind == "enabled" else {"type", "display"}, prefix="thinking.")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not is_int(budget) or budget < 1024:
            raise InvalidArgumentError("thinking.budget_tokens", f"must be an integer of at least 1024 with type enabled, got {budget!r}")
        if max_tokens is not None and budget >= max_tokens:
            raise InvalidArgumentError("thinking.budget_tokens", f"must be less than max_tokens ({max_tokens}), got {budget}")
        return True, budget
    return True, None


def _system(body: dict) -> list[dict[str, Any]]:
    system = body.get("system")
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    if not isinstance(system, list):
        raise InvalidArgumentError("system", f"must be a string or a list of text blocks, got {type_name(system)}")
    return [{"role": "system", "content": "\n".join(_text_block(block, f"system[{i}]") for i, block in enumerate(system))}]


def _conversation(body: dict) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidArgumentError("messages", "must be a non-empty list of messages")
    out: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        name = f"messages[{index}]"
        message = json_object(message, name)
        refuse_unknown(message, {"role", "content"}, prefix=f"{name}.")
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise InvalidArgumentError(f"{name}.role", f"must be \"user\" or \"assistant\", got {role!r}")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise InvalidArgumentError(f"{name}.content", f"must be a string or a list of content blocks, got {type_name(content)}")
        out.extend(_blocks(role, content, f"{name}.content"))
    return out


def _blocks(role: str, blocks: list, name: str) -> list[dict[str, Any]]:
    """One message's content blocks as template messages: its text (and an assistant's calls),
    then a ``tool`` message per tool result."""
    texts: list[str] = []
    thoughts: list[str] = []  # an assistant's thinking sent back (its signature is not checked)
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for index, block in enumerate(blocks):
        where = f"{name}[{index}]"
        block = json_object(block, where)
        kind = block.get("type")
        if not isinstance(kind, str) or kind not in _BLOCK_FIELDS:
            raise InvalidArgumentError(f"{where}.type", f"must be one of {sorted(_BLOCK_FIELDS)} (pdserve serves text models), got {kind!r}")
        # A response's block dumped as the SDK dumps it (``model_dump()``) carries these as null.
        block = {key: value for key, value in block.items() if not (key in _NULL_WHEN_SENT_BACK and value is None)}
        refuse_unknown(block, _BLOCK_FIELDS[kind], prefix=f"{where}.")
        if kind in ("thinking", "redacted_thinking"):
            if role != "assistant":
                raise InvalidArgumentError(f"{where}.type", f"{kind} blocks belong to assistant messages")
            if kind == "thinking":
                if not isinstance(block.get("thinking"), str):
                    raise InvalidArgumentError(f"{where}.thinking", f"must be a string, got {type_name(block.get('thinking'))}")
                thoughts.append(block["thinking"])
        elif kind == "text":
            texts.append(_text_block(block, where))
        elif kind == "tool_use":
            if role != "assistant":
                raise InvalidArgumentError(f"{where}.type", "tool_use blocks belong to assistant messages")
            for key in ("id", "name"):
                if not isinstance(block.get(key), str) or not block[key]:
                    raise InvalidArgumentError(f"{where}.{key}", "must be a non-empty string")
            arguments = json_object(block.get("input"), f"{where}.input")
            calls.append({"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}})
        else:
            if role != "user":
                raise InvalidArgumentError(f"{where}.type", "tool_result blocks belong to user messages")
            if not isinstance(block.get("tool_use_id"), str) or not block["tool_use_id"]:
                raise InvalidArgumentError(f"{where}.tool_use_id", "must be a non-empty string")
            if block.get("is_error") is not None and not isinstance(block["is_error"], bool):
                raise InvalidArgumentError(f"{where}.is_error", f"must be a boolean, got {type_name(block['is_error'])}")
            result = {"role": "tool", "tool_call_id": block["tool_use_id"], "content": _result_content(block.get("content"), f"{where}.content")}
            if block.get("is_error"):
                # No chat template has a field for a failed call: its result was rendered as a
                # success, and the model went on as if the tool had answered (Claude Code sends
                # a refused or failed command this way). The content says so where every
                # template shows it; the flag stays on the message for a template that reads it.
                result["content"] = TOOL_ERROR_PREFIX + result["content"]
                result["is_error"] = True
            results.append(result)
    out: list[dict[str, Any]] = []
    if texts or calls:
        message: dict[str, Any] = {"role": role, "content": "\n".join(texts) if texts else None}
        if thoughts:
            message["reasoning_content"] = "\n".join(thoughts)  # where reasoning templates read it
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    return results + out if role == "user" else out + results


TOOL_ERROR_PREFIX = "Error: "  # before an ``is_error`` tool result, as the model reads it


def _text_block(block: Any, where: str) -> str:
    block = json_object(block, where)
    if block.get("type") != "text":
        raise InvalidArgumentError(f"{where}.type", f"must be \"text\", got {block.get('type')!r}")
    refuse_unknown(block, _BLOCK_FIELDS["text"], prefix=f"{where}.")
    if block.get("citations") is not None:
        raise InvalidArgumentError(f"{where}.citations", "is not supported")
    text = block.get("text")
    if not isinstance(text, str):
        raise InvalidArgumentError(f"{where}.text", f"must be a string, got {type_name(text)}")
    return text


def _result_content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidArgumentError(where, f"must be a string or a list of text blocks, got {type_name(content)}")
    return "\n".join(_text_block(block, f"{where}[{i}]") for i, block in enumerate(content))


# strict: a call's input is held to its schema, as on chat (ToolCalling.constraint: under auto
# in the hermes format, and where the answer must call).
_TOOL_FIELDS = {"type", "name", "description", "input_schema", "cache_control", "strict", "input_examples", "eager_input_streaming"}


def _with_examples(tool: dict[str, Any], where: str) -> dict[str, Any]:
    """The tool with its ``input_examples`` (objects its input may be) shown to the model at the
    end of its description, where a chat template renders what the model reads of a tool."""
    examples = tool.get("input_examples")
    if examples is None:
        return tool
    if not isinstance(examples, list) or not all(isinstance(example, dict) for example in examples):
        raise InvalidArgumentError(f"{where}.input_examples", "must be a list of objects (example inputs)")
    if not examples:
        return tool
    description = tool.get("description")
    if description is not None and not isinstance(description, str):
        return tool  # (flat_function_tool names the description's problem)
    shown = "\n".join(json.dumps(example, ensure_ascii=False) for example in examples)
    head = f"{description}\n\n" if description else ""
    return {**tool, "description": f"{head}Example inputs:\n{shown}"}


def _eager_tools(body: dict) -> frozenset[str]:
    """The names of the tools whose input streams as written (``eager_input_streaming: true``)."""
    tools = body.get("tools")
    if not isinstance(tools, list):
        return frozenset()
    return frozenset(tool["name"] for tool in tools if isinstance(tool, dict) and tool.get("eager_input_streaming") is True)


def _openai_tools(body: dict) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` in OpenAI's shape (what the shared tool calling reads)."""
    tools = body.get("tools")
    if tools is None:
        if body.get("tool_choice") is not None:
            raise InvalidArgumentError("tool_choice", "needs tools")
        return {}
    if not isinstance(tools, list):
        raise InvalidArgumentError("tools", f"must be a list, got {type_name(tools)}")
    converted = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        tool = json_object(tool, where)
        if tool.get("type") not in (None, "custom"):
            raise InvalidArgumentError(f"{where}.type", f"server tools ({tool.get('type')!r}) are not supported; give client tools with input_schema")
        refuse_unknown(tool, _TOOL_FIELDS, prefix=f"{where}.")
        for key in ("strict", "eager_input_streaming"):
            if tool.get(key) is not None:
                boolean(tool, key, False, prefix=f"{where}.")
        flat = flat_function_tool(_with_examples(tool, where), where, "input_schema")
        if tool.get("strict") is True:
            flat["function"]["strict"] = True
        converted.append(flat)
    out: dict[str, Any] = {"tools": converted}
    choice = body.get("tool_choice")
    if choice is not None:
        choice = json_object(choice, "tool_choice")
        kind = choice.get("type")
        refuse_unknown(choice, {"type", "name", "disable_parallel_tool_use"}, prefix="tool_choice.")
        if kind == "tool":
            if not isinstance(choice.get("name"), str):
                raise InvalidArgumentError("tool_choice.name", "must name one of the tools")
            out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        elif kind in ("auto", "any", "none"):
            out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
        else:
            raise InvalidArgumentError("tool_choice.type", f"must be auto, any, tool or none, got {kind!r}")
        if choice.get("disable_parallel_tool_use") is not None:
            out["parallel_tool_calls"] = not boolean(choice, "disable_parallel_tool_use", False, prefix="tool_choice.")
    return out
