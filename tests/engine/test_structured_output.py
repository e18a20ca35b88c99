"""Structured outputs in the engine: sampled answers match their grammar, greedy ones are the
model's own constrained argmax (a transformers loop masked by an llguidance matcher of its
own), and speculation, a resumed stream and the logit adjustments keep both true."""

from __future__ import annotations

import json
import string
import re

import jsonschema
import llguidance
import pytest
import tokenizers
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.errors import InvalidRequestError
from engine.speculation import SpeculativeConfig
from engine.structured_output import StructuredOutput
from engine.thinking import Thinking
from tests.checkpoints import random_prompts

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(e2e_model):
    return LLMEngine(e2e_model.path, EngineConfig(num_kv_blocks=256, num_threads=1))


@pytest.fixture(scope="module")
def decode(e2e_model):
    tokenizer = tokenizers.Tokenizer.from_file(str(e2e_model.path / "tokenizer.json"))
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def _generate(engine, prompt, **fields):
    (completion,) = engine.generate([prompt], SamplingParams(**fields))
    return completion


PUNCTUATED = ["<yes>", "a < b >= c", "".join(sorted(string.punctuation))]
# Says nothing of other properties or items: it takes none (vLLM's default engine, xgrammar in
# strict mode, and OpenAI's strict schemas); a sampled object ran on in keys of its own.
SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 99}
OPEN_SCHEMA = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string", "maxLength": 6}, "pair": {"type": "array", "prefixItems": [SMALL_INT, SMALL_INT]},
    "inner": {"type": "object", "properties": {"x": SMALL_INT}}}}


def _only_named(text: str) -> bool:
    answer = json.loads(text)
    jsonschema.validate(answer, OPEN_SCHEMA)
    return set(answer) <= {"name", "pair", "inner"} and set(answer.get("inner", {})) <= {"x"} and len(answer.get("pair", [])) <= 2
CASES = [
    (StructuredOutput("json_schema", json.dumps(SCHEMA)), lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
    (StructuredOutput("json_object"), lambda text: isinstance(json.loads(text), dict)),
    (StructuredOutput("regex", r"[a-c]{2,4}-[0-9]{3}"), lambda text: re.fullmatch(r"[a-c]{2,4}-[0-9]{3}", text) is not None),
    (StructuredOutput("choice", json.dumps(["red pill", "blue pill", "café (au lait)"])), lambda text: text in {"red pill", "blue pill", "café (au lait)"}),
    (StructuredOutput("grammar", 'root ::= "x=" [0-9]+ ";"'), lambda text: re.fullmatch(r"x=[0-9]+;", text) is not None),
    # Every ASCII punctuation character stands for itself ("<" and ">" escaped were word boundaries: refused).
    (StructuredOutput("choice", json.dumps(PUNCTUATED)), lambda text: text in PUNCTUATED),
    (StructuredOutput("json_schema", json.dumps(OPEN_SCHEMA)), _only_named),
]


@pytest.mark.parametrize("structured,valid", CASES, ids=[case[0].kind for case in CASES])
def test_every_sampled_answer_matches_its_grammar_and_ends_there(engine, e2e_model, decode, structured, valid):
    prompts = random_prompts([12, 30, 5, 21], e2e_model.vocab_size, seed=3)
    for seed in range(6):
        prompt = prompts[seed % len(prompts)]
        # json_object has no bound on its length: a random model may still be writing at max_tokens.
        completion = _generate(engine, prompt, temperature=1.0, seed=seed, max_tokens=120, structured=structured)
        text = decode(completion.token_ids)
        if structured.kind == "json_object" and completion.finish_reason.value == "length":
            continue
        assert completion.finish_reason.value == "eos", (completion.finish_reason, text)
        assert valid(text), text


# Schemas whose objects are composed of parts: a value their parts allow together is allowed
# (closing each part, as strictness first did, forbade the others' properties or made a
# required one unsatisfiable), and a plain object stays closed.
_PART_A = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
_PART_B = {"type": "object", "properties": {"b": {"type": "integer"}}}
COMPOSED = [
    ({"$defs": {"A": _PART_A, "B": _PART_B}, "allOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}]}, {"a": 1, "b": 2}),
    ({"type": "object", "properties": {"common": {"type": "string"}}, "anyOf": [{"properties": {"x": {"type": "integer"}}, "required": ["x"]}]},
     {"common": "c", "x": 1}),
    ({"allOf": [{"properties": {"common": {"type": "string"}}}, {"anyOf": [{"properties": {"kind": {"const": "k"}, "x": {"type": "integer"}}}]}]},
     {"common": "c", "kind": "k", "x": 1}),
    ({"$defs": {"Base": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}}, "$ref": "#/$defs/Base",
      "properties": {"name": {"type": "string"}}}, {"id": 1, "name": "n"}),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}, {"a": 1, "b": 2}),
    ({"$defs": {"A": _PART_A, "B": _PART_B}, "allOf": [{"properties": {"x": {"type": "string"}}, "required": ["x"]},
                                                      {"anyOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}]}]}, {"x": "s", "a": 1}),
    ({"$defs": {"Root": {"type": "object", "properties": {"a": {"type": "integer"}}}, "Base": {"$ref": "#/$defs/Root"}},
      "$ref": "#/$defs/Base", "properties": {"x": {"type": "string"}}}, {"a": 1, "x": "s"}),
    ({"type": "object", "required": ["id"], "anyOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]},
                                                      {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]}, {"a": 2, "id": 1}),
    ({"patternProperties": {"^x_": {}}, "oneOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]}]}, {"a": 1, "x_1": 2}),
]
COMPOSED_IDS = ["allOf_refs", "base_and_anyOf", "allOf_with_union", "ref_beside_properties", "required_unlisted", "allOf_with_union_of_refs",
                "ref_alias_chain", "base_requires_beside_union", "pattern_properties_beside_union"]
# pydantic's shape: a nested model behind Optional (anyOf [$ref, null]) is still closed.
PYDANTIC = {"$defs": {"Addr": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "title": "Addr"}},
            "type": "object", "title": "User", "properties": {"addr": {"anyOf": [{"$ref": "#/$defs/Addr"}, {"type": "null"}], "default": None}}}


@pytest.fixture(scope="module")
def accepts(e2e_model):
    """Whether a json_schema's grammar takes a value (its JSON as json.dumps writes it)."""
    tokenizer_json = (e2e_model.path / "tokenizer.json").read_text()
    encode = tokenizers.Tokenizer.from_str(tokenizer_json)
    eos = json.loads((e2e_model.path / "config.json").read_text())["eos_token_id"]
    llg = llguidance.LLTokenizer(tokenizer_json, n_vocab=e2e_model.vocab_size, eos_token=eos)

    def accepts(schema, value) -> bool:
        matcher = llguidance.LLMatcher(llg, StructuredOutput("json_schema", json.dumps(schema)).to_llguidance())
        return not matcher.is_error() and matcher.consume_tokens(encode.encode(json.dumps(value), add_special_tokens=False).ids) and matcher.is_accepting()

    return accepts


@pytest.mark.parametrize("schema,value", COMPOSED, ids=COMPOSED_IDS)
def test_a_schema_composed_of_parts_takes_what_the_parts_allow_together(accepts, schema, value):
    assert accepts(schema, value)
    assert not accepts(_PART_A, {"a": 1, "b": 2}), "a plain object still takes no property it does not name"
    assert accepts(PYDANTIC, {"addr": {"city": "Oslo"}}) and not accepts(PYDANTIC, {"addr": {"city": "Oslo", "zip": 1}})


_NAMED = {"type": "object", "properties": {"x": {"type": "integer"}}}
# $refs to the root, to a property, to an escaped definition name, with nullable beside: each
# object still takes no property it does not name (such schemas were left open as a whole).
REFERENCED = [
    ({"type": "object", "properties": {"name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#"}}}},
     {"name": "a", "children": [{"name": "b"}]}, {"name": "a", "x": 1}),
    ({"type": "object", "properties": {"billing": _NAMED, "shipping": {"$ref": "#/properties/billing"}}},
     {"billing": {"x": 1}, "shipping": {"x": 2}}, {"shipping": {"x": 2, "y": 3}}),
    ({"$defs": {"a/b": _NAMED}, "type": "object", "properties": {"p": {"$ref": "#/$defs/a~1b"}}}, {"p": {"x": 1}}, {"p": {"x": 1, "zz": 1}}),
    ({"$defs": {"A": _NAMED}, "type": "object", "properties": {"p": {"$ref": "#/$defs/A", "nullable": True}}}, {"p": {"x": 1}}, {"p": {"x": 1, "y": 2}}),
]


@pytest.mark.parametrize("schema,good,bad", REFERENCED, ids=["root", "property", "escaped_definition", "nullable_beside"])
def test_objects_named_by_any_local_ref_are_closed_too(accepts, schema, good, bad):
    assert accepts(schema, good) and not accepts(schema, bad)


def test_closing_leaves_alone_what_is_no_plain_object_schema():
    """A property named like a keyword, a dependentSchemas map, a $ref that does not name a root
    definition (the whole schema then stays as written)."""
    from engine.structured_output import closed_objects

    dependent = {"properties": {"items": {}, "x": {}}, "dependentSchemas": {"items": {"properties": {"n": {}}}}}
    assert closed_objects(dependent) == dependent
    pointer = {"type": "object", "properties": {"p": {"type": "object", "properties": {"a": {}}}}, "allOf": [{"$ref": "#/properties/p"}]}
    assert closed_objects(pointer) == pointer
    # Below an $id, a $ref's "#" is that resource's root: read from this one's, the wrong place was closed.
    resource = {"$defs": {"A": {"$id": "https://example.com/a", "type": "object", "properties": {"k": {"$ref": "#/$defs/C"}},
                                "$defs": {"C": {"type": "object", "properties": {"x": {}}}}}},
                "type": "object", "properties": {"r": {"$ref": "#/$defs/A"}}}
    assert closed_objects(resource) == resource
    # A property named "$id", or a default holding one, is no resource: closed as any other.
    dbref = {"type": "object", "properties": {"$ref": {"type": "string"}, "$id": {"type": "string"}}, "required": ["$id"]}
    assert closed_objects(dbref)["additionalProperties"] is False
    named = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"x": {}}}, "items": {"type": "string"}}}
    assert closed_objects(named)["properties"]["items"] == {"type": "string"}
    assert closed_objects(named)["properties"]["properties"]["additionalProperties"] is False


def _reference_constrained_greedy(hf_model, tokenizer_json: str, vocab_size: int, eos: int, structured, prompt, max_tokens, adjust=None, thinking=None):
    """transformers' logits, masked by a fresh llguidance matcher, argmax; ``adjust(logits,
    output)`` changes the logits first (the request's adjustments, written from vLLM's formulas).
    ``thinking`` (engine.thinking.Thinking's fields): the output thinks first, from its first
    token (``inside``: an opener written first is not counted) or only if that one is the
    opener, until the closer; the grammar holds for the answer
    after it (and a first token may be the opener); past ``budget`` thinking tokens the closer is
    forced."""
    tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
    matcher = None if structured is None else llguidance.LLMatcher(tokenizer, structured.to_llguidance())
    phase = "answer" if thinking is None else "inside" if thinking.inside or thinking.opener is None else "before"
    inside = 0
    output: list[int] = []
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + output])).logits[0, -1].float()
        if adjust is not None:
            logits = adjust(logits, output)
        if matcher is not None and phase != "inside":
            mask = matcher.compute_logit_bias()  # one byte per token: 0 forbidden, 200 allowed
            allowed = torch.tensor(list(mask[:vocab_size]), dtype=torch.uint8) > 0
            if phase == "before":
                allowed[thinking.opener] = True
            logits = logits.masked_fill(~allowed, float("-inf"))
        if phase == "inside" and thinking.budget is not None and inside >= thinking.budget:
            logits = torch.full_like(logits, float("-inf")).index_fill_(0, torch.tensor([thinking.closer]), 0.0)
        token = int(logits.argmax())
        output.append(token)
        if phase == "before":
            phase = "inside" if token == thinking.opener else "answer"
            if phase == "inside":
                continue
        elif phase == "inside":
            phase = "answer" if token == thinking.closer else "inside"
            inside += token != thinking.closer and not (output == [thinking.opener])  # a leading opener is no thinking
            continue
        if matcher is not None:
            assert matcher.consume_token(token)
            if matcher.is_stopped():
                break
    return output


@pytest.fixture(scope="module")
def reference(e2e_model):
    text = (e2e_model.path / "tokenizer.json").read_text()
    config = json.loads((e2e_model.path / "config.json").read_text())
    eos = config["eos_token_id"]

    def run(structured, prompt, max_tokens, adjust=None, thinking=None):
        return _reference_constrained_greedy(e2e_model.hf_model, text, e2e_model.vocab_size, eos, structured, prompt, max_tokens, adjust, thinking)

    return run


def test_greedy_constrained_output_is_the_masked_argmax_with_and_without_speculation(e2e_model, engine, reference):
    structured = StructuredOutput("json_schema", json.dumps(SCHEMA))
    speculating = LLMEngine(
        e2e_model.path, EngineConfig(num_kv_blocks=256, num_threads=1, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    )
    for prompt in random_prompts([9, 25], e2e_model.vocab_size, seed=8):
        expected = reference(structured, prompt, 80)
        assert _generate(engine, prompt, temperature=0.0, max_tokens=80, structured=structured).token_ids == expected
        assert _generate(speculating, prompt, temperature=0.0, max_tokens=80, structured=structured).token_ids == expected
    assert speculating.scheduler.num_draft_tokens > 0, "drafts were proposed and checked against the grammar"


def test_a_resumed_stream_continues_its_grammar_from_the_tokens_it_produced(e2e_model, engine, reference):
    structured = StructuredOutput("json_schema", json.dumps(SCHEMA))
    (prompt,) = random_prompts([14], e2e_model.vocab_size, seed=4)
    whole = reference(structured, prompt, 80)
    produced = whole[:7]
    params = SamplingParams(temperature=0.0, max_tokens=80, structured=structured).resumed(len(produced))
    rest = _generate(engine, prompt + produced, **{name: getattr(params, name) for name in ("temperature", "max_tokens", "structured", "num_resumed_tokens")})
    assert produced + rest.token_ids == whole


def test_a_reasoning_models_grammar_holds_for_the_answer_after_its_thinking(e2e_model, engine, reference, decode):
    """``SamplingParams.thinking`` (engine.thinking): the tokens up to and with the closer are the
    model's own, the rest its grammar's; where the model may open the thinking itself, only an
    output whose first token is the opener thinks; so too with speculation, and resumed before
    or after the closer."""
    (prompt,) = random_prompts([11], e2e_model.vocab_size, seed=6)
    free = reference(None, prompt, 12)
    at = next(i for i in range(3, 12) if free[i] not in free[:i])  # the first time the model writes it
    structured = StructuredOutput("json_schema", json.dumps(SCHEMA))
    thinks = Thinking(closer=free[at])
    expected = reference(structured, prompt, 90, thinking=thinks)
    assert expected[: at + 1] == free[: at + 1] and expected != free[: len(expected)]
    jsonschema.validate(json.loads(decode(expected[at + 1 :])), SCHEMA)
    # A model that may think first: the first token opens it (as this model's does) or not.
    opens = Thinking(closer=free[at], opener=free[0])
    assert reference(structured, prompt, 90, thinking=opens) == expected
    for other in (token for token in range(3, e2e_model.vocab_size) if token != free[0]):
        direct = Thinking(closer=free[at], opener=other)  # the first opener that loses to the grammar's tokens
        answered = reference(structured, prompt, 90, thinking=direct)
        if answered[0] != other:
            break
    jsonschema.validate(json.loads(decode(answered)), SCHEMA)
    speculating = LLMEngine(
        e2e_model.path, EngineConfig(num_kv_blocks=256, num_threads=1, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    )
    for thinking, want, resumed_at in ((thinks, expected, (at - 1, at + 4)), (opens, expected, (3,)), (direct, answered, (3,))):
        fields = dict(temperature=0.0, max_tokens=90, structured=structured, thinking=thinking)
        assert _generate(engine, prompt, **fields).token_ids == want
        assert _generate(speculating, prompt, **fields).token_ids == want
        for k in resumed_at:
            params = SamplingParams(**fields).resumed(k)
            rest = _generate(engine, prompt + want[:k], **{name: getattr(params, name) for name in (*fields, "num_resumed_tokens")})
            assert want[:k] + rest.token_ids == want


def test_a_thinking_budget_forces_the_closer_once_spent(e2e_model, engine, reference):
    """vLLM's thinking_token_budget: after that many thinking tokens the closer comes, whatever
    the model would draw, one step at a time, overlapped and speculating alike."""
    (prompt,) = random_prompts([9], e2e_model.vocab_size, seed=12)
    free = reference(None, prompt, 16)
    closer = next(token for token in range(3, e2e_model.vocab_size) if token not in free)
    for budget in (0, 4):
        thinking = Thinking(closer=closer, budget=budget)
        want = reference(None, prompt, 16, thinking=thinking)
        assert want[: budget + 1] == free[:budget] + [closer]
        overlapped = LLMEngine(e2e_model.path, EngineConfig(num_kv_blocks=256, num_threads=1, async_scheduling=True))
        speculating = LLMEngine(
            e2e_model.path, EngineConfig(num_kv_blocks=256, num_threads=1, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3))
        )
        for each in (engine, overlapped, speculating):
            assert _generate(each, prompt, temperature=0.0, max_tokens=16, ignore_eos=True, thinking=thinking).token_ids == want
    # The opener written first starts the count; budget 0 closes at once after it.
    opens = Thinking(closer=closer, opener=free[0], budget=0)
    assert _generate(engine, prompt, temperature=0.0, max_tokens=8, ignore_eos=True, thinking=opens).token_ids[:2] == [free[0], closer]
    # A spent budget's closer comes though the request's own adjustments forbid it.
    sampled = _generate(engine, prompt, temperature=1.0, seed=1, max_tokens=3, ignore_eos=True, allowed_token_ids=[free[0]],
                        thinking=Thinking(closer=closer, budget=1))
    assert sampled.token_ids == [free[0], closer, free[0]]
    # Thinking from the first token, the opener written again first (DeepSeek-R1's): not counted.
    again = Thinking(closer=closer, opener=free[0], budget=2, inside=True)
    want = reference(None, prompt, 8, thinking=again)
    assert want[:4] == [*free[:3], closer]
    assert _generate(engine, prompt, temperature=0.0, max_tokens=8, ignore_eos=True, thinking=again).token_ids == want


def test_a_grammar_that_does_not_compile_names_the_field(engine, e2e_model):
    (prompt,) = random_prompts([5], e2e_model.vocab_size, seed=1)
    with pytest.raises(InvalidRequestError, match="response_format"):
        engine.add_request("bad", prompt, SamplingParams(structured=StructuredOutput("regex", "(unclosed", field="response_format")))
    assert engine.num_free_blocks == engine.kv_cache.num_blocks


@pytest.mark.parametrize("fields", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 4}, {"temperature": 0.8, "logprobs": 2}])
def test_allowed_token_ids_that_leave_the_grammar_nothing_end_that_request_naming_the_field(engine, e2e_model, fields):
    """[a-c]{2,4}-[0-9]{3} with only "a" allowed: "aaaa" is honest, then only "-" may come and
    there is no honest draw. That request ends as the client's error, naming allowed_token_ids
    (it once drew the forbidden token, or raised an IndexError with logprobs); the request beside
    it is untouched. With only "9" allowed not even a first token can be drawn: the request is
    refused when it is added (on every path a prompt takes, a pipeline stage's included)."""
    tokenizer = tokenizers.Tokenizer.from_file(str(e2e_model.path / "tokenizer.json"))
    letter, digit = tokenizer.token_to_id("a"), tokenizer.token_to_id("9")
    prompt, other = random_prompts([6, 9], e2e_model.vocab_size, seed=2)
    grammar = StructuredOutput("regex", r"[a-c]{2,4}-[0-9]{3}")
    with pytest.raises(InvalidRequestError, match="allowed_token_ids.*structured output"):
        engine.add_request("refused", prompt, SamplingParams(max_tokens=8, allowed_token_ids=[digit], structured=grammar, **fields))
    engine.add_request("conflict", prompt, SamplingParams(max_tokens=8, allowed_token_ids=[letter], structured=grammar, **fields))
    engine.add_request("beside", other, SamplingParams(max_tokens=8, ignore_eos=True, **fields))
    ends, tokens = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids if out.req_id == "conflict" else []
            if out.finished:
                ends[out.req_id] = out
    assert (ends["conflict"].finish_reason, ends["conflict"].error_field, tokens) == ("error", "allowed_token_ids", [letter] * 4)
    assert "structured output" in ends["conflict"].error
    assert (ends["beside"].finish_reason, ends["beside"].error, ends["beside"].num_output_tokens) == ("length", None, 8)
    assert engine.num_free_blocks == engine.kv_cache.num_blocks


@pytest.mark.parametrize("fields", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 4}])
def test_bad_words_that_ban_every_token_the_grammar_allows_end_that_request_naming_the_field(engine, e2e_model, fields):
    """x=[0-9] with "x" a bad word: no honest first token, refused as it is added. With "x ="
    a bad word (the tokens pinned by allowed_token_ids), "=" has no honest draw after "x". Each
    was drawn from a row of -inf (a token the grammar forbids, reported as an ordinary end); it
    is the client's error naming bad_words, and a bad word the grammar can go around is none."""
    tokenizer = tokenizers.Tokenizer.from_file(str(e2e_model.path / "tokenizer.json"))
    x, y, equals = (tokenizer.token_to_id(c) for c in "xy=")
    digits = [tokenizer.token_to_id(str(d)) for d in range(10)]
    prompt, other = random_prompts([6, 7], e2e_model.vocab_size, seed=2)
    grammar = StructuredOutput("regex", r"x=[0-9]")
    with pytest.raises(InvalidRequestError, match="bad_words.*structured output"):
        engine.add_request("refused", prompt, SamplingParams(max_tokens=8, bad_words_token_ids=[[x]], structured=grammar, **fields))
    engine.add_request("banned", prompt, SamplingParams(max_tokens=8, bad_words_token_ids=[[x, equals]], allowed_token_ids=[x, equals, *digits],
                                                        structured=grammar, **fields))
    around = StructuredOutput("regex", r"(x|y)=[0-9]")
    engine.add_request("around", other, SamplingParams(max_tokens=8, bad_words_token_ids=[[x]], allowed_token_ids=[x, y, equals, *digits],
                                                       structured=around, **fields))
    ends, tokens = {}, {"banned": [], "around": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.req_id] += out.new_token_ids
            if out.finished:
                ends[out.req_id] = out
    assert (ends["banned"].finish_reason, ends["banned"].error_field, tokens["banned"]) == ("error", "bad_words", [x])
    assert ends["around"].finish_reason != "error" and tokens["around"][:2] == [y, equals]
    assert engine.num_free_blocks == engine.kv_cache.num_blocks


def test_logit_adjustments_and_penalties_are_vllms_formulas(e2e_model, engine, reference):
    (prompt,) = random_prompts([10], e2e_model.vocab_size, seed=12)
    plain = reference(None, prompt, 12)
    bias = {plain[0]: -30.0, plain[3]: 2.5, 17: 4.0}
    bad_words = [[plain[1]], [plain[2], plain[4]]]
    presence, frequency = 0.7, 0.45

    def adjust(logits, output):
        logits = logits.clone()
        for word in bad_words:
            if output[len(output) - len(word) + 1 :] == word[:-1] or len(word) == 1:
                logits[word[-1]] = float("-inf")
        for token, value in bias.items():
            logits[token] += value
        for token in set(output):
            logits[token] -= presence + frequency * output.count(token)
        return logits

    expected = reference(None, prompt, 12, adjust)
    got = _generate(
        engine, prompt, temperature=0.0, max_tokens=12, ignore_eos=True, logit_bias=bias, bad_words_token_ids=bad_words,
        presence_penalty=presence, frequency_penalty=frequency,
    )
    assert got.token_ids == expected[: len(got.token_ids)] and len(got.token_ids) == 12
    assert expected != plain, "the adjustments changed the answer"

    allowed = sorted({plain[5], 3, 99, 250})
    constrained = _generate(engine, prompt, temperature=1.0, seed=2, max_tokens=30, ignore_eos=True, allowed_token_ids=allowed)
    assert set(constrained.token_ids) <= set(allowed)


def test_masks_forbid_exactly_the_tokens_whose_bit_is_clear_on_constrained_rows_only():
    from engine.grammar import apply_masks

    generator = torch.Generator().manual_seed(0)
    vocab = 70  # no multiple of 32: the last word is partly past the vocabulary
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 3), dtype=torch.int32, generator=generator)
    logits = torch.randn(3, vocab, generator=generator)
    masked = apply_masks(logits, (bitmask, [0, 2]))
    for row in range(3):
        for token in range(vocab):
            allowed = row == 1 or (int(bitmask[row, token // 32]) >> (token % 32)) & 1
            assert masked[row, token] == (logits[row, token] if allowed else float("-inf")), (row, token)


def test_a_chain_of_refs_is_closed_in_a_few_walks_of_the_schema(monkeypatch):
    """Each walk of the schema found one more link of a chain of $refs beside other schemas: a
    2,000-link chain (70 KB) took 2,000 walks, 14 s of the router's one tokenizing thread, and a
    300 KB one hours, for every request that sent it. The chain's end stays open either way."""
    import engine.structured_output as structured

    walks = []
    close = structured._close

    def counted(node, plain_path, composed, found, path):
        if path == ():
            walks.append(len(composed))
        return close(node, plain_path, composed, found, path)

    monkeypatch.setattr(structured, "_close", counted)
    links = 2000
    definitions = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(links)}
    definitions[f"d{links}"] = {"type": "object", "properties": {"a": {"type": "string"}}}
    closed = structured.closed_objects({"allOf": [{"$ref": "#/$defs/d0"}], "$defs": definitions})
    assert len(walks) <= 3, f"{len(walks)} walks of the schema"
    assert "additionalProperties" not in closed["$defs"][f"d{links}"], "an object composed with others was closed"
    # A "$ref" that is data (a default's), under a place composed with others, names nothing:
    # what only plain $refs name is closed, as the walk of schema positions alone finds.
    data_ref = {"type": "object", "properties": {"a": {"$ref": "#/$defs/A", "minProperties": 1}, "b": {"$ref": "#/$defs/B"}},
                "$defs": {"A": {"type": "object", "properties": {"x": {}}, "default": {"$ref": "#/$defs/B"}},
                          "B": {"type": "object", "properties": {"y": {}}}}}
    assert structured.closed_objects(data_ref)["$defs"]["B"]["additionalProperties"] is False


def test_a_schema_sent_again_is_compiled_once(monkeypatch):
    """Clients send one schema with every request (and n choices each carry it): each was
    compiled to check it, hundreds of milliseconds for a large schema on the router's thread.
    Its verdict is kept, a refusal's too (naming each request's own field)."""
    from engine.structured_output import StructuredOutput, check_grammar

    compiled = []
    to_llguidance = StructuredOutput.to_llguidance

    def counted(self):
        compiled.append(self.value)
        return to_llguidance(self)

    monkeypatch.setattr(StructuredOutput, "to_llguidance", counted)
    schema = StructuredOutput("json_schema", '{"type": "object", "properties": {"unique_key_7f3a": {"type": "integer"}}}')
    for _ in range(3):
        check_grammar(schema)
    assert compiled == [schema.value]
    bad = StructuredOutput("regex", "(unclosed_7f3a", field="guided_regex")
    for _ in range(2):
        with pytest.raises(InvalidRequestError) as refused:
            check_grammar(bad)
        assert refused.value.field == "guided_regex"
    assert compiled.count(bad.value) == 1


def test_sampled_answers_under_a_tool_call_grammar_are_the_format_or_calls_that_run(engine, e2e_model, decode):
    """The grammar a response format beside tools decodes under (StructuredOutput.tool_calls),
    through the engine's matchers and masks: every sampled answer is the format's JSON, or
    calls in the hermes format whose arguments meet their tool's schema."""
    import jsonschema

    from engine.structured_output import CallTag
    from router.openai_api.tool_calls import ToolCalling
    from router.openai_api.tool_parsers import ToolCallOutput

    weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"], "additionalProperties": False}
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    tags = [CallTag("<tool_call>", '<tool_call>\n{"name": "get_weather", "arguments": ', weather, "}\n</tool_call>")]
    structured = StructuredOutput.tool_calls(tags, StructuredOutput("json_schema", json.dumps(answer)), "response_format")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}]
    prompts = random_prompts([12, 30, 5, 21], e2e_model.vocab_size, seed=5)
    opener = tokenizers.Tokenizer.from_file(str(e2e_model.path / "tokenizer.json")).encode("<", add_special_tokens=False).ids[0]
    kinds = set()
    for seed in range(8):
        # Every other answer is pushed to open with "<" (a random model rarely calls): both ways run.
        bias = {opener: 30.0} if seed % 2 else {}
        completion = _generate(engine, prompts[seed % len(prompts)], temperature=1.0, seed=seed, max_tokens=80, structured=structured, logit_bias=bias)
        text = decode(completion.token_ids)
        ended = completion.finish_reason.value != "length"
        reader = ToolCallOutput(ToolCalling(tools, "auto", parser="hermes"))
        reader.feed(text)
        reader.finish()
        if reader.calls:
            runnable = reader.runnable_calls
            assert runnable and (ended or len(runnable) >= len(reader.calls) - 1), text  # only a call max_tokens cut may not run
            for made in runnable:
                jsonschema.validate(json.loads(made["function"]["arguments"]), weather)
            kinds.add("calls")
        elif ended:
            jsonschema.validate(json.loads(text), answer)
            kinds.add("answer")
    assert kinds == {"answer", "calls"}, kinds


def test_allowed_token_ids_that_leave_a_drafted_state_nothing_end_as_without_drafts():
    """The grammar's state after a draft was never checked against allowed_token_ids (only the
    step's own was): a draft row they left nothing drew from -inf, and the answer ended outside
    its grammar as a normal stop. With drafts or without, it ends naming the field."""
    from engine.default_model_path import DEFAULT_MODEL_PATH

    vocabulary = tokenizers.Tokenizer.from_file(str(DEFAULT_MODEL_PATH / "tokenizer.json"))
    x, y, z = (vocabulary.token_to_id(c) for c in "xyz")
    prompt = [z, x, x, x, y] * 5 + [z]  # n-gram drafts: x x x y
    ends = []
    for speculative in (None, SpeculativeConfig(method="ngram", num_speculative_tokens=4)):
        engine = LLMEngine(DEFAULT_MODEL_PATH, EngineConfig(num_kv_blocks=64, num_threads=1, speculative=speculative))
        params = SamplingParams(max_tokens=10, temperature=0.0, structured=StructuredOutput("regex", "(x|z){3}y"), allowed_token_ids=[x, 0])
        seq = engine.add_request("r", prompt, params)
        (last,) = [out for out in _all_outputs(engine) if out.finished]
        ends.append((seq.output_token_ids, last.finish_reason.value, last.error_field))
    assert ends[0] == ends[1] == ([x, x, x], "error", "allowed_token_ids")


def _all_outputs(engine) -> list:
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def test_formats_the_grammar_cannot_hold_are_annotations_and_known_ones_are_held():
    """pydantic writes ``format`` "binary" for bytes, "path" for a Path, "password" for a
    SecretStr: llguidance refused them as unknown, a 400 for a model the openai SDK's parse()
    sends as it is. JSON Schema has formats as annotations; those llguidance knows still hold."""
    from datetime import date
    from pathlib import Path

    from openai.lib._parsing._completions import type_to_response_format_param
    from pydantic import BaseModel, SecretStr

    from engine.default_model_path import DEFAULT_MODEL_PATH
    from engine.structured_output import check_grammar

    class Upload(BaseModel):
        data: bytes
        where: Path
        secret: SecretStr
        day: date

    schema = type_to_response_format_param(Upload)["json_schema"]["schema"]
    assert {p.get("format") for p in schema["properties"].values()} >= {"binary", "path", "password", "date"}
    structured = StructuredOutput("json_schema", json.dumps(schema), field="response_format")
    check_grammar(structured)
    tokenizer_json = (DEFAULT_MODEL_PATH / "tokenizer.json").read_text()
    encode = tokenizers.Tokenizer.from_str(tokenizer_json)
    eos = json.loads((DEFAULT_MODEL_PATH / "config.json").read_text())["eos_token_id"]
    llg = llguidance.LLTokenizer(tokenizer_json, n_vocab=encode.get_vocab_size(True), eos_token=eos)

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(llg, structured.to_llguidance(), log_level=0)
        return matcher.consume_tokens(encode.encode(text, add_special_tokens=False).ids) and matcher.is_accepting()

    assert accepts('{"data": "aGk=", "where": "/tmp/x", "secret": "s", "day": "2026-11-29"}')
    assert not accepts('{"data": "aGk=", "where": "/tmp/x", "secret": "s", "day": "yesterday"}'), "a date is still a date"


def test_a_grammar_sent_again_is_compiled_once_and_each_sequence_has_its_own_matcher(monkeypatch):
    """Clients send one schema with every request: each sequence compiled it on the engine
    thread between steps (every stream on the actor waited). Compiled once, copied per sequence;
    the copies advance apart."""
    from engine.default_model_path import DEFAULT_MODEL_PATH
    from engine.grammar import Grammars

    compiled = []
    to_llguidance = StructuredOutput.to_llguidance
    monkeypatch.setattr(StructuredOutput, "to_llguidance", lambda self: compiled.append(self.value) or to_llguidance(self))
    grammars = Grammars(DEFAULT_MODEL_PATH, 4096, [0])
    vocabulary = tokenizers.Tokenizer.from_file(str(DEFAULT_MODEL_PATH / "tokenizer.json"))
    structured = StructuredOutput("regex", "(ab|ac)d", field="structured_outputs.regex")
    a, b, c = (vocabulary.token_to_id(ch) for ch in "abc")
    first = grammars.for_sequence(structured, [a, b])
    second = grammars.for_sequence(structured, [a])
    assert compiled == [structured.value]
    assert second.matcher.consume_token(c) and not first.matcher.consume_token(c), "the copies advance apart"
