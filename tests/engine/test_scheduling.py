"""Continuous batching under pressure: preemption, aborts, priorities, stop conditions."""

from __future__ import annotations

import json
import time

import pytest

from engine import EngineConfig, FinishReason, LLMEngine, SamplingParams
from tests.checkpoints import build_checkpoint, hf_greedy, random_prompts

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def _run_all(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            return tokens
        for out in engine.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
    raise AssertionError("engine did not finish its requests")


def test_too_small_cache_preempts_and_still_matches_transformers(checkpoints):
    path, model = checkpoints["qwen3"]
    prompts = random_prompts([30, 45, 12, 60, 25, 38], model.config.vocab_size, seed=11)
    expected = [hf_greedy(model, p, 20) for p in prompts]
    # 24 blocks of 4 tokens: any one request fits (at most 80 tokens), all six at once do not.
    engine = LLMEngine(path, EngineConfig(num_kv_blocks=24, block_size=4, max_num_batched_tokens=48, long_prefill_chunk=16))
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    tokens = _run_all(engine)
    assert engine.scheduler.num_preemptions > 0, "the test must actually exercise preemption"
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == expected
    assert engine.num_free_blocks == 24


def test_abort_frees_blocks_immediately(checkpoints):
    path, model = checkpoints["llama"]
    engine = LLMEngine(path, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=32))
    prompts = random_prompts([100, 40], model.config.vocab_size)
    engine.add_request("long", prompts[0], GREEDY)
    engine.add_request("short", prompts[1], GREEDY)
    engine.step()
    engine.step()
    assert engine.num_free_blocks < 64
    assert engine.abort_request("long")
    assert engine.abort_request("short")
    assert engine.num_free_blocks == 64
    assert not engine.has_unfinished_requests()
    assert not engine.abort_request("long"), "a second abort of the same id is a no-op"


def test_aborting_one_request_leaves_the_others_exact(checkpoints):
    path, model = checkpoints["mistral"]
    prompts = random_prompts([20, 33, 9], model.config.vocab_size, seed=5)
    expected = [hf_greedy(model, p, 20) for p in prompts]
    engine = LLMEngine(path, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=16))
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    engine.add_request("victim", random_prompts([50], model.config.vocab_size, seed=9)[0], GREEDY)
    tokens: dict[str, list[int]] = {}
    for step in range(6):
        for out in engine.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
    engine.abort_request("victim")
    for req_id, new in _run_all(engine).items():
        tokens.setdefault(req_id, []).extend(new)
    assert [tokens[f"r{i}"] for i in range(3)] == expected
    assert engine.num_free_blocks == 64


def test_high_priority_prompt_is_not_starved_by_a_long_low_priority_one(checkpoints):
    path, model = checkpoints["llama"]
    long_prompt, short_prompt = random_prompts([400, 8], model.config.vocab_size)
    engine = LLMEngine(path, EngineConfig(num_kv_blocks=128, max_num_batched_tokens=32, long_prefill_chunk=32))
    engine.add_request("long-low", long_prompt, SamplingParams(max_tokens=2, temperature=0.0), priority=0)
    engine.step()  # the long prompt is now partially prefilled and running
    engine.add_request("short-high", short_prompt, SamplingParams(max_tokens=2, temperature=0.0), priority=5)
    first = [out.req_id for out in engine.step()]
    assert first == ["short-high"], "the high-priority prompt takes the budget on its first step"


def test_waiting_queue_orders_by_priority_then_arrival(checkpoints):
    path, model = checkpoints["llama"]
    prompts = random_prompts([6, 6, 6, 6], model.config.vocab_size)
    engine = LLMEngine(path, EngineConfig(num_kv_blocks=64, max_num_seqs=1))
    for name, prompt, priority in zip("abcd", prompts, [0, 2, 1, 2]):
        engine.add_request(name, prompt, SamplingParams(max_tokens=1, temperature=0.0), priority=priority)
    finished = []
    while engine.has_unfinished_requests():
        finished += [out.req_id for out in engine.step() if out.finished]
    assert finished == ["b", "d", "c", "a"]


def test_stop_conditions_end_generation_with_the_right_reason(tmp_path):
    model = build_checkpoint("llama", tmp_path)
    (prompt,) = random_prompts([10], model.config.vocab_size, seed=21)
    reference = hf_greedy(model, prompt, 12)
    engine = LLMEngine(tmp_path, EngineConfig(num_kv_blocks=64))

    (by_length,) = engine.generate([prompt], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert (by_length.token_ids, by_length.finish_reason) == (reference[:5], FinishReason.LENGTH)

    stop_at = 3 + next(i for i, t in enumerate(reference[3:]) if t not in reference[:3])
    (by_stop,) = engine.generate(
        [prompt], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[reference[stop_at]])
    )
    assert (by_stop.token_ids, by_stop.finish_reason) == (reference[: stop_at + 1], FinishReason.STOP)

    # Make that same token the model's EOS: generation ends there unless ignore_eos.
    generation_config = json.loads((tmp_path / "generation_config.json").read_text())
    generation_config["eos_token_id"] = reference[stop_at]
    (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    engine = LLMEngine(tmp_path, EngineConfig(num_kv_blocks=64))
    (by_eos,) = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))
    assert (by_eos.token_ids, by_eos.finish_reason) == (reference[: stop_at + 1], FinishReason.EOS)
    (ignoring,) = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert ignoring.token_ids == reference


def test_generation_stops_at_the_model_context(checkpoints):
    path, model = checkpoints["llama"]
    engine = LLMEngine(path, EngineConfig(num_kv_blocks=64, max_model_len=40))
    (prompt,) = random_prompts([35], model.config.vocab_size)
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    assert len(out.token_ids) == 5
    assert out.finish_reason == FinishReason.LENGTH


def test_full_blocks_get_chained_hashes_shared_by_equal_prefixes(checkpoints):
    path, model = checkpoints["llama"]
    engine = LLMEngine(path, EngineConfig(num_kv_blocks=64, block_size=8))
    (prefix,) = random_prompts([16], model.config.vocab_size)
    a = engine.add_request("a", prefix + [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0))
    b = engine.add_request("b", prefix + [9, 9, 9, 9, 9, 9, 9, 9, 9], SamplingParams(max_tokens=4, temperature=0.0))
    engine.step()  # b waits for the blocks a computes of their common prefix
    assert len(a.block_hashes) == 2 and not b.block_table
    engine.step()
    assert len(b.block_hashes) == 3
    assert a.block_hashes[:2] == b.block_hashes[:2], "same prefix, same chained hashes"
    assert b.block_hashes[2] != a.block_hashes[1]
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached_tokens == 16
    assert engine.allocator.lookup(a.block_hashes[0]) == a.block_table[0]


@pytest.mark.parametrize("max_num_seqs", [1, 3])
def test_max_num_seqs_bounds_the_running_batch(checkpoints, max_num_seqs):
    path, model = checkpoints["qwen2"]
    engine = LLMEngine(path, EngineConfig(num_kv_blocks=64, max_num_seqs=max_num_seqs))
    for i, prompt in enumerate(random_prompts([5] * 5, model.config.vocab_size)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    assert peak == max_num_seqs


@pytest.mark.parametrize("max_wait_s", [None, 0.3])
def test_priority_aging_bounds_the_wait_of_a_low_priority_request(checkpoints, max_wait_s):
    """One running slot and an urgent request always waiting: strict priority never runs the
    low-priority one; with aging it runs once it has waited max_wait_s."""
    path, _ = checkpoints["llama"]
    engine = LLMEngine(path, EngineConfig(num_kv_blocks=64, max_num_seqs=1, priority_max_wait_s=max_wait_s))
    short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_request("patient", [5, 6, 7, 8], short, priority=-1)
    started = time.monotonic()
    finished_after = None
    num_urgent = 0
    while time.monotonic() - started < 1.2 and finished_after is None:
        if sum(1 for s in engine.scheduler.requests.values() if s.priority == 5) < 2:
            engine.add_request(f"urgent-{num_urgent}", [9, 10, 11], short, priority=5)
            num_urgent += 1
        for out in engine.step():
            if out.req_id == "patient" and out.finished:
                finished_after = time.monotonic() - started
    assert num_urgent > 10, "urgent requests kept arriving"
    if max_wait_s is None:
        assert finished_after is None
    else:
        assert finished_after is not None and max_wait_s <= finished_after < max_wait_s + 0.5


def test_a_sequence_queued_again_stands_where_aging_puts_it(checkpoints):
    """A prompt that has waited past priority_max_wait_s goes ahead of every priority, and a
    sequence queued while it waits (a preempted one, mid-step) stands behind it. It was inserted
    by priority alone into the queue the step had sorted with aging, ahead of the aged prompt,
    and the step could admit it first and give it the blocks the preemption freed."""
    path, _ = checkpoints["llama"]
    engine = LLMEngine(path, EngineConfig(num_kv_blocks=64, max_num_seqs=1, priority_max_wait_s=5.0))
    short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    patient = engine.add_request("patient", [5, 6, 7, 8], short, priority=-1)
    patient.arrival_time -= 10.0  # it has waited past max_wait_s
    engine.add_request("urgent", [9, 10, 11], short, priority=5)
    assert [seq.req_id for seq in engine.scheduler.waiting] == ["patient", "urgent"]
