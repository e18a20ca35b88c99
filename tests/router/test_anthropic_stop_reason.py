"""Anthropic's stop_reason for how a message ended."""

from __future__ import annotations

from router.anthropic_api.messages import stop_reason
from router.output_stream import StreamEnd, TimingBreakdown


def _end(reason: str, matched_stop: str = "") -> StreamEnd:
    return StreamEnd(reason=reason, prompt_tokens=5, completion_tokens=7, timing=TimingBreakdown(), matched_stop=matched_stop)


def test_a_stop_sequence_inside_a_tool_calls_input_is_a_stop_sequence_not_a_tool_use():
    """The call's name streamed, then a stop sequence matched inside its input: the input is cut
    short (invalid JSON, an empty input in the whole message), and "tool_use" told the client to
    run the tool with it."""
    assert stop_reason(_end("stop", matched_stop="Paris"), tool_calls=True, calls_complete=False) == "stop_sequence"
    # A stop sequence after calls that are whole: the client's agent loop runs them.
    assert stop_reason(_end("stop", matched_stop="Paris"), tool_calls=True, calls_complete=True) == "tool_use"
    assert stop_reason(_end("stop"), tool_calls=True) == "tool_use"
    assert stop_reason(_end("eos"), tool_calls=True) == "tool_use"
    assert stop_reason(_end("length"), tool_calls=True) == "max_tokens"
    assert stop_reason(_end("eos"), tool_calls=False) == "end_turn"


def test_a_responses_function_call_a_stop_sequence_cut_short_is_incomplete():
    """Its arguments are no JSON object (cut short, or a trailing comma): marked "completed", a
    client ran it with them."""
    from router.openai_api.tool_calls import ToolCalling
    from router.openai_api.tool_parsers import ToolCallOutput
    from router.output_stream import OutputChunk
    from router.responses_api.front_end import ResponseState

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    hermes = ToolCalling(tools, "auto", parser="hermes")
    for end, status, written in (
        (_end("stop", matched_stop="Paris"), "incomplete", ""),
        (_end("eos"), "completed", 'Oslo"}}\n</tool_call>'),
        (_end("eos"), "incomplete", 'Oslo",}}\n</tool_call>'),  # a trailing comma: no JSON
    ):
        response = ResponseState("r", "m", {}, 0, ToolCallOutput(hermes))
        text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "' + written
        response.take(OutputChunk(token_ids=[1], text=text, end=end))
        (call,) = [item for item in response.output if item["type"] == "function_call"]
        assert call["status"] == status, call


def test_an_anthropic_tool_use_a_stop_sequence_cut_short_is_left_out_of_the_whole_message():
    """Its input was {} (no JSON object): a client's agent loop ran the tool with it. Chat
    completions leave such a call out; so does the whole message now."""
    from router.anthropic_api.messages import MessageState
    from router.openai_api.tool_calls import ToolCalling
    from router.openai_api.tool_parsers import ToolCallOutput
    from router.output_stream import OutputChunk

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    hermes = ToolCalling(tools, "auto", parser="hermes")
    for end, kinds in ((_end("stop", matched_stop="Paris"), ["text"]), (_end("eos"), ["text", "tool_use"])):
        state = MessageState(ToolCallOutput(hermes))
        complete = end.reason == "eos"
        text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "' + ('Oslo"}}\n</tool_call>' if complete else "")
        state.take(OutputChunk(token_ids=[1], text=text, end=end))
        assert [block["type"] for block in state.content()] == kinds


def test_an_anthropic_tool_use_whose_input_is_no_json_is_no_tool_use():
    """A model's call with a trailing comma: chat completions end such an answer with stop and
    no call to run; the whole message said tool_use with input {}, and a client's agent loop
    ran the tool with it."""
    from router.anthropic_api.messages import MessageState
    from router.openai_api.tool_calls import ToolCalling
    from router.openai_api.tool_parsers import ToolCallOutput
    from router.output_stream import OutputChunk

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    for arguments, kinds, reason in (('{"city": "Oslo",}', ["text"], "end_turn"), ('{"city": "Oslo"}', ["text", "tool_use"], "tool_use")):
        state = MessageState(ToolCallOutput(ToolCalling(tools, "auto", parser="hermes")))
        end = _end("eos")
        text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": ' + arguments + "}\n</tool_call>"
        state.take(OutputChunk(token_ids=[1], text=text))
        state.take(OutputChunk(token_ids=[2], text="", end=end))
        assert [block["type"] for block in state.content()] == kinds and state.stop_reason(end) == reason
        # A call none may run: the answer as written is the text (its call's text was lost).
        assert state.content()[0]["text"] == (text if reason == "end_turn" else "Checking.\n")
