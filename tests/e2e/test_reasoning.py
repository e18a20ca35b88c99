"""A reasoning model's chat answers with ``router.reasoning_parser``: the thinking in
``reasoning`` (and ``reasoning_content``), the answer in ``content``, whole and streamed; a
structured answer's grammar applied after the thinking; thinking turned off by the template's
``enable_thinking``. The model: a tiny random Qwen3 whose tokenizer has ``<think>`` and
``</think>`` and whose template opens the thinking (as DeepSeek-R1's and Qwen3-thinking's do);
its head is arranged so that greedy decoding closes the thinking a few tokens in. References:
transformers' ``apply_chat_template`` + ``generate``, its text split at ``</think>`` with
``str.partition``, and a transformers loop masked by llguidance for the structured answer."""

from __future__ import annotations

import hashlib
import json

import anthropic
import jsonschema
import pytest
import torch
from tokenizers import AddedToken
from transformers import AutoTokenizer

from engine.structured_output import StructuredOutput
from engine.thinking import Thinking
from router.config import RouterConfig
from router.openai_api.reasoning import reasoning_format
from router.tokenizer import Tokenizer
from tests.checkpoints import build_checkpoint, hf_greedy
from tests.engine.test_structured_output import _reference_constrained_greedy
from tests.router.tokenizer_builders import BASE_CONFIG, save_model_dir, train_byte_level_bpe
from tests.e2e.test_openai_api import _http
from tests.serving import running_deployment

TEMPLATE = """{%- if reasoning_effort is defined %}<|system|>
Think {{ reasoning_effort }}.</s>
{% endif %}{%- for message in messages %}<|{{ message['role'] }}|>
{% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>{% endif %}{{ message['content'] }}</s>
{% endfor %}
{%- if add_generation_prompt %}<|assistant|>
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% elif model_opens is not defined or not model_opens %}<think>
{% endif %}{% endif %}"""
MESSAGES = [{"role": "user", "content": "Is 91 a prime number?"}]
SCHEMA = {
    "type": "object",
    "properties": {"prime": {"type": "boolean"}, "factor": {"type": "integer", "minimum": 2, "maximum": 90}},
    "required": ["prime", "factor"],
    "additionalProperties": False,
}
TOKENS = 24


class Thinker:
    def __init__(self, path, hf_model, hf_tokenizer):
        self.path, self.hf_model, self.hf_tokenizer = path, hf_model, hf_tokenizer
        self.close_id = hf_tokenizer.convert_tokens_to_ids("</think>")

    def prompt_ids(self, **template_kwargs) -> list[int]:
        ids = self.hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, **template_kwargs)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    path = tmp_path_factory.mktemp("thinker") / "tiny-thinker"
    backend = train_byte_level_bpe(400)
    backend.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    save_model_dir(path, backend, {**BASE_CONFIG, "chat_template": TEMPLATE})
    model = build_checkpoint("qwen3", path, vocab_size=backend.get_vocab_size(), max_position_embeddings=1024)
    found = Thinker(path, model, AutoTokenizer.from_pretrained(path))
    # The head's rows of </think> and of a token greedy decoding writes a few tokens in are
    # swapped: where the model would write that token, it closes its thinking.
    free = hf_greedy(model, found.prompt_ids(), 12)
    at = next(i for i in range(4, 12) if free[i] not in free[:i] and free[i] != found.close_id)
    with torch.no_grad():
        head = model.lm_head.weight
        head[[free[at], found.close_id]] = head[[found.close_id, free[at]]]
    model.save_pretrained(path)
    assert hf_greedy(model, found.prompt_ids(), 12)[at] == found.close_id
    return found


@pytest.fixture(scope="module")
def deployment(ray_cluster, thinker):
    with running_deployment(thinker, 1, 1, RouterConfig(http_port=0, reasoning_parser="qwen3", local_prefill_max_tokens=0)) as running:
        yield running


def _reference(thinker, **template_kwargs) -> tuple[str, str]:
    text = thinker.hf_tokenizer.decode(hf_greedy(thinker.hf_model, thinker.prompt_ids(**template_kwargs), TOKENS), skip_special_tokens=True)
    return text.partition("</think>")[::2]


def _chat(client, stream=False, **fields):
    return client.chat.completions.create(
        model="tiny-thinker", messages=MESSAGES, max_completion_tokens=TOKENS, temperature=0.0, stream=stream,
        extra_body={"ignore_eos": True, **fields.pop("extra_body", {})}, **fields,
    )


def test_the_thinking_and_the_answer_are_split_whole_and_streamed(client, thinker):
    thinking, answer = _reference(thinker)
    assert thinking and answer, "the reference closes its thinking inside the answer"
    whole = _chat(client)
    message = whole.choices[0].message
    assert (message.reasoning, message.reasoning_content, message.content) == (thinking, thinking, answer)
    ids = hf_greedy(thinker.hf_model, thinker.prompt_ids(), TOKENS)
    assert whole.usage.completion_tokens_details.reasoning_tokens == ids.index(thinker.close_id) + 1  # with </think>

    streamed = {"reasoning": "", "reasoning_content": "", "content": ""}
    for chunk in _chat(client, stream=True):
        for choice in chunk.choices:
            for name in streamed:
                streamed[name] += getattr(choice.delta, name, None) or ""
    assert streamed == {"reasoning": thinking, "reasoning_content": thinking, "content": answer}

    # With tools the answer is also read for calls: the thinking still streams, piece by piece.
    tool = {"type": "function", "function": {"name": "factor", "parameters": {"type": "object", "properties": {}}}}
    with_tools = {"reasoning": "", "content": ""}
    for chunk in _chat(client, stream=True, tools=[tool], tool_choice="none"):
        for choice in chunk.choices:
            for name in with_tools:
                with_tools[name] += getattr(choice.delta, name, None) or ""
    assert with_tools == {"reasoning": thinking, "content": answer}

    # vLLM's include_reasoning: false leaves the thinking out.
    hidden = _chat(client, extra_body={"include_reasoning": False}).choices[0].message
    assert hidden.reasoning is None and hidden.content == answer


def test_an_answer_sent_back_with_its_thinking_continues_the_conversation(client, thinker):
    """Clients send the assistant message (chat) or the output items (Responses) back as they
    came, reasoning fields included: both are taken, and both turns render alike."""
    first = _chat(client).choices[0].message
    turn = [*MESSAGES, first.model_dump(exclude_none=True), {"role": "user", "content": "Why?"}]
    again = client.chat.completions.create(model="tiny-thinker", messages=turn, max_completion_tokens=8, temperature=0.0).choices[0].message
    assert again.reasoning is not None or again.content is not None

    response = client.responses.create(model="tiny-thinker", input=MESSAGES[0]["content"], max_output_tokens=TOKENS, temperature=0.0)
    items = [*MESSAGES, *[item.model_dump(exclude_none=True) for item in response.output], {"role": "user", "content": "Why?"}]
    sent_back = client.responses.create(model="tiny-thinker", input=items, max_output_tokens=8, temperature=0.0)
    continued = client.responses.create(model="tiny-thinker", previous_response_id=response.id, input="Why?", max_output_tokens=8, temperature=0.0)
    assert sent_back.output_text == continued.output_text and sent_back.usage.input_tokens == continued.usage.input_tokens


def test_a_client_that_stores_nothing_gets_its_thinking_sealed_and_sends_it_back(client, thinker):
    """include: ["reasoning.encrypted_content"] with store: false (Codex's way): the reasoning
    item carries its thinking in encrypted_content, which alone brings it back next turn."""
    response = client.responses.create(
        model="tiny-thinker", input=MESSAGES[0]["content"], max_output_tokens=TOKENS, temperature=0.0, store=False, include=["reasoning.encrypted_content"],
    )
    reasoning = response.output[0]
    assert reasoning.type == "reasoning" and reasoning.encrypted_content
    sealed_only = {"type": "reasoning", "id": reasoning.id, "summary": [], "encrypted_content": reasoning.encrypted_content}
    turns = {}
    for name, item in (("sealed", sealed_only), ("plain", reasoning.model_dump(exclude_none=True))):
        items = [*MESSAGES, item, *[i.model_dump(exclude_none=True) for i in response.output[1:]], {"role": "user", "content": "Why?"}]
        turns[name] = client.responses.create(model="tiny-thinker", input=items, max_output_tokens=8, temperature=0.0, store=False)
    assert turns["sealed"].output_text == turns["plain"].output_text and turns["sealed"].usage.input_tokens == turns["plain"].usage.input_tokens
    without = client.responses.create(model="tiny-thinker", input=[*MESSAGES, *[i.model_dump(exclude_none=True) for i in response.output[1:]], {"role": "user", "content": "Why?"}],
                                      max_output_tokens=8, temperature=0.0, store=False)
    assert without.usage.input_tokens < turns["sealed"].usage.input_tokens  # the template renders the thinking sent back
    for bad, param in (({"include": ["message.output_text.logprobs"]}, "include[0]"), ({"input": [{**sealed_only, "encrypted_content": "pdserve-thinking-v1:not base64!"}, {"role": "user", "content": "hi"}]}, "input[0].encrypted_content")):
        status, raw, _ = _http(f"http://127.0.0.1:{client.base_url.port}/v1", "/v1/responses", {"model": "tiny-thinker", "input": "hi", **bad})
        assert status == 400 and json.loads(raw)["error"]["param"] == param, raw


def test_a_response_has_a_reasoning_item_before_its_message_whole_and_streamed(client, thinker):
    thinking, answer = _reference(thinker)
    fields = dict(model="tiny-thinker", input=MESSAGES[0]["content"], max_output_tokens=TOKENS, temperature=0.0, extra_body={"ignore_eos": True})
    response = client.responses.create(**fields)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and [part.text for part in reasoning.content] == [thinking]
    assert message.type == "message" and response.output_text == answer
    # The tokens up to and with </think>: one per character or more, fewer than the answer's all.
    assert 0 < response.usage.output_tokens_details.reasoning_tokens < TOKENS

    deltas, events = "", []
    with client.responses.stream(**fields) as stream:
        for event in stream:
            events.append(event.type)
            if event.type == "response.reasoning_text.delta":
                deltas += event.delta
        final = stream.get_final_response()
    assert deltas == thinking and final.output[0].content[0].text == thinking and final.output_text == answer
    assert events.index("response.reasoning_text.done") < events.index("response.output_text.delta")


def test_a_reasoning_effort_reaches_the_template_as_vllm_passes_it(client, thinker):
    want = len(thinker.prompt_ids(reasoning_effort="high"))
    assert want > len(thinker.prompt_ids())
    chat = client.chat.completions.create(model="tiny-thinker", messages=MESSAGES, max_completion_tokens=2, reasoning_effort="high")
    response = client.responses.create(model="tiny-thinker", input=MESSAGES[0]["content"], max_output_tokens=2, reasoning={"effort": "high", "summary": "auto"})
    assert chat.usage.prompt_tokens == response.usage.input_tokens == want
    assert response.reasoning.effort == "high" and response.reasoning.summary == "auto"
    with anthropic.Anthropic(base_url=str(client.base_url).removesuffix("/v1/"), api_key="unused", max_retries=0, timeout=60) as messages:
        reply = messages.messages.create(model="tiny-thinker", messages=MESSAGES, max_tokens=2, output_config={"effort": "high"})
    # Anthropic's output_config.effort, the same way (a call without `thinking` does not think, as Anthropic's)
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == len(thinker.prompt_ids(reasoning_effort="high", enable_thinking=False))


def test_thinking_turned_off_by_the_template_leaves_it_all_answer(client, thinker):
    thinking, answer = _reference(thinker, enable_thinking=False)
    whole = thinking + "</think>" + answer if answer or "</think>" in thinking else thinking
    message = _chat(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert message.reasoning is None and message.content == whole


def test_a_structured_answer_is_constrained_after_the_thinking(client, thinker):
    free_thinking, _ = _reference(thinker)
    structured = StructuredOutput("json_schema", json.dumps(SCHEMA))
    expected = _reference_constrained_greedy(
        thinker.hf_model, (thinker.path / "tokenizer.json").read_text(), thinker.hf_model.config.vocab_size,
        thinker.hf_tokenizer.eos_token_id, structured, thinker.prompt_ids(), 80, thinking=Thinking(closer=thinker.close_id),
    )
    thinking, _, answer = thinker.hf_tokenizer.decode(expected, skip_special_tokens=True).partition("</think>")
    assert thinking == free_thinking
    message = client.chat.completions.create(
        model="tiny-thinker", messages=MESSAGES, max_completion_tokens=80, temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}},
    ).choices[0].message
    assert (message.reasoning, message.content) == (thinking, answer)
    jsonschema.validate(json.loads(message.content), SCHEMA)


def test_a_thinking_budget_closes_the_thinking_once_spent(client, thinker):
    """vLLM's thinking_token_budget: after that many thinking tokens the model's </think> is
    forced, and the answer goes on from there (transformers with the same rule)."""
    budget = 2
    ids = thinker.prompt_ids()
    expected = _reference_constrained_greedy(
        thinker.hf_model, (thinker.path / "tokenizer.json").read_text(), thinker.hf_model.config.vocab_size,
        thinker.hf_tokenizer.eos_token_id, None, ids, TOKENS, thinking=Thinking(closer=thinker.close_id, budget=budget),
    )
    assert expected[budget] == thinker.close_id and thinker.close_id not in hf_greedy(thinker.hf_model, ids, budget + 1)
    thinking, _, answer = thinker.hf_tokenizer.decode(expected, skip_special_tokens=True).partition("</think>")
    message = _chat(client, extra_body={"thinking_token_budget": budget}).choices[0].message
    assert (message.reasoning, message.content) == (thinking, answer)


def test_anthropic_messages_carry_the_thinking_as_a_thinking_block(deployment, thinker):
    thinking, answer = _reference(thinker)
    with anthropic.Anthropic(base_url=f"http://127.0.0.1:{deployment.http_port}", api_key="unused", max_retries=0, timeout=60) as client:
        fields = dict(model="tiny-thinker", messages=MESSAGES, max_tokens=TOKENS, extra_body={"ignore_eos": True, "temperature": 0.0})
        message = client.messages.create(thinking={"type": "adaptive"}, **fields)
        block, text = message.content
        assert (block.type, block.thinking, text.type, text.text) == ("thinking", thinking, "text", answer)
        assert block.signature == hashlib.sha256(thinking.encode()).hexdigest()

        deltas = {"thinking_delta": "", "text_delta": "", "signature_delta": ""}
        with client.messages.stream(thinking={"type": "adaptive"}, **fields) as stream:
            for event in stream:
                if event.type == "content_block_delta":
                    delta = event.delta
                    deltas[delta.type] += getattr(delta, delta.type.removesuffix("_delta"))
        assert deltas == {"thinking_delta": thinking, "text_delta": answer, "signature_delta": block.signature}

        # Turned off: the template's enable_thinking is false, and the answer is all text.
        off_thinking, off_answer = _reference(thinker, enable_thinking=False)
        (only,) = client.messages.create(thinking={"type": "disabled"}, **fields).content
        assert only.type == "text" and only.text == (off_thinking + "</think>" + off_answer if off_answer else off_thinking)
        # Not asked for: Anthropic's API does not think then, and a client's content[0] is text
        # (it was a thinking block wherever the template thinks by default).
        assert [(b.type, b.text) for b in client.messages.create(**fields).content] == [("text", only.text)]

        # The thinking block sent back with the turn it belongs to.
        turn = [*MESSAGES, {"role": "assistant", "content": [block.model_dump(), text.model_dump()]}, {"role": "user", "content": "Why?"}]
        assert client.messages.create(model="tiny-thinker", messages=turn, max_tokens=4, thinking={"type": "adaptive"}).content
        with pytest.raises(anthropic.BadRequestError, match="thinking.budget_tokens"):
            client.messages.create(thinking={"type": "enabled", "budget_tokens": 1024}, **fields)


def test_a_structured_answer_of_a_model_that_may_open_its_thinking_itself(client, thinker):
    """Qwen3's own template leaves <think> to the model: the grammar waits for </think> only if
    the first token opens the thinking, else it holds from the first token (the engine's test
    has both; this model's first token under the mask opens it)."""
    open_id = thinker.hf_tokenizer.convert_tokens_to_ids("<think>")
    structured = StructuredOutput("json_schema", json.dumps(SCHEMA))
    expected = _reference_constrained_greedy(
        thinker.hf_model, (thinker.path / "tokenizer.json").read_text(), thinker.hf_model.config.vocab_size,
        thinker.hf_tokenizer.eos_token_id, structured, thinker.prompt_ids(model_opens=True), 80,
        thinking=Thinking(closer=thinker.close_id, opener=open_id),
    )
    text = thinker.hf_tokenizer.decode(expected, skip_special_tokens=True)
    thinking, answer = text.removeprefix("<think>").partition("</think>")[::2] if expected[0] == open_id else (None, text)
    message = client.chat.completions.create(
        model="tiny-thinker", messages=MESSAGES, max_completion_tokens=80, temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}},
        extra_body={"chat_template_kwargs": {"model_opens": True}},
    ).choices[0].message
    assert (message.reasoning, message.content) == (thinking, answer)
    jsonschema.validate(json.loads(message.content), SCHEMA)


def test_a_parser_whose_markers_the_model_lacks_is_refused_naming_the_field(e2e_model):
    with pytest.raises(ValueError, match="reasoning_parser: qwen3 needs <think>"):
        reasoning_format("qwen3", Tokenizer.from_model_dir(e2e_model.path))


def test_grpc_chat_renders_as_transformers_and_splits_the_thinking(deployment, thinker):
    """gRPC's ChatPrompt: the conversation through the model's template (transformers'
    apply_chat_template gives the same prompt tokens), the thinking in reasoning_text and the
    answer in text, the thinking's tokens in usage; template variables turn thinking off; a
    bad field is refused naming its place in the request."""
    import grpc

    from router.api.pdserve.v1 import generation_pb2 as pb
    from tests.serving import Client

    def ask(**chat):
        request = pb.GenerateRequest(
            chat=pb.ChatPrompt(messages=[pb.ChatMessage(**m) for m in MESSAGES], **chat),
            sampling=pb.SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True),
        )
        messages = list(client.stub.Generate(request, timeout=60))
        usage = messages[-1].usage
        return "".join(m.reasoning_text for m in messages), "".join(m.text for m in messages), (usage.prompt_tokens, usage.reasoning_tokens)

    client = Client(deployment.address)
    try:
        thinking, answer = _reference(thinker)
        ids = hf_greedy(thinker.hf_model, thinker.prompt_ids(), TOKENS)
        assert ask() == (thinking, answer, (len(thinker.prompt_ids()), ids.index(thinker.close_id) + 1))
        off_thinking, off_answer = _reference(thinker, enable_thinking=False)
        whole = off_thinking + "</think>" + off_answer if off_answer or "</think>" in off_thinking else off_thinking
        assert ask(chat_template_kwargs_json='{"enable_thinking": false}')[:2] == ("", whole)

        # The CLI's `generate --chat`: the answer on stdout, the thinking on stderr.
        import subprocess
        import sys

        cli = subprocess.run(
            [sys.executable, "-m", "cluster.cli", "generate", "--address", deployment.address, "--chat", "--max-tokens", str(TOKENS),
             "--temperature", "0", "--ignore-eos", MESSAGES[0]["content"]],
            capture_output=True, text=True, timeout=120,
        )
        assert cli.returncode == 0 and cli.stdout == answer + "\n" and thinking in cli.stderr, cli.stderr

        for chat, field in (({"chat_template_kwargs_json": "{nope"}, "chat.chat_template_kwargs_json"),
                            ({"tools_json": '[{"type": "function"}]'}, "chat.tools_json[0].function")):
            with pytest.raises(grpc.RpcError) as refused:
                ask(**chat)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and refused.value.details().startswith(field), refused.value.details()
        with pytest.raises(grpc.RpcError) as refused:
            list(client.stub.Generate(pb.GenerateRequest(prompt_text="hi", chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="hi")])), timeout=60))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "set only one of prompt_text, prompt_token_ids and chat" in refused.value.details()
    finally:
        client.close()
