"""The Anthropic Messages API as the official ``anthropic`` client sees it, against a live
deployment (1 prefill + 1 decode actor): short conversations are prefilled on the decode actor,
long ones on the prefill actor. References: the same conversation through chat completions, and
transformers' ``apply_chat_template`` + ``generate``."""

from __future__ import annotations

import json
import time

import anthropic
import jsonschema
import pytest
import ray

from router.config import RouterConfig
from tests.checkpoints import hf_greedy
from tests.e2e.test_openai_api import CHAT_TEMPLATE, CLOCK, FORECAST, _chat_ids, _http
from tests.e2e.test_openai_api import chat_model as chat_model  # noqa: F401  (module fixture)
from tests.e2e.test_openai_api import hf_tokenizer as hf_tokenizer  # noqa: F401  (module fixture)
from tests.serving import Client, running_deployment

assert CHAT_TEMPLATE  # the chat model's template renders system, tool calls and tool results

SYSTEM = "You are terse."
CONVERSATION = [
    {"role": "user", "content": "Name a prime number, café!"},
    {"role": "assistant", "content": [{"type": "text", "text": "Seven."}]},
    {"role": "user", "content": [{"type": "text", "text": "Another"}, {"type": "text", "text": "one?"}]},
]
# The same conversation as OpenAI chat messages (text blocks joined with newlines).
CHAT = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Name a prime number, café!"},
    {"role": "assistant", "content": "Seven."},
    {"role": "user", "content": "Another\none?"},
]
# This client (anthropic 2.x) no longer has sampling arguments; the API still takes them.
GREEDY = {"extra_body": {"temperature": 0.0, "ignore_eos": True}}
TOOLS = [
    {"name": t["function"]["name"], **({"description": t["function"]["description"]} if "description" in t["function"] else {}), "input_schema": t["function"]["parameters"]}
    for t in (FORECAST, CLOCK)
]


@pytest.fixture(scope="module")
def deployment(ray_cluster, chat_model):  # noqa: F811
    with running_deployment(chat_model, 1, 1, RouterConfig(http_port=0)) as running:
        yield running


@pytest.fixture(scope="module")
def claude(deployment):
    with anthropic.Anthropic(base_url=f"http://127.0.0.1:{deployment.http_port}", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


@pytest.mark.parametrize("repeat", [1, 12])  # 12: long enough to be prefilled on the prefill actor
def test_a_message_equals_the_chat_completion_and_transformers_whole_and_streamed(claude, client, chat_model, hf_tokenizer, repeat):  # noqa: F811
    conversation = [*CONVERSATION[:-1], {"role": "user", "content": "Another one? " * repeat}]
    messages = [*CHAT[:-1], {"role": "user", "content": "Another one? " * repeat}]
    ids = _chat_ids(hf_tokenizer, messages)
    want = hf_tokenizer.decode(hf_greedy(chat_model.hf_model, ids, 12), skip_special_tokens=True)
    completion = client.chat.completions.create(model="tiny-chat", messages=messages, max_completion_tokens=12, **GREEDY)
    assert completion.choices[0].message.content == want

    message = claude.messages.create(model="tiny-chat", system=SYSTEM, messages=conversation, max_tokens=12, **GREEDY)
    assert message.type == "message" and message.role == "assistant" and message.model == "tiny-chat"
    assert [block.type for block in message.content] == ["text"] and message.content[0].text == want
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.output_tokens == 12
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == len(ids)

    events, started = [], None
    with claude.messages.stream(model="tiny-chat", system=SYSTEM, messages=conversation, max_tokens=12, **GREEDY) as stream:
        for event in stream:
            events.append(event.type)
            started = event.message.usage if event.type == "message_start" else started
        final = stream.get_final_message()
    assert final.content[0].text == want and final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    # message_start splits the prompt as the end does (the prompt just sent is cached now): it
    # called the whole prompt input, where the end said part of it was read from the cache.
    assert final.usage.cache_read_input_tokens > 0
    assert (started.input_tokens, started.cache_read_input_tokens) == (final.usage.input_tokens, final.usage.cache_read_input_tokens)
    raw = [e for e in events if e in ("message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop")]
    assert raw[:2] == ["message_start", "content_block_start"] and raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert raw.count("content_block_start") == raw.count("content_block_stop") == 1


def test_count_tokens_and_stop_sequences(claude, chat_model, hf_tokenizer):  # noqa: F811
    counted = claude.messages.count_tokens(model="tiny-chat", system=SYSTEM, messages=CONVERSATION)
    assert counted.input_tokens == len(_chat_ids(hf_tokenizer, CHAT))
    full = claude.messages.create(model="tiny-chat", system=SYSTEM, messages=CONVERSATION, max_tokens=30, **GREEDY).content[0].text
    stop = full[10:12]
    stopped = claude.messages.create(model="tiny-chat", system=SYSTEM, messages=CONVERSATION, max_tokens=30, stop_sequences=[stop], **GREEDY)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == full[: full.find(stop)]


def test_an_assistant_prefill_is_continued_as_anthropic_continues_it(claude, chat_model, hf_tokenizer):  # noqa: F811
    """A final assistant message is Anthropic's prefill: the answer goes on from its last
    character, and its content leaves the prefill out. It was rendered as a closed turn, and the
    model started a new one (transformers with continue_final_message is the reference)."""
    prefill = "Eleven, and"
    ids = hf_tokenizer.apply_chat_template([*CHAT, {"role": "assistant", "content": prefill}], continue_final_message=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    want = hf_tokenizer.decode(hf_greedy(chat_model.hf_model, ids, 8), skip_special_tokens=True)
    conversation = [*CONVERSATION, {"role": "assistant", "content": prefill}]
    message = claude.messages.create(model="tiny-chat", system=SYSTEM, messages=conversation, max_tokens=8, **GREEDY)
    assert message.content[0].text == want
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == len(ids)
    with pytest.raises(anthropic.BadRequestError, match="trailing whitespace"):
        claude.messages.create(model="tiny-chat", system=SYSTEM, messages=[*CONVERSATION, {"role": "assistant", "content": "Eleven "}], max_tokens=8)
    # A grammar would constrain what follows the prefill, not the prefill itself (its JSON twice).
    with pytest.raises(anthropic.BadRequestError, match="prefill"):
        claude.messages.create(model="tiny-chat", messages=[*CONVERSATION, {"role": "assistant", "content": "{"}], max_tokens=8,
                               output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}})


def test_tool_use_and_tool_result_blocks_render_as_the_chat_tool_messages(claude, base_url, chat_model):  # noqa: F811
    arguments = {"city": "Oslo", "days": 2}
    conversation = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_forecast", "input": arguments}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 4 C"}]},
    ]
    chat_messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "toolu_1", "type": "function", "function": {"name": "get_forecast", "arguments": json.dumps(arguments)}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 4 C"},
    ]
    status, raw, _ = _http(base_url, "/tokenize", {"messages": chat_messages, "tools": [FORECAST, CLOCK]})
    assert status == 200
    counted = claude.messages.count_tokens(model="tiny-chat", messages=conversation, tools=TOOLS)
    assert counted.input_tokens == json.loads(raw)["count"]


def test_a_forced_tool_gives_a_tool_use_block_whose_input_obeys_the_schema(claude):
    long_question = "Plan a trip and check the weather first. " * 6  # prefilled on the prefill actor
    for question in ("Weather?", long_question):
        for seed in range(3):
            message = claude.messages.create(
                model="tiny-chat", messages=[{"role": "user", "content": question}], tools=TOOLS,
                tool_choice={"type": "tool", "name": "get_forecast"}, max_tokens=120, extra_body={"temperature": 1.0, "seed": seed},
            )
            (block,) = [b for b in message.content if b.type == "tool_use"]
            assert block.name == "get_forecast" and block.id.startswith("toolu_") and message.stop_reason == "tool_use"
            jsonschema.validate(block.input, TOOLS[0]["input_schema"])
    with claude.messages.stream(
        model="tiny-chat", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, tool_choice={"type": "tool", "name": "get_forecast"},
        max_tokens=120, extra_body={"temperature": 1.0, "seed": 5},
    ) as stream:
        final = stream.get_final_message()
    (block,) = [b for b in final.content if b.type == "tool_use"]
    jsonschema.validate(block.input, TOOLS[0]["input_schema"])
    # output_config.format: the text answer is an object of the schema.
    schema = TOOLS[0]["input_schema"]
    for seed in range(3):
        message = claude.messages.create(
            model="tiny-chat", messages=[{"role": "user", "content": "Weather?"}], max_tokens=120,
            output_config={"format": {"type": "json_schema", "schema": schema}}, extra_body={"temperature": 1.0, "seed": seed},
        )
        assert message.stop_reason == "end_turn"
        jsonschema.validate(json.loads(message.content[0].text), schema)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 5}, "messages[0].content[0].type"),
        ({"messages": [{"role": "system", "content": "hi"}], "max_tokens": 5}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": "hot"}, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "output_config": {"effort": "extreme"}}, "output_config.effort"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "thinking": {"type": "enabled", "budget_tokens": 10}}, "thinking"),
        ({"messages": [], "max_tokens": 5}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "tools": [{"name": "f", "input_schema": 3}]}, "tools[0].input_schema"),
        ({"messages": [{"role": "user", "content": [{"type": {}, "text": "hi"}]}], "max_tokens": 5}, "messages[0].content[0].type"),  # not a 500
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "top_k": 2**64}, "top_k"),
    ],
)
def test_bad_messages_get_anthropics_400_naming_the_field(claude, base_url, body, field):
    """Sent as raw JSON (the client checks some fields itself) and through the client."""
    status, raw, _ = _http(base_url, "/v1/messages", {"model": "tiny-chat", **body})
    error = json.loads(raw)
    assert status == 400 and error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(field), error
    if "max_tokens" in body:
        known = {k: v for k, v in body.items() if k in ("messages", "max_tokens", "output_config", "thinking", "tools")}
        extra = {k: v for k, v in body.items() if k not in known}
        with pytest.raises(anthropic.BadRequestError) as raised:
            claude.messages.create(model="tiny-chat", **known, extra_body=extra)
        assert raised.value.body["error"]["message"].startswith(field)


def test_an_unknown_model_is_anthropics_404(claude):
    with pytest.raises(anthropic.NotFoundError) as raised:
        claude.messages.create(model="claude-opus", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert raised.value.body["error"]["type"] == "not_found_error"
    # A route this server does not have (message batches) answers in Anthropic's shape too.
    with pytest.raises(anthropic.NotFoundError) as raised:
        claude.messages.batches.retrieve("msgbatch_1")
    assert raised.value.body["type"] == "error" and raised.value.body["error"]["type"] == "not_found_error"


def test_a_disconnect_mid_stream_frees_every_block(claude, deployment):
    grpc_client = Client(deployment.address)
    decode = next(h for name, h in deployment.handles.items() if name.startswith("decode"))
    ray.get(decode.set_step_delay.remote(0.05))
    try:
        with claude.messages.stream(model="tiny-chat", messages=[{"role": "user", "content": "Count."}], max_tokens=1500, **GREEDY) as stream:
            for _, _event in zip(range(4), stream):
                pass
        started = time.monotonic()
        workers = grpc_client.wait_until_idle(timeout_s=15)
        assert time.monotonic() - started < 15
        assert all(w.num_kv_blocks_used == 0 for w in workers)
        assert not deployment.router.dispatcher.active, "the router forgot the request"
    finally:
        ray.get(decode.set_step_delay.remote(0.0))
        grpc_client.close()
