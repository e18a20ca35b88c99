"""The Generate API as a client sees it: streaming, text, stops, cancel, deadlines, bad input."""

from __future__ import annotations

import dataclasses
import random
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoTokenizer

from router.api.pdserve.v1 import generation_pb2 as pb
from router.config import Disaggregation, RouterConfig
from tests.checkpoints import hf_greedy, random_prompts
from tests.serving import Client, engine_config, make_request, running_deployment


@pytest.fixture(scope="module")
def deployment(ray_cluster, e2e_model):
    """1P+1D, the decode actor overlapping its steps (async_scheduling, engine.overlap): every
    test here (streams equal to transformers, stops, cancels, deadlines, logprobs, grammars
    beside greedy rows) holds for the overlapped path; the other modules serve step by step."""
    router = RouterConfig(disaggregation=Disaggregation.ALWAYS)
    with running_deployment(e2e_model, 1, 1, router, decode_engine=engine_config(async_scheduling=True)) as running:
        yield running


@pytest.fixture(scope="module")
def client(deployment):
    client = Client(deployment.address, deployment.admin_address)
    yield client
    client.close()


@pytest.fixture(scope="module")
def hf_tokenizer(e2e_model):
    return AutoTokenizer.from_pretrained(e2e_model.path)


def test_tokens_stream_before_generation_ends(client, e2e_model):
    (prompt,) = random_prompts([30], e2e_model.vocab_size, seed=1)
    stream = client.generate(prompt_token_ids=prompt, max_tokens=40, temperature=0.0, ignore_eos=True)
    assert len(stream.token_ids) == 40
    assert len(stream.messages) > 5, "tokens arrive step by step, not in one message at the end"
    first_token_at = next(t for t, m in zip(stream.arrival_times, stream.messages) if m.token_ids)
    assert stream.arrival_times[-1] - first_token_at > 0.5 * (stream.last.timing.decode_ms / 1000)
    assert stream.last.timing.time_to_first_token_ms < stream.last.timing.total_ms


def test_stream_interval_sends_fuller_messages_with_the_same_tokens_and_text(client, deployment, e2e_model, hf_tokenizer):
    (prompt,) = random_prompts([16], e2e_model.vocab_size, seed=11)
    every_step = client.generate(prompt_token_ids=prompt, max_tokens=23, temperature=0.0, ignore_eos=True)
    deployment.router.config.stream_interval = 4
    try:
        grouped = client.generate(prompt_token_ids=prompt, max_tokens=23, temperature=0.0, ignore_eos=True)
    finally:
        deployment.router.config.stream_interval = 1
    sizes = [len(m.token_ids) for m in grouped.messages if m.token_ids]
    assert sizes[0] == 1, "the first token is never held back"
    # Every message between the first and the last holds at least 4 tokens. (Not compared with
    # the every-step run's count: on a loaded host the router falls behind and merges those too.)
    assert all(size >= 4 for size in sizes[1:-1]), sizes
    assert len(sizes) <= 1 + -(-22 // 4)
    assert grouped.token_ids == every_step.token_ids == hf_greedy(e2e_model.hf_model, prompt, 23)
    assert grouped.text == every_step.text == hf_tokenizer.decode(grouped.token_ids, skip_special_tokens=True)
    assert grouped.last.usage.completion_tokens == 23


def test_text_is_the_tokenizer_decode_of_all_tokens(client, hf_tokenizer):
    stream = client.generate(prompt_text="Café déjà vu 東京 😀", max_tokens=30, temperature=0.0, ignore_eos=True)
    assert stream.text == hf_tokenizer.decode(stream.token_ids, skip_special_tokens=True)
    sampled = client.generate(prompt_text="Emoji 👍🏽 and Привет", max_tokens=30, temperature=1.0, seed=3, ignore_eos=True)
    assert sampled.text == hf_tokenizer.decode(sampled.token_ids, skip_special_tokens=True)


def test_prompt_text_is_tokenized_like_transformers(client, e2e_model, hf_tokenizer):
    text = "The quick brown fox, São Paulo"
    ids = hf_tokenizer(text)["input_ids"]
    stream = client.generate(prompt_text=text, max_tokens=8, temperature=0.0, ignore_eos=True)
    assert stream.last.usage.prompt_tokens == len(ids)
    assert stream.token_ids == hf_greedy(e2e_model.hf_model, ids, 8)


def test_stop_string_spanning_tokens_ends_generation(client, e2e_model, hf_tokenizer):
    (prompt,) = random_prompts([12], e2e_model.vocab_size, seed=5)
    full = client.generate(prompt_token_ids=prompt, max_tokens=40, temperature=0.0, ignore_eos=True)
    # A stop string made of the last character of one token's text and the first of the next.
    boundaries = [len(hf_tokenizer.decode(full.token_ids[:i])) for i in range(8, 30)]
    boundary = next(b for b, after in zip(boundaries, boundaries[1:]) if 0 < b < after and b < len(full.text))
    stop = full.text[boundary - 1 : boundary + 1]
    start = full.text.find(stop)
    stopped = client.generate(prompt_token_ids=prompt, max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])
    assert stopped.last.finish_reason == pb.FINISH_REASON_STOP
    assert stopped.last.matched_stop_string == stop
    assert stopped.text == full.text[:start]
    assert len(stopped.token_ids) < 40


def test_stop_token_id_ends_generation_with_reason_stop(client, e2e_model):
    (prompt,) = random_prompts([12], e2e_model.vocab_size, seed=6)
    full = client.generate(prompt_token_ids=prompt, max_tokens=20, temperature=0.0, ignore_eos=True)
    target = full.token_ids[7]
    stopped = client.generate(prompt_token_ids=prompt, max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=[target])
    position = full.token_ids.index(target)
    assert stopped.token_ids == full.token_ids[: position + 1]
    assert stopped.last.finish_reason == pb.FINISH_REASON_STOP
    assert stopped.last.matched_stop_token_id == target


def test_logprobs_are_streamed_per_token(client, e2e_model):
    (prompt,) = random_prompts([20], e2e_model.vocab_size, seed=7)
    stream = client.generate(prompt_token_ids=prompt, max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    entries = [e for m in stream.messages for e in m.logprobs]
    assert len(entries) == 6
    for token, entry in zip(stream.token_ids, entries):
        assert entry.top[0].token_id == token  # greedy: the sampled token is the most likely one
        assert entry.logprob == pytest.approx(entry.top[0].logprob, abs=1e-5)


def test_client_cancel_mid_stream_frees_every_block(client, e2e_model):
    (prompt,) = random_prompts([300], e2e_model.vocab_size, seed=8)
    call = client.stub.Generate(make_request(prompt_token_ids=prompt, max_tokens=1500, temperature=0.0, ignore_eos=True))
    received = 0
    for message in call:
        received += len(message.token_ids)
        if received >= 3:
            call.cancel()
            break
    assert received >= 3
    client.wait_until_idle()


def test_cancel_during_prefill_frees_blocks_on_both_actors(deployment, client, e2e_model):
    import ray

    (prompt,) = random_prompts([1200], e2e_model.vocab_size, seed=9)
    # 100 ms after each prefill step: however the prompt is cut (chunks of one actor, or the
    # few larger chunks of a pipeline with the decode actor as its last stage), its prefill
    # takes over 0.3 s, so the cancel at 0.15 s lands mid-prefill on any machine (with 10 ms,
    # a fast one prefilled and decoded it all before).
    prefill = deployment.pools.handles["prefill-0"]
    ray.get(prefill.set_step_delay.remote(0.1))
    try:
        call = client.stub.Generate(make_request(prompt_token_ids=prompt, max_tokens=50, temperature=0.0, ignore_eos=True))
        threading.Timer(0.15, call.cancel).start()
        with pytest.raises(grpc.RpcError) as info:
            for _ in call:
                pass
    finally:
        ray.get(prefill.set_step_delay.remote(0.0))
    assert info.value.code() == grpc.StatusCode.CANCELLED
    client.wait_until_idle()


def test_a_newer_attempt_of_a_request_the_decode_actor_still_holds_replaces_it(deployment, client, e2e_model):
    """The router's abort of an attempt it gave up may not arrive (the actor unreachable a
    moment); its next attempt, sent to the same actor, was refused as "already running": the
    client's INVALID_ARGUMENT for a server's hiccup. The newer attempt replaces the older."""
    import ray

    from decode_workers.messages import DecodeRequest
    from engine.sampling_params import SamplingParams

    (prompt,) = random_prompts([20], e2e_model.vocab_size, seed=12)
    decode = deployment.pools.handles["decode-0"]
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    ray.get(decode.add_local.remote(DecodeRequest("twice", prompt, params, attempt=1, router_id="test-router")))
    ray.get(decode.add_local.remote(DecodeRequest("twice", prompt, params, attempt=2, router_id="test-router")))
    assert ray.get(decode.abort.remote("twice", 1)) is False, "attempt 1 was replaced"
    assert ray.get(decode.abort.remote("twice", 2)) is True
    client.wait_until_idle()


def test_expired_deadline_frees_every_block(client, e2e_model):
    (prompt,) = random_prompts([200], e2e_model.vocab_size, seed=10)
    with pytest.raises(grpc.RpcError) as info:
        client.generate(timeout=0.3, prompt_token_ids=prompt, max_tokens=1500, temperature=0.0, ignore_eos=True)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    client.wait_until_idle()


@pytest.mark.parametrize(
    "request_fields, field",
    [
        (dict(), "prompt"),
        (dict(prompt_text="hi", prompt_token_ids=[5]), "prompt"),
        (dict(prompt_token_ids=[5, 100000]), "prompt_token_ids"),
        (dict(prompt_token_ids=list(range(3, 300)) * 7), "prompt"),
        (dict(prompt_token_ids=[5], max_tokens=0), "max_tokens"),
        (dict(prompt_token_ids=[5], temperature=-1.0), "temperature"),
        (dict(prompt_token_ids=[5], top_p=1.5), "top_p"),
        (dict(prompt_token_ids=[5], top_p=0.0), "top_p"),
        (dict(prompt_token_ids=[5], top_k=-5), "top_k"),
        (dict(prompt_token_ids=[5], min_p=2.0), "min_p"),
        (dict(prompt_token_ids=[5], logprobs=1000), "logprobs"),
        (dict(prompt_token_ids=[5], stop=[""]), "stop"),
        (dict(prompt_token_ids=[5], stop_token_ids=[99999]), "stop_token_ids"),
        (dict(prompt_token_ids=[5], presence_penalty=3.0), "presence_penalty"),
        (dict(prompt_token_ids=[5], structured_output=pb.StructuredOutput(json_schema="{nope")), "sampling.structured_output.json_schema"),
        (dict(prompt_token_ids=[5], structured_output=pb.StructuredOutput(regex="(open")), "sampling.structured_output.regex"),
    ],
)
def test_bad_input_is_invalid_argument_naming_the_field(client, request_fields, field):
    with pytest.raises(grpc.RpcError) as info:
        client.generate(**request_fields)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.details()


def test_structured_output_and_logit_bias_over_grpc(client, e2e_model, hf_tokenizer):
    (prompt,) = random_prompts([40], e2e_model.vocab_size, seed=31)  # prefilled on the prefill actor
    for seed in range(3):
        stream = client.generate(
            prompt_token_ids=prompt, max_tokens=60, temperature=1.0, seed=seed,
            structured_output=pb.StructuredOutput(choice=pb.StringList(values=["alpha beta", "gamma", "delta!"])),
        )
        assert stream.text in ("alpha beta", "gamma", "delta!") and stream.last.finish_reason == pb.FINISH_REASON_EOS
    greedy = hf_greedy(e2e_model.hf_model, prompt, 1)[0]
    banned = client.generate(prompt_token_ids=prompt, max_tokens=1, temperature=0.0, logit_bias={greedy: -100.0})
    assert banned.token_ids != [greedy]


def test_unknown_enum_value_and_bad_request_id_are_refused(client):
    request = make_request(prompt_token_ids=[5, 6], max_tokens=2)
    request.request_id = "bad id with spaces"
    with pytest.raises(grpc.RpcError) as info:
        list(client.stub.Generate(request))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in info.value.details()
    admin_request = pb.ScalePoolRequest(replicas=1)
    admin_request.role = 7  # not a WorkerRole
    with pytest.raises(grpc.RpcError) as info:
        client.admin.ScalePool(admin_request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "role" in info.value.details()


# Values at and past every field's edge: the mutations below draw from these.
_EDGE_INTS = [0, 1, -1, 255, 2**15, 2**31 - 1, -(2**31), 2**32 - 1, 2**63 - 1, 2**64 - 1]
_EDGE_FLOATS = [0.0, -0.0, 1e-45, 0.5, 2.0, -1.0, 1e30, -1e30, float("inf"), float("-inf"), float("nan")]
_EDGE_STRINGS = ["", "a", "\n", "é", "\x00", "x" * 5000, "[" * 300, "(unclosed"]
_EDGE_OUTPUTS = [
    {"regex": "(unclosed"}, {"regex": "a{1000000}"}, {"json_schema": "{"}, {"json_schema": "[" * 200 + "]" * 200},
    {"json_schema": '{"type": "integer", "minimum": 5, "maximum": 1}'}, {"grammar": "root ::= ("}, {"grammar": ""},
    {"choice": pb.StringList(values=[])}, {"choice": pb.StringList(values=["", "b"])}, {"json_object": True},
]


def _edge_value(field, rng):
    kind = field.type
    if kind in (field.TYPE_FLOAT, field.TYPE_DOUBLE):
        return rng.choice(_EDGE_FLOATS)
    if kind == field.TYPE_BOOL:
        return rng.random() < 0.5
    if kind == field.TYPE_STRING:
        return rng.choice(_EDGE_STRINGS)
    low, high = {field.TYPE_UINT32: (0, 2**32), field.TYPE_INT32: (-(2**31), 2**31), field.TYPE_UINT64: (0, 2**64)}[kind]
    return rng.choice([value for value in _EDGE_INTS if low <= value < high])


def _mutated_request(rng) -> pb.GenerateRequest:
    """A valid request with one to four fields set to values at or past their edges."""
    request = make_request(prompt_token_ids=[rng.randrange(1, 200) for _ in range(rng.randint(1, 30))], max_tokens=rng.randint(1, 5))
    sampling = request.sampling
    for _ in range(rng.randint(1, 4)):
        field = rng.choice(sampling.DESCRIPTOR.fields)
        if field.name == "structured_output":
            sampling.structured_output.CopyFrom(pb.StructuredOutput(**rng.choice(_EDGE_OUTPUTS)))
        elif field.name == "logit_bias":
            sampling.logit_bias[rng.choice([0, 5, 2**32 - 1])] = rng.choice(_EDGE_FLOATS)
        elif field.is_repeated:
            getattr(sampling, field.name).extend(_edge_value(field, rng) for _ in range(rng.choice([0, 1, 3, 300])))
        else:
            setattr(sampling, field.name, _edge_value(field, rng))
    edit = rng.random()
    if edit < 0.15:
        request.priority = rng.choice([2**31 - 1, -(2**31), 101])
    elif edit < 0.3:
        request.truncate_prompt_tokens = rng.choice([0, -2, 2**31 - 1])
    elif edit < 0.4:
        request.lora_name = rng.choice(_EDGE_STRINGS)
    elif edit < 0.55:
        del request.prompt_token_ids[:]
        request.prompt_token_ids.extend(rng.choice([[], [2**32 - 1], [1] * 5000]))
    elif edit < 0.65:
        request.prompt_text = rng.choice(_EDGE_STRINGS)  # with token ids too, or alone
    return request


def test_mutated_requests_are_answered_or_refused_naming_the_field_and_leave_no_block_behind(client):
    """Seeded requests with fields at and past their edges (NaN and infinite floats, the largest
    integers, empty and huge lists and strings, grammars that do not compile or match nothing):
    each is served or refused with a client's status whose message names what was wrong, never
    INTERNAL or UNKNOWN; afterwards no worker holds a block."""
    rng = random.Random(2026)
    refused = 0
    for _ in range(150):
        request = _mutated_request(rng)
        try:
            messages = list(client.stub.Generate(request, timeout=60))
            assert messages[-1].finish_reason != pb.FINISH_REASON_ERROR, (request, messages[-1])
        except grpc.RpcError as error:
            refused += 1
            assert error.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), (request, error.code(), error.details())
            assert error.details() and ":" in error.details(), error.details()  # "field: problem"
    assert 30 < refused < 150  # the mutations reach both answers and refusals
    assert all(w.num_kv_blocks_used == 0 for w in client.wait_until_idle())


def test_server_keeps_serving_after_bad_requests(client, e2e_model):
    for _ in range(3):
        with pytest.raises(grpc.RpcError):
            client.generate(prompt_token_ids=[5], top_p=7.0)
    (prompt,) = random_prompts([10], e2e_model.vocab_size, seed=11)
    stream = client.generate(prompt_token_ids=prompt, max_tokens=5, temperature=0.0, ignore_eos=True)
    assert stream.token_ids == hf_greedy(e2e_model.hf_model, prompt, 5)
    client.wait_until_idle()


def test_backpressure_answers_resource_exhausted_at_once(deployment, client, e2e_model):
    config = deployment.router.config
    saved = config.max_queued_requests
    config.max_queued_requests = 0  # everything beyond the limit; the admission rule itself is unit-tested
    try:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            client.generate(prompt_token_ids=[5, 6, 7], max_tokens=3)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "retry later" in info.value.details()
        assert time.monotonic() - started < 1.0, "refused at once, not queued"
    finally:
        config.max_queued_requests = saved
    assert len(client.generate(prompt_token_ids=[5, 6, 7], max_tokens=3, ignore_eos=True).token_ids) == 3
    client.wait_until_idle()


def test_model_info_health_and_reflection(client, e2e_model, deployment):
    info = client.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.vocab_size == e2e_model.vocab_size
    assert info.architecture == "LlamaForCausalLM"
    assert info.max_context_len == 2048
    assert info.block_size == 16
    health = health_pb2_grpc.HealthStub(client.channel)
    assert health.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    def listed(channel) -> set[str]:
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        return {s.name for r in responses for s in r.list_services_response.service}

    # Admin is served on its own (loopback) port only.
    assert {"pdserve.v1.Generation", "grpc.health.v1.Health"} <= listed(client.channel)
    assert "pdserve.v1.Admin" not in listed(client.channel)
    assert "pdserve.v1.Admin" in listed(client.admin_channel)
    roles = sorted(w.role for w in client.status())
    assert roles == [pb.WORKER_ROLE_PREFILL, pb.WORKER_ROLE_DECODE]


@pytest.mark.parametrize(
    "method, raw",
    [
        ("/pdserve.v1.Generation/Generate", b"\x0a\xff\xff\xff\xff\x0f"),  # field 1 claims a 4 GB string
        ("/pdserve.v1.Generation/Generate", b"\x1a\x03\x80\x80"),  # packed ids cut mid-varint
        ("/pdserve.v1.Generation/GetModelInfo", b"\xff"),
        ("/pdserve.v1.Admin/ScalePool", b"\x08"),  # a tag with no value
    ],
)
def test_malformed_request_bytes_are_invalid_argument_not_unknown(deployment, method, raw):
    """Hand-made bytes on a generic channel: the server answers INVALID_ARGUMENT naming the message
    type (it used to be UNKNOWN with a traceback in the log) and keeps serving."""
    channel = grpc.insecure_channel(deployment.admin_address if method.startswith("/pdserve.v1.Admin/") else deployment.address)
    call = channel.unary_stream(method) if method.endswith("/Generate") else channel.unary_unary(method)
    with pytest.raises(grpc.RpcError) as info:
        result = call(raw, timeout=10)
        list(result) if method.endswith("/Generate") else result
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "pdserve.v1." in info.value.details() and "not a valid" in info.value.details()
    channel.close()


def test_text_far_beyond_the_context_is_refused_before_tokenizing(client, deployment):
    limits = deployment.router.limits
    text = "x" * (limits.max_prompt_chars_per_token * limits.max_context_len + 1)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        client.generate(prompt_text=text, max_tokens=2)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_text" in info.value.details() and "characters" in info.value.details()
    assert time.monotonic() - started < 2.0


def test_a_long_text_prompt_does_not_stall_other_streams(client, e2e_model, deployment):
    """The largest text accepted is tokenized off the router's event loop: a stream already running
    keeps receiving tokens meanwhile (inline, every stream stalled for seconds)."""
    saved = deployment.router.limits
    # A limit loose enough for two megabytes of text: seconds of tokenizing.
    deployment.router.limits = dataclasses.replace(saved, max_prompt_chars_per_token=1 << 30)
    big_text = "def f(x):\n    return x * 2  # twice\n" * 100_000  # 3.6 MB, under grpc's 4 MB message limit
    (prompt,) = random_prompts([8], e2e_model.vocab_size, seed=12)
    gaps: list[float] = []
    received: list[int] = []

    def stream_tokens():
        stream = client.generate(prompt_token_ids=prompt, max_tokens=200, temperature=0.0, ignore_eos=True)
        times = stream.arrival_times
        gaps.extend(b - a for a, b in zip(times, times[1:]))
        received.append(len(stream.token_ids))

    runner = threading.Thread(target=stream_tokens)
    runner.start()
    time.sleep(0.3)
    try:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            client.generate(prompt_text=big_text, max_tokens=2)  # tokenizes to more than the context holds
        tokenizing_s = time.monotonic() - started
    finally:
        deployment.router.limits = saved
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in info.value.details()
    runner.join(60)
    assert tokenizing_s > 1.0, "the text must take long enough to tokenize for a stall to show"
    assert received == [200]
    assert max(gaps) < 1.0, f"a stream stalled {max(gaps):.2f}s while a long text was tokenized"
    client.wait_until_idle()


def test_admin_refuses_to_leave_nothing_serving_or_to_wait_for_missing_resources(client, deployment):
    """ScalePool(DECODE, 0) and draining the only decode actor used to succeed and leave nothing
    serving; growing a pool beyond the cluster's free CPUs answered INTERNAL after 300 s."""
    with pytest.raises(grpc.RpcError) as info:
        client.admin.ScalePool(pb.ScalePoolRequest(role=pb.WORKER_ROLE_DECODE, replicas=0))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "force" in info.value.details()
    (decode,) = [w.worker_id for w in client.status() if w.role == pb.WORKER_ROLE_DECODE]
    with pytest.raises(grpc.RpcError) as info:
        client.admin.DrainWorker(pb.DrainWorkerRequest(worker_id=decode))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and decode in info.value.details()
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        client.admin.ScalePool(pb.ScalePoolRequest(role=pb.WORKER_ROLE_PREFILL, replicas=60), timeout=30)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "CPU" in info.value.details() and "free" in info.value.details()
    assert time.monotonic() - started < 5.0
    assert sorted(w.role for w in client.wait_until_idle()) == [pb.WORKER_ROLE_PREFILL, pb.WORKER_ROLE_DECODE]
    assert len(client.generate(prompt_token_ids=[5, 6, 7], max_tokens=3, ignore_eos=True).token_ids) == 3


def test_a_worker_that_does_not_start_is_named_and_the_pool_keeps_trying(client, deployment):
    """A scale-up whose worker never became ready answered INTERNAL ('the server log has the
    details'); it says what happened, and the pool still grows to the size asked once workers
    start again."""
    spec = deployment.pools.spec
    normal, spec.startup_timeout_s = spec.startup_timeout_s, 0.001
    try:
        with pytest.raises(grpc.RpcError) as info:
            client.admin.ScalePool(pb.ScalePoolRequest(role=pb.WORKER_ROLE_PREFILL, replicas=2), timeout=60)
    finally:
        spec.startup_timeout_s = normal
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "did not start" in info.value.details() and "startup_timeout_s" in info.value.details()
    deadline = time.monotonic() + 60
    while sum(w.role == pb.WORKER_ROLE_PREFILL for w in client.wait_until_idle()) < 2:
        assert time.monotonic() < deadline, "the pool did not launch the missing worker again"
        time.sleep(0.5)
    client.admin.ScalePool(pb.ScalePoolRequest(role=pb.WORKER_ROLE_PREFILL, replicas=1))
    assert len(client.generate(prompt_token_ids=[5, 6, 7], max_tokens=3, ignore_eos=True).token_ids) == 3
