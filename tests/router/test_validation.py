"""Every bad request field is refused with INVALID_ARGUMENT naming the field; good ones become typed requests."""

from __future__ import annotations

import dataclasses
import json
import math

import grpc
import pytest

from engine.sampling_params import SamplingDefaults
from engine.sampling_params import SamplingParams
from router.api.pdserve.v1 import generation_pb2 as pb
from router.errors import DeadlineExceededError, InvalidArgumentError, grpc_status
from router.validation import (
    RequestLimits,
    validate_drain_worker_request,
    validate_generate_request,
    validate_scale_pool_request,
)

LIMITS = RequestLimits(vocab_size=1000, max_context_len=64)


def encode(text: str, add_special_tokens: bool = True) -> list[int]:
    """One token per character plus a BOS of 1: easy to reason about lengths."""
    return [1] * add_special_tokens + [2 + ord(c) % 900 for c in text]


def request(**fields) -> pb.GenerateRequest:
    sampling = fields.pop("sampling", {})
    fields.setdefault("prompt_text", "hello")
    return pb.GenerateRequest(sampling=pb.SamplingParams(**sampling), **fields)


def validate(req: pb.GenerateRequest, limits: RequestLimits = LIMITS, **kwargs):
    return validate_generate_request(req, limits, encode, **kwargs)


def test_defaults_of_a_minimal_text_request():
    result = validate(request(), now=100.0)
    assert len(result.req_id) == 32  # assigned
    assert result.prompt_token_ids == encode("hello")
    assert result.prompt_text == "hello"
    assert result.sampling_params == SamplingParams(max_tokens=16)
    assert (result.stop, result.skip_special_tokens, result.priority) == ([], True, 0)
    assert (result.arrival_time, result.deadline) == (100.0, None)


def test_explicit_fields_reach_the_engine_params():
    req = request(
        request_id="client-1:a.b_c",
        prompt_text=None,
        prompt_token_ids=[5, 6, 7],
        priority=-3,
        sampling=dict(
            max_tokens=10, temperature=0.0, top_k=5, top_p=0.5, min_p=0.25, seed=7, repetition_penalty=1.5,
            stop_token_ids=[3, 3, 4], ignore_eos=True, logprobs=0, stop=["\n", "\n", "END"], skip_special_tokens=False,
        ),
    )
    result = validate(req, timeout_s=2.5, now=10.0)
    assert result.req_id == "client-1:a.b_c"
    assert (result.prompt_text, result.prompt_token_ids) == (None, [5, 6, 7])
    assert result.sampling_params == SamplingParams(
        max_tokens=10, temperature=0.0, top_k=5, top_p=0.5, min_p=0.25, seed=7, repetition_penalty=1.5,
        stop_token_ids=[3, 4], ignore_eos=True, logprobs=0,
    )
    assert (result.stop, result.skip_special_tokens) == (["\n", "END"], False)
    assert (result.priority, result.deadline) == (-3, 12.5)


def test_every_64_bit_seed_the_proto_carries_is_a_seed():
    """The proto's seed is uint64; values from 2^63 on (half of random.getrandbits(64)) were
    refused. They are the negative int64 seeds, distinct from every other."""
    seeds = [validate(request(sampling=dict(seed=seed))).sampling_params.seed for seed in (7, 2**63 - 1, 2**63, 2**64 - 1)]
    assert seeds == [7, 2**63 - 1, -(2**63), -1]


def test_min_tokens_reaches_the_engine_and_lifts_an_unset_max_tokens():
    result = validate(request(sampling=dict(min_tokens=20)))
    assert (result.sampling_params.min_tokens, result.sampling_params.max_tokens) == (20, 20)


def test_unset_max_tokens_shrinks_to_the_room_left_in_the_context():
    result = validate(request(prompt_text="x" * 60))  # 61 tokens in a 64-token context
    assert result.sampling_params.max_tokens == 3


def test_an_empty_text_prompt_starts_a_document_where_the_tokenizer_writes_a_bos():
    """As OpenAI's and vLLM's completions take ``"prompt": ""``: generated from the BOS alone (it
    was refused); a tokenizer that writes none leaves no tokens, refused naming the field."""
    assert validate(request(prompt_text="")).prompt_token_ids == [1]
    with pytest.raises(InvalidArgumentError, match="^prompt_text: must not be empty$"):
        validate_generate_request(request(prompt_text=""), LIMITS, lambda text, add_special_tokens=True: encode(text, False))


def test_prompt_filling_the_context_exactly_leaves_one_token():
    result = validate(request(prompt_token_ids=[5] * 63, prompt_text=None, sampling=dict(max_tokens=1)))
    assert result.sampling_params.max_tokens == 1


BAD_REQUESTS = [
    ("prompt", dict(prompt_text=None)),
    ("prompt", dict(prompt_token_ids=[1, 2])),  # both text and ids
    ("prompt_token_ids[1]", dict(prompt_text=None, prompt_token_ids=[1, 1000])),
    ("prompt_text", dict(prompt_text="x" * 63)),  # 64 tokens: no room to generate
    ("prompt_token_ids", dict(prompt_text=None, prompt_token_ids=[5] * 64)),
    ("sampling.max_tokens", dict(prompt_text="x" * 50, sampling=dict(max_tokens=14))),  # 51 + 14 > 64
    ("sampling.max_tokens", dict(sampling=dict(max_tokens=0))),
    ("sampling.temperature", dict(sampling=dict(temperature=-0.5))),
    ("sampling.temperature", dict(sampling=dict(temperature=math.nan))),
    ("sampling.temperature", dict(sampling=dict(temperature=math.inf))),
    ("sampling.top_p", dict(sampling=dict(top_p=0.0))),
    ("sampling.top_p", dict(sampling=dict(top_p=1.5))),
    ("sampling.top_p", dict(sampling=dict(top_p=math.nan))),
    ("sampling.top_k", dict(sampling=dict(top_k=-2))),
    ("sampling.min_p", dict(sampling=dict(min_p=-0.1))),
    ("sampling.min_p", dict(sampling=dict(min_p=1.1))),
    ("sampling.repetition_penalty", dict(sampling=dict(repetition_penalty=0.0))),
    ("sampling.logprobs", dict(sampling=dict(logprobs=21))),
    ("sampling.prompt_logprobs", dict(sampling=dict(prompt_logprobs=21))),
    ("sampling.stop_token_ids", dict(sampling=dict(stop_token_ids=[1000]))),
    ("sampling.stop_token_ids", dict(sampling=dict(stop_token_ids=list(range(65))))),
    ("sampling.stop[1]", dict(sampling=dict(stop=["ok", ""]))),
    ("sampling.stop[0]", dict(sampling=dict(stop=["x" * 257]))),
    ("sampling.stop", dict(sampling=dict(stop=[str(i) for i in range(17)]))),
    ("request_id", dict(request_id="x" * 129)),
    ("request_id", dict(request_id="has space")),
    ("request_id", dict(request_id="new\nline")),
    ("request_id", dict(request_id="é")),
    ("priority", dict(priority=101)),
    ("priority", dict(priority=-101)),
    ("sampling.min_tokens", dict(sampling=dict(max_tokens=4, min_tokens=5))),
    ("sampling.min_tokens", dict(prompt_text="x" * 60, sampling=dict(min_tokens=5))),  # 61 + 5 > 64
]


@pytest.mark.parametrize(("field", "fields"), BAD_REQUESTS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_REQUESTS)])
def test_bad_field_is_invalid_argument_naming_the_field(field, fields):
    with pytest.raises(InvalidArgumentError) as info:
        validate(request(**fields))
    assert info.value.field == field
    code, message = grpc_status(info.value)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert message.startswith(f"{field}: ") and len(message) > len(field) + 10


def test_truncate_prompt_tokens_keeps_the_prompts_end():
    """vLLM's truncate_prompt_tokens: the last k tokens (-1: as many as leave one for the answer);
    a prompt cut this way is its tokens only (its text no longer says what the model reads)."""
    long_text = "abcdefghij" * 10  # 101 tokens: too long for the context of 64 unless cut
    cut = validate(request(prompt_text=long_text, truncate_prompt_tokens=5))
    assert (cut.prompt_token_ids, cut.prompt_text) == ([1] + encode(long_text)[-4:], None)  # the BOS kept, as a tokenizer cuts
    assert len(validate(request(prompt_text=long_text, truncate_prompt_tokens=-1)).prompt_token_ids) == 63
    room = validate(request(prompt_text=long_text, truncate_prompt_tokens=-1, sampling=dict(max_tokens=10)))
    assert len(room.prompt_token_ids) == 54 and room.sampling_params.max_tokens == 10  # -1 leaves room for max_tokens
    ids = validate(request(prompt_text=None, prompt_token_ids=list(range(5, 105)), truncate_prompt_tokens=8))
    assert ids.prompt_token_ids == list(range(97, 105))  # ids are taken as sent: the last k
    with pytest.raises(InvalidArgumentError) as info:  # named by its place in what the client sent
        validate(request(prompt_text=None, prompt_token_ids=[5] * 50 + [5000], truncate_prompt_tokens=8))
    assert info.value.field == "prompt_token_ids[50]"
    huge = "ab" * (64 * 64)  # past the characters taken uncut, but to be cut
    assert len(validate(request(prompt_text=huge, truncate_prompt_tokens=8)).prompt_token_ids) == 8
    whole = validate(request(prompt_text="hi", truncate_prompt_tokens=50))  # shorter than k: untouched
    assert (whole.prompt_token_ids, whole.prompt_text) == (encode("hi"), "hi")
    for bad in (0, -2):
        with pytest.raises(InvalidArgumentError) as info:
            validate(request(truncate_prompt_tokens=bad))
        assert info.value.field == "truncate_prompt_tokens"
    with pytest.raises(InvalidArgumentError, match="has 101 input tokens"):  # uncut, it is refused as it is
        validate(request(prompt_text=long_text))
    assert validate(request(sampling=dict(include_stop_str_in_output=True))).include_stop_str is True
    assert validate(request()).include_stop_str is False
    assert validate(request(sampling=dict(cache_salt="t1"))).sampling_params.cache_salt == "t1"
    with pytest.raises(InvalidArgumentError) as info:
        validate(request(sampling=dict(cache_salt="")))
    assert info.value.field == "sampling.cache_salt"


def test_context_error_says_how_many_tokens_fit():
    with pytest.raises(InvalidArgumentError, match="at most 13 new tokens fit"):
        validate(request(prompt_text="x" * 50, sampling=dict(max_tokens=14)))


def test_unknown_field_from_a_newer_client_is_refused():
    wire = request().SerializeToString() + b"\xa0\x06\x01"  # field 100, varint 1
    with pytest.raises(InvalidArgumentError, match=r"unknown field number\(s\) \[100\]"):
        validate(pb.GenerateRequest.FromString(wire))
    nested = pb.SamplingParams(temperature=0.5).SerializeToString() + b"\xa8\x06\x01"  # field 101
    wire = request().SerializeToString() + b"\x22" + bytes([len(nested)]) + nested  # sampling (field 4) again: merged
    with pytest.raises(InvalidArgumentError) as info:
        validate(pb.GenerateRequest.FromString(wire))
    assert info.value.field == "sampling"


def test_expired_deadline_is_deadline_exceeded():
    with pytest.raises(DeadlineExceededError):
        validate(request(), timeout_s=0.0)
    assert grpc_status(DeadlineExceededError("late"))[0] == grpc.StatusCode.DEADLINE_EXCEEDED


def test_long_prompt_is_not_tokenized_when_a_cheap_field_is_already_bad():
    calls = []
    with pytest.raises(InvalidArgumentError):
        validate_generate_request(request(sampling=dict(top_p=2.0)), LIMITS, lambda text: calls.append(text) or [1])
    assert calls == []


def test_scale_pool_refuses_unknown_and_unset_roles():
    validate_scale_pool_request(pb.ScalePoolRequest(role=pb.WORKER_ROLE_DECODE, replicas=2), max_replicas=8)
    for role, match in [(7, "unknown WorkerRole value 7"), (pb.WORKER_ROLE_UNSPECIFIED, "must be")]:
        with pytest.raises(InvalidArgumentError, match=match) as info:
            validate_scale_pool_request(pb.ScalePoolRequest(role=role, replicas=1), max_replicas=8)
        assert info.value.field == "role"
    with pytest.raises(InvalidArgumentError) as info:
        validate_scale_pool_request(pb.ScalePoolRequest(role=pb.WORKER_ROLE_PREFILL, replicas=9), max_replicas=8)
    assert info.value.field == "replicas"


def test_drain_worker_needs_a_well_formed_id():
    validate_drain_worker_request(pb.DrainWorkerRequest(worker_id="decode-0"))
    for worker_id in ["", "a b", "x" * 129]:
        with pytest.raises(InvalidArgumentError) as info:
            validate_drain_worker_request(pb.DrainWorkerRequest(worker_id=worker_id))
        assert info.value.field == "worker_id"


def test_the_models_generation_config_fills_only_what_a_request_leaves_unset(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "max_new_tokens": 40, "do_sample": True})
    )
    defaults = SamplingDefaults.from_model_dir(tmp_path)
    limits = RequestLimits(vocab_size=1000, max_context_len=64, defaults=defaults)
    unset = validate(request(), limits).sampling_params
    assert (unset.temperature, unset.top_p, unset.top_k, unset.min_p, unset.repetition_penalty) == (0.6, 0.9, 20, 0.05, 1.1)
    assert unset.max_tokens == 16, "a completion's default stays 16 (vLLM's): max_new_tokens only caps it"
    short = RequestLimits(vocab_size=1000, max_context_len=64, defaults=dataclasses.replace(defaults, max_tokens=5))
    assert validate(request(), short).sampling_params.max_tokens == 5
    given = validate(request(sampling=dict(temperature=0.0, top_p=1.0, top_k=-1, max_tokens=3, repetition_penalty=1.0)), limits)
    params = given.sampling_params
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens, params.repetition_penalty) == (0.0, 1.0, -1, 3, 1.0)
    # gRPC's min_p set to 0 turns the model's off (it was taken for unset, and no value could).
    assert validate(request(sampling=dict(min_p=0.0)), limits).sampling_params.min_p == 0.0
    # Long prompts: the default still shrinks to the room left.
    assert validate(request(prompt_text="x" * 60), limits).sampling_params.max_tokens == 3


def test_a_malformed_generation_config_is_named(tmp_path):
    from engine.errors import ModelLoadError

    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(ModelLoadError, match="temperature must be a number"):
        SamplingDefaults.from_model_dir(tmp_path)


def test_errors_name_the_fields_as_each_api_spells_them():
    """Anthropic's stop strings are stop_sequences and the Responses API's length max_output_tokens:
    their errors named "stop" and "max_tokens", fields the client never sent."""
    from router.validation import GenerateInput, validate_input

    anthropic = GenerateInput(prompt_text="hi", stop=["x"] * 17, sampling_prefix="", field_names={"stop": "stop_sequences"})
    with pytest.raises(InvalidArgumentError) as info:
        validate_input(anthropic, LIMITS, encode)
    assert info.value.field == "stop_sequences"
    responses = GenerateInput(prompt_text="x" * 40, max_tokens=40, sampling_prefix="", field_names={"max_tokens": "max_output_tokens"})
    with pytest.raises(InvalidArgumentError) as info:
        validate_input(responses, LIMITS, encode)
    assert info.value.field == "max_output_tokens" and "'max_output_tokens' is too large: 40" in info.value.problem
    with pytest.raises(InvalidArgumentError) as info:
        validate(request(prompt_text="x" * 40, sampling=dict(max_tokens=40)))
    assert info.value.field == "sampling.max_tokens"


def test_a_grpc_chats_json_nested_thousands_deep_is_refused_naming_its_field():
    """As the HTTP routes refuse it: it was a RecursionError, answered as INTERNAL."""
    from router.grpc_chat import read_chat_prompt

    deep = "[" * 5000 + "]" * 5000
    for fields, name in (({"tools_json": deep}, "chat.tools_json"), ({"chat_template_kwargs_json": '{"a": ' + deep + "}"}, "chat.chat_template_kwargs_json")):
        prompt = pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="hi")], **fields)
        with pytest.raises(InvalidArgumentError) as raised:
            read_chat_prompt(prompt, None, None, False)
        assert raised.value.field == name and "nests deeper" in raised.value.problem
