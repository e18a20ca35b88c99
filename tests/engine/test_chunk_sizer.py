"""Adaptive chunk size: the sizer learns step time and sizes chunks to a target; the engine stays exact."""

from __future__ import annotations

import random

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.chunk_sizer import AdaptiveChunkSizer
from engine.step_profile import StepShape, shape_of
from tests.checkpoints import hf_greedy, random_prompts


def _true_step_s(shape: StepShape) -> float:
    return 0.004 + 1.5e-4 * shape.num_prefill_tokens + 3e-9 * shape.prefill_attention + 2e-4 * shape.num_decode_rows + 2e-7 * shape.num_decode_kv_tokens


def _random_shape(rng: random.Random) -> StepShape:
    tokens = rng.choice([0, rng.randint(1, 512)])
    start = rng.randint(0, 1024)
    rows = rng.randint(0 if tokens else 1, 48)
    return StepShape(tokens, tokens * (start + tokens / 2), 1 if tokens else 0, rows, rows * rng.randint(16, 1024))


def test_sizer_learns_the_step_time_and_fills_the_target():
    sizer = AdaptiveChunkSizer(target_step_s=0.05, min_chunk=16, max_tokens=2048)
    rng = random.Random(0)
    for _ in range(200):
        shape = _random_shape(rng)
        sizer.observe(shape, _true_step_s(shape) * rng.uniform(0.97, 1.03))
    rows, kv, start = 16, 16 * 500, 256
    allowed = sizer.prefill_tokens(rows, kv, start)
    step = _true_step_s(StepShape(allowed, allowed * (start + allowed / 2), 1, rows, kv))
    assert step == pytest.approx(0.05, rel=0.05)  # the step it allows takes the target, not less, not more
    # More decode work leaves less room; with nothing to decode there is no limit.
    assert sizer.prefill_tokens(48, 48 * 1000, start) < allowed
    assert sizer.prefill_tokens(0, 0, start) is None
    # A target the decode work alone exceeds still lets a prompt move, by the minimum.
    assert sizer.prefill_tokens(4000, 4000 * 4000, start) == 16


def test_sizer_is_conservative_until_it_has_measured():
    sizer = AdaptiveChunkSizer(target_step_s=0.05, min_chunk=16, max_tokens=512)
    assert sizer.prefill_tokens(8, 800, 0) == 16
    with pytest.raises(ValueError, match="target_step_ms"):
        AdaptiveChunkSizer(target_step_s=0.0, min_chunk=16, max_tokens=512)


def test_adaptive_chunks_keep_greedy_output_exact(checkpoints):
    path, hf_model = checkpoints["llama"]
    prompts = random_prompts([300, 12, 20, 9], hf_model.config.vocab_size, seed=5)
    config = EngineConfig(dtype="float32", block_size=16, num_kv_blocks=128, max_num_batched_tokens=512, target_step_ms=2.0)
    engine = LLMEngine(path, config)
    # The short prompts decode while the long one arrives and is prefilled beside them.
    short = [engine.add_request(f"short-{i}", p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)) for i, p in enumerate(prompts[1:])]
    for _ in range(3):
        engine.step()
    long = engine.add_request("long", prompts[0], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    chunks = []
    while engine.has_unfinished_requests():
        batch = engine.scheduler.schedule()
        shape = shape_of(batch)
        if shape.num_decode_rows and shape.num_prefill_tokens:
            chunks.append((shape.num_prefill_tokens, engine.scheduler.chunk_sizer.last_allowed))
        engine.run_batch(batch)
    assert long.output_token_ids == hf_greedy(hf_model, prompts[0], 8)
    for seq, prompt in zip(short, prompts[1:]):
        assert seq.output_token_ids == hf_greedy(hf_model, prompt, 24)
    # The long prompt went in several chunks beside the decodes, each within what the sizer allowed.
    assert len(chunks) >= 2
    assert all(tokens <= allowed for tokens, allowed in chunks)
    assert engine.num_free_blocks == 128
