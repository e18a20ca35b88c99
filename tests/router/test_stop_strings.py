"""Stop strings end generation across token boundaries, and the client never sees their start."""

from __future__ import annotations

import random

import pytest

from router.detokenizer import IncrementalDetokenizer
from router.stop_strings import StopStringMatcher


def feed_all(matcher: StopStringMatcher, deltas: list[str]) -> tuple[str, str | None]:
    """Feed deltas until a stop matches; return the released text (flushed if none matched) and the stop."""
    out = []
    for delta in deltas:
        check = matcher.feed(delta)
        out.append(check.text)
        if check.matched_stop is not None:
            return "".join(out), check.matched_stop
    out.append(matcher.flush())
    return "".join(out), None


def expected(text: str, stops: list[str]) -> tuple[str, str | None]:
    found = [(text.find(s), i, s) for i, s in enumerate(stops) if s in text]
    if not found:
        return text, None
    index, _, stop = min(found)
    return text[:index], stop


def test_stop_string_split_over_deltas_cuts_before_it():
    matcher = StopStringMatcher(["\n\n"])
    assert matcher.feed("Hello world\n").text == "Hello world"
    check = matcher.feed("\nBye")
    assert (check.text, check.matched_stop) == ("", "\n\n")
    assert matcher.feed("more").text == ""


def test_held_text_is_released_when_the_stop_does_not_complete():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("go ST").text == "go "
    assert matcher.held_text == "ST"
    assert matcher.feed("ART").text == "START"
    assert matcher.feed(" ST").text == " "
    assert matcher.flush() == "ST"


def test_only_text_that_can_start_a_stop_is_held():
    matcher = StopStringMatcher(["abc", "xyz"])
    assert matcher.feed("hello a").text == "hello "
    assert matcher.feed("b").text == ""
    assert matcher.feed("x").text == "ab"  # "abx" cannot start either stop; "x" can
    assert matcher.held_text == "x"


def test_earliest_match_wins_when_two_stops_complete_together():
    matcher = StopStringMatcher(["world", "lo w"])
    check = matcher.feed("hello world")
    assert (check.text, check.matched_stop) == ("hel", "lo w")


def test_stop_at_the_very_start_gives_empty_text():
    assert StopStringMatcher(["###"]).feed("### rest").text == ""


def test_no_stops_passes_text_through():
    matcher = StopStringMatcher([])
    assert matcher.feed("anything").text == "anything"
    assert matcher.flush() == ""


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])


@pytest.mark.parametrize("seed", range(200))
def test_random_text_and_splits_match_a_whole_text_search(seed):
    rng = random.Random(seed)
    alphabet = "ab\n東😀"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 8))))
    deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]

    matcher = StopStringMatcher(stops)
    released = ""
    for delta in deltas:
        check = matcher.feed(delta)
        released += check.text
        if check.matched_stop is not None:
            break
        # What was released can never be cut by a later stop: no stop starts inside it.
        seen = released + matcher.held_text
        assert all(seen.find(s) == -1 or seen.find(s) >= len(released) for s in stops)
    got = feed_all(StopStringMatcher(stops), deltas)
    assert got == expected(text, stops), (text, stops, deltas)


def test_stop_string_spanning_tokens_through_the_detokenizer(byte_level_tokenizer):
    tok = byte_level_tokenizer
    text = "The quick brown fox jumps over the lazy dog. 東京は日本の首都です。"
    token_ids = tok.encode(text, add_special_tokens=False)
    for stop in ["lazy dog", "x j", "都で", "す。"]:
        assert not any(stop in tok.decode([t]) for t in token_ids), "stop must span tokens for this test"
        detok = IncrementalDetokenizer(tok)
        matcher = StopStringMatcher([stop])
        sent, num_tokens = [], 0
        for token_id in token_ids:
            num_tokens += 1
            check = matcher.feed(detok.add_tokens([token_id]))
            sent.append(check.text)
            if check.matched_stop:
                break
        assert check.matched_stop == stop
        assert "".join(sent) == text[: text.index(stop)]
        # Generation ends on the token that completes the stop string, not later.
        assert stop in tok.decode(token_ids[:num_tokens]) and stop not in tok.decode(token_ids[: num_tokens - 1])


def test_include_stop_keeps_the_stop_string_that_ended_the_text():
    """vLLM's include_stop_str_in_output: the text runs to the stop string's end, however it was cut."""
    matcher = StopStringMatcher(["\n\n", "END"], include_stop=True)
    assert matcher.feed("one\n").text == "one"
    check = matcher.feed("\ntwo")
    assert (check.text, check.matched_stop) == ("\n\n", "\n\n")
    assert matcher.feed("more").text == ""


def test_the_text_of_the_first_min_tokens_tokens_is_never_cut_by_a_stop_string(byte_level_tokenizer):
    """vLLM's rule: stop strings are matched from the token after ``min_tokens`` on (min_tokens 1
    is how clients ask for no empty answer: a first "\\n" must not end it). Token by token, also
    within one output that carries several (stream_interval, speculative decoding)."""
    from decode_workers.messages import SeqOutput
    from engine.sampling_params import SamplingParams
    from router.output_stream import OutputAssembler
    from router.validation import ValidatedRequest

    (nl,), (a,), (b,) = (byte_level_tokenizer.encode(t, add_special_tokens=False) for t in ("\n", "a", "b"))

    def answer(min_tokens: int, outputs: list[list[int]]) -> tuple[str, str | None]:
        return _answer(byte_level_tokenizer, ["\n"], min_tokens, outputs)

    assert answer(0, [[nl], [a]]) == ("", "\n")
    assert answer(1, [[nl], [a], [nl], [b]]) == ("\na", "\n")
    assert answer(3, [[a], [nl, a, nl, b]]) == ("a\na", "\n")  # the 4th token, mid-output, matches
    assert answer(3, [[a, nl, a, b]]) == ("a\nab", None)
    # A stop string that spans outputs still ends the answer, with or without a minimum.
    request = lambda min_tokens: ValidatedRequest("r", [72], None, SamplingParams(min_tokens=min_tokens, max_tokens=50), ["ab"], True, 0, 0.0, None)
    for min_tokens in (0, 1):
        assembler, text, end = OutputAssembler(request(min_tokens), byte_level_tokenizer), "", None
        for ids in ([nl], [nl], [a], [b], [nl]):
            chunk = assembler.on_output(SeqOutput("r", ids))
            text += chunk.text
            if chunk.end is not None:
                end = chunk.end.matched_stop
                break
        assert (text, end) == ("\n\n", "ab"), min_tokens


def test_a_stop_string_that_begins_inside_min_tokens_and_ends_after_it_matches(byte_level_tokenizer):
    """As vLLM looks back: min_tokens 2 with stop "ab" and the answer "a", "b": the stop begins in
    the second token (unmatched) and ends in the third, so the answer ends before it; the "a" was
    released unmatched and the stop could no longer end it. One that lies wholly within the
    minimum never matches, even where a longer stop held it back."""
    (x,), (a,), (b,), (c,) = (byte_level_tokenizer.encode(t, add_special_tokens=False) for t in ("x", "a", "b", "c"))

    def answer(stops: list[str], min_tokens: int, outputs: list[list[int]]) -> tuple[str, str | None]:
        return _answer(byte_level_tokenizer, stops, min_tokens, outputs)

    assert answer(["ab"], 2, [[x], [a], [b], [x]]) == ("x", "ab")
    assert answer(["ab"], 2, [[x, a, b, x]]) == ("x", "ab")  # the same within one output
    assert answer(["ab", "abc"], 2, [[a], [b], [x]]) == ("abx", None)  # "ab" lay within the minimum
    assert answer(["ab", "abc"], 2, [[a], [b], [c]]) == ("", "abc")  # "abc" ends after it


def test_text_held_for_a_stop_string_reaches_the_client_when_the_request_fails(byte_level_tokenizer):
    """A failure after tokens were sent ends the stream with a last chunk (final_chunk): the
    text held back as the possible start of a stop string was generated, and no stop can end it
    now. It was dropped."""
    from decode_workers.messages import SeqOutput
    from engine.sampling_params import SamplingParams
    from router.output_stream import OutputAssembler
    from router.validation import ValidatedRequest

    (a,), (nl,) = (byte_level_tokenizer.encode(t, add_special_tokens=False) for t in ("a", "\n"))
    request = ValidatedRequest("r", [72], None, SamplingParams(max_tokens=50), ["\n\n"], True, 0, 0.0, None)
    assembler = OutputAssembler(request, byte_level_tokenizer)
    assert assembler.on_output(SeqOutput("r", [a, nl])).text == "a"  # "\n" may begin the stop
    last = assembler.final_chunk("error", "decode worker lost")
    assert (last.text, last.end.reason) == ("\n", "error")


def test_a_failed_request_keeps_the_text_its_detokenizer_still_held(wordpiece_cleanup_dir):
    """A tokenizer that cleans up spaces holds back the last characters of its text (" ." may
    still become "."): a stream that failed after tokens were sent lost them, though their token
    ids were sent."""
    from decode_workers.messages import SeqOutput
    from engine.sampling_params import SamplingParams
    from router.output_stream import OutputAssembler
    from router.tokenizer import Tokenizer
    from router.validation import ValidatedRequest

    tokenizer = Tokenizer.from_model_dir(wordpiece_cleanup_dir)
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog", add_special_tokens=False)
    request = ValidatedRequest("r", [5], None, SamplingParams(max_tokens=50), [], True, 0, 0.0, None)
    assembler = OutputAssembler(request, tokenizer)
    sent = assembler.on_output(SeqOutput("r", ids)).text
    last = assembler.final_chunk("error", "decode worker lost")
    after_prompt = tokenizer.decode([5] + ids, True)[len(tokenizer.decode([5], True)) :]
    assert sent + last.text == after_prompt and len(last.text) > 0


@pytest.mark.parametrize("include_stop", [False, True])
def test_tokens_after_the_one_that_completed_a_stop_string_are_no_part_of_the_answer(byte_level_tokenizer, include_stop):
    """Several steps' tokens arrive in one output (merged on their way, a stream interval,
    drafts): when a stop string matched, the text was cut but the token ids, log-probabilities
    and usage kept every token, so one greedy request reported different usage run to run.
    They end at the token that completed the stop, as vLLM's do."""
    from decode_workers.messages import SeqOutput
    from engine.sampling_params import SamplingParams, TokenLogprob
    from router.output_stream import OutputAssembler
    from router.validation import ValidatedRequest

    (a,), (nl,), (b,) = (byte_level_tokenizer.encode(t, add_special_tokens=False) for t in ("a", "\n", "b"))
    request = ValidatedRequest("r", [72], None, SamplingParams(max_tokens=50, logprobs=0), ["\n\n"], True, 0, 0.0, None, include_stop_str=include_stop)
    assembler = OutputAssembler(request, byte_level_tokenizer)
    first = assembler.on_output(SeqOutput("r", [a, nl], logprobs=[TokenLogprob(t, -1.0, 1, []) for t in (a, nl)]))
    tokens = [nl, b, a, b]
    last = assembler.on_output(SeqOutput("r", tokens, logprobs=[TokenLogprob(t, -1.0, 1, []) for t in tokens]))
    assert (first.text + last.text, last.end.reason) == ("a\n\n" if include_stop else "a", "stop")
    assert first.token_ids + last.token_ids == [a, nl, nl] and [lp.token_id for lp in last.logprobs] == [nl]
    assert last.end.completion_tokens == 3


def _answer(tokenizer, stops: list[str], min_tokens: int, outputs: list[list[int]]) -> tuple[str, str | None]:
    """The answer's text and the stop that ended it, from the router's assembler fed these
    outputs (token ids each); text still held back is flushed where none ended it."""
    from decode_workers.messages import SeqOutput
    from engine.sampling_params import SamplingParams
    from router.output_stream import OutputAssembler
    from router.validation import ValidatedRequest

    request = ValidatedRequest("r", [72], None, SamplingParams(min_tokens=min_tokens, max_tokens=50), stops, True, 0, 0.0, None)
    assembler, text = OutputAssembler(request, tokenizer), ""
    for ids in outputs:
        chunk = assembler.on_output(SeqOutput("r", ids))
        text += chunk.text
        if chunk.end is not None:
            return text, chunk.end.matched_stop
    return text + assembler.stops.flush(), None
