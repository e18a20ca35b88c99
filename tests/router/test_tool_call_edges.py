"""Tool calls a model writes badly, and tools whose schemas a generator wrote: a client is never
told to run a call whose arguments do not parse, the values are typed by the schema however it
is spelled, and content is neither held back nor lost. Each answer is read whole and in pieces
of every size, into the same calls (test_tool_calls.py's ``_run``)."""

from __future__ import annotations

import enum
import json

import pydantic
import pytest

from router.openai_api.tool_calls import ToolCalling
from router.openai_api.tool_parsers import ToolCallOutput
from router.output_stream import StreamEnd, TimingBreakdown
from tests.router.test_tool_calls import GLM45, HERMES, LLAMA, MISTRAL, PYTHONIC, QWEN3_CODER, TIME, WEATHER, WRITE_FILE, _run

PIECES = (1, 3, 7, 10_000)
EOS = StreamEnd(reason="eos", prompt_tokens=1, completion_tokens=9, timing=TimingBreakdown())


def _calling(parser: str, *tools: dict) -> ToolCalling:
    return ToolCalling(list(tools) or [WRITE_FILE, WEATHER, TIME], "auto", parser=parser)


def _reads(calling: ToolCalling, text: str) -> tuple[str, list[tuple[str, str]], str | None]:
    """The answer's content, calls (name, arguments' text) and finish reason, the same for every
    piece size, and its streamed deltas adding up to its calls."""
    reads = []
    for piece in PIECES:
        content, streamed, whole, reason = _run(calling, text, piece)
        assert streamed == whole, (text, piece)
        reads.append((content, [(call["name"], call["arguments"]) for call in whole], reason))
    assert all(read == reads[0] for read in reads), text
    return reads[0]


# A file's text as models write it inside JSON: raw line ends and tabs (and a stray control character).
_RAW_FILE = "line1\nline2\ttab\r\x01end"
_JSON_CALL = '{"name": "write_file", "arguments": {"path": "a.py", "content": "%s"}}' % _RAW_FILE


@pytest.mark.parametrize("parser, text", [
    ("hermes", f"<tool_call>\n{_JSON_CALL}\n</tool_call>"),
    ("hermes", f"<tool_call>\n{_JSON_CALL}"),  # the answer ended before the block did
    ("llama3_json", _JSON_CALL),
    ("mistral", f"[TOOL_CALLS][{_JSON_CALL}]"),
    ("mistral", '[TOOL_CALLS]write_file[ARGS]{"path": "a.py", "content": "%s"}' % _RAW_FILE),
], ids=["hermes", "hermes_unclosed", "llama3_json", "mistral", "mistral_named"])
def test_raw_control_characters_in_a_json_calls_strings_reach_the_client_escaped(parser, text):
    """A raw newline or tab inside a JSON string is no JSON: the arguments were sent as written
    and a client's json.loads failed on a call told to be run. Escaped as they stream, the call
    parses to the text the model meant."""
    content, calls, reason = _reads(_calling(parser), text)
    assert content == "" and reason == "tool_calls"
    assert [(name, json.loads(arguments)) for name, arguments in calls] == [("write_file", {"path": "a.py", "content": _RAW_FILE})]


@pytest.mark.parametrize("calling, text", [
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",}}\n</tool_call>'),
    (HERMES, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {'city': 'Paris'}}\n</tool_call>"),
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),  # the answer ended inside it
    (LLAMA, '{"name": "get_weather", "parameters": {"city": "Paris",}}'),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": NaN}}]'),
    (MISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris",}'),
], ids=["hermes_trailing_comma", "hermes_single_quotes", "hermes_cut_off", "llama3_json", "mistral_nan", "mistral_named"])
def test_a_json_call_whose_arguments_do_not_parse_is_not_reported_as_one_to_run(calling, text):
    """The call was streamed as it was written (the client has it), but the answer no longer
    ends with "tool_calls" (a client runs every call then, and failed on these): "stop", as
    vLLM's reading of such an answer gives."""
    _, calls, reason = _reads(calling, text)
    assert [name for name, _ in calls] == ["get_weather"] and reason is None
    output = ToolCallOutput(calling)
    output.feed(text)
    output.finish()
    assert output.finish_reason_at(EOS) is None  # what the front ends ask: the choice ends with "stop"


def test_a_call_named_with_a_raw_control_character_or_a_bad_escape_is_content_and_raises_nothing():
    """The name's JSON string was parsed strictly where it was found: a raw newline or an unknown
    escape in it raised JSONDecodeError out of the reader, taking the answer's stream down."""
    for name in ('"get\nweather"', '"get\\qweather"'):
        text = '<tool_call>{"name": %s, "arguments": {"city": "Oslo"}}</tool_call> Done.' % name
        assert _reads(HERMES, text) == (text, [], None)


@pytest.mark.parametrize("calling, text", [
    (HERMES, '<tool_call>{"name": "get_time", "arguments": "now"}</tool_call>'),
    (LLAMA, '{"name": "get_time", "parameters": "now"}'),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_time", "arguments": "now"}]'),
], ids=["hermes", "llama3_json", "mistral"])
def test_arguments_written_as_a_string_reach_the_client_as_json(calling, text):
    """A call whose arguments the model wrote as a string: a string that is an object's JSON is
    that object; any other is written as a JSON string (it was sent bare, ``now``, no JSON)."""
    assert _reads(calling, text) == ("", [("get_time", '"now"')], "tool_calls")
    assert _reads(calling, text.replace('"now"', '"{\\"tz\\": \\"UTC\\"}"'))[1] == [("get_time", '{"tz": "UTC"}')]


@pytest.mark.parametrize("text, arguments, content", [
    ('[get_weather(city="Paris", unit=celsius)]', {"city": "Paris"}, "unit=celsius)]"),
    ('[get_weather(city="Paris", days=3+1)]', {"city": "Paris"}, "days=3+1)]"),
    ('[get_weather(city="x", city="y")]', {"city": "x"}, 'city="y")]'),
    ('[get_weather(city="Paris".upper())]', {"city": "Paris"}, 'city="Paris".upper())]'),
    ('[get_weather(city="Par', {"city": "Par"}, ""),  # the answer ended inside the value
    ('[get_time(), get_weather(city="Oslo", unit=c)]', None, 'unit=c)]'),
])
def test_a_pythonic_call_cut_short_keeps_arguments_that_parse_and_is_not_one_to_run(text, arguments, content):
    """A call shown (its first value, a string, streams as it is written) whose reading then
    stopped kept its arguments open ('{"city": "Paris"'), with "tool_calls": what was shown is
    now closed where it stands, and the answer ends with "stop"."""
    got_content, calls, reason = _reads(PYTHONIC, text)
    read = [(name, json.loads(arguments_text)) for name, arguments_text in calls]
    expected = [("get_weather", arguments)] if arguments is not None else [("get_time", {}), ("get_weather", {"city": "Oslo"})]
    assert (got_content, read, reason) == (content, expected, None)


def test_an_answer_that_starts_with_a_bracket_but_is_no_call_streams_as_content():
    """"[Note] ..." starts as a pythonic answer's calls do: the whole answer was held back until it
    ended. Once its reading stops before any call, it is content, and what follows streams."""
    text = "[Note] this answer has no call at all, and goes on for a while."
    output = ToolCallOutput(PYTHONIC)
    early = "".join(part for char in text[:20] for part in output.feed(char) if isinstance(part, str))
    assert early == text[:20]
    assert _reads(PYTHONIC, text) == (text, [], None)
    # A call not yet shown where its reading stopped is content too, all of the answer (as vLLM reads it).
    for answer in ("[1, 2] are the answers", "[get_weather(days=3+1)]", "[get_weather(days=1, days=2)]", "[get_weather(unit=celsius, city='x')]"):
        assert _reads(PYTHONIC, answer) == (answer, [], None)
    # Still calls: where Python reads on past where the streamed reading stops (a comment, a
    # line continued), the whole answer decides; a name may start with any letter.
    assert _reads(PYTHONIC, "[get_time(a=1 # now\n)]")[1:] == ([("get_time", '{"a": 1}')], "tool_calls")
    assert _reads(PYTHONIC, "[get_time(a=1,\\\n b=2)]")[1:] == ([("get_time", '{"a": 1, "b": 2}')], "tool_calls")
    assert _reads(PYTHONIC, "[\u00e9t\u00e9(a=1)]")[1:] == ([("\u00e9t\u00e9", '{"a": 1}')], "tool_calls")


class _Address(pydantic.BaseModel):
    city: str
    zip: int


class _Unit(str, enum.Enum):
    c = "c"
    f = "f"


class _Shipment(pydantic.BaseModel):
    to: _Address
    back: _Address | None = None
    note: _Address = pydantic.Field(description="where the note goes")
    unit: _Unit
    days: int | None = None


def _ship_tool() -> dict:
    """A tool as pydantic writes it, with what other generators write: allOf around a reference,
    pydantic 1's "definitions", oneOf, a schema that refers to itself, and ones that name no type."""
    parameters = _Shipment.model_json_schema()
    parameters["definitions"] = {"Count": {"type": "integer"}}
    parameters["$defs"]["Loop"] = {"$ref": "#/$defs/Loop"}
    parameters["properties"].update({
        "wrapped": {"allOf": [{"$ref": "#/$defs/_Address"}], "description": "an address"},
        "count": {"$ref": "#/definitions/Count"},
        "either": {"oneOf": [{"$ref": "#/$defs/_Address"}, {"type": "integer"}]},
        "loop": {"$ref": "#/$defs/Loop"},
        "extra": {"description": "anything"},
        "label": {"description": "anything, here a word"},
    })
    return {"type": "function", "function": {"name": "ship", "parameters": parameters}}


_SHIP_VALUES = {"to": '{"city": "Oslo", "zip": 150}', "back": "null", "note": '{"city": "Rome", "zip": 1}', "unit": "c", "days": "3",
                "wrapped": '{"city": "Lima", "zip": 2}', "count": "7", "either": "5", "loop": "[1, 2]", "extra": '{"k": true}', "label": "hello"}
_SHIP_ARGUMENTS = {"to": {"city": "Oslo", "zip": 150}, "back": None, "note": {"city": "Rome", "zip": 1}, "unit": "c", "days": 3,
                   "wrapped": {"city": "Lima", "zip": 2}, "count": 7, "either": 5, "loop": [1, 2], "extra": {"k": True}, "label": "hello"}


@pytest.mark.parametrize("parser", ["qwen3_coder", "glm45"])
def test_values_are_typed_through_schema_references_and_combinations(parser):
    """pydantic writes a nested model as {"$ref": "#/$defs/..."} and an optional one as anyOf
    [{"$ref"}, null]: their values came back as strings of JSON (the client got '"{\\"city\\"..."'
    where it asked for an object). References are looked up, allOf, anyOf and oneOf looked
    through, and a schema that names no type takes the JSON the model wrote (else its text)."""
    assert _Shipment.model_json_schema()["properties"]["to"] == {"$ref": "#/$defs/_Address"}  # what is being read
    tool = _ship_tool()
    if parser == "qwen3_coder":
        body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in _SHIP_VALUES.items())
        text = f"<tool_call>\n<function=ship>\n{body}</function>\n</tool_call>"
    else:
        body = "".join(f"<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>\n" for key, value in _SHIP_VALUES.items())
        text = f"<tool_call>ship\n{body}</tool_call>"
    content, calls, reason = _reads(_calling(parser, tool), text)
    assert (content, reason) == ("", "tool_calls")
    assert [(name, json.loads(arguments)) for name, arguments in calls] == [("ship", _SHIP_ARGUMENTS)]


@pytest.mark.parametrize("calling, text, content, arguments", [
    (GLM45, "<tool_call>get_forecast\n<arg_key>city</arg_key><arg_value>/a.py</arg_value>\n<arg_", "", {"city": "/a.py"}),
    (GLM45, "<tool_call>get_forecast\n<arg_key>city</arg_key><arg_value>Oslo</arg_value><arg_key>days</arg_", "", {"city": "Oslo"}),
    (GLM45, "<tool_call>get_forecast\n<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_c", "", {"city": "Oslo"}),
    (QWEN3_CODER, "<tool_call>\n<function=get_forecast>\n<parameter=city>\nParis\n</", "", {"city": "Paris"}),
    (QWEN3_CODER, "<tool_call>\n<function=get_forecast>\n<parameter=code>\na\n\n</param", "", {"code": "a\n"}),
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_', "", {"city": "Oslo"}),
], ids=["glm45_tag", "glm45_key", "glm45_closer", "qwen3_coder_value", "qwen3_coder_own_newline", "hermes"])
def test_a_tag_the_answer_ended_in_the_middle_of_is_dropped(calling, text, content, arguments):
    """An answer cut off (max_tokens, a stop string) inside a closing tag: the half tag came back
    as content ('<arg_'), or as the end of a value ("Paris\\n</"), where the stream had held it
    back as what may begin a tag."""
    got_content, calls, _ = _reads(calling, text)
    assert (got_content, [(name, json.loads(arguments_text)) for name, arguments_text in calls]) == (content, [(calls[0][0], arguments)])


@pytest.mark.parametrize("calling, text, runnable", [
    (QWEN3_CODER, "<tool_call>\n<function=get_forecast>\n<parameter=city>\nPar", False),  # cut inside a value
    (QWEN3_CODER, "<tool_call>\n<function=get_forecast>\n<parameter=city>\nParis\n</parameter>\n</function>", True),  # only </tool_call> missing
    (GLM45, "<tool_call>get_forecast\n<arg_key>city</arg_key><arg_value>Par", False),
    (GLM45, "<tool_call>get_forecast\n<arg_key>city</arg_key><arg_value>Paris</arg_value>\n<arg_key>un", False),  # between arguments
    (GLM45, "<tool_call>get_forecast\n<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>", True),
], ids=["qwen3_coder_value", "qwen3_coder_closed", "glm45_value", "glm45_between", "glm45_closed"])
def test_a_text_value_the_answer_ended_inside_is_no_call_to_run(calling, text, runnable):
    """A stop string matched inside a value: the whole read closed it as a shorter value, and the
    answer ended with tool_calls: an agent wrote a truncated file. Like a JSON call cut short
    (hermes ends with stop), it is no call to run."""
    for piece in PIECES:
        output = ToolCallOutput(calling)
        for start in range(0, len(text), piece):
            output.feed(text[start : start + piece])
        output.finish()
        assert len(output.calls) == 1
        assert (output.finish_reason == "tool_calls", len(output.runnable_calls)) == ((True, 1) if runnable else (False, 0)), piece


def test_every_api_leaves_a_call_none_may_run_out_of_its_whole_answer():
    """Chat's whole message listed a call cut short in tool_calls (finish_reason was stop, but
    agent loops read tool_calls), the Responses API marked it completed, Anthropic's message kept
    it as a tool_use, and gRPC's last message listed it: each told a client to run a call with arguments closed where the
    reading stopped ({"city": "Paris"} without the unit the model was writing)."""
    from router.anthropic_api.messages import MessageState
    from router.openai_api.responses import ChoiceState
    from router.output_stream import OutputChunk
    from router.responses_api.front_end import ResponseState

    text = '[get_forecast(city="Paris", unit=celsius)]'  # a non-literal: the reading stops there
    end = StreamEnd(reason="eos", prompt_tokens=1, completion_tokens=2, timing=TimingBreakdown())

    chat = ChoiceState(0, True, None, 1, tools=ToolCallOutput(PYTHONIC))
    chat.add(OutputChunk(token_ids=[1], text=text), None)
    chat.add(OutputChunk(token_ids=[2], text="", end=end), None)
    message = chat.whole()["message"]
    assert "tool_calls" not in message and chat.whole()["finish_reason"] == "stop"
    # Nor is its text lost: an answer whose calls none may run is its content, as written (vLLM's
    # answer where its tool parser cannot read the output); the content was empty.
    assert message["content"] == text
    hermes = '<tool_call>\n{"name": "get_forecast", "arguments": {"city": "Paris",}}\n</tool_call>'  # a trailing comma
    for answer, content in ((f"Checking.\n{hermes}", f"Checking.\n{hermes}"), (f"Both.\n{hermes}\n{hermes.replace(',}', '}')}", "Both.\n")):
        chat = ChoiceState(0, True, None, 1, tools=ToolCallOutput(_calling("hermes")))
        chat.add(OutputChunk(token_ids=[1], text=answer), None)
        chat.add(OutputChunk(token_ids=[2], text="", end=end), None)
        whole = chat.whole()["message"]
        assert whole["content"] == content, "the text around a runnable call stays as it was"
        assert len(whole.get("tool_calls", [])) == (0 if content == answer else 1)

    response = ResponseState("r", "m", {}, 0, ToolCallOutput(PYTHONIC))
    response.take(OutputChunk(token_ids=[1], text=text))
    response.take(OutputChunk(token_ids=[2], text="", end=end))
    assert [item["status"] for item in response.output if item["type"] == "function_call"] == ["incomplete"]

    anthropic = MessageState(ToolCallOutput(PYTHONIC))
    anthropic.take(OutputChunk(token_ids=[1], text=text))
    anthropic.take(OutputChunk(token_ids=[2], text="", end=end))
    assert "tool_use" not in [block["type"] for block in anthropic.content()] and anthropic.stop_reason(end) == "end_turn"

    from types import SimpleNamespace

    from router.api.pdserve.v1 import generation_pb2 as pb
    from router.grpc_chat import ChatAnswer
    from router.openai_api.protocol import Conversation

    grpc = ChatAnswer(Conversation("", PYTHONIC, None), SimpleNamespace(reasoning=None))
    grpc.take(OutputChunk(token_ids=[1], text=text))
    grpc.take(OutputChunk(token_ids=[2], text="", end=end))
    answer = pb.GenerateResponse(finish_reason=pb.FINISH_REASON_EOS)
    grpc.fill_end(answer, end)
    assert not answer.tool_calls and answer.finish_reason == pb.FINISH_REASON_EOS


def test_a_closer_inside_a_string_after_a_raw_newline_is_text_of_the_call():
    """A raw newline inside a string was taken for quotes gone wrong, so a "</tool_call>" later in
    the same string ended the call there (the file's rest came back as content)."""
    source = 'x = 1\ns = "</tool_call>"\n'
    written = json.dumps(source)[1:-1].replace("\\n", "\n")  # its quotes escaped, its newlines raw, as models write it
    text = "<tool_call>\n" + json.dumps({"name": "write_file", "arguments": {"path": "t.py", "content": "@"}}).replace("@", written) + "\n</tool_call>"
    content, calls, reason = _reads(_calling("hermes"), text)
    assert content == "" and reason == "tool_calls"
    assert [(name, json.loads(arguments)) for name, arguments in calls] == [("write_file", {"path": "t.py", "content": source})]
