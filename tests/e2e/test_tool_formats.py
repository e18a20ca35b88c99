"""Tool-call formats through the chat API of a real deployment, the model writing what a grammar
lets it.

Mistral's, with a tokenizer whose ``[TOOL_CALLS]`` and ``[ARGS]`` are special tokens, as
Mistral's are: the router keeps them in the text it reads (else the calls would pass as content),
and leaves the end-of-sequence token out of the answer; the follow-up turn goes through a
template that, as Mistral's do, takes only 9-character ids.

Qwen3-Coder's, through a second router over the same workers whose chat template (as
Qwen3-Coder's does) teaches ``<function=...><parameter=...>``: the parser is recognised from the
template, the parameters' text typed by the tools' schemas, and a call sent back renders as the
model wrote it."""

from __future__ import annotations

import json
import urllib.request

import pytest
from tokenizers import AddedToken

from router.config import RouterConfig
from tests.checkpoints import build_checkpoint
from tests.router.test_tool_calls import MISTRAL_TEMPLATE
from tests.router.tokenizer_builders import BASE_CONFIG, save_model_dir, train_byte_level_bpe
from tests.serving import following_router, running_deployment

TEMPLATE = MISTRAL_TEMPLATE + "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]


class Model:
    def __init__(self, path, ids):
        self.path, self.ids = path, ids


@pytest.fixture(scope="module")
def mistral_like(tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral_like") / "tiny-mistral"
    backend = train_byte_level_bpe(400)
    backend.add_special_tokens([AddedToken("[TOOL_CALLS]", special=True), AddedToken("[ARGS]", special=True)])
    save_model_dir(path, backend, {**BASE_CONFIG, "chat_template": TEMPLATE})
    ids = {token: backend.token_to_id(token) for token in ("[TOOL_CALLS]", "[ARGS]", "<s>", "</s>")}
    build_checkpoint("llama", path, vocab_size=backend.get_vocab_size(), max_position_embeddings=1024, bos_token_id=ids["<s>"], eos_token_id=ids["</s>"])
    return Model(path, ids)


@pytest.fixture(scope="module")
def deployment(ray_cluster, mistral_like):
    with running_deployment(mistral_like, 0, 1, RouterConfig(http_port=0), name="tool-formats", durable_workers=True) as running:
        yield running


def _forced(client, grammar: str, stream: bool = False, messages=MESSAGES):
    return client.chat.completions.create(
        model="tiny-mistral", messages=messages, tools=[WEATHER], max_completion_tokens=40, temperature=0.0, stream=stream,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )


def test_calls_marked_by_special_tokens_are_read_whole_and_streamed_and_come_back(client, mistral_like):
    ids = mistral_like.ids
    grammar = f'start: "Checking." <[{ids["[TOOL_CALLS]"]}]> "get_weather" <[{ids["[ARGS]"]}]> "{{\\"city\\": \\"Oslo\\"}}"'
    whole = _forced(client, grammar).choices[0]
    (call,) = whole.message.tool_calls
    assert (whole.finish_reason, whole.message.content, call.function.name, json.loads(call.function.arguments)) == ("tool_calls", "Checking.", "get_weather", {"city": "Oslo"})
    assert len(call.id) == 9 and call.id.isalnum()

    content, arguments, reasons = "", "", []
    for chunk in _forced(client, grammar, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            arguments += "".join(delta.function.arguments or "" for delta in choice.delta.tool_calls or [])
            reasons.append(choice.finish_reason)
    assert (content, json.loads(arguments), reasons[-1]) == ("Checking.", {"city": "Oslo"}, "tool_calls")

    # The next turn sends the call and its result back; the template takes the id.
    turn = [*MESSAGES, whole.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    assert _forced(client, 'start: "Sunny."', messages=turn).choices[0].message.content == "Sunny."


def test_an_answer_without_calls_has_no_end_of_sequence_text(client, mistral_like):
    answer = _forced(client, f'start: "Hello there." <[{mistral_like.ids["</s>"]}]>').choices[0]
    assert (answer.message.content, answer.message.tool_calls, answer.finish_reason) == ("Hello there.", None, "stop")


QWEN3_CODER_TEMPLATE = """{%- if tools %}[SYSTEM]To call a function, write:
<tool_call>
<function=example_function_name>
<parameter=example_parameter>
value
</parameter>
</function>
</tool_call>
{% for tool in tools %}{{ tool.function | tojson }}
{% endfor %}{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}[ASSISTANT]{{ message.content or '' }}{% for call in message.tool_calls %}<tool_call>
<function={{ call.function.name }}>
{% for key, value in call.function.arguments | items %}<parameter={{ key }}>
{{ value if value is string else value | tojson }}
</parameter>
{% endfor %}</function>
</tool_call>{% endfor %}
{%- elif message.role == 'tool' %}[TOOL]{{ message.content }}
{%- else %}[{{ message.role | upper }}]{{ message.content }}{% endif %}
{%- endfor %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}"""
FORECAST = {"type": "function", "function": {"name": "get_forecast", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"}}}}}
QWEN3_CODER_CALL = "<tool_call>\n<function=get_forecast>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=zip>\n0150\n</parameter>\n</function>\n</tool_call>"


@pytest.fixture(scope="module")
def qwen3_coder_router(deployment):
    with following_router(deployment, RouterConfig(http_port=0, chat_template=QWEN3_CODER_TEMPLATE)) as router:
        yield router


def test_qwen3_coder_calls_are_typed_by_the_schema_streamed_and_rendered_back(qwen3_coder_router):
    import openai

    base = f"http://127.0.0.1:{qwen3_coder_router.http_port}"
    grammar = "start: " + json.dumps("Looking." + QWEN3_CODER_CALL)
    with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        def forced(stream):
            return client.chat.completions.create(
                model="tiny-mistral", messages=MESSAGES, tools=[FORECAST], max_completion_tokens=300, temperature=0.0, stream=stream,
                extra_body={"structured_outputs": {"grammar": grammar}},
            )

        whole = forced(False).choices[0]
        (call,) = whole.message.tool_calls
        want = {"city": "Oslo", "days": 3, "zip": "0150"}  # days an integer by the schema; zip a string, its zero kept
        assert (whole.finish_reason, whole.message.content, call.function.name, json.loads(call.function.arguments)) == ("tool_calls", "Looking.", "get_forecast", want)

        content, arguments, reasons = "", "", []
        for chunk in forced(True):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                arguments += "".join(delta.function.arguments or "" for delta in choice.delta.tool_calls or [])
                reasons.append(choice.finish_reason)
        assert (content, json.loads(arguments), reasons[-1]) == ("Looking.", want, "tool_calls")

    # Sent back, the call renders through the template as the model wrote it.
    turn = [*MESSAGES, whole.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    tokens = _post(f"{base}/tokenize", {"messages": turn, "tools": [FORECAST]})["tokens"]
    prompt = _post(f"{base}/detokenize", {"tokens": tokens})["prompt"]
    assert "[ASSISTANT]Looking." + QWEN3_CODER_CALL + "[TOOL]sunny" in prompt


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def test_grpc_chat_reads_the_calls_out_of_the_answer_and_takes_them_back(deployment, mistral_like):
    """gRPC's ChatPrompt with tools: the same calls as the chat API's, in tool_calls with finish
    reason TOOL_CALLS and none of their markup in the text; sent back in the next turn's
    messages, they render through the template (which takes only 9-character ids)."""
    from router.api.pdserve.v1 import generation_pb2 as pb
    from tests.serving import Client

    ids = mistral_like.ids
    grammar = f'start: "Checking." <[{ids["[TOOL_CALLS]"]}]> "get_weather" <[{ids["[ARGS]"]}]> "{{\\"city\\": \\"Oslo\\"}}"'

    def ask(messages, grammar):
        request = pb.GenerateRequest(
            chat=pb.ChatPrompt(messages=messages, tools_json=json.dumps([WEATHER])),
            sampling=pb.SamplingParams(max_tokens=40, temperature=0.0, structured_output=pb.StructuredOutput(grammar=grammar)),
        )
        return list(client.stub.Generate(request, timeout=60))

    client = Client(deployment.address)
    try:
        asked = [pb.ChatMessage(role="user", content=MESSAGES[0]["content"])]
        answer = ask(asked, grammar)
        last = answer[-1]
        (call,) = last.tool_calls
        assert "".join(m.text for m in answer) == "Checking."
        assert (last.finish_reason, call.name, json.loads(call.arguments_json)) == (pb.FINISH_REASON_TOOL_CALLS, "get_weather", {"city": "Oslo"})
        assert len(call.id) == 9 and call.id.isalnum()
        turn = [*asked, pb.ChatMessage(role="assistant", content="Checking.", tool_calls=[call]), pb.ChatMessage(role="tool", tool_call_id=call.id, content="sunny")]
        follow_up = ask(turn, 'start: "Sunny."')
        assert "".join(m.text for m in follow_up) == "Sunny." and not follow_up[-1].tool_calls
        assert follow_up[-1].finish_reason != pb.FINISH_REASON_TOOL_CALLS
    finally:
        client.close()
