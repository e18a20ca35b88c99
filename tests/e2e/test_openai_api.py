"""The OpenAI HTTP API as the official ``openai`` client sees it, against a live deployment.

References are transformers' own: ``apply_chat_template`` + ``generate`` for chat, the
tokenizer's decode for text, the model's log-softmax for log-probabilities.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import time
import urllib.error
import urllib.request
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest
import ray
import torch
from transformers import AutoTokenizer

from router.config import RouterConfig
from router.metrics import Metrics
from tests.checkpoints import hf_greedy, random_prompts
from tests.serving import Client, running_deployment

# A chat template with the features transformers' rendering has: special-token variables,
# trim_blocks/lstrip_blocks whitespace, filters, raise_exception, add_generation_prompt, and
# tools, assistant tool calls and tool results in the Hermes format (<tool_call>).
CHAT_TEMPLATE = """{{ bos_token }}
{%- if tools %}
<|system|>
Functions you may call:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>{{ eos_token }}
{% endif %}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}
        {{- raise_exception('unknown role ' + message['role']) }}
    {%- endif %}
<|{{ message['role'] }}|>
{% if message.tool_calls %}
{%- for call in message.tool_calls %}<tool_call>{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}</tool_call>{% endfor %}{{ eos_token }}
{% else %}
{{ message['content'] | trim }}{{ eos_token }}
{% endif %}
{% endfor %}
{%- if add_generation_prompt %}
<|assistant|>
{% endif %}"""

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime number, café!"},
]
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def chat_model(e2e_model, tmp_path_factory):
    """The e2e model directory plus a chat template in tokenizer_config.json."""
    path = tmp_path_factory.mktemp("chat_model") / "tiny-chat"
    shutil.copytree(e2e_model.path, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return type(e2e_model)(path, e2e_model.hf_model, e2e_model.vocab_size)


@pytest.fixture(scope="module")
def deployment(ray_cluster, chat_model):
    with running_deployment(chat_model, 1, 1, RouterConfig(http_port=0), metrics=Metrics("tiny-chat")) as running:
        yield running


@pytest.fixture(scope="module")
def hf_tokenizer(chat_model):
    return AutoTokenizer.from_pretrained(chat_model.path)


def _chat_ids(hf_tokenizer, messages) -> list[int]:
    ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_models_and_health(client, base_url):
    assert [m.id for m in client.models.list().data] == ["tiny-chat"]
    with urllib.request.urlopen(base_url.removesuffix("/v1") + "/health") as response:
        assert response.status == 200


def test_chat_completion_equals_transformers_greedy_whole_and_streamed(client, chat_model, hf_tokenizer):
    ids = _chat_ids(hf_tokenizer, MESSAGES)
    expected = hf_greedy(chat_model.hf_model, ids, 12)
    want_text = hf_tokenizer.decode(expected, skip_special_tokens=True)

    # OpenAI's service tiers are served (ordered by priority) and named in the answer.
    whole = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_completion_tokens=12, service_tier="priority", **GREEDY)
    assert whole.object == "chat.completion" and whole.service_tier == "priority"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == want_text
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (len(ids), 12, len(ids) + 12)

    chunks = list(
        client.chat.completions.create(
            model="tiny-chat", messages=MESSAGES, max_tokens=12, stream=True, stream_options={"include_usage": True}, service_tier="flex", **GREEDY
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant" and {c.service_tier for c in chunks} == {"flex"}
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want_text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    # The same messages again: their full blocks (16 tokens each) came from the prefix cache.
    assert len(ids) > 16 and chunks[-1].usage.prompt_tokens_details.cached_tokens == (len(ids) - 1) // 16 * 16
    # Steps the tiny model decodes faster than the router sends arrive merged (router/output_inbox.py).
    assert len(chunks) > 2, "tokens stream as they come, not in one piece"


def test_continuous_usage_is_each_chunks_choices_own_as_vllm_reports_it(client):
    """stream_options.continuous_usage_stats (vLLM's): beside include_usage, every chunk carries
    the usage so far of its choice; without include_usage, no usage at all (as vLLM)."""
    stream = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=8, n=2, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}, **GREEDY)
    chunks = list(stream)
    so_far = {0: 0, 1: 0}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        assert chunk.usage.completion_tokens >= so_far[choice.index]
        so_far[choice.index] = chunk.usage.completion_tokens
    assert so_far == {0: 8, 1: 8}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    plain = list(client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=4, stream=True,
                                                stream_options={"continuous_usage_stats": True}, **GREEDY))
    assert all(chunk.usage is None for chunk in plain) and all(chunk.choices for chunk in plain)


def test_text_completion_of_token_ids_and_of_text_equals_transformers(client, chat_model, hf_tokenizer):
    (prompt,) = random_prompts([20], chat_model.vocab_size, seed=11)
    expected = hf_greedy(chat_model.hf_model, prompt, 10)
    whole = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=10, **GREEDY)
    assert whole.choices[0].text == hf_tokenizer.decode(expected, skip_special_tokens=True)
    assert whole.usage.prompt_tokens == 20

    text = "The quick brown fox"
    text_ids = hf_tokenizer(text)["input_ids"]
    expected = hf_greedy(chat_model.hf_model, text_ids, 10)
    streamed = client.completions.create(model="tiny-chat", prompt=text, max_tokens=10, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed) == hf_tokenizer.decode(expected, skip_special_tokens=True)


def test_logprobs_are_the_models_log_softmax(client, chat_model):
    (prompt,) = random_prompts([15], chat_model.vocab_size, seed=12)
    completion = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=6, logprobs=3, **GREEDY)
    logprobs = completion.choices[0].logprobs
    generated = hf_greedy(chat_model.hf_model, prompt, 6)
    with torch.no_grad():
        logits = chat_model.hf_model(torch.tensor([prompt + generated])).logits[0]
    reference = torch.log_softmax(logits.double(), dim=-1)
    for step, token in enumerate(generated):
        want = reference[len(prompt) - 1 + step]
        assert logprobs.token_logprobs[step] == pytest.approx(want[token].item(), abs=1e-3)
        top = sorted(logprobs.top_logprobs[step].values(), reverse=True)
        assert top == pytest.approx(want.topk(3).values.tolist(), abs=1e-3)
    assert len(logprobs.tokens) == 6 and logprobs.text_offset[0] == 0

    chat = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=4, logprobs=True, top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(entry.top_logprobs) == 2 for entry in content)
    assert all(entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-6) for entry in content), "greedy picks the top token"


def test_stop_string_cuts_the_text_and_is_reported(client, chat_model, hf_tokenizer):
    (prompt,) = random_prompts([12], chat_model.vocab_size, seed=13)
    full = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=30, **GREEDY).choices[0].text
    stop = full[10:12]
    stopped = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=30, stop=[stop], **GREEDY).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full[: full.find(stop)]
    assert stopped.model_extra["stop_reason"] == stop
    kept = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=30, stop=[stop], temperature=0.0, extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == full[: full.find(stop) + len(stop)]  # vLLM's include_stop_str_in_output


def test_a_clients_request_id_names_the_response_and_comes_back_in_its_header(client, base_url, chat_model):
    """vLLM's request_id field and X-Request-Id header (the header first): the id the call's
    requests go by in the server's logs, and the response's id."""
    (prompt,) = random_prompts([6], chat_model.vocab_size, seed=16)
    raw = client.completions.with_raw_response.create(model="tiny-chat", prompt=prompt, max_tokens=2, extra_body={"request_id": "trace-7.a"})
    assert (raw.parse().id, raw.headers["x-request-id"]) == ("cmpl-trace-7.a", "trace-7.a")
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-chat", messages=MESSAGES, max_tokens=2, stream=True, extra_headers={"X-Request-Id": "hdr:1"}, extra_body={"request_id": "body"})
    assert raw.headers["x-request-id"] == "hdr:1" and {chunk.id for chunk in raw.parse()} == {"chatcmpl-hdr:1"}
    plain = client.completions.with_raw_response.create(model="tiny-chat", prompt=prompt, max_tokens=2)
    assert plain.headers["x-request-id"] == plain.parse().id  # one made up, said
    # A header in another form (a proxy's) is passed over; a body field is the client's own: checked.
    odd = client.completions.with_raw_response.create(model="tiny-chat", prompt=prompt, max_tokens=2, extra_headers={"X-Request-Id": "a+b/c="})
    assert odd.headers["x-request-id"] == odd.parse().id != "cmpl-a+b/c="
    with pytest.raises(openai.BadRequestError, match="request_id"):
        client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=2, extra_body={"request_id": "a b"})

    async def fan_out():  # one trace id on parallel calls: each is served
        async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60) as aclient:
            calls = [aclient.completions.create(model="tiny-chat", prompt=prompt, max_tokens=8, temperature=0.0, extra_headers={"X-Request-Id": "trace-9"},
                                                extra_body={"ignore_eos": True}) for _ in range(3)]
            return await asyncio.gather(*calls)

    assert {answer.id for answer in asyncio.run(fan_out())} == {"cmpl-trace-9"}


def test_a_cache_salt_shares_the_prefix_cache_only_with_the_same_salt(client, chat_model):
    """vLLM's cache_salt, through the router's KV-aware pick and the workers' caches: the same
    40-token prompt hits the cache (32 tokens: two full blocks) only under the salt that put it there."""
    (prompt,) = random_prompts([40], chat_model.vocab_size, seed=17)

    def cached(salt: str) -> tuple[int, str]:
        answer = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=3, temperature=0.0, extra_body={"ignore_eos": True, "cache_salt": salt})
        return answer.usage.prompt_tokens_details.cached_tokens, answer.choices[0].text

    first = cached("tenant-a")
    assert first[0] == 0
    assert cached("tenant-b") == (0, first[1])
    assert cached("tenant-a") == (32, first[1])
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        cached("")


def test_truncate_prompt_tokens_reads_only_the_prompts_end(client, chat_model):
    (prompt,) = random_prompts([12], chat_model.vocab_size, seed=15)
    cut = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True, "truncate_prompt_tokens": 5})
    end = client.completions.create(model="tiny-chat", prompt=prompt[-5:], max_tokens=6, **GREEDY)
    assert cut.usage.prompt_tokens == 5 and cut.choices[0].text == end.choices[0].text


def test_n_choices_with_a_seed_are_each_reproducible(client, chat_model):
    (prompt,) = random_prompts([10], chat_model.vocab_size, seed=14)
    sampled = {"temperature": 1.0, "seed": 7, "max_tokens": 12, "extra_body": {"ignore_eos": True}}
    first = client.completions.create(model="tiny-chat", prompt=prompt, n=2, **sampled)
    again = client.completions.create(model="tiny-chat", prompt=prompt, n=2, **sampled)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.choices[0].text != first.choices[1].text, "choice i draws with seed + i"
    alone = client.completions.create(model="tiny-chat", prompt=prompt, n=1, **sampled)
    assert alone.choices[0].text == first.choices[0].text
    assert first.usage.prompt_tokens == 10 and first.usage.completion_tokens == 24


def test_n_choices_of_a_prompt_prefill_it_once_and_share_its_blocks(client, chat_model, hf_tokenizer, deployment):
    """Each of n choices was a request of its own: its prompt's KV moved to the decode actor and
    held there n times. The choices after the first now follow it to its decode actor once its
    prompt is computed, and take the prompt from that actor's prefix cache (a block or two
    computed there): moved once, its blocks shared, every choice still transformers' greedy
    answer."""
    import ray

    alone, prompt = random_prompts([300, 300], chat_model.vocab_size, seed=16)
    want = hf_greedy(chat_model.hf_model, prompt, 6)

    def counts():
        hits = ray.get(deployment.handles["decode-0"].status.remote()).engine.num_prefix_hit_tokens
        moved = deployment.metrics.registry.get_sample_value("pdserve:kv_transfer_bytes_total", {"model_name": "tiny-chat"}) or 0.0
        return hits, moved

    hits, moved = counts()
    client.completions.create(model="tiny-chat", prompt=alone, n=1, max_tokens=2, **GREEDY)
    hits_one, moved_one = counts()
    completion = client.completions.create(model="tiny-chat", prompt=prompt, n=4, max_tokens=6, **GREEDY)
    hits_four, moved_four = counts()
    assert [choice.text for choice in completion.choices] == [hf_tokenizer.decode(want, skip_special_tokens=True)] * 4
    assert moved_one - moved > 0 and moved_four - moved_one < 2 * (moved_one - moved), "the prompt's KV moved once, not once per choice"
    assert hits_four - hits_one >= 3 * (len(prompt) - 32), "three choices took it from the decode actor's cache"
    assert completion.usage.prompt_tokens == 300 and completion.usage.completion_tokens == 24


def test_min_tokens_holds_off_a_stop_token(client, chat_model):
    (prompt,) = random_prompts([10], chat_model.vocab_size, seed=15)
    greedy = hf_greedy(chat_model.hf_model, prompt, 8)
    at = next(i for i in range(1, 8) if greedy[i] not in greedy[:i])  # its first appearance
    stop_token = greedy[at]
    early = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=8, temperature=0.0, extra_body={"stop_token_ids": [stop_token]})
    assert early.usage.completion_tokens == at + 1 and early.choices[0].model_extra["stop_reason"] == stop_token
    held = client.completions.create(
        model="tiny-chat", prompt=prompt, max_tokens=8, temperature=0.0, extra_body={"stop_token_ids": [stop_token], "min_tokens": 5}
    )
    assert held.usage.completion_tokens >= 5


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
        ({"extra_body": {"logit_bias": {"100000": 1}}}, "logit_bias"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"extra_body": {"not_a_field": 1}}, "not_a_field"),
        ({"extra_body": {"top_k": "ten"}}, "top_k"),
        ({"stop": ["ok", ""]}, "stop[1]"),
        ({"max_tokens": 5000}, "max_tokens"),
        # Past a 64-bit integer: torch would overflow on them inside the decode actor.
        ({"seed": 2**63}, "seed"),
        ({"extra_body": {"top_k": 2**63}}, "top_k"),
    ],
)
def test_bad_completion_requests_get_a_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model="tiny-chat", prompt="hello", **kwargs)
    assert raised.value.status_code == 400
    assert raised.value.body["param"] == param
    assert raised.value.body["type"] == "invalid_request_error"
    assert param.split("[")[0] in raised.value.body["message"]


def test_bad_chat_requests_and_unknown_models(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="tiny-chat", messages=[{"role": "robot", "content": "hi"}])
    assert raised.value.body["param"] == "messages" and "unknown role robot" in raised.value.body["message"]
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="tiny-chat", messages=[])
    assert raised.value.body["param"] == "messages"
    for extra, param in (({"thinking_token_budget": 8}, "thinking_token_budget"), ({"include_reasoning": "yes"}, "include_reasoning")):
        with pytest.raises(openai.BadRequestError) as raised:  # a model served without a reasoning parser
            client.chat.completions.create(model="tiny-chat", messages=MESSAGES, extra_body=extra)
        assert raised.value.body["param"] == param
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert raised.value.body["code"] == "model_not_found"
    request = urllib.request.Request(str(client.base_url) + "completions", data=b"{not json", method="POST")
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request)
    assert raised.value.code == 400 and json.loads(raised.value.read())["error"]["param"] == "body"
    # Nested past what Python's parser follows (a RecursionError inside it), or past the bound
    # that keeps templates and grammar compilers from recursing as deep.
    for depth in (200, 100_000):
        body = b'{"model": "tiny-chat", "prompt": "x", "metadata": ' + b"[" * depth + b"]" * depth + b"}"
        request = urllib.request.Request(str(client.base_url) + "completions", data=body, method="POST")
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(request)
        error = json.loads(raised.value.read())["error"]
        assert raised.value.code == 400 and error["param"] == "body" and "nests deeper than" in error["message"]


def test_a_disconnect_mid_stream_aborts_the_request_and_frees_every_block(client, chat_model, deployment):
    grpc_client = Client(deployment.address)
    decode = next(h for name, h in deployment.handles.items() if name.startswith("decode"))
    ray.get(decode.set_step_delay.remote(0.05))  # 1,500 tokens would take over a minute
    try:
        (prompt,) = random_prompts([40], chat_model.vocab_size, seed=16)
        stream = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=1500, stream=True, **GREEDY)
        for _, chunk in zip(range(3), stream):
            assert chunk.choices[0].finish_reason is None
        stream.close()
        started = time.monotonic()
        workers = grpc_client.wait_until_idle(timeout_s=15)
        assert time.monotonic() - started < 15
        assert all(w.num_kv_blocks_used == 0 for w in workers)
        assert not deployment.router.dispatcher.active, "the router forgot the request"
    finally:
        ray.get(decode.set_step_delay.remote(0.0))
        grpc_client.close()


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    verified: bool


def test_parse_with_a_pydantic_model_returns_valid_objects_from_both_pools(client, chat_model):
    """Short chats are prefilled on the decode actor, long ones (past local_prefill_max_tokens)
    on the prefill actor, whose sampled first token must already obey the schema."""
    long_chat = [{"role": "user", "content": "Describe a person as JSON. " * 12}]
    for seed, messages in enumerate([MESSAGES, long_chat] * 3):
        completion = client.chat.completions.parse(
            model="tiny-chat", messages=messages, response_format=Person, temperature=1.0, seed=seed, max_completion_tokens=150
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Person), choice.message.content


def test_every_sampled_answer_obeys_its_constraint(client, chat_model):
    # Strict, as OpenAI's strict mode requires: without additionalProperties false, JSON Schema
    # lets a sampled object go on with keys of its own until max_tokens.
    schema = {**Person.model_json_schema(), "additionalProperties": False}
    prompts = random_prompts([10, 70], chat_model.vocab_size, seed=21)  # decode-local and prefill-actor prefills
    constraints = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}},
         lambda text: jsonschema.validate(json.loads(text), schema) is None),
        ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2,5}"}}, lambda text: re.fullmatch("[0-9]{3}-[a-z]{2,5}", text) is not None),
        ({"guided_choice": ["positive", "negative", "neutral"]}, lambda text: text in ("positive", "negative", "neutral")),
        ({"structured_outputs": {"grammar": 'root ::= "(" [a-z]+ ("," [a-z]+)* ")"'}}, lambda text: re.fullmatch(r"\([a-z]+(,[a-z]+)*\)", text) is not None),
    ]
    for extra, valid in constraints:
        for prompt in prompts:
            completion = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=150, temperature=1.0, seed=5, n=8, extra_body=extra)
            for choice in completion.choices:
                assert choice.finish_reason == "stop" and valid(choice.text), (extra, choice.text)


def test_penalties_and_logit_bias_change_exactly_what_vllms_formulas_say(client, chat_model):
    (prompt,) = random_prompts([40], chat_model.vocab_size, seed=23)
    plain = hf_greedy(chat_model.hf_model, prompt, 10)
    bias = {plain[0]: -100.0, plain[2]: 3.0}
    presence, frequency = 0.8, 0.6
    output: list[int] = []
    for _ in range(10):  # the reference: transformers' logits, adjusted as the formulas say
        with torch.no_grad():
            logits = chat_model.hf_model(torch.tensor([prompt + output])).logits[0, -1].float()
        for token, value in bias.items():
            logits[token] += value
        for token in set(output):
            logits[token] -= presence + frequency * output.count(token)
        output.append(int(logits.argmax()))
    completion = client.completions.create(
        model="tiny-chat", prompt=prompt, max_tokens=10, temperature=0.0, presence_penalty=presence, frequency_penalty=frequency,
        logit_bias={str(k): v for k, v in bias.items()}, extra_body={"ignore_eos": True},
    )
    expected_text = AutoTokenizer.from_pretrained(chat_model.path).decode(output, skip_special_tokens=True)
    assert completion.choices[0].text == expected_text
    assert output != plain, "the adjustments changed the answer"


def test_echo_puts_the_prompt_before_the_completion(client, chat_model, hf_tokenizer):
    text = "def fibonacci(n):"
    expected = hf_tokenizer.decode(hf_greedy(chat_model.hf_model, hf_tokenizer(text)["input_ids"], 6), skip_special_tokens=True)
    whole = client.completions.create(model="tiny-chat", prompt=text, max_tokens=6, echo=True, **GREEDY)
    assert whole.choices[0].text == text + expected
    streamed = client.completions.create(model="tiny-chat", prompt=text, max_tokens=6, echo=True, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed) == text + expected


def _prompt_reference(model, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax at each prompt position (row p scores token p + 1)."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("length", [12, 70], ids=["prefilled-by-decode", "prefilled-by-prefill"])
def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(client, chat_model, hf_tokenizer, length):
    """A scoring client's call (lm-eval's loglikelihood, a perplexity script): echo, logprobs and
    max_tokens 0. A 12-token prompt is prefilled by the decode actor (local_prefill_max_tokens 32),
    a 70-token one by the prefill actor, which reports the scores with its result."""
    (prompt,) = random_prompts([length], chat_model.vocab_size, seed=length)
    reference = _prompt_reference(chat_model.hf_model, prompt)
    scored = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=0, echo=True, logprobs=2, temperature=0.0)
    choice = scored.choices[0]
    assert choice.text == hf_tokenizer.decode(prompt, skip_special_tokens=True) and choice.finish_reason == "length"
    assert (scored.usage.prompt_tokens, scored.usage.completion_tokens) == (length, 0)
    lp = choice.logprobs
    assert lp.tokens == [hf_tokenizer.decode([t]) for t in prompt]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [reference[p, prompt[p + 1]].item() for p in range(length - 1)]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-3)
    for p, top in enumerate(lp.top_logprobs[1:]):
        assert max(top.values()) == pytest.approx(reference[p].max().item(), abs=1e-3)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)

    # With an answer: the prompt's entries, then the answer's (transformers' greedy tokens).
    answer = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=3, echo=True, logprobs=1, **GREEDY)
    lp = answer.choices[0].logprobs
    assert len(lp.tokens) == length + 3 and lp.token_logprobs[1:length] == pytest.approx(want, abs=1e-3)
    assert lp.tokens[length:] == [hf_tokenizer.decode([t]) for t in hf_greedy(chat_model.hf_model, prompt, 3)]
    # Streamed, the first chunk carries the prompt's, as the whole response does.
    chunks = list(client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=0, echo=True, logprobs=2, stream=True, temperature=0.0))
    assert [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs][1:] == pytest.approx(want, abs=1e-3)

    # vLLM's prompt_logprobs: by token id, the prompt's token with its rank, and the top ones.
    vllm = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=1, temperature=0.0, extra_body={"prompt_logprobs": 1})
    entries = vllm.choices[0].prompt_logprobs
    assert len(entries) == length and entries[0] is None
    for p, entry in enumerate(entries[1:]):
        row, token = reference[p], prompt[p + 1]
        mine = entry[str(token)]
        assert mine["logprob"] == pytest.approx(row[token].item(), abs=1e-3)
        assert mine["rank"] == int((row > row[token]).sum()) + 1 and mine["decoded_token"] == hf_tokenizer.decode([token])
        best = str(int(row.argmax()))
        assert entry[best]["rank"] == 1 and len(entry) <= 2


def test_a_batch_of_prompts_is_scored_in_one_call_as_lm_eval_sends_it(client, chat_model):
    """lm-eval's local-completions loglikelihood with batch_size 32: 32 token-id prompts, echo,
    logprobs 1, max_tokens 1; it sums each continuation's token_logprobs[ctxlen:-1] and calls a
    continuation greedy where each of its tokens' log-probability is the top one's."""
    prompts = random_prompts([8 + i for i in range(32)], chat_model.vocab_size, seed=32)
    batch = client.completions.create(model="tiny-chat", prompt=prompts, max_tokens=1, echo=True, logprobs=1, temperature=0.0, seed=1234)
    assert [c.index for c in batch.choices] == list(range(32))
    for prompt, choice in zip(prompts, batch.choices):
        reference = _prompt_reference(chat_model.hf_model, prompt)
        context = len(prompt) // 2
        continuation = range(context, len(prompt))
        want = sum(reference[p - 1, prompt[p]].item() for p in continuation)
        assert sum(choice.logprobs.token_logprobs[context:-1]) == pytest.approx(want, abs=1e-3)
        greedy = all(int(reference[p - 1].argmax()) == prompt[p] for p in continuation)
        tops = zip(choice.logprobs.token_logprobs[context:-1], choice.logprobs.top_logprobs[context:-1])
        assert all(abs(lp - max(top.values())) < 1e-6 for lp, top in tops) == greedy


def test_return_token_ids_gives_the_prompts_and_the_answers_ids_whole_and_streamed(client, chat_model, hf_tokenizer):
    """vLLM's return_token_ids, as agent RL frameworks read it: the prompt's ids and the answer's
    (transformers' greedy ids) beside the text; streamed, the prompt's on the first chunk and each
    chunk's own. return_tokens_as_token_ids names logprobs' tokens "token_id:<id>"."""
    (prompt,) = random_prompts([15], chat_model.vocab_size, seed=15)
    want = hf_greedy(chat_model.hf_model, prompt, 8)
    extra = {"ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": True}
    whole = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=8, temperature=0.0, logprobs=2, extra_body=extra)
    choice = whole.choices[0]
    assert choice.model_extra["prompt_token_ids"] == prompt and choice.model_extra["token_ids"] == want
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in want]
    # Offsets still count each token's text, as without the field, not the "token_id:<id>" names.
    named = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=8, temperature=0.0, logprobs=2, extra_body={"ignore_eos": True})
    assert choice.logprobs.text_offset == named.choices[0].logprobs.text_offset
    assert all(key.startswith("token_id:") for top in choice.logprobs.top_logprobs for key in top)
    chunks = list(client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=8, temperature=0.0, stream=True, extra_body=extra))
    firsts = [c.choices[0].model_extra.get("prompt_token_ids") for c in chunks if c.choices]
    assert firsts[0] == prompt and not any(firsts[1:])
    assert [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]] == want

    ids = _chat_ids(hf_tokenizer, MESSAGES)
    chat_want = hf_greedy(chat_model.hf_model, ids, 6)
    chat = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=6, temperature=0.0, extra_body=extra)
    assert chat.model_extra["prompt_token_ids"] == ids and chat.choices[0].model_extra["token_ids"] == chat_want
    streamed = list(client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=6, temperature=0.0, stream=True, extra_body=extra))
    assert streamed[0].model_extra["prompt_token_ids"] == ids and not any(c.model_extra.get("prompt_token_ids") for c in streamed[1:])
    assert [t for c in streamed if c.choices for t in c.choices[0].model_extra["token_ids"]] == chat_want


def test_chat_prompt_logprobs_score_the_templated_prompt(client, chat_model, hf_tokenizer):
    ids = _chat_ids(hf_tokenizer, MESSAGES)
    reference = _prompt_reference(chat_model.hf_model, ids)
    chat = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=2, temperature=0.0, extra_body={"ignore_eos": True, "prompt_logprobs": 0})
    entries = chat.model_extra["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    got = [entry[str(token)]["logprob"] for entry, token in zip(entries[1:], ids[1:])]
    assert got == pytest.approx([reference[p, ids[p + 1]].item() for p in range(len(ids) - 1)], abs=1e-3)
    # Its prompt was computed in full (no prefix cache): the cached blocks of earlier tests did not count.
    assert chat.usage.prompt_tokens_details.cached_tokens == 0
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=2, extra_body={"prompt_logprobs": 21})
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny-chat", prompt="abc", max_tokens=0)


FORECAST = {
    "type": "function",
    "function": {
        "name": "get_forecast",
        "description": "The weather for the next days",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}


def test_tools_and_tool_messages_render_as_transformers_renders_them(client, chat_model, hf_tokenizer):
    arguments = {"city": "Oslo", "days": 2}
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_forecast", "arguments": json.dumps(arguments)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 4 C"},
    ]
    # transformers gets the arguments as an object, as vLLM hands them to templates.
    reference = [dict(m) for m in messages]
    reference[1] = {**messages[1], "tool_calls": [{**messages[1]["tool_calls"][0], "function": {"name": "get_forecast", "arguments": arguments}}]}
    ids = hf_tokenizer.apply_chat_template(reference, tools=[FORECAST, CLOCK], add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    completion = client.chat.completions.create(
        model="tiny-chat", messages=messages, tools=[FORECAST, CLOCK], tool_choice="none", max_completion_tokens=8, **GREEDY
    )
    assert completion.usage.prompt_tokens == len(ids)
    assert completion.choices[0].message.content == hf_tokenizer.decode(hf_greedy(chat_model.hf_model, ids, 8), skip_special_tokens=True)
    assert completion.choices[0].message.tool_calls is None


def test_required_and_named_tool_calls_always_parse_against_their_parameters(client):
    schema = FORECAST["function"]["parameters"]
    long_question = [{"role": "user", "content": "Plan a trip and check the weather first. " * 6}]  # prefilled on the prefill actor
    for messages in ([{"role": "user", "content": "Weather?"}], long_question):
        # One call each (a random model would append calls to a parallel list until max_tokens).
        required = client.chat.completions.create(
            model="tiny-chat", messages=messages, tools=[FORECAST, CLOCK], tool_choice="required", parallel_tool_calls=False,
            temperature=1.0, seed=3, n=4, max_completion_tokens=120,
        )
        for choice in required.choices:
            assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice.message
            for call in choice.message.tool_calls:
                assert call.function.name in ("get_forecast", "get_time") and call.id.startswith("call_")
                arguments = json.loads(call.function.arguments)
                if call.function.name == "get_forecast":
                    jsonschema.validate(arguments, schema)
                else:
                    assert arguments == {}
        named = client.chat.completions.create(
            model="tiny-chat", messages=messages, tools=[FORECAST, CLOCK], tool_choice={"type": "function", "function": {"name": "get_forecast"}},
            temperature=1.0, seed=4, n=4, max_completion_tokens=120,
        )
        for choice in named.choices:
            (call,) = choice.message.tool_calls
            assert call.function.name == "get_forecast" and choice.finish_reason == "stop"
            jsonschema.validate(json.loads(call.function.arguments), schema)


def test_streamed_tool_call_deltas_assemble_into_the_same_call(client):
    """tool_choice auto: the model's own Hermes text is parsed (made to write one by a regex)."""
    hermes = r'Checking\. <tool_call>\{"name": "get_forecast", "arguments": \{"city": "[a-z]{2,8}", "days": [1-7]\}\}</tool_call>'
    request = dict(
        model="tiny-chat", messages=[{"role": "user", "content": "Weather in two days?"}], tools=[FORECAST, CLOCK], temperature=1.0,
        seed=9, max_completion_tokens=120, extra_body={"structured_outputs": {"regex": hermes}},
    )
    whole = client.chat.completions.create(**request)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and message.content == "Checking. "
    (call,) = message.tool_calls
    assert call.function.name == "get_forecast"
    jsonschema.validate(json.loads(call.function.arguments), FORECAST["function"]["parameters"])

    chunks = list(client.chat.completions.create(stream=True, **request))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assembled: dict[int, dict] = {}
    for chunk in chunks:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = assembled.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            if delta.id:
                entry["id"], entry["name"] = delta.id, delta.function.name
            entry["arguments"] += delta.function.arguments or ""
    assert content == "Checking. "
    assert [(e["name"], e["arguments"]) for e in assembled.values()] == [(call.function.name, call.function.arguments)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def _http(base_url: str, path: str, body: dict | None = None, method: str | None = None) -> tuple[int, bytes, dict]:
    """(status, body, headers) of a request to the HTTP port (a 4xx/5xx too)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base_url.removesuffix("/v1") + path, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, error.read(), dict(error.headers)


def test_vllms_tokenize_and_detokenize_match_the_models_tokenizer_and_template(base_url, chat_model, hf_tokenizer):
    status, raw, _ = _http(base_url, "/tokenize", {"prompt": "Hello café world", "return_token_strs": True})
    answer = json.loads(raw)
    assert status == 200 and answer["tokens"] == hf_tokenizer("Hello café world")["input_ids"]
    assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] > 0
    assert answer["token_strs"] == hf_tokenizer.convert_ids_to_tokens(answer["tokens"])  # the vocabulary's pieces, as vLLM's
    status, raw, _ = _http(base_url, "/tokenize", {"model": "tiny-chat", "messages": MESSAGES})
    assert status == 200 and json.loads(raw)["tokens"] == _chat_ids(hf_tokenizer, MESSAGES)
    status, raw, _ = _http(base_url, "/detokenize", {"tokens": answer["tokens"]})
    assert status == 200 and json.loads(raw)["prompt"] == hf_tokenizer.decode(answer["tokens"])
    # Bad bodies: a 400 naming the field, in OpenAI's shape.
    for path, body, param in [
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "x", "bogus": 1}, "bogus"),
        ("/detokenize", {"tokens": [1, "a"]}, "tokens"),
        ("/detokenize", {"tokens": [chat_model.vocab_size]}, "tokens"),
        ("/tokenize", {"model": "other", "prompt": "x"}, "model"),
    ]:
        status, raw, _ = _http(base_url, path, body)
        error = json.loads(raw)["error"]
        assert status == (404 if body.get("model") == "other" else 400) and error["param"] == param, (path, body, error)


def test_vllms_version_ping_load_and_metrics_on_the_api_port(base_url, client):
    status, raw, _ = _http(base_url, "/version")
    assert status == 200 and json.loads(raw)["version"]
    assert _http(base_url, "/ping")[0] == 200 and _http(base_url, "/ping", {}, method="POST")[0] == 200
    status, raw, _ = _http(base_url, "/load")
    assert status == 200 and json.loads(raw)["server_load"] == 0
    client.completions.create(model="tiny-chat", prompt="count", max_tokens=2, **GREEDY)
    status, raw, headers = _http(base_url, "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    finished = re.search(r'^pdserve:request_success_total\{[^}]*finished_reason="length"[^}]*\} (\S+)', raw.decode(), re.M)
    assert finished and float(finished.group(1)) >= 1


def test_the_model_answers_to_the_path_it_was_started_with(client, chat_model):
    completion = client.completions.create(model=str(chat_model.path), prompt="count", max_tokens=3, **GREEDY)
    assert completion.model == "tiny-chat" and completion.usage.completion_tokens == 3
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=str(chat_model.path) + "-other", prompt="count", max_tokens=3)


def test_runtime_lora_endpoints_are_off_unless_the_deployment_allows_them(base_url):
    status, raw, _ = _http(base_url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"})
    assert status == 404 and "allow_runtime_lora_updating" in json.loads(raw)["error"]["message"]


@pytest.fixture
def one_token_a_message(deployment):
    """The decode actor paced (50 ms a step) so each step's token reaches the client as a message
    of its own, not merged with the next ones (as a fast tiny model's would be)."""
    decode = next(h for name, h in deployment.handles.items() if name.startswith("decode"))
    ray.get(decode.set_step_delay.remote(0.05))
    yield
    ray.get(decode.set_step_delay.remote(0.0))


def test_a_streamed_token_whose_text_is_held_back_still_goes_out_as_a_chunk(client, chat_model, hf_tokenizer, one_token_a_message):
    """As vLLM streams: each step's tokens make a chunk even while their text waits (here at a
    possible stop string), so a client sees the first token when it came."""
    (prompt,) = random_prompts([12], chat_model.vocab_size, seed=21)
    expected = hf_greedy(chat_model.hf_model, prompt, 6)
    first_text = hf_tokenizer.decode(expected[:1])
    assert first_text, "the first token has no text of its own: pick another seed"
    stop = first_text + "\x07never"  # the first token's text may start it: held back until it cannot
    chunks = list(client.completions.create(
        model="tiny-chat", prompt=prompt, max_tokens=6, stop=[stop], temperature=0.0, stream=True, extra_body={"ignore_eos": True}
    ))
    assert chunks[0].choices[0].text == "" and chunks[0].choices[0].finish_reason is None
    assert "".join(c.choices[0].text for c in chunks) == hf_tokenizer.decode(expected, skip_special_tokens=True)


def test_a_streamed_chat_token_whose_text_is_held_back_has_empty_content(client, chat_model, hf_tokenizer, one_token_a_message):
    """Chat's chunks for tokens whose text waits carry ``content: ""``, as vLLM's do."""
    ids = _chat_ids(hf_tokenizer, MESSAGES)
    expected = hf_greedy(chat_model.hf_model, ids, 6)
    held = hf_tokenizer.decode(expected[:2])
    assert held.strip(), "the first tokens have no text: pick other messages"
    chunks = list(client.chat.completions.create(
        model="tiny-chat", messages=MESSAGES, max_tokens=6, stop=[held + "\x07never"], stream=True, **GREEDY
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[1].choices[0].delta.content == "" and chunks[1].choices[0].finish_reason is None
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == hf_tokenizer.decode(expected, skip_special_tokens=True)


def test_allowed_token_ids_that_leave_a_grammar_nothing_are_the_clients_400_or_error_event(client, hf_tokenizer, deployment):
    """Only "a" allowed against the regex "ab": the first token ("a", drawn by the prefill actor)
    is fine, the second has no honest draw (on the decode actor). Only "9" allowed: the first has
    none. Each is the client's error naming allowed_token_ids: a 400 before anything was sent,
    an invalid_request_error event after; and no block is left behind."""
    a, nine = hf_tokenizer.convert_tokens_to_ids("a"), hf_tokenizer.convert_tokens_to_ids("9")
    for allowed in ([nine], [a]):
        with pytest.raises(openai.BadRequestError) as raised:
            client.completions.create(model="tiny-chat", prompt="hello", max_tokens=4, temperature=0.0,
                                      extra_body={"guided_regex": "ab", "allowed_token_ids": allowed})
        assert raised.value.body["param"] == "allowed_token_ids" and "structured output" in raised.value.body["message"]
    stream = client.completions.create(model="tiny-chat", prompt="hello", max_tokens=4, temperature=0.0, stream=True,
                                       extra_body={"guided_regex": "ab", "allowed_token_ids": [a]})
    texts = []
    with pytest.raises(openai.APIError) as raised:
        for chunk in stream:
            texts.append(chunk.choices[0].text)
    assert "".join(texts) == "a" and raised.value.body["param"] == "allowed_token_ids", raised.value.body
    workers = Client(deployment.address).wait_until_idle(timeout_s=30)
    assert all(w.num_kv_blocks_used == 0 for w in workers)


# Valid bodies for each front end on the API port; the fuzz test below mutates them.
_FUZZ_SEEDS = {
    "/v1/chat/completions": {
        "model": "tiny-chat", "max_tokens": 3, "temperature": 0.7, "top_p": 0.9, "logprobs": True, "top_logprobs": 2, "seed": 3,
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                     {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "ok"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}],
        "response_format": {"type": "json_object"}, "stop": ["\n"],
    },
    "/v1/completions": {"model": "tiny-chat", "prompt": "hello", "max_tokens": 3, "logprobs": 2, "stop": "x", "logit_bias": {"5": 1.0}, "presence_penalty": 0.1},
    "/v1/responses": {
        "model": "tiny-chat", "max_output_tokens": 3, "instructions": "short", "store": False,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}, {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c", "output": "ok"}],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}],
    },
    "/v1/messages": {
        "model": "tiny-chat", "max_tokens": 3, "system": "s", "stop_sequences": ["z"],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}, {"role": "assistant", "content": [{"type": "tool_use", "id": "u", "name": "t", "input": {}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "u", "content": "ok"}]}],
        "tools": [{"name": "t", "input_schema": {"type": "object", "properties": {}}}],
    },
}
_ODD_VALUES = [None, True, -1, 0, 7, 2**63, 2**64, 1e308, -0.5, float("nan"), "", "x", "auto", "🙂", [], [[]], [1], {}, {"type": {}}, {"a": [1]}]
_EXTRA_FIELDS = ["top_k", "min_p", "min_tokens", "seed", "n", "stop_token_ids", "allowed_token_ids", "bad_words", "guided_json", "guided_choice",
                 "reasoning_effort", "chat_template_kwargs", "prompt_logprobs", "priority", "tool_choice", "stream_options", "logit_bias", "echo"]


def _mutated(rng, body):
    """``body`` with one to three of its values (at any depth) replaced, deleted or joined by another field."""
    body = json.loads(json.dumps(body))
    for _ in range(rng.randint(1, 3)):
        paths, stack = [], [((), body)]
        while stack:
            path, value = stack.pop()
            children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
            for key, child in children:
                paths.append(path + (key,))
                stack.append((path + (key,), child))
        path = rng.choice(paths)
        parent = body
        for key in path[:-1]:
            parent = parent[key]
        action = rng.random()
        if action < 0.15:
            del parent[path[-1]]
        elif action < 0.35:
            body[rng.choice(_EXTRA_FIELDS)] = rng.choice(_ODD_VALUES)
        else:
            parent[path[-1]] = rng.choice(_ODD_VALUES)
    if rng.random() < 0.25:
        body["stream"] = True
    return body


def test_mutated_requests_never_get_a_server_error_and_leave_no_block_behind(base_url, deployment):
    """Seeded mutations of valid requests to every front end: each answer is a success or a
    client error that says what is wrong (never a 500, an error event in a stream, or a hang),
    and afterwards no request holds a KV block."""
    import random

    rng = random.Random(20261128)
    answered = {"ok": 0, "refused": 0}
    for _ in range(160):
        path = rng.choice(sorted(_FUZZ_SEEDS))
        body = _mutated(rng, _FUZZ_SEEDS[path])
        request = urllib.request.Request(base_url + path.removeprefix("/v1"), data=json.dumps(body).encode(), method="POST")
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                status, text = response.status, response.read().decode()
        except urllib.error.HTTPError as refused:
            status, text = refused.code, refused.read().decode()
        assert status < 500, (path, body, text)
        if status >= 400:
            error = json.loads(text)["error"]
            assert error["message"] and "internal" not in error["type"], (path, body, text)
            answered["refused"] += 1
        else:
            assert "internal error" not in text and "event: error" not in text, (path, body, text)
            answered["ok"] += 1
    assert answered["ok"] >= 10 and answered["refused"] >= 50, answered  # both kinds were exercised
    workers = Client(deployment.address).wait_until_idle(timeout_s=30)
    assert all(w.num_kv_blocks_used == 0 for w in workers)
    assert not deployment.router.dispatcher.active


def test_a_failure_after_a_stream_began_ends_it_with_an_error_event(client, chat_model, monkeypatch, one_token_a_message):
    """A fault in the router after the first chunk went out (the status line with it): the stream
    carries an error event and ends as streams end, which the official client raises as an API
    error; a second response written into the first's body was a protocol error to it."""
    import openai

    from router.openai_api.responses import ChoiceState

    (prompt,) = random_prompts([12], chat_model.vocab_size, seed=22)
    original, calls = ChoiceState.add, []

    def failing_add(self, chunk, tokenizer):
        calls.append(chunk)
        if len(calls) == 3:
            raise RuntimeError("a fault in the router")
        return original(self, chunk, tokenizer)

    monkeypatch.setattr(ChoiceState, "add", failing_add)
    received = []
    with pytest.raises(openai.APIError) as raised:
        for chunk in client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=8, temperature=0.0, stream=True, extra_body={"ignore_eos": True}):
            received.append(chunk)
    assert len(received) == 2 and "internal" in str(raised.value).lower()
    assert not isinstance(raised.value, openai.APIConnectionError)
