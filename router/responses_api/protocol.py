"""OpenAI Responses request bodies (``POST /v1/responses``) read and checked.

``input`` (a string, or items: messages with text parts, ``function_call`` and
``function_call_output``) becomes chat-template messages as chat completions renders them: a
``developer`` message is a system message, a function call is an assistant message's
``tool_calls``, its output a ``tool`` message. ``instructions`` go first as a system message
(and, as in OpenAI's API, are not carried to a follow-up turn). ``tools`` (function tools,
flat as the Responses API writes them) and ``tool_choice`` go through chat completions' tool
calling (router/openai_api/tool_calls.py); ``text.format`` (json_schema, json_object) is the
answer's grammar. Every problem raises ``InvalidArgumentError`` naming the field as written
(``input[2].call_id``); a field the API defines that pdserve does not serve is refused.
"""

from __future__ import annotations

import base64
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine import bounded_json
from engine.structured_output import StructuredOutput
from router.errors import InvalidArgumentError
from router.openai_api.fields import boolean, cache_salt, integer, int_list, json_object, number, refuse_unknown, served_priority, text_parts, type_name
from router.openai_api.reasoning import read_effort
from router.openai_api.tool_calls import flat_function_tool
from router.validation import GenerateInput

_FIELDS = {
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice", "parallel_tool_calls",
    "text", "stream", "store", "previous_response_id", "metadata", "user", "truncation", "background", "service_tier",
    "reasoning", "include", "prompt_cache_key", "safety_identifier", "stream_options", "top_logprobs",
    # vLLM's extensions
    "top_k", "min_p", "repetition_penalty", "seed", "ignore_eos", "min_tokens", "stop", "stop_token_ids", "priority",
    "cache_salt",
}
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


@dataclass(slots=True)
class ResponsesRequest:
    """One Responses call, read and checked (its prompt is rendered once the conversation it
    continues is known)."""

    model: str | None
    stream: bool
    store: bool
    background: bool
    previous_response_id: str | None
    instructions: str | None
    messages: list[dict[str, Any]]  # this call's input, as chat-template messages
    generate: GenerateInput  # everything but the prompt
    chat_tools: dict[str, Any]  # tools / tool_choice / parallel_tool_calls in chat completions' shape
    reasoning_effort: str | None = None  # reasoning.effort, for the chat template
    seal_reasoning: bool = False  # include reasoning.encrypted_content: reasoning items carry their thinking sealed
    echo: dict[str, Any] = field(default_factory=dict)  # the request's settings a response object repeats
    input_items: list[dict[str, Any]] = field(default_factory=list)  # this call's input, as GET .../input_items lists it


def read_responses(body: Any) -> ResponsesRequest:
    body = json_object(body, "body")
    refuse_unknown(body, _FIELDS)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidArgumentError("model", f"must be a string, got {type_name(model)}")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidArgumentError("instructions", f"must be a string, got {type_name(instructions)}")
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise InvalidArgumentError("previous_response_id", "must be a response id")
    if body.get("truncation") not in (None, "disabled"):
        raise InvalidArgumentError("truncation", "only \"disabled\" is supported (a conversation longer than the context is refused)")
    reasoning = _reasoning(body)
    include = body.get("include") or []
    if not isinstance(include, list):
        raise InvalidArgumentError("include", f"must be a list, got {type_name(include)}")
    for index, extra in enumerate(include):
        if extra != SEALED_REASONING:
            raise InvalidArgumentError(f"include[{index}]", f"only {SEALED_REASONING!r} is supported (no logprobs or tool results), got {extra!r}")
    if body.get("top_logprobs") not in (None, 0):
        raise InvalidArgumentError("top_logprobs", "is not supported on /v1/responses; use /v1/chat/completions")
    for name in ("user", "prompt_cache_key", "safety_identifier"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise InvalidArgumentError(name, f"must be a string, got {type_name(body[name])}")
    metadata = body.get("metadata")
    if metadata is not None:
        metadata = json_object(metadata, "metadata")
        if len(metadata) > 16 or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise InvalidArgumentError("metadata", "must map at most 16 string keys to strings")
        # OpenAI's bounds: a stored response keeps them (a 60 MB value held for an hour per call).
        for key, value in metadata.items():
            if len(key) > 64 or len(value) > 512:
                raise InvalidArgumentError(f"metadata.{key[:64]}", "keys are at most 64 characters and values at most 512")
    stream = boolean(body, "stream", False)
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise InvalidArgumentError("stream_options", "is only allowed with stream: true")
        refuse_unknown(json_object(options, "stream_options"), {"include_obfuscation"}, prefix="stream_options.")
    background = boolean(body, "background", False)
    store = boolean(body, "store", True)
    if background and not store:
        raise InvalidArgumentError("background", "needs store: true (a background response is fetched by its id)")
    if background and stream:
        raise InvalidArgumentError("background", "with stream: true is not supported; poll GET /v1/responses/{id} instead")
    text_format, structured = _text_format(body)
    chat_tools = _chat_tools(body)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise InvalidArgumentError("stop", "must be a string or a list of strings")
    priority, service_tier = served_priority(body)
    generate = GenerateInput(
        add_special_tokens=False,  # the template writes them
        text_field="input",
        ids_field="input",
        max_tokens=integer(body, "max_output_tokens", None, 1, None),
        max_tokens_fills_context=True,
        temperature=number(body, "temperature", None),
        top_p=number(body, "top_p", None),
        top_k=integer(body, "top_k", None, -1, None),
        min_p=number(body, "min_p", None),
        repetition_penalty=number(body, "repetition_penalty", None),
        seed=integer(body, "seed", None, None, None),
        ignore_eos=boolean(body, "ignore_eos", False),
        min_tokens=integer(body, "min_tokens", 0, 0, None),
        stop=list(stop or []),
        stop_token_ids=int_list(body, "stop_token_ids"),
        priority=priority,
        cache_salt=cache_salt(body),
        sampling_prefix="",
        field_names={"max_tokens": "max_output_tokens"},
        structured=structured,
    )
    echo = {
        "instructions": instructions,
        "max_output_tokens": generate.max_tokens,
        "temperature": generate.temperature,
        "top_p": generate.top_p,
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice", "auto"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "text": {"format": text_format},
        "metadata": metadata or {},
        "user": body.get("user"),
        "truncation": "disabled",
        "store": store,
        "background": background,
        "previous_response_id": previous,
        "service_tier": service_tier or "default",
    }
    if reasoning is not None:
        echo["reasoning"] = reasoning
    return ResponsesRequest(
        model=model, stream=stream, store=store, background=background, previous_response_id=previous, instructions=instructions,
        messages=_input(body), generate=generate, chat_tools=chat_tools, echo=echo,
        reasoning_effort=reasoning["effort"] if reasoning is not None else None, seal_reasoning=SEALED_REASONING in include,
        input_items=listed_items(body["input"]),
    )


# Ids given to input items that came without one, by type (OpenAI's prefixes).
_ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def listed_items(value: str | list) -> list[dict[str, Any]]:
    """A call's input (checked by ``_input``) as the Responses API lists it: items with an id
    each, a message's text as content parts (a string input is one user message)."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}]
    items = []
    for item in value:
        item = {key: field for key, field in item.items() if not (key in _NULL_WHEN_SENT_BACK and field is None)}
        kind = item.setdefault("type", "message")
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        item.setdefault("id", f"{_ITEM_ID_PREFIXES.get(kind, 'item')}_{uuid.uuid4().hex}")
        items.append(item)
    return items


SEALED_REASONING = "reasoning.encrypted_content"
_SEAL = "pdserve-thinking-v1:"


def seal(thinking: str) -> str:
    """A reasoning item's ``encrypted_content`` (``include: ["reasoning.encrypted_content"]``):
    the thinking itself, base64-encoded (not encrypted: it is the client's own answer), for a
    client that stores nothing (``store: false``) to send back with the next turn."""
    return _SEAL + base64.b64encode(thinking.encode()).decode()


def unseal(value: Any, where: str) -> str:
    """The thinking a sent-back ``encrypted_content`` carries: "" where there is none, or where
    another provider sealed it (a history that changed servers: its thinking is theirs to read)."""
    if value in (None, ""):
        return ""
    if not isinstance(value, str):
        raise InvalidArgumentError(where, f"must be a string, got {type_name(value)}")
    if not value.startswith(_SEAL):
        return ""
    try:
        return base64.b64decode(value[len(_SEAL) :], validate=True).decode()
    except (ValueError, UnicodeDecodeError):
        raise InvalidArgumentError(where, "is damaged") from None


def _reasoning(body: dict) -> dict[str, Any] | None:
    """``reasoning``: its ``effort`` goes to the chat template (``read_effort``); a ``summary``
    is taken, and none is written (the reasoning item's ``summary`` stays empty, its ``content``
    holds the thinking itself)."""
    reasoning = body.get("reasoning")
    if reasoning is None:
        return None
    reasoning = json_object(reasoning, "reasoning")
    refuse_unknown(reasoning, {"effort", "summary", "generate_summary"}, prefix="reasoning.")
    summary = reasoning.get("summary", reasoning.get("generate_summary"))
    if summary not in (None, "auto", "concise", "detailed"):
        raise InvalidArgumentError("reasoning.summary", f"must be auto, concise or detailed, got {summary!r}")
    return {"effort": read_effort(reasoning.get("effort"), "reasoning.effort"), "summary": summary}


def _text_format(body: dict) -> tuple[dict[str, Any], StructuredOutput | None]:
    text = body.get("text")
    if text is None:
        return {"type": "text"}, None
    text = json_object(text, "text")
    refuse_unknown(text, {"format", "verbosity"}, prefix="text.")
    if text.get("verbosity") not in (None, "medium"):
        raise InvalidArgumentError("text.verbosity", "only medium is supported")
    fmt = text.get("format")
    if fmt is None:
        return {"type": "text"}, None
    fmt = json_object(fmt, "text.format")
    kind = fmt.get("type")
    if kind == "text":
        refuse_unknown(fmt, {"type"}, prefix="text.format.")
        return {"type": "text"}, None
    if kind == "json_object":
        refuse_unknown(fmt, {"type"}, prefix="text.format.")
        return {"type": "json_object"}, StructuredOutput.build("json_object", True, "text.format")
    if kind == "json_schema":
        refuse_unknown(fmt, {"type", "name", "schema", "strict", "description"}, prefix="text.format.")
        if not isinstance(fmt.get("name"), str) or not fmt["name"]:
            raise InvalidArgumentError("text.format.name", "is required: a non-empty string")
        schema = json_object(fmt.get("schema"), "text.format.schema")
        return dict(fmt), StructuredOutput.build("json_schema", schema, "text.format.schema")
    raise InvalidArgumentError("text.format.type", f"must be text, json_object or json_schema, got {kind!r}")


def _chat_tools(body: dict) -> dict[str, Any]:
    """The request's tools in chat completions' shape (what the shared tool calling reads)."""
    tools = body.get("tools")
    out: dict[str, Any] = {}
    if tools is not None:
        if not isinstance(tools, list):
            raise InvalidArgumentError("tools", f"must be a list, got {type_name(tools)}")
        converted = []
        for index, tool in enumerate(tools):
            where = f"tools[{index}]"
            tool = json_object(tool, where)
            if tool.get("type") != "function":
                raise InvalidArgumentError(f"{where}.type", f"only function tools are supported, got {tool.get('type')!r}")
            refuse_unknown(tool, {"type", "name", "description", "parameters", "strict"}, prefix=f"{where}.")
            chat_tool = flat_function_tool(tool, where, "parameters")
            if tool.get("strict") is not None:
                chat_tool["function"]["strict"] = boolean(tool, "strict", False, prefix=f"{where}.")
            converted.append(chat_tool)
        out["tools"] = converted
    choice = body.get("tool_choice")
    if choice is not None:
        if isinstance(choice, str):
            out["tool_choice"] = choice
        else:
            choice = json_object(choice, "tool_choice")
            refuse_unknown(choice, {"type", "name"}, prefix="tool_choice.")
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise InvalidArgumentError("tool_choice", "must be none, auto, required or {\"type\": \"function\", \"name\": ...}")
            out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    if body.get("parallel_tool_calls") is not None:
        out["parallel_tool_calls"] = body["parallel_tool_calls"]
    return out


def _input(body: dict) -> list[dict[str, Any]]:
    value = body.get("input")
    if value is None:
        raise InvalidArgumentError("input", "is required: a string or a list of input items")
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidArgumentError("input", f"must be a string or a non-empty list of input items, got {type_name(value)}")
    messages: list[dict[str, Any]] = []
    thinking = ""  # a reasoning item's text, for the assistant turn after it
    for index, item in enumerate(value):
        where = f"input[{index}]"
        item = json_object(item, where)
        # An output item sent back as the SDK dumps it: fields pdserve never sets come as null.
        item = {key: field for key, field in item.items() if not (key in _NULL_WHEN_SENT_BACK and field is None)}
        kind = item.get("type", "message")
        if kind == "reasoning":  # a reasoning model's earlier output sent back
            refuse_unknown(item, {"type", "id", "summary", "content", "encrypted_content", "status"}, prefix=f"{where}.")
            text = text_parts(item.get("content") or [], f"{where}.content", ("reasoning_text",), {"type", "text"})
            thinking += text or unseal(item.get("encrypted_content"), f"{where}.encrypted_content")
            continue
        if kind == "message":
            # phase: an assistant message's (commentary, final_answer), which the SDK says to send back.
            refuse_unknown(item, {"type", "role", "content", "id", "status", "phase"}, prefix=f"{where}.")
            role = item.get("role")
            if not isinstance(role, str) or role not in _ROLES:
                raise InvalidArgumentError(f"{where}.role", f"must be one of {sorted(_ROLES)}, got {role!r}")
            messages.append({"role": _ROLES[role], "content": _content(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            refuse_unknown(item, {"type", "call_id", "name", "arguments", "id", "status"}, prefix=f"{where}.")
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str) or (key != "arguments" and not item[key]):
                    raise InvalidArgumentError(f"{where}.{key}", "must be a non-empty string" if key != "arguments" else "must be a JSON string")
            try:
                bounded_json.loads(item["arguments"] or "{}")
            except ValueError as exc:  # JSONDecodeError, or an integer past Python's 4,300 digits
                # An incomplete call (cut short by max_output_tokens or a stop string, as pdserve
                # answers it) comes back as it was written: a client resends its history whole.
                if item.get("status") != "incomplete":
                    raise InvalidArgumentError(f"{where}.arguments", f"is not valid JSON: {exc}") from None
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls") is not None:
                messages[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            elif messages and messages[-1]["role"] == "assistant" and "tool_calls" not in messages[-1]:
                messages[-1]["tool_calls"] = [call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            refuse_unknown(item, {"type", "call_id", "output", "id", "status"}, prefix=f"{where}.")
            if not isinstance(item.get("call_id"), str) or not item["call_id"]:
                raise InvalidArgumentError(f"{where}.call_id", "must be a non-empty string")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _content(item.get("output"), f"{where}.output")})
        else:
            raise InvalidArgumentError(f"{where}.type", f"must be message, function_call, function_call_output or reasoning (text models), got {kind!r}")
        if thinking and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = thinking
        thinking = ""  # a reasoning item belongs to the assistant turn right after it, or to none
    if not messages:
        raise InvalidArgumentError("input", "has no message, function call or output (a reasoning item goes with the turn it belongs to)")
    return messages


_NULL_WHEN_SENT_BACK = {"async", "async_", "caller", "namespace", "created_by", "phase"}


def _content(value: Any, where: str) -> str:
    return text_parts(value, where, ("input_text", "output_text", "text"), {"type", "text", "annotations", "logprobs"})
