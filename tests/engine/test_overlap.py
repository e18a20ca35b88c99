"""Overlapped steps (async scheduling) give the tokens steps run one at a time give, token for
token, and account for every block: prompts in chunks, stop tokens that land while the next
step is in flight, lengths, preemption under block pressure, aborts mid-flight, logprobs read
with the tokens, penalties and min_tokens counting tokens the host has not read yet, and rows
that need the host (bad words) forcing a step to run at once. On a CPU the overlap changes nothing
but the order of work, which is exactly what these tests hold fixed."""

from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.default_model_path import DEFAULT_MODEL_PATH
from tests.checkpoints import random_prompts

VOCAB = 4096
LENGTHS = [5, 37, 70, 12, 100, 3, 64, 17]
MAX_TOKENS = [10, 30, 5, 40, 25, 50, 8, 33]


def _engine(overlap: bool, **config) -> LLMEngine:
    config = {"num_kv_blocks": 96, "max_num_batched_tokens": 64, **config}
    return LLMEngine(DEFAULT_MODEL_PATH, EngineConfig(async_scheduling=overlap, **config))


def _streams(engine: LLMEngine, prompts, params, abort_at: dict[int, str] | None = None) -> dict[str, tuple[list[int], str | None, int]]:
    """Each request's streamed tokens, finish reason and how many outputs said it finished,
    stepping until done (aborting request ``abort_at[step]`` before that step)."""
    streams = {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
        streams[f"r{i}"] = ([], None, 0)
    step = 0
    while engine.has_unfinished_requests():
        if abort_at and step in abort_at:
            engine.abort_request(abort_at[step])
        for out in engine.step():
            tokens, reason, finished = streams[out.req_id]
            assert finished == 0, f"{out.req_id}: an output after the one that finished it"
            streams[out.req_id] = (tokens + out.new_token_ids, out.finish_reason.value if out.finish_reason else reason, finished + out.finished)
        step += 1
        assert step < 2000
    return streams


@pytest.fixture(scope="module")
def engines():
    return {overlap: _engine(overlap) for overlap in (False, True)}


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(LENGTHS, VOCAB, seed=3)


def _counting_overlap(engine: LLMEngine) -> dict:
    """Counts the steps launched overlapped and the rows that read their input on the device."""
    counts = {"overlapped": 0, "pending_rows": 0}
    launch, fill = engine._run_overlapped, engine.runner.fill_pending_inputs

    def run_overlapped(batch):
        counts["overlapped"] += 1
        return launch(batch)

    def fill_pending(step, input_ids):
        counts["pending_rows"] += len(step.pending_rows)
        return fill(step, input_ids)

    engine._run_overlapped, engine.runner.fill_pending_inputs = run_overlapped, fill_pending
    return counts


def test_greedy_streams_equal_steps_run_one_at_a_time_and_every_block_comes_back(engines, prompts):
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    plain = _streams(engines[False], prompts, params)
    # Stop tokens taken from the plain run, so requests stop mid-stream on a token while the
    # next step is already in flight.
    stopped = [
        SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, stop_token_ids=[plain[f"r{i}"][0][m // 2]] if i % 3 == 0 else [])
        for i, m in enumerate(MAX_TOKENS)
    ]
    counts = _counting_overlap(engines[True])
    for run in (params, stopped):
        want = _streams(engines[False], prompts, run)
        got = _streams(engines[True], prompts, run)
        assert got == want
        assert all(finished == 1 for _, _, finished in got.values())
        assert engines[True].num_free_blocks == engines[True].kv_cache.num_blocks
    assert any(reason == "stop" for _, reason, _ in want.values()), "a stop token ended a request early"
    assert counts["overlapped"] > 50 and counts["pending_rows"] > 200, counts


def test_preemption_under_block_pressure_reads_the_step_in_flight_first(prompts):
    params = [SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True) for _ in prompts]
    small = {"num_kv_blocks": 24, "enable_prefix_caching": False}
    want = _streams(_engine(False, **small), prompts, params)
    engine = _engine(True, **small)
    got = _streams(engine, prompts, params)
    assert got == want
    assert engine.scheduler.num_preemptions > 0, "the cache was small enough to preempt"
    assert engine.num_free_blocks == engine.kv_cache.num_blocks


def test_an_abort_while_its_step_is_in_flight_frees_its_blocks_and_ends_its_stream(engines, prompts):
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True) for _ in prompts]
    want = _streams(engines[False], prompts, params, abort_at={12: "r1", 20: "r4"})
    got = _streams(engines[True], prompts, params, abort_at={12: "r1", 20: "r4"})
    assert got["r1"][0] == want["r1"][0][: len(got["r1"][0])] and got["r4"][0] == want["r4"][0][: len(got["r4"][0])]
    assert {k: v for k, v in got.items() if k not in ("r1", "r4")} == {k: v for k, v in want.items() if k not in ("r1", "r4")}
    assert engines[True].num_free_blocks == engines[True].kv_cache.num_blocks


def test_logprobs_travel_with_the_overlapped_tokens(engines, prompts):
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=3 if i % 2 else 0) for i, m in enumerate(MAX_TOKENS)]
    counts = _counting_overlap(engines[True])
    got = engines[True].generate(prompts, params)
    want = engines[False].generate(prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [[(lp.token_id, lp.logprob, lp.rank, lp.top) for lp in c.logprobs] for c in got] == [
        [(lp.token_id, lp.logprob, lp.rank, lp.top) for lp in c.logprobs] for c in want
    ]
    assert all(len(c.logprobs) == len(c.token_ids) for c in got) and len(got[1].logprobs[0].top) == 3
    assert counts["overlapped"] > 40


def test_penalties_bias_allowed_tokens_and_min_tokens_apply_on_the_device_and_count_the_unread_token(engines, prompts):
    """Repetition, frequency and presence penalties count each sequence's newest token while
    the host has not read it yet (folded in from the step in flight's samples), and so does
    min_tokens (a stop token allowed from the seventh token on ends the request right there);
    logit_bias and allowed_token_ids apply on the device too: every token equals the classic run's."""
    plain = engines[False].generate(prompts, [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS])
    allowed = list(range(3, 900))
    params = [
        SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, repetition_penalty=1.3 if i % 2 else 1.0,
                       frequency_penalty=0.4 if i % 3 == 0 else 0.0, presence_penalty=0.6 if i % 4 == 1 else 0.0,
                       logit_bias={5: 3.0, 17: -2.0} if i == 5 else {}, allowed_token_ids=allowed if i == 7 else None,
                       min_tokens=6 if i == 4 else 0, stop_token_ids=[plain[4].token_ids[6]] if i == 4 else [])
        for i, m in enumerate(MAX_TOKENS)
    ]
    counts = _counting_overlap(engines[True])
    got = engines[True].generate(prompts, params)
    want = engines[False].generate(prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert sum(a.token_ids != b.token_ids for a, b in zip(want, plain)) >= 4, "the penalties changed the answers"
    # The stop comes exactly when min_tokens lets it (the seventh token): counting one token
    # short would hold it off one step more and change the answer.
    assert plain[4].token_ids[6] not in plain[4].token_ids[:6]
    assert want[4].token_ids == plain[4].token_ids[:7]
    assert counts["overlapped"] > 40


def test_rows_that_need_the_host_run_at_once_among_overlapped_ones(engines, prompts):
    """Bad words on two short requests (whether a word's last token is banned depends on the
    tokens read): their steps are read before the next is scheduled, the others' overlap once
    they end; every token is the same."""
    plain = engines[False].generate(prompts, [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS])
    params = [
        SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, bad_words_token_ids=[plain[i].token_ids[1:3]] if i in (2, 6) else [])
        for i, m in enumerate(MAX_TOKENS)
    ]
    got_engine, want_engine = engines[True], engines[False]
    counts = _counting_overlap(got_engine)
    steps_before = got_engine.num_steps
    got = got_engine.generate(prompts, params)
    want = want_engine.generate(prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert want[2].token_ids != plain[2].token_ids, "the bad word changed the answer"
    assert counts["overlapped"] > 10, "the steps after those requests ended overlapped"
    assert got_engine.num_steps - steps_before - counts["overlapped"] >= max(MAX_TOKENS[2], MAX_TOKENS[6]), "theirs ran at once"
    assert got_engine.num_free_blocks == got_engine.kv_cache.num_blocks


def test_the_context_limit_ends_a_request_without_computing_past_it(prompts):
    """Lengths are known ahead: no row is computed for a token past a request's end (the same
    tokens computed as steps run one at a time), whether max_model_len or max_tokens ends it."""
    params = [SamplingParams(max_tokens=500 if i < 2 else 20, temperature=0.0, ignore_eos=True) for i in range(3)]
    engines = {overlap: _engine(overlap, max_model_len=128) for overlap in (False, True)}
    want = _streams(engines[False], prompts[:3], params)
    got = _streams(engines[True], prompts[:3], params)
    assert got == want
    assert [(reason, len(prompts[i]) + len(tokens)) for i, (tokens, reason, _) in enumerate(got.values())] == [
        ("length", 128), ("length", 128), ("length", len(prompts[2]) + 20)
    ]
    assert engines[True].num_scheduled_tokens == engines[False].num_scheduled_tokens


def test_seeded_sampled_rows_draw_the_same_tokens_overlapped(engines, prompts, monkeypatch):
    """Seeded sampled rows drawn on the device (what a CUDA step draws: here on the CPU, with an
    exact stand-in for FlashInfer's kernels), top-k rows and whole rows, some with min-p: an overlapped step keys
    each draw by the position a step run at once gives it (the token in flight counted), so every
    seeded request repeats token for token."""
    import engine.sampler
    from tests.sampling_reference import ExactFlashInferSampling

    monkeypatch.setattr(engine.sampler, "_drawn_on_device", lambda seq, device: True)
    monkeypatch.setattr(engine.sampler, "_flashinfer_sampling", lambda: ExactFlashInferSampling())
    params = [SamplingParams(max_tokens=m, temperature=0.9, top_k=20 if i % 2 else 0, top_p=0.9, min_p=0.02 if i % 3 == 0 else 0.0,
                             seed=100 + i, ignore_eos=True)
              for i, m in enumerate(MAX_TOKENS)]
    counts = _counting_overlap(engines[True])
    got = engines[True].generate(prompts, params)
    want = engines[False].generate(prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert counts["overlapped"] > 40
    plain = engines[False].generate(prompts, [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS])
    assert sum(a.token_ids != b.token_ids for a, b in zip(want, plain)) >= 6, "sampled, not greedy"


def test_an_abort_of_a_request_its_step_in_flight_finishes_says_it_was_not_here(engines, prompts):
    """An abort reads the step in flight first; where that step's token ends the request (its
    last token, an EOS), the abort found it gone and raised UnknownRequestError out of the engine
    thread (a decode actor's cleanup of a departed router's requests stopped there). Now it says
    False, and the request's finish is delivered once, with its reason."""
    engine = engines[True]
    results = set()
    for steps_before in range(1, 6):
        engine.add_request("short", prompts[0], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        finishes = [out.finish_reason.value for _ in range(steps_before) for out in engine.step() if out.finished]
        aborted = engine.abort_request("short")
        while engine.has_unfinished_requests():
            finishes += [out.finish_reason.value for out in engine.step() if out.finished]
        results.add(aborted)
        assert len(finishes) == (0 if aborted else 1), (steps_before, aborted, finishes)
        assert engine.num_free_blocks == engine.kv_cache.num_blocks
    assert results == {True, False}  # aborted while running, and found finished by its step in flight


def test_an_aborted_requests_tokens_from_the_step_in_flight_go_to_nobody(engines, prompts):
    """With overlapped steps an abort reads the step in flight first; its tokens for the aborted
    request were kept and went out with the next step under the request's id, which a newer
    attempt of it (a decode actor takes a given-up attempt's place at once) then holds."""
    engine = engines[True]
    engine.add_request("again", prompts[1], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.abort_request("again")
    engine.add_request("again", prompts[0], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [token for out in engine.step() if out.req_id == "again" for token in out.new_token_ids]
    assert len(tokens) == 3  # the newer attempt's own, none of the aborted one's
    assert engine.num_free_blocks == engine.kv_cache.num_blocks
