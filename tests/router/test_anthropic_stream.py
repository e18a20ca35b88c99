"""Anthropic Messages streams as the official SDK's accumulator reads them: tool inputs sent
whole and checked (or as written, for tools that ask for eager input streaming), thinking shown
or omitted, and the request fields the SDK sends for them."""

from __future__ import annotations

import pytest

from router.anthropic_api.messages import MessageState
from router.errors import InvalidArgumentError
from router.openai_api.tool_calls import ToolCalling
from router.openai_api.tool_parsers import ToolCallOutput
from router.output_stream import OutputChunk, StreamEnd, TimingBreakdown

TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    for name in ("get_weather", "get_time")
]


def _stream(text: str, eager: frozenset[str] = frozenset(), piece: int = 3, **state) -> tuple[list[dict], object]:
    """``text`` streamed ``piece`` characters a chunk through a hermes model's message state: the
    events sent, and the message the anthropic SDK's accumulator builds from them."""
    from anthropic.lib.streaming._messages import accumulate_event
    from anthropic.types import RawMessageStreamEvent
    from pydantic import TypeAdapter

    message = MessageState(ToolCallOutput(ToolCalling(TOOLS, "auto", parser="hermes")), eager_tools=eager, **state)
    end = StreamEnd(reason="eos", prompt_tokens=5, completion_tokens=9, timing=TimingBreakdown())
    pieces = [text[i : i + piece] for i in range(0, len(text), piece)]
    events = []
    for index, chunk in enumerate(pieces):
        events += message.take(OutputChunk(token_ids=[1], text=chunk, end=end if index == len(pieces) - 1 else None))
    start = {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": {"input_tokens": 5, "output_tokens": 0}}}
    stop = {"type": "message_delta", "delta": message.stop_fields(end), "usage": {"output_tokens": 9}}
    snapshot, buffers = None, {}
    for event in [start, *events, stop]:
        snapshot = accumulate_event(event=TypeAdapter(RawMessageStreamEvent).validate_python(event), current_snapshot=snapshot, json_bufs=buffers)
    return events, snapshot


CALL = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'


def test_a_tool_calls_input_is_sent_whole_once_written_and_the_sdk_reads_it():
    events, message = _stream(CALL)
    deltas = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"]
    assert deltas == ['{"city": "Oslo"}']
    assert [(block.type, getattr(block, "input", None)) for block in message.content] == [("text", None), ("tool_use", {"city": "Oslo"})]
    assert message.stop_reason == "tool_use"


def test_a_call_whose_input_is_no_json_never_reaches_the_sdk():
    """A model's trailing comma: its pieces streamed as written, and the SDK's accumulator, which
    parses the input at every delta, raised (the whole answer lost). The call is left out of the
    stream now, as of the whole message, and the answer ends its turn."""
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo",}}\n</tool_call>\n'
    events, message = _stream(text)
    assert [block.type for block in message.content] == ["text"]
    assert message.stop_reason == "end_turn"
    assert not [e for e in events if e["type"] == "content_block_start" and e["content_block"]["type"] == "tool_use"]


def test_calls_after_one_left_out_keep_their_order_and_indices():
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo",}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"city": "Lima"}}\n</tool_call>\nDone.')
    events, message = _stream(text, piece=5)
    assert [(block.type, getattr(block, "name", None)) for block in message.content] == [("tool_use", "get_time"), ("text", None)]
    starts = [e["index"] for e in events if e["type"] == "content_block_start"]
    assert starts == list(range(len(starts)))
    assert message.stop_reason == "end_turn"  # a call none may run was made: vLLM's and chat's rule


def test_a_tool_with_eager_input_streaming_streams_its_input_as_written():
    events, message = _stream(CALL, eager=frozenset({"get_weather"}), piece=2)
    deltas = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"]
    assert len(deltas) > 3 and "".join(deltas) == '{"city": "Oslo"}'
    assert message.content[-1].input == {"city": "Oslo"}


def test_thinking_display_omitted_sends_its_blocks_with_signatures_only():
    """thinking.display "omitted": the thinking block comes with empty text and the signature
    of the thinking's text (the SDK's accumulator takes it); "summarized" shows the text."""
    from engine.thinking import Thinking
    from router.anthropic_api.messages import thinking_signature
    from router.openai_api.reasoning import ReasoningSplitter

    shown = {}
    for omit in (False, True):
        splitter = ReasoningSplitter(Thinking(closer=7, opener=6, inside=True))
        events, message = _stream("Let me think.</think>Sunny.", reasoning=splitter, omit_thinking=omit)
        thinking, text = message.content
        assert (thinking.type, text.text) == ("thinking", "Sunny.")
        assert thinking.signature == thinking_signature("Let me think.")
        shown[omit] = thinking.thinking
        assert any(e["type"] == "content_block_delta" and e["delta"]["type"] == "thinking_delta" for e in events) is not omit
    assert shown == {False: "Let me think.", True: ""}


def test_request_fields_the_sdk_sends_are_taken():
    from router.anthropic_api.protocol import _EFFORTS, _cache_control, _openai_tools, _with_examples

    assert _EFFORTS["xhigh"] == _EFFORTS["max"] == "high"
    tool = {"name": "f", "description": "Weather.", "input_schema": {"type": "object"}, "strict": True,
            "eager_input_streaming": None, "input_examples": [{"city": "Oslo"}]}
    (converted,) = _openai_tools({"tools": [tool]})["tools"]
    assert converted["function"]["description"] == 'Weather.\n\nExample inputs:\n{"city": "Oslo"}'
    for bad, field in (({"strict": "yes"}, "tools[0].strict"), ({"input_examples": ["x"]}, "tools[0].input_examples")):
        with pytest.raises(InvalidArgumentError) as refused:
            _openai_tools({"tools": [{**tool, **bad}]})
        assert refused.value.field == field
    assert _with_examples({"name": "f"}, "tools[0]") == {"name": "f"}
    _cache_control({"cache_control": {"type": "ephemeral", "ttl": "1h"}})  # every prompt is cached anyway
    with pytest.raises(InvalidArgumentError) as refused:
        _cache_control({"cache_control": {"type": "forever"}})
    assert refused.value.field == "cache_control.type"


def test_a_call_the_whole_message_leaves_out_is_not_streamed_either():
    """An input with NaN is no JSON to the tool parsers (the whole message leaves its call out),
    but the stream's check was lenient: a call followed by another was streamed with it."""
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": NaN}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"city": "Lima"}}\n</tool_call>')
    events, message = _stream(text, piece=7)
    assert [block.name for block in message.content if block.type == "tool_use"] == ["get_time"]
