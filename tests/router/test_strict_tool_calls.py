"""Strict tools under tool_choice auto, and a response format beside tools: the answer's grammar
holds a call's arguments to its tool's parameters in the model's own format (hermes, Llama 3's
JSON), and lets
an answer with a format call its tools instead of writing that format."""

from __future__ import annotations

import json

import llguidance
import pytest
import tokenizers

from engine.default_model_path import DEFAULT_MODEL_PATH
from engine.structured_output import TOOL_CALLS, StructuredOutput, check_grammar
from router.errors import InvalidArgumentError
from router.openai_api.tool_calls import read_tool_calling

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": True}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}},
]
ANSWER = {"type": "object", "properties": {"summary": {"type": "string"}}, "required": ["summary"]}


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


@pytest.fixture(scope="module")
def accepts():
    """Whether a constraint's grammar takes a text whole (under the built-in model's tokenizer)."""
    tokenizer_json = (DEFAULT_MODEL_PATH / "tokenizer.json").read_text()
    encode = tokenizers.Tokenizer.from_str(tokenizer_json)
    eos = json.loads((DEFAULT_MODEL_PATH / "config.json").read_text())["eos_token_id"]
    llg = llguidance.LLTokenizer(tokenizer_json, n_vocab=encode.get_vocab_size(True), eos_token=eos)

    def accepts(structured: StructuredOutput, text: str) -> bool:
        matcher = llguidance.LLMatcher(llg, structured.to_llguidance(), log_level=0)
        return matcher.consume_tokens(encode.encode(text, add_special_tokens=False).ids) and matcher.is_accepting()

    return accepts


def _auto(tools=TOOLS, parser="hermes"):
    return read_tool_calling({"tools": tools}, "", parser)


def test_a_strict_tools_calls_are_held_to_its_parameters_under_auto(accepts):
    """strict: true was accepted and not enforced under auto: a call missing a required key, with
    one of its own, or with a trailing comma reached the client (the openai SDK's parse helpers
    raise on it). Text around the calls stays free; a tool without strict takes any object."""
    constraint = _auto().constraint()
    assert constraint.kind == TOOL_CALLS and constraint.field == "tools"
    check_grammar(constraint)
    good = call("get_weather", '{"city": "Oslo", "unit": "c"}')
    assert accepts(constraint, "Checking.\n" + good)
    assert accepts(constraint, good + "\n" + call("get_time", '{"anything": [1, 2]}') + "\nDone.")
    assert accepts(constraint, "No call needed.")
    for bad in ('{"city": "Oslo"}', '{"city": "Oslo", "unit": "c", "extra": 1}', '{"city": "Oslo", "unit": "k"}', '{"city": "Oslo", "unit": "c",}'):
        assert not accepts(constraint, call("get_weather", bad)), bad
    assert not accepts(constraint, call("get_time", "[1, 2]"))  # arguments are an object
    assert not accepts(constraint, call("no_such_tool", "{}"))


def test_without_strict_tools_or_a_format_auto_is_unconstrained_and_other_formats_too():
    assert _auto(tools=[TOOLS[1]]).constraint() is None
    for parser in ("qwen3_coder", "mistral", "pythonic", "glm45"):  # (their calls are not held by a grammar here)
        assert _auto(parser=parser).constraint() is None
    with pytest.raises(InvalidArgumentError) as refused:
        _auto(tools=[{"type": "function", "function": {"name": "f", "strict": "yes"}}])
    assert refused.value.field == "tools[0].function.strict"


def test_llama3_json_calls_are_held_too_and_a_text_or_json_answer_stays_free(accepts):
    """Llama 3.x writes its calls as the whole answer, JSON objects joined by ";": a strict tool's
    arguments were not held there (only hermes' were). Text, or JSON that is no call, stays free."""
    from router.openai_api.tool_calls import ToolCalling
    from router.openai_api.tool_parsers import ToolCallOutput

    constraint = _auto(parser="llama3_json").constraint()
    check_grammar(constraint)
    weather = '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}'
    both = weather + '; {"name": "get_time", "parameters": {"zone": "UTC", "any": [1]}}'
    for text in (weather, both, "No call needed.", '{"answer": 42}', '[{"name": "x"}]', '{"name": "Alice", "age": 30}'):
        assert accepts(constraint, text), text
    for bad in ('{"city": "Oslo"}', '{"city": "Oslo", "unit": "k"}', '{"city": "Oslo", "unit": "c",}'):
        assert not accepts(constraint, '{"name": "get_weather", "parameters": ' + bad + "}"), bad
    # JSON naming no tool is an answer, as the reader takes it (not forced into a call).
    assert accepts(constraint, '{"name": "no_such_tool", "parameters": {}}')
    assert not accepts(constraint, ' {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}')
    reader = ToolCallOutput(ToolCalling(TOOLS, "auto", parser="llama3_json"))
    reader.feed(both)
    reader.finish()
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reader.runnable_calls] == [
        ("get_weather", {"city": "Oslo", "unit": "c"}), ("get_time", {"zone": "UTC", "any": [1]})]
    answer = StructuredOutput("json_schema", json.dumps(ANSWER), field="response_format.json_schema")
    with_format = _auto(tools=[TOOLS[1]], parser="llama3_json").constraint(answer)
    assert accepts(with_format, '{"summary": "Sunny."}') and accepts(with_format, '{"name": "get_time", "parameters": {"zone": "UTC"}}')
    assert not accepts(with_format, "Free text.")
    # One JSON value: a call after the answer would spoil the answer's JSON.
    assert not accepts(with_format, '{"summary": "Sunny."}; {"name": "get_time", "parameters": {"zone": "UTC"}}')


def test_a_response_format_beside_tools_lets_the_answer_call_them(accepts):
    """A json_schema answer format with tools under auto held the whole answer to the format: no
    tool could be called (the OpenAI Agents SDK's agents with an output type never called theirs).
    The answer is the format's JSON, or calls, and nothing else."""
    answer = StructuredOutput("json_schema", json.dumps(ANSWER), field="response_format.json_schema")
    constraint = _auto(tools=[TOOLS[1]]).constraint(answer)
    assert constraint.kind == TOOL_CALLS and constraint.field == "response_format.json_schema"
    assert accepts(constraint, '{"summary": "Sunny."}')
    assert accepts(constraint, call("get_time", '{"zone": "UTC"}'))
    assert not accepts(constraint, "Free text.")
    assert not accepts(constraint, '{"summary": "Sunny.", "more": 1}')
    assert _auto(tools=[TOOLS[1]]).constraint(StructuredOutput("regex", "[a-z]+")) is None  # kept as it is


def test_each_api_takes_the_format_in_beside_auto_tools():
    """Chat, the Responses API and Anthropic's output_config.format: one grammar, not a refusal
    or a format that leaves the tools uncallable."""
    from router.anthropic_api.protocol import _constraint
    from router.openai_api.protocol import Conversation
    from router.validation import GenerateInput

    calling = _auto(tools=[TOOLS[1]])
    request = GenerateInput(structured=StructuredOutput("json_schema", json.dumps(ANSWER), field="response_format"))
    Conversation("prompt", calling, None).apply(request, False)
    assert request.structured.kind == TOOL_CALLS
    body = {"output_config": {"format": {"type": "json_schema", "schema": ANSWER}}}
    assert _constraint(body, calling).kind == TOOL_CALLS
    forced = read_tool_calling({"tools": [TOOLS[1]], "tool_choice": "required"}, "", "hermes")
    with pytest.raises(InvalidArgumentError):
        _constraint(body, forced)


def test_a_strict_tool_beside_a_regex_answer_or_with_a_schema_no_grammar_holds_is_read_as_written():
    """A regex (choice, grammar) answer stays the client's: the strict tool's grammar replaced it
    without a word. A strict schema llguidance cannot hold a value to (uniqueItems, as pydantic
    writes a set) was a 400 once strict was held; it is read as written, as before."""
    regex = StructuredOutput("regex", "[0-9]+", field="structured_outputs.regex")
    assert _auto().constraint(regex) is None
    tags = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}}
    assert _auto(tools=[{"type": "function", "function": {"name": "tag", "parameters": tags, "strict": True}}]).constraint() is None


def test_a_llama3_answer_format_and_tools_with_definitions_compile_and_hold(accepts):
    """Pydantic models with a nested one carry "$defs" (the openai SDK's parse() and
    pydantic_function_tool both send them): nested in the one JSON grammar of an answer or a
    Llama 3 call, their "#/$defs/..." pointed at a root that had none, a 400 for a valid request."""
    address = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}
    answer = {"type": "object", "properties": {"home": {"$ref": "#/$defs/Address"}}, "required": ["home"],
              "additionalProperties": False, "$defs": {"Address": address}}
    lookup = {"type": "object", "properties": {"where": {"$ref": "#/$defs/Address"}}, "required": ["where"],
              "additionalProperties": False, "$defs": {"Address": {**address, "properties": {"city": {"enum": ["Oslo", "Rome"]}}}}}
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": lookup, "strict": True}}]
    format_ = StructuredOutput("json_schema", json.dumps(answer), field="response_format.json_schema")
    constraint = read_tool_calling({"tools": tools}, "", "llama3_json").constraint(format_)
    check_grammar(constraint)
    assert accepts(constraint, '{"home": {"city": "Paris"}}')
    assert accepts(constraint, '{"name": "lookup", "parameters": {"where": {"city": "Rome"}}}')
    assert not accepts(constraint, '{"name": "lookup", "parameters": {"where": {"city": "Paris"}}}'), "each branch keeps its own Address"
    assert not accepts(constraint, '{"home": {"town": "Paris"}}')


def test_parallel_tool_calls_false_holds_the_answer_to_one_call_where_calls_stand_alone(accepts):
    """parallel_tool_calls: false left the grammar open to more calls (the reader then dropped
    them, after the model had spent its tokens writing them). Where calls are the whole answer
    (Llama 3's JSON, or calls beside an answer format) the grammar takes one."""
    weather = '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}'
    time_call = '{"name": "get_time", "parameters": {"zone": "UTC"}}'
    single = read_tool_calling({"tools": TOOLS, "parallel_tool_calls": False}, "", "llama3_json").constraint()
    assert accepts(single, weather) and not accepts(single, f"{weather}; {time_call}")
    assert accepts(_auto(parser="llama3_json").constraint(), f"{weather}; {time_call}"), "parallel by default"
    answer = StructuredOutput("json_schema", json.dumps(ANSWER), field="response_format.json_schema")
    hermes = read_tool_calling({"tools": [TOOLS[1]], "parallel_tool_calls": False}, "", "hermes").constraint(answer)
    one = call("get_time", '{"zone": "UTC"}')
    assert accepts(hermes, one) and not accepts(hermes, one + "\n" + one)


def test_parallel_tool_calls_false_holds_a_hermes_answer_among_text_to_one_call(accepts):
    """Hermes calls among free text under parallel_tool_calls: false, with a strict tool's grammar
    in effect: it took any number (the reader dropped all but the first, after the model had
    written them). Now text may come before and after one call, but no second call can begin;
    the strict tool's arguments are still held. Without a strict tool no grammar is made for it
    (a constrained row is sampled on the host, never overlapped): the reader drops later calls."""
    weather = call("get_weather", '{"city": "Oslo", "unit": "c"}')
    clock = call("get_time", '{"zone": "UTC"}')
    single = read_tool_calling({"tools": TOOLS, "parallel_tool_calls": False}, "", "hermes").constraint()
    assert single is not None and single.kind == TOOL_CALLS
    check_grammar(single)
    assert accepts(single, "Let me look.\n" + clock) and accepts(single, clock + "\nDone.") and accepts(single, "No call needed.")
    assert not accepts(single, clock + "\n" + clock), "a second call"
    assert not accepts(single, clock + " and <tool_call> more"), "a call's opening after the call"
    assert accepts(single, weather) and not accepts(single, call("get_weather", '{"city": 1}')), "strict arguments held"
    assert not accepts(single, weather + "\n" + clock)
    assert read_tool_calling({"tools": [TOOLS[1]], "parallel_tool_calls": False}, "", "hermes").constraint() is None
    assert accepts(_auto().constraint(), weather + "\n" + clock), "parallel by default"
