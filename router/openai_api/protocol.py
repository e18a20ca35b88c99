"""OpenAI request bodies (completions, chat completions) read into the router's neutral requests.

Each field is checked for its JSON type and range here, and any problem raises
``InvalidArgumentError`` naming the field as the client wrote it (``temperature``,
``messages[2].content``, ``stream_options.include_usage``). A field the API defines but
pdserve does not implement (``suffix``, ...) and a field the API
does not define are refused with 400 too, never ignored: nothing a client sent is dropped
silently. vLLM's extensions are accepted under vLLM's names (``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``min_tokens``, ``stop_token_ids``,
``skip_special_tokens``, ``priority`` where lower is served first, ``add_generation_prompt``,
``chat_template_kwargs``, ``allowed_token_ids``, ``bad_words``, ``structured_outputs`` and its
older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``,
``prompt_logprobs``, ``return_token_ids``, ``return_tokens_as_token_ids``,
``include_stop_str_in_output``, ``truncate_prompt_tokens``, ``add_special_tokens`` (completions:
true, the tokenizer's BOS before the prompt; chat: false, else the tokenizer's special tokens go
around the rendered template's too) and chat's ``documents`` (the template's RAG documents)).
vLLM's fields for what pdserve does one way only are taken at that way and refused otherwise,
naming the field: ``use_beam_search`` false, ``length_penalty`` 1, ``spaces_between_special_tokens``
true, ``truncation_side`` "left" (truncate_prompt_tokens keeps the prompt's last tokens), chat's
``echo`` false. OpenAI's ``service_tier`` moves the
request's priority (``flex`` 100 lower, ``priority`` 100 higher: fields.py) and the answer names
the tier served; ``prompt_cache_key`` and ``safety_identifier`` are
checked and need nothing more (prefix caching is automatic; ``user`` is likewise only checked).

A prompt is scored as the legacy completions API scores it: ``echo`` with ``logprobs`` puts the
prompt's tokens, with their log-probabilities, before the answer's, and ``max_tokens: 0`` (with
``echo`` only) returns the scored prompt and generates nothing, as scoring clients (lm-eval's
loglikelihood, perplexity scripts) ask.

An output constraint (``response_format`` json_object or json_schema, ``structured_outputs``,
``guided_*``, or a ``required`` or named ``tool_choice``) becomes the request's
``StructuredOutput``, its grammar checked by the router before any worker sees it
(router/validation.py); one per request. Tools: router/openai_api/tool_calls.py.

``n`` choices (and, for completions, a batch of prompts) become one neutral request each; a
seeded request's choice i draws with seed + i, so choices differ and each repeats exactly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from engine.sampling_params import MIN_SEED
from engine.structured_output import TOOL_CALLS
from engine.thinking import Thinking
from router.errors import InvalidArgumentError
from router.openai_api.chat_template import ChatTemplate
from router.openai_api.constraints import logit_bias, structured_output
from router.openai_api.reasoning import ReasoningFormat, as_written, read_effort
from router.openai_api.fields import boolean, cache_salt, int_list, integer, is_int, json_object, number, refuse_unknown, served_priority, string_list, text_parts, type_name
from router.openai_api.tool_calls import ToolCalling, check_message_tool_fields, read_tool_calling, template_messages
from router.validation import GenerateInput

MAX_CHOICES = 16  # n
# n times the prompts of a completions batch: each is a request of its own, admitted together.
# Scoring clients batch prompts (lm-eval's local-completions sends batch_size of them in one
# call); the router's default queue (max_queued_requests) admits this many at once.
MAX_BATCH_CHOICES = 256
MAX_LOGPROBS = 20
# Fields of an assistant message pdserve never sets: taken (and left out) when null.
_NULL_WHEN_SENT_BACK = {"function_call", "refusal", "audio", "annotations"}

# Fields both endpoints take, with what they do here.
_COMMON_FIELDS = {
    "model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
    "presence_penalty", "frequency_penalty", "logit_bias", "user", "best_of", "response_format",
    # vLLM's extensions
    "prompt_logprobs", "return_token_ids", "return_tokens_as_token_ids", "top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids", "skip_special_tokens", "priority",
    "allowed_token_ids", "bad_words", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "include_stop_str_in_output", "truncate_prompt_tokens", "request_id", "cache_salt", "add_special_tokens",
    # vLLM's, each taken at the one value pdserve does (_one_way_only)
    "use_beam_search", "length_penalty", "spaces_between_special_tokens", "truncation_side",
    # OpenAI's, read and checked: one service tier here; caching and abuse tracking are the server's own
    "service_tier", "prompt_cache_key", "safety_identifier",
}
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "logprobs", "echo", "suffix"}
_CHAT_FIELDS = _COMMON_FIELDS | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
    "parallel_tool_calls", "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "metadata", "store",
    "include_reasoning", "thinking_token_budget", "reasoning_effort", "documents", "echo",
}


@dataclass(slots=True)
class ApiRequest:
    """One completions or chat completions call, read and checked."""

    model: str | None
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    continuous_usage: bool  # stream_options.continuous_usage_stats (vLLM) with include_usage: each chunk's choice's usage
    logprobs: int | None  # top alternatives per token (completions' logprobs, chat's top_logprobs); None: none
    echo: bool = False  # completions: each choice's text starts with its prompt
    # vLLM's prompt_logprobs: each prompt token's log-probability and this many alternatives, in
    # the choice's (completions) or the response's (chat) ``prompt_logprobs``. None: not asked.
    prompt_logprobs: int | None = None
    prompt_only: bool = False  # completions' max_tokens 0 with echo: the prompt scored, nothing generated
    return_token_ids: bool = False  # vLLM's: the prompt's and the answer's token ids beside the text
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"
    tool_calling: ToolCalling | None = None  # chat with tools: how its answers are read
    request_id: str | None = None  # vLLM's: the client's id for the call (the X-Request-Id header's too)
    service_tier: str | None = None  # the OpenAI tier served, where the request named one: the answer says it
    # Chat with a reasoning parser (router.reasoning_parser; each choice's thinking is its
    # GenerateInput's), and vLLM's include_reasoning (false: the thinking is left out).
    reasoning: ReasoningFormat | None = None
    include_reasoning: bool = True
    # Chat: the answer's role, vLLM's rule: "assistant" where the prompt asks for a new turn
    # (add_generation_prompt), else the last message's (continue_final_message goes on with it).
    role: str = "assistant"
    choices: list[GenerateInput] = field(default_factory=list)  # in choice-index order: prompt by prompt, n each
    choices_per_prompt: int = 1


def read_completion(body: Any) -> ApiRequest:
    body = json_object(body, "body")
    refuse_unknown(body, _COMPLETION_FIELDS)
    echo = boolean(body, "echo", False)
    if body.get("suffix") is not None:
        raise InvalidArgumentError("suffix", "is not supported")
    logprobs = integer(body, "logprobs", None, 0, MAX_LOGPROBS)
    prompt_only = integer(body, "max_tokens", None, None, None) == 0
    if prompt_only:
        if not echo:
            raise InvalidArgumentError("max_tokens", "must be >= 1; 0 only with echo: true (the prompt scored, nothing generated)")
        # One token is drawn (a prompt's pass ends with one) and left out of the answer.
        body = {**body, "max_tokens": 1}
    prompts = _prompts(body)
    base = _common(body, logprobs)
    base.add_special_tokens = boolean(body, "add_special_tokens", True)
    request = _api_request(body, logprobs)
    request.echo, request.prompt_only = echo, prompt_only
    # Echoed with logprobs, the prompt's tokens carry theirs: computed with the vLLM field's.
    asked = [k for k in (request.prompt_logprobs, logprobs if echo else None) if k is not None]
    base.prompt_logprobs = max(asked) if asked else None
    count = request.choices_per_prompt = _num_choices(body, len(prompts))
    for prompt_field, prompt in prompts:
        for i in range(count):
            choice = _choice(base, i)
            choice.text_field = choice.ids_field = prompt_field
            if isinstance(prompt, str):
                choice.prompt_text = prompt
            else:
                choice.prompt_token_ids = prompt
            request.choices.append(choice)
    return request


def read_chat(body: Any, template: ChatTemplate | None, tool_call_parser: str | None = None, reasoning: ReasoningFormat | None = None) -> ApiRequest:
    """``tool_call_parser``: the deployment's (router.tool_call_parser); None: recognised from
    the template. ``reasoning``: the deployment's reasoning parser, if any."""
    body = json_object(body, "body")
    refuse_unknown(body, _CHAT_FIELDS)
    conversation = read_conversation(body, template, tool_call_parser, reasoning)
    if body.get("store") not in (None, False):
        raise InvalidArgumentError("store", "is not supported")
    if "metadata" in body and body["metadata"] is not None:
        json_object(body["metadata"], "metadata")
    # A null is unset (clients that write every field send the one they do not use as null).
    given = [name for name in ("max_completion_tokens", "max_tokens") if body.get(name) is not None]
    if len(given) == 2 and body["max_tokens"] != body["max_completion_tokens"]:
        raise InvalidArgumentError("max_completion_tokens", "differs from max_tokens (its deprecated name); give one")
    wants_logprobs = boolean(body, "logprobs", False)
    top = integer(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top and not wants_logprobs:  # (0, the default clients fill in, asks for nothing: vLLM takes it)
        raise InvalidArgumentError("top_logprobs", "needs logprobs: true")
    logprobs = (top or 0) if wants_logprobs else None
    if boolean(body, "echo", False):
        raise InvalidArgumentError("echo", "is not supported on chat (only false)")
    base = _common(body, logprobs, max_tokens_field=given[0] if given else "max_tokens")
    conversation.apply(base, skip_special_tokens_given="skip_special_tokens" in body)
    # vLLM's: the tokenizer's special tokens (BOS) on top of those the template wrote.
    base.add_special_tokens = boolean(body, "add_special_tokens", False)
    base.prompt_logprobs = integer(body, "prompt_logprobs", None, 0, MAX_LOGPROBS)
    base.text_field = base.ids_field = "messages"
    request = _api_request(body, logprobs)
    request.tool_calling = conversation.calling
    request.reasoning, request.include_reasoning = reasoning, boolean(body, "include_reasoning", True)
    if not _adds_generation_prompt(body):
        request.role = body["messages"][-1]["role"]  # (read and checked with the conversation)
    request.choices_per_prompt = _num_choices(body, 1)
    request.choices = [_choice(base, i) for i in range(request.choices_per_prompt)]
    return request


@dataclass(slots=True)
class Conversation:
    """A chat's conversation read and rendered: its prompt text, how it may call its tools
    (None: it has none) and where its answer's thinking is (None: no reasoning parser, or the
    template turned thinking off)."""

    prompt: str
    calling: ToolCalling | None
    thinking: Thinking | None

    def apply(self, request: GenerateInput, skip_special_tokens_given: bool) -> None:
        """Make ``request`` (its sampling fields read) this conversation's answer: its prompt,
        its tool choice's grammar, its thinking, and the default max_tokens of a chat."""
        constraint = self.calling.constraint(request.structured) if self.calling is not None else None
        if constraint is not None:
            if request.structured is not None and constraint.kind != TOOL_CALLS:  # (tool calls take the answer's format in)
                raise InvalidArgumentError("tool_choice", f"{self.calling.choice} constrains the answer, and {request.structured.field} already does; give one")
            request.structured = constraint
        if self.calling is not None and self.calling.reads_special_tokens and not skip_special_tokens_given:
            request.skip_special_tokens = False
        request.thinking = self.thinking
        request.prompt_text = self.prompt
        request.add_special_tokens = False  # the template wrote them
        request.max_tokens_fills_context = True


def read_conversation(body: dict, template: ChatTemplate | None, tool_call_parser: str | None, reasoning: ReasoningFormat | None) -> Conversation:
    """A chat body's conversation fields (``messages``, ``tools``, ``tool_choice``,
    ``parallel_tool_calls``, the template options, ``thinking_token_budget``), checked and rendered."""
    if template is None:
        raise InvalidArgumentError("messages", "this model has no chat template (tokenizer_config.json or chat_template.jinja); use /v1/completions")
    template = template.for_tools(body.get("tools"))
    calling = read_tool_calling(body, template.text, tool_call_parser)
    prompt = render_conversation(body, template, calling.tools if calling is not None else None)
    budget = integer(body, "thinking_token_budget", None, 0, None)
    thinking = None
    if reasoning is not None:
        thinking = reasoning.thinking(prompt, budget, _continued(body))
    elif budget is not None:
        raise InvalidArgumentError("thinking_token_budget", "needs a reasoning model served with router.reasoning_parser")
    return Conversation(prompt, calling, thinking)


def _continued(body: dict) -> str | None:
    """With continue_final_message, the continued assistant message as the model wrote it: its
    thinking, where it came in reasoning fields, before its text (what says whether the answer
    goes on inside the thinking)."""
    if not boolean(body, "continue_final_message", False):
        return None
    return as_written(_messages(body)[-1])


_RENDER_ARGUMENTS = {"messages", "tools", "documents", "add_generation_prompt"}  # what ChatTemplate.render takes itself


def render_conversation(body: dict, template: ChatTemplate, tools: list[dict[str, Any]] | None) -> str:
    """The prompt text of a chat body's ``messages`` through the model's template, with its
    ``add_generation_prompt``, ``continue_final_message`` (vLLM's: the last message is left open
    for the model to go on with), ``chat_template_kwargs`` and ``reasoning_effort``."""
    messages = _messages(body)
    extra = body.get("chat_template_kwargs")
    extra = dict(json_object(extra, "chat_template_kwargs")) if extra is not None else None
    for name in _RENDER_ARGUMENTS & set(extra or ()):
        # (Passed on, the template's render got it twice: a TypeError reported against messages.)
        raise InvalidArgumentError(f"chat_template_kwargs.{name}", "is the request's own to give (its field of that name), not a template variable")
    effort = read_effort(body.get("reasoning_effort"), "reasoning_effort")
    if effort is not None:
        extra = {"reasoning_effort": effort, **(extra or {})}
    continue_final = boolean(body, "continue_final_message", False)
    add_generation_prompt = _adds_generation_prompt(body)
    if continue_final and add_generation_prompt:
        raise InvalidArgumentError("continue_final_message", "cannot be combined with add_generation_prompt: true")
    return template.render(
        template_messages(messages, template.text), add_generation_prompt=add_generation_prompt, tools=tools, documents=_documents(body), extra=extra,
        continue_final_message=continue_final,
    )


def _adds_generation_prompt(body: dict) -> bool:
    """add_generation_prompt, whose default is true unless the last message is continued."""
    return boolean(body, "add_generation_prompt", not boolean(body, "continue_final_message", False))


def _documents(body: dict) -> list[dict[str, str]] | None:
    """vLLM's ``documents`` (chat): objects of strings (vLLM suggests ``title`` and ``text``) the
    template shows the model for retrieval-augmented answers; a template that reads none ignores them."""
    documents = body.get("documents")
    if documents is None:
        return None
    if not isinstance(documents, list):
        raise InvalidArgumentError("documents", f"must be a list of objects, got {type_name(documents)}")
    for index, document in enumerate(documents):
        for key, value in json_object(document, f"documents[{index}]").items():
            if not isinstance(value, str):
                raise InvalidArgumentError(f"documents[{index}].{key}", f"must be a string, got {type_name(value)}")
    return documents


def _one_way_only(body: dict) -> None:
    """vLLM's fields for what pdserve does one way only: taken at that value, refused at any other."""
    if boolean(body, "use_beam_search", False):
        raise InvalidArgumentError("use_beam_search", "is not supported (only false: choices are sampled)")
    if number(body, "length_penalty", 1.0) != 1.0:
        raise InvalidArgumentError("length_penalty", "is not supported other than 1 (it weighs beam search's candidates)")
    if not boolean(body, "spaces_between_special_tokens", True):
        raise InvalidArgumentError("spaces_between_special_tokens", "is not supported (only true)")
    side = body.get("truncation_side")
    if side not in (None, "left"):
        raise InvalidArgumentError("truncation_side", f"is not supported other than \"left\" (truncate_prompt_tokens keeps the prompt's last tokens), got {side!r}"[:200])


def _api_request(body: dict, logprobs: int | None) -> ApiRequest:
    stream = boolean(body, "stream", False)
    options = body.get("stream_options")
    include_usage = continuous = False
    if options is not None:
        if not stream and options != {}:  # (an empty one asks nothing: vLLM takes it)
            raise InvalidArgumentError("stream_options", "is only allowed with stream: true")
        options = json_object(options, "stream_options")
        # include_obfuscation (OpenAI's padding of chunks against side channels) is taken and
        # ignored: no padding is sent, what false asks for.
        refuse_unknown(options, {"include_usage", "continuous_usage_stats", "include_obfuscation"}, prefix="stream_options.")
        boolean(options, "include_obfuscation", False, prefix="stream_options.")
        include_usage = boolean(options, "include_usage", False, prefix="stream_options.")
        # Usage on every chunk only beside the last chunk's, as vLLM has it.
        continuous = include_usage and boolean(options, "continuous_usage_stats", False, prefix="stream_options.")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidArgumentError("model", f"must be a string, got {type_name(model)}")
    request_id = body.get("request_id")
    if request_id is not None and not is_client_request_id(request_id):
        raise InvalidArgumentError("request_id", f"must be 1-100 characters from [A-Za-z0-9._:-], got {request_id!r}"[:200])
    return ApiRequest(
        request_id=request_id, service_tier=served_priority(body)[1],
        model=model, stream=stream, include_usage=include_usage, continuous_usage=continuous, logprobs=logprobs,
        prompt_logprobs=integer(body, "prompt_logprobs", None, 0, MAX_LOGPROBS),
        return_token_ids=boolean(body, "return_token_ids", False),
        tokens_as_ids=boolean(body, "return_tokens_as_token_ids", False),
    )


_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,100}")


def is_client_request_id(value: Any) -> bool:
    """Whether ``value`` may be a client's id for its call (vLLM's ``request_id``, the
    ``X-Request-Id`` header): it names the response and, in the server's logs, its requests,
    so printable and short."""
    return isinstance(value, str) and _CLIENT_REQUEST_ID.fullmatch(value) is not None


def _common(body: dict, logprobs: int | None, max_tokens_field: str = "max_tokens") -> GenerateInput:
    for name in ("user", "prompt_cache_key", "safety_identifier"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise InvalidArgumentError(name, f"must be a string, got {type_name(body[name])}")
    _one_way_only(body)
    top_k = integer(body, "top_k", None, -1, None)
    return GenerateInput(
        max_tokens=integer(body, max_tokens_field, None, None, None),
        temperature=number(body, "temperature", None),
        top_k=top_k,
        top_p=number(body, "top_p", None),
        min_p=number(body, "min_p", None),
        seed=integer(body, "seed", None, None, None),
        repetition_penalty=number(body, "repetition_penalty", None),
        stop=_stop(body),
        stop_token_ids=int_list(body, "stop_token_ids"),
        ignore_eos=boolean(body, "ignore_eos", False),
        logprobs=logprobs,
        min_tokens=integer(body, "min_tokens", 0, 0, None),
        skip_special_tokens=boolean(body, "skip_special_tokens", True),
        include_stop_str=boolean(body, "include_stop_str_in_output", False),
        cache_salt=cache_salt(body),
        truncate_prompt_tokens=integer(body, "truncate_prompt_tokens", None, None, None),
        priority=served_priority(body)[0],
        sampling_prefix="",
        presence_penalty=number(body, "presence_penalty", 0.0),
        frequency_penalty=number(body, "frequency_penalty", 0.0),
        logit_bias=logit_bias(body),
        allowed_token_ids=int_list(body, "allowed_token_ids") if body.get("allowed_token_ids") is not None else None,
        bad_words=string_list(body, "bad_words"),
        structured=structured_output(body),
        field_names={"max_tokens": max_tokens_field},  # errors name the one the client sent
    )


def _choice(base: GenerateInput, index: int) -> GenerateInput:
    return replace(
        base,
        stop=list(base.stop),
        stop_token_ids=list(base.stop_token_ids),
        # Choice i draws with seed + i, wrapping within the 64-bit signed range (the largest seed's
        # next choices are the smallest); the first keeps the seed as sent (refused if out of range).
        seed=base.seed if base.seed is None or index == 0 else (base.seed + index - MIN_SEED) % 2**64 + MIN_SEED,
    )


def _num_choices(body: dict, num_prompts: int) -> int:
    n = integer(body, "n", 1, 1, MAX_CHOICES)
    best_of = integer(body, "best_of", None, 1, None)
    if best_of is not None and best_of != n:
        raise InvalidArgumentError("best_of", f"is not supported other than equal to n ({n})")
    if n * num_prompts > MAX_BATCH_CHOICES:
        raise InvalidArgumentError("n", f"n ({n}) x prompts ({num_prompts}) must be at most {MAX_BATCH_CHOICES}")
    return n


def _prompts(body: dict) -> list[tuple[str, str | list[int]]]:
    """(field name for errors, text or token ids) for each prompt of a completions call."""
    if "prompt" not in body or body["prompt"] is None:
        raise InvalidArgumentError("prompt", "is required")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return [("prompt", prompt)]
    if not isinstance(prompt, list) or not prompt:
        raise InvalidArgumentError("prompt", "must be a string, a list of token ids, or a non-empty list of either")
    if all(is_int(x) for x in prompt):
        return [("prompt", list(prompt))]
    prompts: list[tuple[str, str | list[int]]] = []
    for index, item in enumerate(prompt):
        name = f"prompt[{index}]"
        if isinstance(item, str):
            prompts.append((name, item))
        elif isinstance(item, list) and item and all(is_int(x) for x in item):
            prompts.append((name, list(item)))
        else:
            raise InvalidArgumentError(name, "must be a string or a non-empty list of token ids")
    return prompts


def _messages(body: dict) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidArgumentError("messages", "must be a non-empty list of messages")
    out = []
    for index, message in enumerate(messages):
        name = f"messages[{index}]"
        message = json_object(message, name)
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidArgumentError(f"{name}.role", "must be a non-empty string")
        plain: dict[str, Any] = {"role": role}
        for key, value in message.items():
            if key == "role":
                continue
            if key == "content":
                plain["content"] = _content(value, f"{name}.content")
            elif key == "name":
                if not isinstance(value, str):
                    raise InvalidArgumentError(f"{name}.name", f"must be a string, got {type_name(value)}")
                plain["name"] = value
            elif key in ("tool_calls", "tool_call_id"):
                plain.update(check_message_tool_fields({key: value}, name))
            elif key in _NULL_WHEN_SENT_BACK and value is None:
                continue  # an answer sent back as the SDK dumps it (``model_dump()``) carries these as null
            elif key in ("reasoning", "reasoning_content"):  # a reasoning model's answer sent back
                if value is not None and not isinstance(value, str):
                    raise InvalidArgumentError(f"{name}.{key}", f"must be a string, got {type_name(value)}")
                if value:
                    plain["reasoning_content"] = value  # the name reasoning models' templates read
            else:
                raise InvalidArgumentError(f"{name}.{key}", "is not supported")
        out.append(plain)
    return out


def _content(value: Any, name: str) -> str:
    """Text content; none (an assistant's turn of tool calls sends ``null``) is empty text, as
    vLLM renders it: templates print or concatenate content, and would write "None" or fail."""
    return "" if value is None else text_parts(value, name, ("text",))


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise InvalidArgumentError("stop", "must be a string or a list of strings")
