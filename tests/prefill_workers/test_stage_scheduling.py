"""A pipeline stage's prompt in the prefill actor's scheduler: its blocks taken at once, its
prefix-cache entries salted with its layers (never found by a prompt that needs every layer),
its cached prefix trimmed to where the pipeline starts, and every block given back."""

from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.block_allocator import OutOfBlocksError
from engine.scheduler import ScheduledBatch, ScheduledSlice
from prefill_workers.scheduler import PrefillScheduler
from tests.checkpoints import build_checkpoint, random_prompts

NUM_BLOCKS = 32


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("stage_sched")
    build_checkpoint("llama", path)
    return path


def _engine(model_path) -> LLMEngine:
    return LLMEngine(model_path, EngineConfig(num_kv_blocks=NUM_BLOCKS, dtype="float32"), scheduler_cls=PrefillScheduler)


def _run_first_stage(engine: LLMEngine, req_id: str, prompt: list[int], salt: bytes = b"layers:0-1", chunk: int = 16) -> int:
    """Stage [0, 1) of a 2-layer model over the whole prompt; returns the cached tokens it started from."""
    seq = engine.make_sequence(req_id, prompt, SamplingParams(max_tokens=1))
    engine.scheduler.add_stage(seq, salt)
    cached = seq.num_computed_tokens
    engine.scheduler.start_stage_at(seq, cached)
    while seq.num_computed_tokens < len(prompt):
        n = min(chunk, len(prompt) - seq.num_computed_tokens)
        engine.run_stage(ScheduledBatch([ScheduledSlice(seq, n)]), range(0, 1), None)
    assert req_id in engine.scheduler.held and req_id not in engine.scheduler.staged
    engine.scheduler.release(req_id)
    return cached


def test_a_stage_caches_its_layers_under_its_own_salt(model_path):
    engine = _engine(model_path)
    prompt = random_prompts([70], engine.model_config.vocab_size, seed=3)[0]
    assert _run_first_stage(engine, "a", prompt) == 0
    assert engine.num_free_blocks == NUM_BLOCKS  # every block back (cached ones are free to take)
    # The same stage sees its four full blocks again.
    assert _run_first_stage(engine, "b", prompt) == 64
    # Another stage's layers, or a prompt that needs every layer, never hit them.
    assert _run_first_stage(engine, "c", prompt, salt=b"layers:1-2") == 0
    whole = engine.add_request("d", prompt, SamplingParams(max_tokens=1))
    engine.step()
    assert whole.num_cached_tokens == 0


def test_the_cached_prefix_is_trimmed_to_where_the_pipeline_starts(model_path):
    engine = _engine(model_path)
    prompt = random_prompts([70], engine.model_config.vocab_size, seed=4)[0]
    _run_first_stage(engine, "a", prompt)
    seq = engine.make_sequence("b", prompt, SamplingParams(max_tokens=1))
    engine.scheduler.add_stage(seq, b"layers:0-1")
    cached_ids = list(seq.block_table[:4])
    assert seq.num_computed_tokens == 64
    engine.scheduler.start_stage_at(seq, 32)  # another stage holds only two blocks
    assert seq.num_computed_tokens == 32 and seq.block_table[:2] == cached_ids[:2]
    # The blocks past the start are this sequence's own now (it rewrites them): none is shared.
    assert all(engine.allocator.ref_count(b) == 1 for b in seq.block_table)
    assert len(seq.block_hashes) == 2 and seq.num_cached_tokens == 32
    engine.abort_request("b")
    assert engine.num_free_blocks == NUM_BLOCKS and "b" not in engine.scheduler.staged


def test_a_stage_that_does_not_fit_keeps_nothing(model_path):
    engine = _engine(model_path)
    prompt = random_prompts([NUM_BLOCKS * 16 + 5], engine.model_config.vocab_size, seed=5)[0]
    seq = engine.make_sequence("big", prompt[: NUM_BLOCKS * 16 - 1], SamplingParams(max_tokens=1))
    engine.scheduler.add_stage(seq, b"layers:0-1")
    other = engine.make_sequence("other", prompt[:40], SamplingParams(max_tokens=1))
    with pytest.raises(OutOfBlocksError, match="needs 3 free KV blocks, 0 are"):
        engine.scheduler.add_stage(other, b"layers:0-1")
    assert "other" not in engine.scheduler.requests and not other.block_table
    engine.abort_request("big")
    assert engine.num_free_blocks == NUM_BLOCKS
