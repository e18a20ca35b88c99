"""OpenAI request bodies become neutral requests, chat templates render as transformers renders
them, and the HTTP edge answers without any worker: auth, health, errors."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from transformers import PreTrainedTokenizerFast

from engine.sampling_params import MAX_SEED
from router.errors import InvalidArgumentError
from router.openai_api.chat_template import ChatTemplate
from router.openai_api.protocol import read_chat, read_completion
from tests.router.tokenizer_builders import BASE_CONFIG, save_model_dir, train_byte_level_bpe

TEMPLATES = {
    "chatml": (
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    # Block tags on their own lines: trim_blocks and lstrip_blocks decide the whitespace.
    "blocks": (
        "{{ bos_token }}\n{% for m in messages %}\n  {% if m.role == 'system' %}\n[SYS] {{ m.content | trim }}\n  {% else %}\n"
        "<{{ m.role }}> {{ m.content }}{{ eos_token }}\n  {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}<assistant>{% endif %}"
    ),
    "json": "{% for m in messages %}{{ m | tojson }}{% if not loop.last %},{% endif %}{% endfor %}{{ extra_flag }}",
    # TRL's assistant-only-loss templates mark the assistant's text (transformers renders the body).
    "generation": (
        "{% for m in messages %}{% if m.role == 'assistant' %}<a>{% generation %}{{ m.content }}</s>{% endgeneration %}"
        "{% else %}<{{ m.role }}>{{ m.content }}{% endif %}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
    ),
}
MESSAGES = [
    {"role": "system", "content": "  Be brief. Ünïcode ok  "},
    {"role": "user", "content": "2+2? 東京"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "and 3+3?"},
]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    path = save_model_dir(tmp_path_factory.mktemp("tok"), train_byte_level_bpe(300), BASE_CONFIG)
    return PreTrainedTokenizerFast.from_pretrained(path)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_templates_render_as_transformers_renders_them(hf_tokenizer, name, add_generation_prompt):
    template = TEMPLATES[name]
    want = hf_tokenizer.apply_chat_template(
        MESSAGES, chat_template=template, add_generation_prompt=add_generation_prompt, tokenize=False, extra_flag="!"
    )
    ours = ChatTemplate(template, {"bos_token": "<s>", "eos_token": "</s>"})
    assert ours.render(MESSAGES, add_generation_prompt=add_generation_prompt, extra={"extra_flag": "!"}) == want


_DEFAULT_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
_TOOL_USE_TEMPLATE = "<tools>{{ tools | tojson }}</tools> Call them in <tool_call></tool_call>.\n" + _DEFAULT_TEMPLATE


@pytest.mark.parametrize("layout", ["tokenizer_config list", "transformers v5 files"])
def test_a_model_with_a_tool_use_template_renders_requests_with_tools_by_it(tmp_path, layout):
    """Hermes-2-Pro and Hermes-3 name two templates, "default" and "tool_use": transformers and
    vLLM render a request with tools by the second. pdserve rendered every request by the
    default one, which never shows the model its tools."""
    from types import SimpleNamespace

    from router.config import RouterConfig
    from router.openai_api.chat_format import _load_template
    from router.openai_api.protocol import read_conversation
    from router.tokenizer import Tokenizer

    if layout == "tokenizer_config list":
        templates = [{"name": "default", "template": _DEFAULT_TEMPLATE}, {"name": "tool_use", "template": _TOOL_USE_TEMPLATE}]
        path = save_model_dir(tmp_path, train_byte_level_bpe(300), {**BASE_CONFIG, "chat_template": templates})
    else:
        path = save_model_dir(tmp_path, train_byte_level_bpe(300), BASE_CONFIG)
        (path / "chat_template.jinja").write_text(_DEFAULT_TEMPLATE)
        (path / "additional_chat_templates").mkdir()
        (path / "additional_chat_templates" / "tool_use.jinja").write_text(_TOOL_USE_TEMPLATE)
    hf = PreTrainedTokenizerFast.from_pretrained(path)
    template = _load_template(SimpleNamespace(tokenizer=Tokenizer.from_model_dir(path), config=RouterConfig()))
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    with_tools = read_conversation({"messages": messages, "tools": tools}, template, None, None)
    assert with_tools.prompt == hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert with_tools.prompt.startswith('<tools>[{"type": "function"')
    assert with_tools.calling.parser == "hermes", "the format is read from the template the request renders by"
    without = read_conversation({"messages": messages}, template, None, None)
    assert without.prompt == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == "<user>Weather in Paris?<assistant>"
    configured = _load_template(SimpleNamespace(tokenizer=Tokenizer.from_model_dir(path), config=RouterConfig(chat_template=_DEFAULT_TEMPLATE)))
    assert not read_conversation({"messages": messages, "tools": tools}, configured, "hermes", None).prompt.startswith("<tools>"), (
        "a configured template replaces the model's, its tool_use one too"
    )


@pytest.mark.parametrize("final", ["end", "m", "Sure:\n\n", "The answer is ", "  ```python\n"])
@pytest.mark.parametrize("name", ["chatml", "trimming"])
def test_a_continued_final_message_ends_the_prompt_where_transformers_ends_it(hf_tokenizer, name, final):
    """The prompt was cut at the message's text's last occurrence, stripped: a short message
    matched inside the template's closing text ("end" left "...end<|im_end"), and its trailing
    spacing was lost. transformers (and vLLM, which renders through it) cut at a tag."""
    template = TEMPLATES["chatml"] if name == "chatml" else TEMPLATES["chatml"].replace("message['content']", "(message['content'] | trim)")
    messages = [{"role": "user", "content": "Go on."}, {"role": "assistant", "content": final}]
    want = hf_tokenizer.apply_chat_template(messages, chat_template=template, continue_final_message=True, tokenize=False)
    from router.openai_api.protocol import render_conversation

    ours = render_conversation({"messages": messages, "continue_final_message": True}, ChatTemplate(template, {}), None)
    assert ours == want
    assert not ours.endswith("<|im_end") and ours.endswith(final if name == "chatml" else final.strip())


def test_reasoning_sent_back_reaches_a_template_that_reads_thinking(hf_tokenizer):
    """gpt-oss templates read an assistant's reasoning as ``thinking``; transformers aliases it
    from ``reasoning_content``/``reasoning``; pdserve passed ``reasoning_content`` only."""
    from router.openai_api.protocol import render_conversation

    template = "{% for m in messages %}<{{ m.role }}>{% if m.thinking %}[{{ m.thinking }}]{% endif %}{{ m.content }}{% endfor %}"
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning": "Adding."},
                {"role": "user", "content": "and 3+3?"}]
    ours = render_conversation({"messages": messages, "add_generation_prompt": False}, ChatTemplate(template, {}), None)
    assert ours == hf_tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False) == "<user>2+2?<assistant>[Adding.]4<user>and 3+3?"


def test_a_template_that_raises_names_the_messages():
    template = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}", {})
    with pytest.raises(InvalidArgumentError) as raised:
        template.render([{"role": "system", "content": "x"}])
    assert raised.value.field == "messages" and "first must be user" in raised.value.problem


def test_the_sandbox_keeps_templates_from_python_internals():
    template = ChatTemplate("{{ messages.__class__.__mro__ }}", {})
    with pytest.raises(InvalidArgumentError):
        template.render([{"role": "user", "content": "x"}])


def test_negative_token_ids_are_refused_naming_the_position():
    from router.validation import RequestLimits, validate_input

    (choice,) = read_completion({"prompt": [5, -1, 7]}).choices
    with pytest.raises(InvalidArgumentError) as raised:
        validate_input(choice, RequestLimits(vocab_size=100, max_context_len=64), lambda text: [1])
    assert raised.value.field == "prompt[1]" and "-1" in raised.value.problem


def test_completion_fields_map_to_the_neutral_request():
    request = read_completion(
        {
            "model": "m", "prompt": "hi", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": "\n",
            "logprobs": 2, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "ignore_eos": True, "min_tokens": 2,
            "priority": 4, "stop_token_ids": [9], "stream": True, "stream_options": {"include_usage": True}, "n": 2,
        }
    )
    assert request.stream and request.include_usage and request.logprobs == 2 and request.choices_per_prompt == 2
    first, second = request.choices
    assert (first.prompt_text, first.max_tokens, first.temperature, first.top_p, first.stop) == ("hi", 7, 0.5, 0.9, ["\n"])
    assert (first.top_k, first.min_p, first.repetition_penalty, first.ignore_eos, first.min_tokens) == (5, 0.1, 1.2, True, 2)
    assert first.stop_token_ids == [9] and first.logprobs == 2
    assert first.priority == -4, "vLLM's priority: lower first; the router's: higher first"
    assert (first.seed, second.seed) == (3, 4), "choice i draws with seed + i"
    assert first.sampling_prefix == ""


def test_openai_service_tiers_order_requests_and_the_answer_names_the_tier_served():
    """flex is served 100 priority points lower and priority 100 higher (within the router's
    [-100, 100]): at vLLM's default priority, behind and ahead of every default request. auto is
    served as default; a tier not served here is refused naming the field."""
    def served(**fields):
        request = read_completion({"prompt": "x", **fields})
        return request.choices[0].priority, request.service_tier

    assert served() == (0, None) and served(service_tier="auto") == (0, "default") and served(service_tier="default") == (0, "default")
    assert served(service_tier="flex") == (-100, "flex") and served(service_tier="priority") == (100, "priority")
    assert served(service_tier="flex", priority=-30) == (-70, "flex") and served(service_tier="priority", priority=-30) == (100, "priority")
    assert served(service_tier="scale") == (0, "default")
    for tier in ("turbo", 3, ["flex"]):
        with pytest.raises(InvalidArgumentError) as raised:
            read_completion({"prompt": "x", "service_tier": tier})
        assert raised.value.field == "service_tier"
    from router.responses_api.protocol import read_responses

    answer = read_responses({"input": "x", "service_tier": "flex"})
    assert answer.generate.priority == -100 and answer.echo["service_tier"] == "flex"
    assert read_responses({"input": "x"}).echo["service_tier"] == "default"


def test_the_largest_seeds_later_choices_wrap_around_and_a_seed_past_it_stays_as_sent():
    assert [c.seed for c in read_completion({"prompt": "x", "n": 3, "seed": MAX_SEED}).choices] == [MAX_SEED, -MAX_SEED - 1, -MAX_SEED]
    assert [c.seed for c in read_completion({"prompt": "x", "n": 2, "seed": MAX_SEED + 1}).choices][0] == MAX_SEED + 1  # refused when validated


def test_a_batch_of_prompts_gives_n_choices_each_in_order():
    request = read_completion({"prompt": [[1, 2, 3], "text"], "n": 2})
    assert [(c.prompt_token_ids, c.prompt_text) for c in request.choices] == [([1, 2, 3], None), ([1, 2, 3], None), (None, "text"), (None, "text")]
    assert [c.text_field for c in request.choices] == ["prompt[0]", "prompt[0]", "prompt[1]", "prompt[1]"]


def test_echo_with_logprobs_asks_for_the_prompts_and_max_tokens_0_only_scores_it():
    """The prompt's log-probabilities are computed with as many alternatives as the echoed
    logprobs or vLLM's field ask, the larger; max_tokens 0 (with echo) draws one token to drop."""
    request = read_completion({"prompt": "x", "echo": True, "logprobs": 3, "prompt_logprobs": 1, "max_tokens": 0})
    assert request.prompt_only and request.echo and request.prompt_logprobs == 1
    assert [(c.prompt_logprobs, c.max_tokens, c.logprobs) for c in request.choices] == [(3, 1, 3)]
    assert read_completion({"prompt": "x", "logprobs": 3}).choices[0].prompt_logprobs is None  # no echo: the answer's only
    assert read_completion({"prompt": "x", "prompt_logprobs": 0}).choices[0].prompt_logprobs == 0


def test_vllm_structured_outputs_options_are_taken():
    """vLLM's options beside the constraint were refused as unknown fields (400): they change
    nothing here, and are accepted (objects take no property their schema does not name anyway)."""
    from router.openai_api.constraints import structured_output

    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}}, "required": ["a"]}
    options = {"disable_any_whitespace": True, "disable_fallback": True, "disable_additional_properties": True}
    taken = structured_output({"structured_outputs": {"json": schema, **options}})
    assert json.loads(taken.value) == schema and taken.field == "structured_outputs.json"


@pytest.mark.parametrize(
    "body, field",
    [
        ({}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": ["ok", 5]}, "prompt[1]"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
        ({"prompt": "x", "n": 17}, "n"),
        ({"prompt": [[1]] * 129, "n": 2}, "n"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "frequency_penalty": "high"}, "frequency_penalty"),
        ({"prompt": "x", "logit_bias": {"five": 1}}, "logit_bias.five"),
        ({"prompt": "x", "logit_bias": {"5": "up"}}, "logit_bias.5"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "x", "echo": True, "prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format.type"),
        ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format.json_schema.schema"),
        ({"prompt": "x", "structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs.choice"),
        ({"prompt": "x", "structured_outputs": {"ebnf": "x"}}, "structured_outputs.ebnf"),
        ({"prompt": "x", "structured_outputs": {"json": {"type": "object"}, "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
        ({"prompt": "x", "guided_choice": []}, "guided_choice"),
        ({"prompt": "x", "response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"prompt": "x", "bad_words": [""]}, "bad_words"),
        ({"prompt": "x", "allowed_token_ids": ["a"]}, "allowed_token_ids"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "stream": True, "stream_options": {"usage": True}}, "stream_options.usage"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "stop": [1]}, "stop"),
        ({"prompt": "x", "ignore_eos": "yes"}, "ignore_eos"),
        ({"prompt": "x", "priority": 101}, "priority"),
        ({"prompt": "x", "typo_field": 1}, "typo_field"),
        ([1, 2], "body"),
    ],
)
def test_bad_completion_bodies_name_the_field(body, field):
    with pytest.raises(InvalidArgumentError) as raised:
        read_completion(body)
    assert raised.value.field == field


def test_bodies_vllm_takes_are_taken():
    """What vLLM's request models take: a whole number written as a float (a client's
    ``max_tokens=1e3``), an empty ``stream_options`` without streaming, and OpenAI's
    ``stream_options.include_obfuscation`` (no padding is sent: what false asks for)."""
    request = read_completion({"prompt": "x", "max_tokens": 100.0, "n": 2.0, "logprobs": 1.0, "stream_options": {}})
    assert [type(c.max_tokens) for c in request.choices] == [int, int] and request.choices[0].max_tokens == 100
    assert request.choices[0].logprobs == 1
    streamed = read_chat({"messages": [{"role": "user", "content": "hi"}], "stream": True,
                          "stream_options": {"include_usage": True, "include_obfuscation": False}}, ChatTemplate(TEMPLATES["chatml"], {}), None, None)
    assert streamed.include_usage
    for body, field in [({"prompt": "x", "max_tokens": 100.5}, "max_tokens"),
                        ({"prompt": "x", "stream": True, "stream_options": {"include_obfuscation": "no"}}, "stream_options.include_obfuscation")]:
        with pytest.raises(InvalidArgumentError) as raised:
            read_completion(body)
        assert raised.value.field == field


@pytest.mark.parametrize(
    "body, field",
    [
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": "x", "weird": 1}]}, "messages[0].weird"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0].function"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "a"}]}]}, "messages[0].tool_calls[0]"),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 3}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {"schema": 5}}}, "response_format.json_schema.schema"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
        # The request's own fields are not template variables (rendered, they came twice: an error against messages).
        ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": 1}}, "chat_template_kwargs.messages"),
        ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
    ],
)
def test_bad_chat_bodies_name_the_field(body, field):
    with pytest.raises(InvalidArgumentError) as raised:
        read_chat(body, ChatTemplate(TEMPLATES["chatml"], {}))
    assert raised.value.field == field


def test_chat_renders_text_parts_and_leaves_special_tokens_to_the_template():
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], "max_completion_tokens": 5}
    request = read_chat(body, ChatTemplate(TEMPLATES["chatml"], {}))
    (choice,) = request.choices
    assert choice.prompt_text == "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n"
    assert choice.add_special_tokens is False and choice.max_tokens == 5 and choice.text_field == "messages"


def test_chat_without_a_template_is_refused_with_a_pointer_to_completions():
    with pytest.raises(InvalidArgumentError) as raised:
        read_chat({"messages": [{"role": "user", "content": "x"}]}, None)
    assert "/v1/completions" in raised.value.problem


# -- the HTTP edge of a router with no worker -------------------------------------------------


def _hosted_router(model_path, **router_fields):
    from cluster.deployment import DeploymentSpec, PoolSpec
    from router.config import RouterConfig
    from tests.serving import HostedRouter, engine_config

    spec = DeploymentSpec(
        model_path=model_path,
        prefill=PoolSpec(0, engine_config()),
        decode=PoolSpec(1, engine_config()),
        router=RouterConfig(http_port=0, **router_fields),
    )
    return HostedRouter(spec)


@pytest.fixture
def hosted(e2e_model):
    router = _hosted_router(e2e_model.path, auth_token="s3cret", served_model_names=["alias", "other"], ready_wait_s=0.5)
    yield f"http://127.0.0.1:{router.http_port}"
    router.close()


def _call(url: str, token: str | None = None, body: dict | None = None, raw: bytes | None = None) -> tuple[int, dict]:
    """GET ``url``, or POST ``body`` as JSON (or ``raw``, the bytes as they are)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers, method="GET" if data is None else "POST")
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_the_bearer_token_guards_everything_but_health(hosted):
    status, body = _call(f"{hosted}/v1/models")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, body = _call(f"{hosted}/v1/models", token="wrong")
    assert status == 401
    status, body = _call(f"{hosted}/v1/models", token="s3cret")
    assert status == 200 and [m["id"] for m in body["data"]] == ["alias", "other"]
    status, body = _call(f"{hosted}/health")
    assert status == 503, "no worker yet: not ready"


def test_a_request_before_any_worker_waits_then_gets_503(hosted):
    status, body = _call(f"{hosted}/v1/completions", token="s3cret", body={"model": "other", "prompt": "hi", "max_tokens": 2})
    assert status == 503 and body["error"]["type"] == "service_unavailable"
    status, body = _call(f"{hosted}/v1/completions", token="s3cret", body={"model": "nope", "prompt": "hi"})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, body = _call(f"{hosted}/v1/nothing", token="s3cret")
    assert status == 404 and "error" in body


def test_overload_is_a_429_in_openais_shape_with_a_retry_after(e2e_model):
    """A full queue's 429 said "retry later" with no Retry-After, which the official clients'
    retries wait for (they fell back to their own shorter backoff)."""
    refused, body = _refused_completion(e2e_model, {"prompt": "hi", "max_tokens": 2}, max_queued_requests=0)
    assert refused.code == 429 and body["error"]["type"] == "rate_limit_error" and "retry later" in body["error"]["message"]
    assert refused.headers["Retry-After"] == "1"


def _refused_completion(e2e_model, body: dict, **router_config):
    """The HTTP error a completion gets from a router of ``router_config``, and its JSON body."""
    router = _hosted_router(e2e_model.path, **router_config)
    request = urllib.request.Request(f"http://127.0.0.1:{router.http_port}/v1/completions", data=json.dumps(body).encode(), method="POST")
    try:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request)
    finally:
        router.close()
    return refused.value, json.loads(refused.value.read())


def test_the_token_is_accepted_as_a_bearer_token_or_as_anthropics_x_api_key():
    from types import SimpleNamespace

    from router.openai_api.errors import UnauthenticatedError
    from router.openai_api.server import OpenAIServer

    server = SimpleNamespace(auth_token="s3cret")
    for headers in ({"Authorization": "Bearer s3cret"}, {"x-api-key": "s3cret"}):
        OpenAIServer._authenticate(server, SimpleNamespace(headers=headers))
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}, {"Authorization": "s3cret"}):
        with pytest.raises(UnauthenticatedError):
            OpenAIServer._authenticate(server, SimpleNamespace(headers=headers))


def _chars(text: str, add_special_tokens: bool = True) -> list[int]:
    """One token per character: lengths easy to reason about."""
    return [2 + ord(c) % 900 for c in text]


def test_an_unset_max_tokens_is_16_on_completions_and_the_contexts_room_on_chat_and_responses(tmp_path):
    """As OpenAI and vLLM answer: a completion stops at 16 tokens unless told otherwise, a
    conversation runs until the context is full (or the model's max_new_tokens), so a chat client
    that leaves max_tokens out does not get a reply cut after 16 tokens."""
    from engine.sampling_params import SamplingDefaults
    from router.responses_api.protocol import read_responses
    from router.validation import RequestLimits, validate_input

    limits = RequestLimits(vocab_size=1000, max_context_len=200)
    template = ChatTemplate(TEMPLATES["chatml"], {})
    messages = [{"role": "user", "content": "hi"}]

    def max_tokens(request, limits=limits):
        validated = validate_input(request, limits, _chars)
        return validated.sampling_params.max_tokens, limits.max_context_len - len(validated.prompt_token_ids)

    assert max_tokens(read_completion({"prompt": "hi"}).choices[0])[0] == 16
    given, room = max_tokens(read_chat({"messages": messages}, template).choices[0])
    assert given == room > 100
    responses = read_responses({"input": "hi"}).generate
    responses.prompt_text = template.render(messages)
    given, room = max_tokens(responses)
    assert given == room > 100
    # The model's generation_config.json max_new_tokens caps a conversation's default too.
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 40}))
    capped = RequestLimits(vocab_size=1000, max_context_len=200, defaults=SamplingDefaults.from_model_dir(tmp_path))
    assert max_tokens(read_chat({"messages": messages}, template).choices[0], capped)[0] == 40
    assert max_tokens(read_chat({"messages": messages, "max_tokens": 5}, template).choices[0])[0] == 5


def test_a_null_max_tokens_or_max_completion_tokens_is_unset_beside_the_other():
    template = ChatTemplate(TEMPLATES["chatml"], {})
    messages = [{"role": "user", "content": "hi"}]
    assert read_chat({"messages": messages, "max_tokens": 50, "max_completion_tokens": None}, template).choices[0].max_tokens == 50
    assert read_chat({"messages": messages, "max_tokens": None, "max_completion_tokens": 7}, template).choices[0].max_tokens == 7
    assert read_chat({"messages": messages, "max_tokens": 7, "max_completion_tokens": 7}, template).choices[0].max_tokens == 7
    with pytest.raises(InvalidArgumentError) as raised:
        read_chat({"messages": messages, "max_tokens": 7, "max_completion_tokens": 8}, template)
    assert raised.value.field == "max_completion_tokens"


def test_errors_about_the_length_name_max_completion_tokens_where_the_client_sent_it():
    """The SDK's current name: an error naming max_tokens points at a field the client never sent."""
    from router.validation import RequestLimits, validate_input

    limits = RequestLimits(vocab_size=1000, max_context_len=200)
    template = ChatTemplate(TEMPLATES["chatml"], {})
    messages = [{"role": "user", "content": "hi"}]
    for name in ("max_completion_tokens", "max_tokens"):
        for value, problem in ((0, "must be >= 1"), (100_000, f"'{name}' is too large: 100000. This model's maximum context length is 200")):
            with pytest.raises(InvalidArgumentError) as raised:
                validate_input(read_chat({"messages": messages, name: value}, template).choices[0], limits, _chars)
            assert raised.value.field == name and problem in str(raised.value)


def test_top_logprobs_0_without_logprobs_asks_for_nothing_as_vllm_takes_it():
    template = ChatTemplate(TEMPLATES["chatml"], {})
    request = read_chat({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 0}, template)
    assert request.choices[0].logprobs is None


def test_bad_words_are_bounded_and_a_long_list_is_named():
    from router.validation import RequestLimits, validate_input

    limits = RequestLimits(vocab_size=1000, max_context_len=200)
    validated = validate_input(read_completion({"prompt": "x", "bad_words": ["ab"] * 1024}).choices[0], limits, _chars)
    assert validated.sampling_params.bad_words_token_ids
    for words, field in ((["ab"] * 1025, "bad_words"), (["ok", "x" * 257], "bad_words[1]")):
        with pytest.raises(InvalidArgumentError) as raised:
            validate_input(read_completion({"prompt": "x", "bad_words": words}).choices[0], limits, _chars)
        assert raised.value.field == field


def test_half_a_surrogate_pair_or_an_endless_integer_is_a_400_naming_where(hosted):
    """JSON can spell text that is not Unicode (a lone UTF-16 surrogate: an emoji a client cut in
    two) and integers Python will not read (over 4,300 digits); each is refused at the edge, the
    field named, on every API, where it was a 500 from deep inside (the tokenizer, the answer's
    UTF-8)."""
    lone = b'"hi \\ud83d there"'
    cases = [
        ("/v1/completions", b'{"prompt": ' + lone + b', "max_tokens": 2}', "prompt"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": ' + lone + b'}]}', "messages[0].content"),
        ("/v1/responses", b'{"input": "x", "metadata": {"k": ' + lone + b'}}', "metadata.k"),
        ("/v1/messages", b'{"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "system": ' + lone + b'}', "system"),
        ("/v1/completions", b'{"prompt": "x", "bad_words": ["ok", ' + lone + b']}', "bad_words[1]"),
        ("/v1/completions", b'{"prompt": "x", "\\udc00": 1}', "body"),
        ("/tokenize", b'{"prompt": ' + lone + b'}', "prompt"),
        ("/v1/completions", b'{"prompt": "x", "seed": ' + b"1" * 5000 + b"}", "body"),
    ]
    for path, data, field in cases:
        status, body = _call(hosted + path, "s3cret", raw=data)
        error = body["error"]
        named = error["message"].split(":")[0] if path == "/v1/messages" else error["param"]  # Anthropic's shape has no param
        assert (status, named) == (400, field), (path, body)
    # A whole pair is one character, served as any other.
    status, body = _call(hosted + "/tokenize", "s3cret", raw=b'{"prompt": "hi \\ud83d\\ude00"}')
    assert status == 200 and body["count"] == len(body["tokens"]) > 2


def test_an_answer_sent_back_as_the_sdks_dump_it_is_taken():
    """Clients append ``response.choices[0].message.model_dump()`` (and Anthropic's
    ``[block.model_dump() for block in message.content]``): the null fields the SDKs write for
    what pdserve never sets were refused as unsupported; they render as the message itself."""
    from anthropic.types import TextBlock, ToolUseBlock
    from openai.types.chat import ChatCompletionMessage

    from router.anthropic_api.protocol import read_messages

    template = ChatTemplate(TEMPLATES["chatml"], {})
    dumped = ChatCompletionMessage(role="assistant", content="hi").model_dump()
    turn = [{"role": "user", "content": "a"}, dumped, {"role": "user", "content": "b"}]
    plain = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "b"}]
    assert read_chat({"messages": turn}, template).choices[0].prompt_text == read_chat({"messages": plain}, template).choices[0].prompt_text
    with pytest.raises(InvalidArgumentError) as raised:
        read_chat({"messages": [{**dumped, "audio": {"id": "x"}}]}, template)
    assert raised.value.field == "messages[0].audio"  # only null is left out

    blocks = [TextBlock(text="checking", type="text").model_dump(), ToolUseBlock(id="toolu_1", input={"x": 1}, name="f", type="tool_use").model_dump()]
    tool = {"name": "f", "input_schema": {"type": "object", "properties": {"x": {"type": "integer"}}}}
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": blocks},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}]}]
    request = read_messages({"model": "m", "max_tokens": 4, "tools": [tool], "messages": messages}, template, "hermes")
    assert "checking" in request.generate.prompt_text


def test_an_anthropic_tool_result_with_is_error_tells_the_model_the_call_failed():
    """``is_error: true`` was checked and dropped: a failed tool call rendered exactly as its
    success would, and the model answered from the error text as if it were the tool's result."""
    from router.anthropic_api.protocol import read_messages

    template = ChatTemplate(TEMPLATES["json"], {})  # the messages as the template gets them
    tool = {"name": "f", "input_schema": {"type": "object"}}

    def prompt(**result):
        messages = [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "no such file", **result}]},
        ]
        return read_messages({"model": "m", "max_tokens": 4, "tools": [tool], "messages": messages}, template, "hermes").generate.prompt_text

    failed = prompt(is_error=True)
    assert '"content": "Error: no such file"' in failed and '"is_error": true' in failed
    assert "Error:" not in prompt() and "is_error" not in prompt() and prompt() == prompt(is_error=False)
    with pytest.raises(InvalidArgumentError) as raised:
        prompt(is_error="yes")
    assert raised.value.field == "messages[2].content[0].is_error"


def test_legacy_completions_top_logprobs_always_hold_the_sampled_token(byte_level_tokenizer):
    """OpenAI's legacy logprobs return the chosen token's too (up to logprobs + 1 entries), as
    vLLM's do: logprobs 0 gave an empty dict at every position, and a token drawn outside the
    top k was missing from its own."""
    from engine.sampling_params import TokenLogprob
    from router.openai_api.responses import ChoiceState
    from router.output_stream import OutputChunk

    a, b, c = (byte_level_tokenizer.encode(t, add_special_tokens=False)[0] for t in ("a", "b", "c"))
    drawn = TokenLogprob(c, -2.5, 3, [(a, -0.4), (b, -1.1)])
    for num_logprobs, want in ((0, {"c": -2.5}), (1, {"c": -2.5, "a": -0.4})):
        state = ChoiceState(0, False, num_logprobs, 1)
        rendered = state.add(OutputChunk(token_ids=[c], text="c", logprobs=[drawn]), byte_level_tokenizer)
        assert rendered["top_logprobs"] == [want]
    # Two tokens that read alike (bytes of one character): the more likely one's stays, though
    # the chosen one comes first.
    from router.openai_api.responses import _top_by_text

    assert _top_by_text([(c, -2.5), (a, -0.4)], lambda token_id: "\ufffd") == {"\ufffd": -0.4}


def test_choice_i_draws_with_seed_plus_i_for_a_negative_seed_too():
    """n choices draw with seed + i, wrapping within the 64-bit signed range: a negative seed's
    next choice went to the far end of the range (-5 + 1 became 2^63 - 4), not -4."""
    from engine.sampling_params import MAX_SEED, MIN_SEED

    def seeds(seed: int) -> list[int]:
        return [c.seed for c in read_completion({"prompt": "x", "n": 3, "seed": seed}).choices]

    assert seeds(-5) == [-5, -4, -3]
    assert seeds(MAX_SEED) == [MAX_SEED, MIN_SEED, MIN_SEED + 1]
    assert seeds(7) == [7, 8, 9]


def test_responses_output_items_sent_back_as_the_sdk_dumps_them_are_taken():
    """model_dump() of an output message carries phase (which the SDK says to send back) and of
    a function call null fields pdserve never sets (async, caller, namespace): a 400 each."""
    from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText

    from router.responses_api.protocol import read_responses

    said = ResponseOutputMessage(id="msg_1", type="message", role="assistant", status="completed", phase="final_answer",
                                 content=[ResponseOutputText(type="output_text", text="Let me look.", annotations=[])])
    call = ResponseFunctionToolCall(type="function_call", call_id="call_1", name="get_weather", arguments='{"city": "Oslo"}')
    for dump in (lambda item: item.model_dump(), lambda item: item.model_dump(by_alias=True)):
        body = {"input": [{"role": "user", "content": "weather?"}, dump(said), dump(call),
                          {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]}
        messages = read_responses(body).messages
        assert [m["role"] for m in messages] == ["user", "assistant", "tool"] and messages[1]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_responses_usage_validates_as_the_sdks_response_usage():
    """input_tokens_details.cache_write_tokens is required there (typed code read None)."""
    from openai.types.responses import ResponseUsage

    from router.responses_api.front_end import usage

    ResponseUsage.model_validate(usage(None, 12, 5, 2))


def test_a_request_past_the_context_says_so_as_vllm_and_openai_do():
    """LiteLLM raises ContextWindowExceededError (which agents answer by shortening their
    history) on the text "This model's maximum context length is"; OpenAI's code says it too.
    The error names the field: messages for chat, the length field the client sent."""
    from router.openai_api.errors import error_body
    from router.validation import RequestLimits, validate_input

    limits = RequestLimits(vocab_size=1000, max_context_len=200)
    template = ChatTemplate(TEMPLATES["chatml"], {})
    for body, field in (
        ({"messages": [{"role": "user", "content": "x" * 300}]}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 190}, "max_tokens"),
    ):
        with pytest.raises(InvalidArgumentError) as raised:
            validate_input(read_chat(body, template).choices[0], limits, _chars)
        status, error, _ = error_body(raised.value)
        assert status == 400 and error["error"]["code"] == "context_length_exceeded" and error["error"]["param"] == field
        assert "This model's maximum context length is 200 tokens" in error["error"]["message"]


def test_a_tool_use_template_that_does_not_compile_leaves_the_default_serving():
    """A model's broken tool_use template turned chat off for every request (its error was the
    whole template's); the default one serves all of them, tools too."""
    template = ChatTemplate(TEMPLATES["chatml"], {}, None, tool_use="{% if tools %}unclosed")
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert template.for_tools(tools) is template
    assert template.render([{"role": "user", "content": "hi"}], tools=tools).endswith("<|im_start|>assistant\n")


def test_more_choices_than_the_router_queues_at_once_is_a_400_naming_n(e2e_model):
    """Each choice waits for its first token as a request of its own: a batch of more choices than
    max_queued_requests was refused with 429 and Retry-After at every retry, and could never pass."""
    refused, body = _refused_completion(e2e_model, {"prompt": ["a", "b"], "n": 2, "max_tokens": 2}, max_queued_requests=3)
    assert refused.code == 400 and body["error"]["param"] == "n" and "max_queued_requests" in body["error"]["message"]
