"""Tool calls read from a model's text, whole and streamed in pieces of every size: the deltas
assemble into the same calls, and the content around them is what the client sees."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from router.errors import InvalidArgumentError
from router.openai_api.tool_calls import ToolCalling, detect_parser, flat_function_tool, mistral_id, read_tool_calling
from router.openai_api.tool_parsers import ToolCallDelta, ToolCallOutput, content_and_deltas

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "now", "parameters": {"type": "object", "properties": {}}}}


def _run(calling: ToolCalling, text: str, piece: int | random.Random):
    """Feed ``text`` in pieces of ``piece`` characters (a Random: 1-9 at random): (content, calls
    from the deltas, calls)."""
    output = ToolCallOutput(calling)
    parts, start = [], 0
    while start < len(text):
        size = piece if isinstance(piece, int) else piece.randint(1, 9)
        parts += output.feed(text[start : start + size])
        start += size
    parts += output.finish()
    content, deltas = content_and_deltas(parts)
    assembled: dict[int, dict] = {}
    for delta in deltas:
        body = delta.to_json()
        call = assembled.setdefault(body["index"], {"id": None, "name": None, "arguments": ""})
        if "id" in body:
            call["id"], call["name"] = body["id"], body["function"]["name"]
        call["arguments"] += body["function"]["arguments"]
    whole = [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in output.calls]
    return content, [assembled[i] for i in sorted(assembled)], whole, output.finish_reason


def _read(calls: list[dict]) -> list[tuple[str, object]]:
    """Each call's name and its arguments, parsed."""
    return [(c["name"], json.loads(c["arguments"])) for c in calls]


HERMES = ToolCalling([WEATHER, TIME], "auto", parser="hermes")
LLAMA = ToolCalling([WEATHER, TIME], "auto", parser="llama3_json")


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_hermes_calls_after_content_stream_into_the_same_calls(piece):
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    content, streamed, whole, reason = _run(HERMES, text, piece)
    assert content == "Let me check.\n"
    assert streamed == whole
    assert _read(whole) == [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {})]
    assert reason == "tool_calls"


def test_a_chunk_carries_each_call_once():
    """A call's name and its first arguments came as two deltas of one index in one chunk; the
    openai client merges them, but OpenAI and vLLM send an index once a chunk (older stream
    helpers took the second as a call without id or name)."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    output = ToolCallOutput(HERMES)
    _, deltas = content_and_deltas(output.feed(text) + output.finish())
    assert [d.index for d in deltas] == [0, 1]
    assert [(d.name, json.loads(d.arguments)) for d in deltas] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(d.id is not None for d in deltas)


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_without_parallel_tool_calls_only_the_first_call_an_auto_answer_writes_is_made(piece):
    """``parallel_tool_calls: false`` under auto: a model may still write several calls; as
    OpenAI and vLLM answer, the client gets the first, whole and streamed alike, and the content."""
    text = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
    single = read_tool_calling({"tools": [WEATHER, TIME], "parallel_tool_calls": False}, "", "hermes")
    content, streamed, whole, reason = _run(single, text, piece)
    assert content == "Checking.\n" and streamed == whole and reason == "tool_calls"
    assert _read(whole) == [("get_weather", {"city": "Oslo"})]
    assert len(_run(read_tool_calling({"tools": [WEATHER, TIME]}, "", "hermes"), text, piece)[2]) == 3


@pytest.mark.parametrize("piece", [1, 5, 1000])
def test_text_without_a_call_is_content_even_where_it_looks_like_a_marker(piece):
    text = "a < b and <tool_ use x"
    assert _run(HERMES, text, piece)[:2] == (text, [])
    assert _run(LLAMA, "Sure: {not a call", piece)[:2] == ("Sure: {not a call", [])


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_llama3_json_calls_with_and_without_the_python_tag(piece):
    for text in ('{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}',
                 '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}'):
        content, streamed, whole, reason = _run(LLAMA, text, piece)
        assert content == "" and streamed == whole and reason == "tool_calls"
        assert _read(whole) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    # Not a call after all: the text comes back as content; so does text after a call.
    assert _run(LLAMA, '{"city": 3}', piece)[:2] == ('{"city": 3}', [])
    content, _, whole, _ = _run(LLAMA, '{"name": "get_time", "parameters": {}} and that is all', piece)
    assert (content, [(c["name"], c["arguments"]) for c in whole]) == ("and that is all", [("get_time", "{}")])
    assert [c["arguments"] for c in _run(LLAMA, '{"name": "get_time", "parameters": null}', piece)[2]] == ["{}"]  # an object, as the API promises
    # An answer in JSON with a "name" is no call: not without arguments, nor naming no tool.
    for answer in ('{"name": "Alice", "age": 30}', '{"name": "get_time"}', '{"name": "Alice", "parameters": {}}'):
        assert _run(LLAMA, answer, piece)[:3] == (answer, [], [])


@pytest.mark.parametrize("piece", [1, 2, 5])
def test_whitespace_before_an_answer_settles_it_once_its_start_is_read(piece):
    """Blank lines before a call or content (models write them) wait, read once each, until the
    first characters tell which it is: the call comes whole, content keeps its whitespace."""
    pythonic = ToolCalling([WEATHER, TIME], "auto", parser="pythonic")
    for calling, call in ((LLAMA, '<|python_tag|>{"name": "get_time", "parameters": {}}'), (pythonic, "[get_time()]")):
        content, streamed, whole, reason = _run(calling, "\n \n\t " + call, piece)
        assert content == "" and streamed == whole and _read(whole) == [("get_time", {})] and reason == "tool_calls"
        assert _run(calling, "\n\n  <|python_ta Hi", piece)[:2] == ("\n\n  <|python_ta Hi", [])
        content, streamed, whole, _ = _run(calling, " " * 20_000 + "x", piece)
        assert content == " " * 20_000 + "x" and whole == []


def test_required_and_named_choices_have_grammars_and_parse_their_json():
    required = ToolCalling([WEATHER, TIME], "required", parallel=False)
    schema = json.loads(required.constraint().value)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Rome"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, schema)  # parallel_tool_calls false
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {"unit": "c"}}], schema)  # city is required
    content, streamed, whole, reason = _run(required, '[{"name": "get_weather", "parameters": {"city": "Rome"}}]', 4)
    assert content == "" and streamed == whole and json.loads(whole[0]["arguments"]) == {"city": "Rome"} and reason == "tool_calls"

    named = ToolCalling([WEATHER, TIME], "named", name="get_weather")
    assert json.loads(named.constraint().value) == WEATHER["function"]["parameters"]
    content, streamed, whole, reason = _run(named, '{"city": "Lima"}', 3)
    assert content == "" and streamed == whole and whole[0]["name"] == "get_weather" and reason is None


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_required_calls_stream_as_they_are_written_and_an_answer_cut_short_keeps_them(piece):
    """The required choice's list was read only once the answer ended: nothing streamed until
    then, and an answer cut short (max_tokens) lost its calls and their text altogether."""
    required = ToolCalling([WEATHER, TIME], "required")
    answer = '[{"name": "get_weather", "parameters": {"city": "Rome", "unit": "c"}}, {"name": "get_time", "parameters": {}}]'
    output = ToolCallOutput(required)
    early = output.feed(answer[:60])
    assert any(isinstance(part, ToolCallDelta) and part.name == "get_weather" for part in early), "the first call streams at once"
    content, streamed, whole, reason = _run(required, answer, piece)
    assert content == "" and streamed == whole and reason == "tool_calls"
    assert _read(whole) == [("get_weather", {"city": "Rome", "unit": "c"}), ("get_time", {})]
    content, streamed, whole, reason = _run(required, answer[:50], piece)  # max_tokens or a stop string inside the arguments
    assert content == "" and streamed == whole and [c["name"] for c in whole] == ["get_weather"]
    assert whole[0]["arguments"] == '{"city": "R'


def test_a_call_a_stop_string_cut_short_is_no_call_made_and_any_other_end_keeps_vllms_reason():
    """A stop string inside a call's arguments cut it short: "tool_calls" told the client to run
    it with arguments it cannot parse. Any other end keeps vLLM's "tool_calls", whatever the
    arguments are (a llama3_json call whose parameters are no object included)."""
    from router.output_stream import StreamEnd, TimingBreakdown

    stopped = StreamEnd(reason="stop", prompt_tokens=1, completion_tokens=9, timing=TimingBreakdown(), matched_stop="Ro")
    eos = StreamEnd(reason="eos", prompt_tokens=1, completion_tokens=9, timing=TimingBreakdown())
    cut = ToolCallOutput(ToolCalling([WEATHER, TIME], "required"))
    cut.feed('[{"name": "get_weather", "parameters": {"city": "')
    cut.finish()
    assert (cut.finish_reason_at(stopped), cut.finish_reason_at(eos)) == (None, "tool_calls")
    odd = ToolCallOutput(LLAMA)
    odd.feed('{"name": "get_time", "parameters": "now"}')
    odd.finish()
    assert [c["function"]["name"] for c in odd.calls] == ["get_time"] and odd.finish_reason_at(eos) == "tool_calls"


def test_required_choice_compiles_tools_whose_parameters_reference_their_definitions():
    """The openai SDK's tools from nested pydantic models keep the nested models under "$defs",
    referenced as "#/$defs/...": nested in the required choice's array schema, those references
    named nothing and every such request was refused (400). Discriminated unions come as oneOf,
    also refused. Both compile now, and the grammar's answers are the tools' own."""
    import openai
    import pydantic

    from engine.structured_output import check_grammar

    class Place(pydantic.BaseModel):
        city: str

    class Trip(pydantic.BaseModel):
        start: Place
        end: Place

    class Ask(pydantic.BaseModel):
        where: Place
        unit: str = pydantic.Field(json_schema_extra={"oneOf": [{"const": "c"}, {"const": "f"}]})

    tools = [openai.pydantic_function_tool(Trip), openai.pydantic_function_tool(Ask)]
    constraint = ToolCalling(tools, "required").constraint()
    check_grammar(constraint)
    schema = json.loads(constraint.value)
    jsonschema.validate([{"name": "Trip", "parameters": {"start": {"city": "Oslo"}, "end": {"city": "Rome"}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "Trip", "parameters": {"start": {"town": "Oslo"}, "end": {"city": "Rome"}}}], schema)
    check_grammar(ToolCalling(tools, "named", name="Ask").constraint())

    clash = json.loads(json.dumps(tools[1]))
    clash["function"]["name"] = "Other"
    clash["function"]["parameters"]["$defs"]["Place"]["properties"] = {"zip": {"type": "string"}}
    with pytest.raises(InvalidArgumentError) as refused:
        ToolCalling([tools[0], clash], "required").constraint()
    assert refused.value.field == "tools[1].function.parameters.$defs.Place"


@pytest.mark.parametrize(
    "body, field",
    [
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": ["x"]}}}]}, "tools[0].function.parameters.properties"),
    ],
)
def test_bad_tools_name_the_field(body, field):
    with pytest.raises(InvalidArgumentError) as raised:
        read_tool_calling(body, "<tool_call>", None)
    assert raised.value.field == field


def test_a_flat_tools_schema_is_checked_under_the_apis_own_names():
    """The Responses API's and Anthropic's tools are written flat; a schema whose properties are
    not an object (the readers look each argument up there) is named as the client wrote it."""
    for key in ("parameters", "input_schema"):
        for schema, field in (([], f"tools[2].{key}"), ({"properties": ["x"]}, f"tools[2].{key}.properties")):
            with pytest.raises(InvalidArgumentError) as raised:
                flat_function_tool({"name": "f", key: schema}, "tools[2]", key)
            assert raised.value.field == field


def test_auto_needs_a_parser_the_template_shows_or_the_config_names():
    assert detect_parser("... <tool_call> ...") == "hermes" and detect_parser("<|python_tag|>") == "llama3_json"
    with pytest.raises(InvalidArgumentError, match="tool_call_parser"):
        read_tool_calling({"tools": [WEATHER]}, "plain template", None)
    assert read_tool_calling({"tools": [WEATHER]}, "plain template", "llama3_json").parser == "llama3_json"
    assert read_tool_calling({"tools": [WEATHER], "tool_choice": "required"}, "plain template", None).choice == "required"


MISTRAL = ToolCalling([WEATHER, TIME], "auto", parser="mistral")


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_mistral_calls_in_both_of_its_formats(piece):
    for text in ('Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]',
                 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{}'):
        content, streamed, whole, reason = _run(MISTRAL, text, piece)
        assert content == "Sure." and streamed == whole and reason == "tool_calls"
        assert _read(whole) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in whole)  # the ids Mistral's templates take back
    # The end of sequence a kept special token brings, after the calls, is no part of them.
    for text in ('[TOOL_CALLS] [{"name": "get_time", "arguments": null}]</s>', '[TOOL_CALLS]get_time[ARGS]{}</s>'):
        assert [(c["name"], json.loads(c["arguments"])) for c in _run(MISTRAL, text, piece)[2]] == [("get_time", {})]
    assert _run(MISTRAL, "[TOOL_CALLS] not a call", piece)[:2] == ("[TOOL_CALLS] not a call", [])
    content, _, whole, _ = _run(MISTRAL, '[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]then no call', piece)
    assert (content, [c["name"] for c in whole]) == ("[TOOL_CALLS]then no call", ["get_time"])
    assert _run(MISTRAL, "a [TOOL_ or [TOOL", piece)[:2] == ("a [TOOL_ or [TOOL", [])


# A template that, as Mistral's do, refuses tool call ids other than 9 letters and digits.
MISTRAL_TEMPLATE = """{%- for message in messages %}
{%- if message.tool_calls %}[TOOL_CALLS]{% for call in message.tool_calls %}{% if call.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}{{ call.function.name }}[CALL_ID]{{ call.id }}[ARGS]{{ call.function.arguments | tojson }}{% endfor %}</s>
{%- elif message.role == 'tool' %}[TOOL_RESULTS]{{ message.tool_call_id }}[TOOL_CONTENT]{{ message.content }}[/TOOL_RESULTS]
{%- else %}[INST]{{ message.content }}[/INST]{% endif %}
{%- endfor %}"""


def test_an_agents_history_renders_with_null_content_and_calls_written_without_arguments():
    """Agents send back a turn of tool calls with ``content: null``, and a call that takes no
    arguments as ``""`` or ``null``: templates see empty content and empty arguments (as vLLM
    renders them), not "None", a 400, or a prompt with nothing after ``"arguments":``."""
    from router.openai_api.chat_template import ChatTemplate
    from router.openai_api.protocol import render_conversation

    concatenating = (  # Phi-4 and Granite add strings to content; Qwen3-Coder iterates arguments
        "{% for m in messages %}{{ '<' + m.role + '>' + m.content }}{% for c in m.tool_calls or [] %}"
        "[{{ c.function.name }}{% for k, v in c.function.arguments | items %} {{ k }}={{ v }}{% endfor %}]"
        "{% endfor %}{% endfor %}"
    )
    for arguments in ("", None, "null", " "):
        body = {"messages": [
            {"role": "user", "content": "Time?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "noon"},
        ]}
        assert render_conversation(body, ChatTemplate(concatenating, {}), [TIME]) == "<user>Time?<assistant>[get_time]<tool>noon"
    from router.openai_api.protocol import read_chat

    for arguments in (False, 0, [], {}):  # no JSON text: refused naming the call, not rendered as written
        body["messages"][1]["tool_calls"][0]["function"]["arguments"] = arguments
        with pytest.raises(InvalidArgumentError) as refused:
            read_chat(body, ChatTemplate(concatenating, {}))
        assert refused.value.field == "messages[1].tool_calls[0].function"



def test_a_mistral_template_gets_the_tool_call_ids_it_takes():
    """Clients send back ids of every shape (OpenAI's call_..., another server's): for a Mistral
    template each becomes 9 letters and digits, the call's and its result's alike."""
    from router.openai_api.chat_template import ChatTemplate
    from router.openai_api.protocol import render_conversation

    call_id = "call_0123456789abcdef"
    body = {"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "sunny"},
    ]}
    prompt = render_conversation(body, ChatTemplate(MISTRAL_TEMPLATE, {}), [WEATHER])
    short = mistral_id(call_id)
    assert len(short) == 9 and short.isalnum() and mistral_id("a1b2c3d4e") == "a1b2c3d4e"
    assert mistral_id("tool_a_weather_1") != mistral_id("tool_b_weather_1")  # no two ids made one
    assert f'[CALL_ID]{short}[ARGS]{{"city": "Oslo"}}' in prompt and f"[TOOL_RESULTS]{short}[TOOL_CONTENT]sunny" in prompt
    assert detect_parser(MISTRAL_TEMPLATE) == "mistral"


FORECAST = {"type": "function", "function": {"name": "get_forecast", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "hourly": {"type": "boolean"}, "options": {"type": "object"},
    "hours": {"type": "array", "items": {"type": "integer"}}, "note": {"type": ["string", "null"]}, "code": {"type": "string"}}}}}
QWEN3_CODER = ToolCalling([FORECAST, TIME], "auto", parser="qwen3_coder")
GLM45 = ToolCalling([FORECAST, TIME], "auto", parser="glm45")
PYTHONIC = ToolCalling([FORECAST, TIME], "auto", parser="pythonic")
# What each format's calls must come to: values typed by the tool's schema where the format
# writes them as text (a string parameter stays as written, digits and all).
FORECAST_ARGUMENTS = {"city": "Oslo", "days": 3, "hourly": True, "options": {"units": "metric"}, "hours": [6, 12], "note": None, "code": "0042"}


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_qwen3_coder_calls_are_typed_by_the_schema_and_stream_into_the_same_calls(piece):
    text = (
        "I'll look.\n<tool_call>\n<function=get_forecast>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
        "<parameter=hourly>\ntrue\n</parameter>\n<parameter=options>\n{\"units\": \"metric\"}\n</parameter>\n<parameter=hours>\n[6, 12]\n</parameter>\n"
        "<parameter=note>\nnull\n</parameter>\n<parameter=code>\n0042\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
    )
    content, streamed, whole, reason = _run(QWEN3_CODER, text, piece)
    assert content == "I'll look.\n" and streamed == whole and reason == "tool_calls"
    assert _read(whole) == [("get_forecast", FORECAST_ARGUMENTS), ("get_time", {})]
    # A multi-line string keeps its own newlines (one each side is the format's); a <function=...>
    # written without its <tool_call>, and a parameter the tool does not declare, are read too.
    code = "def f():\n    return 1\n"
    text = f"<function=get_forecast>\n<parameter=code>\n{code}\n</parameter>\n<parameter=extra>\n7\n</parameter>\n</function>"
    (call,) = _run(QWEN3_CODER, text, piece)[2]
    assert json.loads(call["arguments"]) == {"code": code, "extra": "7"}
    # A call the answer did not close is still a call; a block without a function is content.
    assert json.loads(_run(QWEN3_CODER, "<tool_call>\n<function=get_forecast>\n<parameter=days>\n5", piece)[2][0]["arguments"]) == {"days": 5}
    assert _run(QWEN3_CODER, "x <tool_call>no function</tool_call> y <functio", piece)[:2] == ("x <tool_call>no function</tool_call> y <functio", [])


@pytest.mark.parametrize("piece", [1, 5, 1000])
def test_glm45_calls_are_read_from_their_key_value_tags(piece):
    values = {"city": "Oslo", "days": "3", "hourly": "true", "options": '{"units": "metric"}', "hours": "[6, 12]", "note": "null", "code": "0042"}
    arguments = "".join(f"<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>\n" for key, value in values.items())
    text = f"Checking.<tool_call>get_forecast\n{arguments}</tool_call>\n<tool_call>get_time\n</tool_call>"
    content, streamed, whole, reason = _run(GLM45, text, piece)
    assert content == "Checking." and streamed == whole and reason == "tool_calls"
    assert _read(whole) == [("get_forecast", FORECAST_ARGUMENTS), ("get_time", {})]
    # A Hermes-style JSON block is no GLM call: it stays content.
    assert _run(GLM45, '<tool_call>{"name": "get_time"}</tool_call>', piece)[:2] == ('<tool_call>{"name": "get_time"}</tool_call>', [])


WRITE_FILE = {"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}}}
# What a long value may hold: starts of every format's tags (never a whole one), escapes, newlines.
_VALUE_PIECES = ["code ", "x", "\n", "<", "</", "</param", "</arg_v", "<arg_k", "<function", "</tool_c", "\n<", "\\", '"', "{", "}", "]", "é", "\t"]


def _write_file_answer(form: str, content: str) -> str:
    """Two write_file calls in a format's own form: the long ``content`` (before the path), then a short one."""
    if form == "qwen3_coder":  # the second <function=...> without its <tool_call>
        return ("Writing.\n<tool_call>\n<function=write_file>\n<parameter=content>\n" + content + "\n</parameter>\n<parameter=path>\na.py\n"
                "</parameter>\n</function>\n</tool_call>\n<function=write_file>\n<parameter=path>\nb.txt\n</parameter>\n<parameter=content>\nend\n</parameter>\n</function>")
    if form == "glm45":
        return ("Writing.<tool_call>write_file\n<arg_key>content</arg_key>\n<arg_value>" + content + "</arg_value>\n<arg_key>path</arg_key>\n"
                "<arg_value>a.py</arg_value>\n</tool_call><tool_call>write_file\n<arg_key>path</arg_key><arg_value>b.txt</arg_value>"
                "<arg_key>content</arg_key><arg_value>end</arg_value></tool_call>")
    first, second = ({"content": content, "path": "a.py"}, {"path": "b.txt", "content": "end"})
    if form.startswith("pythonic"):  # a plain string (Python's own escapes), or a triple-quoted one
        written = repr(content) if form == "pythonic" else _triple_quoted(content)
        return f'<|python_start|>[write_file(content={written}, path="a.py"),\n write_file(path=\'b.txt\', content="end")]<|python_end|>'
    if form == "mistral_named":  # newer Mistral models: each call after its own marker
        return "Writing.[TOOL_CALLS]write_file[ARGS]" + json.dumps(first, ensure_ascii=False) + "[TOOL_CALLS]write_file[ARGS]" + json.dumps(second)
    calls = [json.dumps({"name": "write_file", "arguments": arguments}, ensure_ascii=False) for arguments in (first, second)]
    return {"hermes": "Writing.\n" + "\n".join(f"<tool_call>\n{call}\n</tool_call>" for call in calls), "mistral": f"Writing.[TOOL_CALLS][{', '.join(calls)}]",
            "llama3_json": "; ".join(calls)}[form]


def _triple_quoted(content: str) -> str:
    """``content`` as a Python triple-quoted string, its newlines and quotes as written but for
    a quote that would end it (one before another, or the last character)."""
    body = content.replace("\\", "\\\\")
    return '"""' + "".join('\\"' if char == '"' and body[i + 1 : i + 2] in ('"', "") else char for i, char in enumerate(body)) + '"""'


@pytest.mark.parametrize("form", ["hermes", "qwen3_coder", "glm45", "llama3_json", "mistral", "mistral_named", "pythonic", "pythonic_triple"])
def test_a_long_value_read_on_token_by_token_is_what_a_whole_read_finds(form):
    """A call writing a long value is read on from where the last token left it (not read
    again whole with every token): fed in random pieces, its streamed arguments add up to its
    whole call, which is the one the answer read in one piece gives, values as written, and the
    call after it is read as well."""
    calling = ToolCalling([WRITE_FILE], "auto", parser=form.removesuffix("_named").removesuffix("_triple"))
    rng = random.Random(form)
    for _ in range(25):
        content = "".join(rng.choice(_VALUE_PIECES) for _ in range(rng.randint(1, 120)))
        text = _write_file_answer(form, content)
        at_once = _run(calling, text, len(text))
        assert _read(at_once[2]) == [("write_file", {"content": content, "path": "a.py"}), ("write_file", {"path": "b.txt", "content": "end"})], text
        content_seen, streamed, whole, _ = _run(calling, text, rng)
        assert content_seen == at_once[0] and [c["arguments"] for c in streamed] == [c["arguments"] for c in whole] == [c["arguments"] for c in at_once[2]], text


def test_a_mistral_marker_inside_a_string_starts_no_call():
    """name[ARGS]{...} calls: the next call is looked for after the arguments end, so a value
    that holds the marker stays in its call (split at every marker, it streamed a broken call)."""
    text = '[TOOL_CALLS]write_file[ARGS]{"content": "x[TOOL_CALLS]v[ARGS]{\\"d\\": 1}"}'
    for piece in (1, 3, len(text)):
        content, streamed, whole, _ = _run(ToolCalling([WRITE_FILE], "auto", parser="mistral"), text, piece)
        assert content == "" and streamed == whole
        assert _read(whole) == [("write_file", {"content": 'x[TOOL_CALLS]v[ARGS]{"d": 1}'})]


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_pythonic_calls_are_python_lists_of_keyword_calls(piece):
    call = 'get_forecast(city="Oslo", days=3, hourly=True, options={"units": "metric"}, hours=(6, 12), note=None, code=\'0042\')'
    for text in (f"[{call}, get_time()]", f"<|python_start|>[{call}, get_time()]<|python_end|>", f"[{call},\n get_time()]"):
        content, streamed, whole, reason = _run(PYTHONIC, text, piece)
        assert content == "" and streamed == whole and reason == "tool_calls"
        assert _read(whole) == [("get_forecast", FORECAST_ARGUMENTS), ("get_time", {})]
    # JSON's spellings are taken; anything that is not a list of keyword calls of literals is content.
    assert json.loads(_run(PYTHONIC, "[get_forecast(hourly=false, note=null)]", piece)[2][0]["arguments"]) == {"hourly": False, "note": None}
    for text in ("[1, 2] are the answers", 'Sure: [get_time()]', '[get_forecast("Oslo")]', "[get_forecast(days=x)]", "[get_forecast(**kw)]", "[]"):
        assert _run(PYTHONIC, text, piece)[:2] == (text, [])


_PYTHONIC_ANSWERS = [
    '[get_forecast(city="Oslo", days=3, hourly=True, options={"units": "metric"}, hours=(6, 12), note=None), get_time()]',
    '<|python_start|>[write_file(content="""a\\"b\n\'\'\'c""", path=r"x\\y"), a.b(x=-1.5e3, y=[1, {"k": (2,)}])]<|python_end|>',
    "[f(s='\\x41\\u00e9\\N{BULLET}\\101\\\n end', t='''x''' 'y')]",
    '[f(a="""x\r\ny"""), g(b=\'\\\r\n\')]',
]
_PYTHONIC_MARKS = list("[]()=,'\"\\ \nab1{}:#.-\r\x00\udc80\ufb01") + ['"""', "'''", "\\n", "\\x4", "\\N{", " # ,b=2\n"]


def test_a_pythonic_answer_reads_alike_however_it_is_cut(caplog):
    """Pythonic calls stream value by value: answers a model may write badly (quotes, escapes,
    brackets and line ends added, dropped, or cut off) are read into the same content and calls
    whether the text comes whole or in pieces of any size, and what was streamed is never taken
    back (that would be logged as a warning)."""
    rng = random.Random(7)
    for _ in range(300):
        text = rng.choice(_PYTHONIC_ANSWERS)
        for _ in range(rng.randint(0, 3)):
            at, edit = rng.randrange(len(text) + 1), rng.random()
            text = text[:at] + rng.choice(_PYTHONIC_MARKS) + text[at:] if edit < 0.4 else text[:at] + text[at + 1 :] if edit < 0.8 else text[:at]
        reads = []
        for piece in (1, 3, rng, max(len(text), 1)):
            content, streamed, whole, _ = _run(PYTHONIC, text, piece)
            assert streamed == whole, text
            reads.append((content, [(call["name"], call["arguments"]) for call in whole]))
        assert all(read == reads[-1] for read in reads), text
    assert not [record for record in caplog.records if record.levelname == "WARNING"]


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_pythonic_calls_are_read_as_python_reads_them(piece):
    """Comments, names Python normalises, and characters no Python source holds: streamed calls
    never say what the whole answer's parse does not (a comment's text once streamed as an
    argument, or as a call of its own), and nothing raises."""
    for text, calls in [
        ("[f(a=1 # ,b=2\n)]", [("f", {"a": 1})]),
        ("[f(a=1 # ), g(b=2)\n)]", [("f", {"a": 1})]),
        ("[f(a='x', # the city\n b=2)]", [("f", {"a": "x", "b": 2})]),
        ("[\ufb01nd(a\ufb01=1)]", [("find", {"afi": 1})]),
    ]:
        content, streamed, whole, _ = _run(PYTHONIC, text, piece)
        assert (content, streamed, _read(whole)) == ("", whole, calls), text
    for text in ["[f(a='x\udc80y')]", "[f(a='x\x00y')]"]:  # no Python: the call as far as it read (closed), the rest content
        content, streamed, whole, reason = _run(PYTHONIC, text, piece)
        assert (content, [(c["name"], c["arguments"]) for c in whole]) == (text[3:], [("f", '{"a": "x"}')]) and streamed == whole
        assert reason is None  # a call cut short is none to run


def test_a_hermes_closer_inside_the_calls_strings_is_text_of_the_call():
    """An agent writing code about tool markup: the block ends at the closer after the JSON, not
    at one inside a string (the call was cut there: arguments no JSON, the rest as content)."""
    code = 'print("</tool_call>")\nx = "\\"</tool_call>"'
    call = json.dumps({"name": "write_file", "arguments": {"path": "a.py", "content": code}})
    text = f"Writing.\n<tool_call>\n{call}\n</tool_call>\nDone."
    for piece in (1, 3, 7, len(text)):
        content, streamed, whole, reason = _run(ToolCalling([WRITE_FILE], "auto", parser="hermes"), text, piece)
        assert content == "Writing.\n" + "\nDone." and streamed == whole and reason == "tool_calls"
        assert _read(whole) == [("write_file", {"path": "a.py", "content": code})]


@pytest.mark.parametrize("text", [
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par}}\n</tool_call>\n<tool_call>\n'
    '{"name": "get_time", "arguments": {}}\n</tool_call>\nDone.',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "a 5" screen"}}</tool_call> and more',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "x</tool_call> then the answer ends',
    # The next quote on the same line is no end of a string: not followed by , : } or ].
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Par}}</tool_call><tool_call>{"name": "get_time", "arguments": {}}</tool_call>Done.',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Par}}</tool_call> I said "hi" to you.',
])
def test_a_hermes_block_whose_quotes_are_off_ends_at_its_first_closer_as_ever(text, monkeypatch):
    """A closer inside a string is text of the call only while the string is one: a quote the
    model left out (a raw newline inside the "string", or the answer ending in it) and the block
    ends at its first closer, as it did before closers were looked for outside strings (else the
    next call and the content after it were swallowed); nothing past that closer was streamed."""
    from router.openai_api.tool_blocks import HermesReader

    def read(piece):
        content, streamed, whole, reason = _run(HERMES, text, piece)
        assert streamed == whole
        return content, [(call["name"], call["arguments"]) for call in whole], reason  # (ids are drawn anew)

    results = {}
    for json_body in (False, True):
        monkeypatch.setattr(HermesReader, "json_body", json_body)
        results[json_body] = [read(piece) for piece in (1, 3, 7, len(text))]
    assert results[True] == results[False]


@pytest.mark.parametrize("piece", [1, 1000])
def test_a_hermes_block_that_is_no_call_comes_back_as_content(piece):
    text = 'Here: <tool_call>{"city": "Oslo"}</tool_call> and <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    content, streamed, whole, _ = _run(HERMES, text, piece)
    assert content == 'Here: <tool_call>{"city": "Oslo"}</tool_call> and ' and [c["name"] for c in whole] == ["get_time"]


def test_each_format_is_recognised_in_its_template_and_vllm_names_are_taken():
    qwen3_coder = "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>"
    glm = "<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n</tool_call>"
    pythonic = "you MUST put it in the format of [func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]"
    assert [detect_parser(t) for t in (qwen3_coder, glm, pythonic)] == ["qwen3_coder", "glm45", "pythonic"]
    for alias, name in (("qwen3_xml", "qwen3_coder"), ("llama4_pythonic", "pythonic"), ("llama4_json", "llama3_json")):
        assert read_tool_calling({"tools": [WEATHER]}, "plain template", alias).parser == name
    from router.config import RouterConfig

    with pytest.raises(ValueError, match="tool_call_parser"):
        RouterConfig(tool_call_parser="qwen4").validate()
    RouterConfig(tool_call_parser="glm45").validate()


@pytest.mark.parametrize(
    "calling, text",
    [
        (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'),
        (QWEN3_CODER, "<tool_call>\n<function=get_forecast>\n<parameter=code>\n%s\n</parameter>\n</function>\n</tool_call>"),
        (GLM45, "<tool_call>get_forecast\n<arg_key>code</arg_key>\n<arg_value>%s</arg_value>\n</tool_call>"),
        (LLAMA, '{"name": "get_weather", "parameters": {"city": "%s"}}'),
        (MISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"city": "%s"}'),
        (MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "%s"}}]'),
        (PYTHONIC, '[get_weather(city="%s")]'),
        (PYTHONIC, '[get_weather(city="""%s""")]'),
    ],
    ids=["hermes", "qwen3_coder", "glm45", "llama3_json", "mistral", "mistral_json_list", "pythonic", "pythonic_triple_quoted"],
)
def test_a_call_streams_its_name_first_then_its_arguments_as_they_are_written(calling, text):
    """What an agent writing a file sees: the call at once, the file's text growing with the answer."""
    value = "line one\nline two\n" * 4
    escaped = json.dumps(value)[1:-1]
    json_format = calling not in (QWEN3_CODER, GLM45)
    written = escaped if json_format and '"""' not in text else value  # JSON (and Python) escaped, or the text itself
    answer = text % written
    value_end = answer.index(written) + len(written) - 1
    output = ToolCallOutput(calling)
    name_at, arguments, shown_at_value_end = None, "", None
    for position, char in enumerate(answer):
        content, deltas = content_and_deltas(output.feed(char))
        assert content == ""
        for delta in deltas:
            name_at = position if delta.name and name_at is None else name_at
            arguments += delta.arguments
        if position == value_end:
            shown_at_value_end = arguments
    content, deltas = content_and_deltas(output.finish())
    arguments += "".join(delta.arguments for delta in deltas)
    # Named before its arguments came (a Python call with its value's first character: '"' may open '"""').
    assert name_at is not None and name_at < answer.index(written) + (calling is PYTHONIC)
    assert json.loads(arguments) == json.loads(output.calls[0]["function"]["arguments"]) and arguments == output.calls[0]["function"]["arguments"]
    assert json.loads(arguments)[("city" if json_format else "code")] == value
    assert escaped[:-4] in shown_at_value_end  # all but the value's last characters were out before it ended


# Answers a model may write badly: read the same whether the text comes whole or a character at
# a time, and nothing in them is lost (what is no call comes back as content).
ODD_ANSWERS = [
    (GLM45, "<tool_call>get_time\nsorry</tool_call>", "<tool_call>get_time\nsorry</tool_call>", []),
    (GLM45, "<tool_call>get_forecast\n<arg_key>code</arg_key><arg_value>v1\n<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>",
     "", [("get_forecast", {"code": "v1\n", "days": 3})]),  # </arg_value> left out: the next key ends the value
    (GLM45, "<tool_call>get_time\n<arg_key>a</arg_key><arg_value>1</arg_value> and more</tool_call>", "and more", [("get_time", {"a": "1"})]),
    (QWEN3_CODER, "<tool_call><function=get_forecast><parameter=code>a<function=get_time></function></tool_call>",
     "", [("get_forecast", {"code": "a"}), ("get_time", {})]),
    (QWEN3_CODER, "<tool_call>Let me\n<function=get_time></function> and more</tool_call>", "Let me\nand more", [("get_time", {})]),
    (QWEN3_CODER, "<tool_call><function=get_time></function><function=>x</function></tool_call>", "<function=>x</function>", [("get_time", {})]),
    (HERMES, '<tool_call>{"name": "get_time", "arguments": {}}\n{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
     "", [("get_time", {}), ("get_weather", {"city": "Oslo"})]),
    (HERMES, '<tool_call>{"name": "get_time", "arguments": {}} oops</tool_call>', "oops", [("get_time", {})]),
    (HERMES, '<tool_call>{"name": "get_time", "arguments": null}</tool_call>', "", [("get_time", {})]),
    (QWEN3_CODER, "<function=get_forecast><parameter=days>NaN</parameter><parameter=hours>1e999</parameter></function>",
     "", [("get_forecast", {"days": "NaN", "hours": "1e999"})]),  # no JSON numbers: kept as written
    (QWEN3_CODER, "<function=get_forecast><parameter=hours>[1e999]</parameter></function>", "", [("get_forecast", {"hours": "[1e999]"})]),
    (PYTHONIC, "[get_forecast(days=1e999)]", "[get_forecast(days=1e999)]", []),
    (PYTHONIC, "[get_forecast(days=1, days=2)]", "[get_forecast(days=1, days=2)]", []),  # no call until what follows a value is read
    # Calls read before text that is no call stay calls (they were streamed); the text is content.
    (PYTHONIC, "[get_time(), get_forecast(days=x)]", "get_forecast(days=x)]", [("get_time", {})]),
    (PYTHONIC, "[get_time()] and more<|python_end|>", "and more", [("get_time", {})]),
]


@pytest.mark.parametrize("calling, text, content, calls", ODD_ANSWERS, ids=[f"{c.parser}-{i}" for i, (c, *_) in enumerate(ODD_ANSWERS)])
def test_odd_answers_read_alike_whole_and_streamed_and_lose_nothing(calling, text, content, calls):
    for piece in (1, len(text)):
        got_content, streamed, whole, _ = _run(calling, text, piece)
        assert streamed == whole
        assert (got_content, _read(whole)) == (content, calls)


_DEEP = "[" * 3000 + "]" * 3000  # past what Python's JSON parser follows (RecursionError inside it)


@pytest.mark.parametrize(
    "calling, text, name, arguments",
    [
        (HERMES, '<tool_call>{"name": "get_time", "arguments": {"a": %s}}</tool_call>' % _DEEP, "get_time", '{"a": %s}' % _DEEP),
        (LLAMA, '{"name": "get_time", "parameters": {"a": %s}}' % _DEEP, "get_time", '{"a": %s}' % _DEEP),
        (MISTRAL, '[TOOL_CALLS][{"name": "get_time", "arguments": {"a": %s}}]' % _DEEP, "get_time", '{"a": %s}' % _DEEP),
        (QWEN3_CODER, "<tool_call><function=get_forecast><parameter=days>%s</parameter></function></tool_call>" % _DEEP, "get_forecast",
         json.dumps({"days": _DEEP})),
    ],
    ids=lambda value: value.parser if isinstance(value, ToolCalling) else "",
)
def test_a_call_whose_arguments_nest_thousands_deep_keeps_them_as_written(calling, text, name, arguments):
    """A model may write any nesting: the call is read, its arguments kept as the model wrote
    them (too deep to type by the schema), and no reader raises (it once took the stream down)."""
    for piece in (1000, len(text)):
        content, streamed, whole, _ = _run(calling, text, piece)
        assert content == "" and streamed == whole
        assert [(c["name"], c["arguments"]) for c in whole] == [(name, arguments)]


def test_content_after_a_call_in_the_same_chunk_comes_after_it():
    """A chunk may hold a call's end and the text after it (several tokens a message): the
    parts keep the answer's order, and the Anthropic and Responses streams build their blocks
    in it (the text after the call opens its own block)."""
    from router.anthropic_api.messages import MessageState
    from router.output_stream import OutputChunk
    from router.responses_api.front_end import ResponseState

    chunks = ['Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os', 'lo"}}\n</tool_call>\nDone.']
    output = ToolCallOutput(HERMES)
    parts = output.feed(chunks[0]) + output.feed(chunks[1]) + output.finish()
    assert [p if isinstance(p, str) else (p.name, p.arguments) for p in parts] == [
        "Sure.", ("get_weather", ""), (None, '{"city": "Os'), (None, 'lo"}'), "\nDone."]
    message = MessageState(ToolCallOutput(HERMES))
    for chunk in chunks:
        message.take(OutputChunk(token_ids=[1], text=chunk))
    assert [(b["type"], b.get("text") or b.get("partial")) for b in message.blocks] == [
        ("text", "Sure."), ("tool_use", '{"city": "Oslo"}'), ("text", "\nDone.")]
    response = ResponseState("r", "m", {}, 0, ToolCallOutput(HERMES))
    for chunk in chunks:
        response.take(OutputChunk(token_ids=[1], text=chunk))
    assert [(item["type"], item.get("arguments") or item["content"][0]["text"]) for item in response.output] == [
        ("message", "Sure."), ("function_call", '{"city": "Oslo"}'), ("message", "\nDone.")]


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_text_a_qwen3_coder_block_holds_before_its_call_comes_before_the_call(piece):
    """Qwen3-Coder may write text inside <tool_call> before <function=...>: it is content, and goes
    out before the call (it came after it, so an Anthropic or Responses answer put the text's
    block after the call's)."""
    text = "<tool_call>\nLet me look.\n<function=get_time>\n</function> done</tool_call>"
    output = ToolCallOutput(QWEN3_CODER)
    parts = [part for start in range(0, len(text), piece) for part in output.feed(text[start : start + piece])] + output.finish()
    content_at = [index for index, part in enumerate(parts) if isinstance(part, str)]
    call_at = next(index for index, part in enumerate(parts) if isinstance(part, ToolCallDelta))
    assert "".join(parts[i] for i in content_at) == "Let me look.\ndone"
    assert "".join(parts[i] for i in content_at if i < call_at) == "Let me look.\n"
