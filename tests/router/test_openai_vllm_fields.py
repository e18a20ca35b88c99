"""vLLM's request fields and answer rules on completions and chat, as a vLLM client sees them:
fields vLLM defines are taken (for real, or at the one value pdserve serves), the answer's role
follows vLLM's rule, and ``include_reasoning: false`` leaves the thinking's tokens out of
logprobs and token_ids too."""

from __future__ import annotations

import pytest

from engine.sampling_params import TokenLogprob
from router.errors import InvalidArgumentError
from router.openai_api.chat_template import ChatTemplate
from router.openai_api.protocol import read_chat, read_completion
from router.openai_api.reasoning import ReasoningFormat, ReasoningSplitter
from router.openai_api.responses import ChoiceState
from router.output_stream import OutputChunk, StreamEnd, TimingBreakdown
from router.validation import RequestLimits, validate_input

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
USER = [{"role": "user", "content": "2+2?"}]
LIMITS = RequestLimits(vocab_size=1000, max_context_len=512)
BOS = 1


def _encode(text: str, add_special_tokens: bool = True) -> list[int]:
    """One token per character, and a BOS first where special tokens are added (as Llama's tokenizer)."""
    return ([BOS] if add_special_tokens else []) + [2 + ord(c) % 900 for c in text]


def _prompt_ids(api) -> list[int]:
    return validate_input(api.choices[0], LIMITS, _encode).prompt_token_ids


# -- fields vLLM defines ---------------------------------------------------------------------


def test_add_special_tokens_adds_the_tokenizers_bos_or_not_as_vllm_does():
    """Completions: true by default (BOS before the prompt), false leaves it out; chat: false by
    default (the template wrote them), true adds the tokenizer's on top of the template's."""
    assert _prompt_ids(read_completion({"prompt": "hi"})) == _encode("hi")
    assert _prompt_ids(read_completion({"prompt": "hi", "add_special_tokens": False})) == _encode("hi", add_special_tokens=False)
    template = ChatTemplate(CHATML, {})
    plain = _prompt_ids(read_chat({"messages": USER}, template))
    assert plain[0] != BOS
    assert _prompt_ids(read_chat({"messages": USER, "add_special_tokens": True}, template)) == [BOS, *plain]
    with pytest.raises(InvalidArgumentError) as raised:
        read_completion({"prompt": "hi", "add_special_tokens": "no"})
    assert raised.value.field == "add_special_tokens"


def test_chat_documents_reach_the_template():
    template = ChatTemplate(
        "{% for d in documents or [] %}[{{ d.title }}] {{ d.text }}\n{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>", {}
    )
    documents = [{"title": "Oslo", "text": "Rainy today."}, {"title": "Rome", "text": "Sunny."}]
    (choice,) = read_chat({"messages": USER, "documents": documents}, template).choices
    assert choice.prompt_text.startswith("[Oslo] Rainy today.\n[Rome] Sunny.\n<user>2+2?")
    # A template that reads none ignores them, as in vLLM.
    assert read_chat({"messages": USER, "documents": documents}, ChatTemplate(CHATML, {})).choices[0].prompt_text == read_chat({"messages": USER}, ChatTemplate(CHATML, {})).choices[0].prompt_text
    for documents, field in (("x", "documents"), ([3], "documents[0]"), ([{"title": 1}], "documents[0].title")):
        with pytest.raises(InvalidArgumentError) as raised:
            read_chat({"messages": USER, "documents": documents}, template)
        assert raised.value.field == field


ONE_WAY = {"use_beam_search": (False, True), "length_penalty": (1.0, 0.5), "spaces_between_special_tokens": (True, False), "truncation_side": ("left", "right")}


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("name", sorted(ONE_WAY))
def test_vllms_fields_are_taken_at_the_value_pdserve_serves_and_refused_at_another(endpoint, name):
    """vLLM clients send these (some at their defaults, on every call): the value pdserve serves
    is taken, as vLLM takes it; another is refused naming the field, never ignored."""
    def read(extra: dict):
        if endpoint == "chat":
            return read_chat({"messages": USER, **extra}, ChatTemplate(CHATML, {}))
        return read_completion({"prompt": "hi", **extra})

    served, other = ONE_WAY[name]
    assert _prompt_ids(read({name: served})) == _prompt_ids(read({}))
    read({name: None})
    with pytest.raises(InvalidArgumentError) as raised:
        read({name: other})
    assert raised.value.field == name and "is not supported" in raised.value.problem


def test_chat_echo_is_taken_as_false_and_refused_as_true():
    template = ChatTemplate(CHATML, {})
    read_chat({"messages": USER, "echo": False}, template)
    with pytest.raises(InvalidArgumentError) as raised:
        read_chat({"messages": USER, "echo": True}, template)
    assert raised.value.field == "echo" and "is not supported" in raised.value.problem


# -- the answer's role -----------------------------------------------------------------------


def _answer(api, pieces: list[str]) -> tuple[dict, list[dict]]:
    """The first choice of ``api`` answered with ``pieces`` (a token each): the whole choice and
    the stream's deltas."""
    validated = validate_input(api.choices[0], LIMITS, _encode)

    def chunks():
        for index, text in enumerate(pieces):
            end = StreamEnd("eos", 3, len(pieces), TimingBreakdown()) if index == len(pieces) - 1 else None
            yield OutputChunk([100 + index], text, end=end)

    whole, streamed = ChoiceState.of(0, True, api, validated), ChoiceState.of(0, True, api, validated)
    for chunk in chunks():
        whole.add(chunk, None)
    deltas = [streamed.delta(chunk, streamed.add(chunk, None)) for chunk in chunks()]
    return whole.whole(), deltas


@pytest.mark.parametrize(
    ("extra", "messages", "role"),
    [
        ({}, USER, "assistant"),
        # continue_final_message: the answer goes on with the last message, in its role.
        ({"continue_final_message": True}, [*USER, {"role": "assistant", "content": "It is"}], "assistant"),
        ({"add_generation_prompt": False}, USER, "user"),
        ({"continue_final_message": True, "add_generation_prompt": False}, [{"role": "system", "content": "You are"}], "system"),
    ],
)
def test_the_answers_role_is_the_last_messages_where_no_new_turn_is_asked_for(extra, messages, role):
    """vLLM's get_chat_request_role: "assistant" with add_generation_prompt, else the last
    message's role, in the whole answer and on a stream's first chunk."""
    whole, deltas = _answer(read_chat({"messages": messages, **extra}, ChatTemplate(CHATML, {})), [" 4", "."])
    assert whole["message"]["role"] == role
    assert deltas[0]["delta"]["role"] == role and all("role" not in d["delta"] for d in deltas[1:])


# -- include_reasoning: false --------------------------------------------------------------


def _thinking_answer(byte_level_tokenizer) -> tuple[list[OutputChunk], list[int], str, int]:
    """An answer that thinks ("let me see"), closes its thinking, then answers (" It is 4."), in
    chunks of which one holds the thinking's end and the answer's start; its answer's ids and
    text, and how many tokens it has."""
    tok = byte_level_tokenizer
    close_id = tok.eos_token_id  # stands for </think>: a token of its own, in no text below
    thought, answer = tok.encode("let me see", add_special_tokens=False), tok.encode(" It is 4.", add_special_tokens=False)
    ids = [*thought, close_id, *answer]
    texts = [tok.decode([t]) for t in thought] + ["</think>"] + [tok.decode([t]) for t in answer]
    cuts = [0, 2, len(thought) + 3, len(ids)]
    chunks = []
    for start, stop in zip(cuts, cuts[1:]):
        end = StreamEnd("eos", 3, len(ids), TimingBreakdown()) if stop == len(ids) else None
        chunks.append(OutputChunk(ids[start:stop], "".join(texts[start:stop]), [TokenLogprob(t, -0.25, 1, []) for t in ids[start:stop]], end=end))
    return chunks, answer, " It is 4.", len(ids)


@pytest.mark.parametrize("stream", [False, True])
def test_hidden_reasoning_leaves_the_thinkings_tokens_out_of_logprobs_and_token_ids(byte_level_tokenizer, stream):
    """vLLM leaves the logprobs and token_ids out whole where it hides the thinking; they spelled
    it out, token by token, beside a hidden reasoning field. Here only the thinking's entries go:
    the answer's tokens keep theirs, and usage still counts every token."""
    tok = byte_level_tokenizer
    fmt = ReasoningFormat("deepseek_r1", tok.bos_token_id, tok.eos_token_id)

    def state(show: bool) -> ChoiceState:
        return ChoiceState(0, True, 0, 5, reasoning=ReasoningSplitter(fmt.thinking("<|im_start|>assistant\n")), show_reasoning=show, return_token_ids=True)

    def answered(show: bool) -> tuple[str, list[str], list[int], str | None, ChoiceState]:
        chunks, *_ = _thinking_answer(tok)
        one = state(show)
        if not stream:
            for chunk in chunks:
                one.add(chunk, tok)
            choice = one.whole()
            return choice["message"]["content"], [e["token"] for e in choice["logprobs"]["content"]], choice["token_ids"], choice["message"]["reasoning"], one
        content, tokens, ids, thinking = "", [], [], ""
        for chunk in chunks:
            delta = one.delta(chunk, one.add(chunk, tok))
            content += delta["delta"].get("content") or ""
            thinking += delta["delta"].get("reasoning") or ""
            tokens += [e["token"] for e in (delta["logprobs"] or {"content": []})["content"]]
            ids += delta["token_ids"]
        return content, tokens, ids, thinking or None, one

    _, answer_ids, answer_text, num_tokens = _thinking_answer(tok)
    content, tokens, ids, thinking, hidden = answered(show=False)
    assert (content, thinking) == (answer_text, None)
    assert "".join(tokens) == answer_text and ids == answer_ids
    assert hidden.num_tokens == num_tokens and hidden.reasoning_tokens == num_tokens - len(answer_ids)
    # Shown, the thinking keeps its tokens' entries.
    content, tokens, ids, thinking, _ = answered(show=True)
    assert thinking == "let me see" and "".join(tokens).startswith("let me see") and len(ids) == num_tokens
