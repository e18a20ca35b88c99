"""The prompt's log-probabilities reach a client once, on its first chunk, whole or not at all."""

from __future__ import annotations

from decode_workers.messages import SeqOutput
from engine.sampling_params import SamplingParams, TokenLogprob
from router.output_stream import OutputAssembler
from router.validation import ValidatedRequest


def _assembler(tokenizer, prompt: list[int], asked: int | None = 1) -> OutputAssembler:
    request = ValidatedRequest("r", prompt, None, SamplingParams(prompt_logprobs=asked), [], True, 0, 0.0, None)
    return OutputAssembler(request, tokenizer)


def _entries(prompt: list[int]) -> list[TokenLogprob]:
    return [TokenLogprob(token, -1.0 - i, i + 1) for i, token in enumerate(prompt[1:])]


def test_a_first_chunk_waits_for_a_report_that_covers_the_whole_prompt(byte_level_tokenizer):
    prompt = [72, 105, 33]
    assembler = _assembler(byte_level_tokenizer, prompt)
    assert assembler.awaits_prompt_logprobs
    assembler.prompt_logprobs = _entries(prompt)[:1]  # less than every token after the first
    assert assembler.awaits_prompt_logprobs
    assembler.prompt_logprobs = _entries(prompt)  # the prefill actor's report (dispatcher)
    assert not assembler.awaits_prompt_logprobs
    first = assembler.on_output(SeqOutput("r", [104]))
    later = assembler.on_output(SeqOutput("r", [105], finished=True, finish_reason="length"))
    assert first.prompt_logprobs == _entries(prompt) and later.prompt_logprobs is None


def test_a_decode_actor_that_prefilled_the_prompt_sends_them_with_its_first_output(byte_level_tokenizer):
    prompt = [72, 105, 33, 10]
    assembler = _assembler(byte_level_tokenizer, prompt, asked=0)
    chunk = assembler.on_output(SeqOutput("r", [104], prompt_logprobs=_entries(prompt)))
    assert chunk.prompt_logprobs == _entries(prompt) and not assembler.awaits_prompt_logprobs


def test_a_one_token_prompt_has_none_to_wait_for_and_unasked_chunks_carry_none(byte_level_tokenizer):
    single = _assembler(byte_level_tokenizer, [72])
    assert not single.awaits_prompt_logprobs
    assert single.on_output(SeqOutput("r", [104])).prompt_logprobs == []
    unasked = _assembler(byte_level_tokenizer, [72, 105], asked=None)
    assert not unasked.awaits_prompt_logprobs
    assert unasked.on_output(SeqOutput("r", [104])).prompt_logprobs is None


def test_the_token_that_ends_a_request_is_no_part_of_its_text_and_no_other_is(byte_level_tokenizer):
    """vLLM's rule: an EOS (finish "eos") or a stop token id (finish "stop") that ended the
    request is left out of its text; a grammar's last token (finish "eos" too) is its text, even
    where it is also one of the request's stop token ids."""
    def text(finish: str, stop_token_ids: list[int], skip: bool = True, include: bool = False) -> str:
        request = ValidatedRequest("r", [72], None, SamplingParams(stop_token_ids=stop_token_ids), [], skip, 0, 0.0, None, include_stop_str=include)
        assembler = OutputAssembler(request, byte_level_tokenizer, eos_token_ids=[2])
        chunks = [assembler.on_output(SeqOutput("r", [104])), assembler.on_output(SeqOutput("r", [105, 125], finished=True, finish_reason=finish))]
        return "".join(chunk.text for chunk in chunks)

    whole = byte_level_tokenizer.decode([104, 105, 125])
    assert text("stop", [125]) == byte_level_tokenizer.decode([104, 105])
    assert text("stop", [125], include=True) == whole  # include_stop_str_in_output keeps it
    assert text("eos", [125]) == whole  # 125 ended a grammar's answer, not as a stop token
    assert text("length", [125]) == whole


def test_a_kept_stop_token_whose_text_completes_a_stop_string_is_reported_as_the_token(byte_level_tokenizer):
    """include_stop_str_in_output with stop=["}"] and the token of "}" as a stop token id: the
    token ended the request (its id is the stop reason) and the decode timing is kept."""
    word, brace = byte_level_tokenizer.encode("ok", add_special_tokens=False), byte_level_tokenizer.encode("}", add_special_tokens=False)
    (stop_id,) = brace
    request = ValidatedRequest("r", [72], None, SamplingParams(stop_token_ids=[stop_id]), ["}"], True, 0, 0.0, None, include_stop_str=True)
    assembler = OutputAssembler(request, byte_level_tokenizer, eos_token_ids=[2])
    last = assembler.on_output(SeqOutput("r", [*word, stop_id], finished=True, finish_reason="stop"))
    assert last.text == "ok}"
    assert (last.end.matched_stop_token_id, last.end.matched_stop) == (stop_id, "")


def test_a_migrated_request_whose_new_cache_held_more_than_its_prompt_reports_sane_usage(byte_level_tokenizer):
    """After a migration the last prefill was of the prompt and the tokens already sent, and a
    prefix cache may hold more than the prompt of it (a twin that generated the same tokens):
    the usage's cached tokens stay within the prompt, and the gRPC answer's last message is sent
    (a negative count of prompt tokens computed failed it with INTERNAL)."""
    from decode_workers.messages import DecodeTiming
    from router.grpc_api import generate_response

    request = ValidatedRequest("r", list(range(40, 56)), None, SamplingParams(), [], True, 0, 0.0, None)
    assembler = OutputAssembler(request, byte_level_tokenizer)
    assembler.on_output(SeqOutput("r", list(range(60, 80))))
    last = assembler.on_output(SeqOutput("r", [104], finished=True, finish_reason="length", timing=DecodeTiming(num_cached_tokens=32)))
    assert last.end.cached_prompt_tokens == 16 and last.end.timing.prompt_tokens_computed == 0
    message = generate_response("r", last)
    assert message.usage.cached_prompt_tokens == 16 and message.timing.prompt_tokens_computed == 0


def test_a_stream_ended_by_a_stop_string_keeps_the_usage_its_first_output_reported(byte_level_tokenizer):
    """The router ends a request on a stop string (and aborts it on the decode actor), so no last
    output with the decode actor's timing comes: the first output's timing is what the usage
    has of the prompt's cached tokens (a decode actor that prefilled it itself)."""
    from decode_workers.messages import DecodeTiming

    (nl,) = byte_level_tokenizer.encode("\n", add_special_tokens=False)
    request = ValidatedRequest("r", list(range(40, 72)), None, SamplingParams(), ["\n"], True, 0, 0.0, None)
    assembler = OutputAssembler(request, byte_level_tokenizer)
    assembler.on_output(SeqOutput("r", [104], timing=DecodeTiming(num_cached_tokens=16)))
    last = assembler.on_output(SeqOutput("r", [nl]))
    assert last.end.reason == "stop" and last.end.cached_prompt_tokens == 16 and last.end.timing.prompt_tokens_computed == 16
