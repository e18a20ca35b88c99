"""How a reasoning model's answer is split into thinking and answer (router/openai_api/reasoning.py):
where the thinking starts (the prompt, the parser), and the same split whatever pieces the text
streams in. The reference split is ``str.partition`` on the marker."""

from __future__ import annotations

import random

import pytest

from engine.thinking import Thinking
from router.openai_api.reasoning import ReasoningFormat, ReasoningSplitter

R1, QWEN3 = ReasoningFormat("deepseek_r1", 6, 7), ReasoningFormat("qwen3", 6, 7)


@pytest.mark.parametrize(
    ("prompt", "r1", "qwen3"),
    [
        ("<|assistant|>\n<think>\n", True, True),  # the template opened it
        ("<|assistant|>\n<think>\n\n</think>\n\n", False, False),  # the template closed it: thinking off
        ("<|assistant|>\n", True, None),  # R1 may leave <think> out; Qwen3 may open it itself
        ("<think>old</think> said\n<|assistant|>\n", True, None),  # an earlier turn's closed thinking
        ("<|user|>\nWhat does <think> mean?\n<|assistant|>\n", True, None),  # a marker in a message's text
    ],
)
def test_where_the_thinking_starts(prompt, r1, qwen3):
    assert (R1.starts_inside(prompt), QWEN3.starts_inside(prompt)) == (r1, qwen3)


def test_vllms_other_parser_names_read_the_thinking_as_their_models_write_it():
    """GLM-4.5 and DeepSeek-V3.1 open <think> themselves (or their templates do), as Qwen3;
    MiniMax-M2 may leave it out, as R1."""
    prompt = "<|assistant|>\n"
    assert [ReasoningFormat(name, 6, 7).starts_inside(prompt) for name in ("glm45", "deepseek_v3", "minimax_m2")] == [None, None, True]
    from router.config import RouterConfig

    RouterConfig(reasoning_parser="glm45").validate()
    with pytest.raises(ValueError, match="reasoning_parser"):
        RouterConfig(reasoning_parser="glm5").validate()


def test_an_answer_that_continues_an_assistant_message_continues_its_thinking():
    """continue_final_message: the message's own markers say (the prompt ends with its text)."""
    prompt = "<|assistant|>\n<think>\nLet me"
    assert QWEN3.starts_inside(prompt, continues="<think>\nLet me") is True
    assert QWEN3.starts_inside(prompt + "</think>\nSo", continues="<think>\nLet me</think>\nSo") is False
    # Text with no marker (a prefill): an answer already begun, for a parser that thinks from the
    # start too (deepseek_r1 took it all for thinking, and a client got no text).
    assert QWEN3.starts_inside("<|assistant|>\nSo", continues="So") is False
    assert R1.starts_inside("<|assistant|>{", continues="{") is False
    assert R1.starts_inside("<|assistant|>") is True  # nothing continued: as ever


def _split(inside, text: str, pieces: list[str]) -> tuple[str, str]:
    # The thinking the engine is told of: from the first token, where the model may open it, none.
    splitter = ReasoningSplitter(None if inside is False else Thinking(closer=7, opener=6, inside=bool(inside)))
    thinking = answer = ""
    for piece in pieces:
        more_thinking, more_answer = splitter.feed(piece)
        thinking, answer = thinking + more_thinking, answer + more_answer
    more_thinking, more_answer = splitter.finish()
    return thinking + more_thinking, answer + more_answer


CASES = [
    # (inside, the model's text, (thinking, answer))
    (True, "\nLet me see.</think>\n\nYes.", ("\nLet me see.", "\n\nYes.")),
    (True, "<think>\nhm</think>ok", ("\nhm", "ok")),  # a <think> repeated after the prompt's
    (True, "cut off by max_tokens </thi", ("cut off by max_tokens </thi", "")),
    (None, "  <think>a < b</think>so <think> stays", ("a < b", "so <think> stays")),
    (None, "No thinking.</think>", ("", "No thinking.</think>")),
    (None, "<thi", ("", "<thi")),
    (False, "<think>x</think>y", ("", "<think>x</think>y")),
]


@pytest.mark.parametrize(("inside", "text", "want"), CASES)
def test_every_way_of_streaming_the_text_splits_it_the_same(inside, text, want):
    rng = random.Random(0)
    assert _split(inside, text, [text]) == want
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert _split(inside, text, pieces) == want, pieces
    assert _split(inside, text, list(text)) == want


def test_the_engine_is_told_where_the_thinking_is_and_its_budget():
    assert QWEN3.thinking("<think>\n") == Thinking(closer=7, opener=6, inside=True)  # from the first token
    assert R1.thinking("<|assistant|>\n", budget=5) == Thinking(closer=7, opener=6, budget=5, inside=True)
    # The model may open it itself: only an output whose first token is <think> thinks.
    assert QWEN3.thinking("<|assistant|>\n") == Thinking(closer=7, opener=6)
    assert QWEN3.thinking("<think>\n\n</think>\n\n", budget=5) is None  # thinking is off


def test_the_thinkings_tokens_are_counted_by_id_up_to_and_with_the_closer():
    splitter = ReasoningSplitter(QWEN3.thinking("<think>\n"))
    assert splitter.thinking_tokens([1, 2]) == 2  # still thinking
    assert splitter.thinking_tokens([1, 7, 9]) == 2  # a token, then </think>; 9 is the answer's
    assert splitter.thinking_tokens([9]) == 0
    assert ReasoningSplitter(QWEN3.thinking("<think>\n\n</think>\n\n")).thinking_tokens([1, 7]) == 0  # thinking is off
    may_open = ReasoningSplitter(QWEN3.thinking("<|assistant|>\n"))
    assert may_open.thinking_tokens([6, 1, 7, 9]) == 3  # <think>, a token, </think>


def test_a_named_tool_call_after_thinking_streams_as_one_block_after_it():
    """A named tool_choice on a reasoning deployment: the call's block (Anthropic's tool_use, the
    Responses API's function_call) opens with the answer, after the thinking; it opened on the
    first chunk of thinking, the next thinking chunk interrupted it, and the arguments then went
    into the thinking block (a 500, or an error event mid-stream)."""
    from router.anthropic_api.messages import MessageState
    from router.openai_api.tool_calls import ToolCalling
    from router.openai_api.tool_parsers import ToolCallOutput
    from router.output_stream import OutputChunk, StreamEnd, TimingBreakdown
    from router.responses_api.front_end import ResponseState

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    pieces = ["Let me", " think", "</think>", '{"a": 1}']

    def chunks():
        for index, text in enumerate(pieces):
            end = StreamEnd("eos", 3, len(pieces), TimingBreakdown()) if index == len(pieces) - 1 else None
            yield OutputChunk([100 + index], text, end=end)

    def parts():
        return ToolCallOutput(ToolCalling([tool], "named", name="f")), ReasoningSplitter(Thinking(closer=7, opener=6, inside=True))

    message = MessageState(*parts())
    events = [event for chunk in chunks() for event in message.take(chunk)]
    content = message.content()
    assert [block["type"] for block in content] == ["thinking", "tool_use"]
    assert content[0]["thinking"] == "Let me think" and content[1]["input"] == {"a": 1}
    assert {e["index"] for e in events if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"} == {1}

    tools, splitter = parts()
    response = ResponseState("resp_1", "m", {}, 3, tools, splitter)
    for chunk in chunks():
        response.take(chunk)
    assert [(item["type"], item.get("arguments")) for item in response.output] == [("reasoning", None), ("function_call", '{"a": 1}')]


def test_an_item_cut_off_by_max_output_tokens_is_incomplete_and_a_huge_argument_is_no_500():
    """The Responses API's item the answer's end cut off says "incomplete", as OpenAI's does; an
    Anthropic tool call whose arguments hold an integer past bounded_json's limit is left out
    (its JSON is unreadable), not a 500."""
    from router.anthropic_api.messages import MessageState
    from router.openai_api.tool_calls import ToolCalling
    from router.openai_api.tool_parsers import ToolCallOutput
    from router.output_stream import OutputChunk, StreamEnd, TimingBreakdown
    from router.responses_api.front_end import ResponseState

    response = ResponseState("resp_1", "m", {}, 3, None)
    response.take(OutputChunk([5], "cut"))
    response.take(OutputChunk([6], " off", end=StreamEnd("length", 3, 2, TimingBreakdown())))
    assert [(item["type"], item["status"]) for item in response.output] == [("message", "incomplete")]
    assert response.obj()["status"] == "incomplete"

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    message = MessageState(ToolCallOutput(ToolCalling([tool], "named", name="f")))
    end = StreamEnd("eos", 3, 1, TimingBreakdown())
    message.take(OutputChunk([5], '{"n": ' + "9" * 5000 + "}", end=end))
    assert message.content() == [] and message.stop_reason(end) == "end_turn"  # no input to run it with
