"""The start-up warm-up (engine.kernel_warm_up) runs a real prefill and decode step and the
sampler's draws, and leaves nothing a user could notice behind: the same tokens afterwards
(unseeded draws included: the engine's generator is untouched), every KV block free, no request
or cache event. On CUDA the engine runs it itself; here it is called on a CPU engine, whose
state it must leave exactly as the GPU's."""

from __future__ import annotations

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.default_model_path import DEFAULT_MODEL_PATH
from engine.kernel_warm_up import warm_up_kernels
from tests.checkpoints import random_prompts

PARAMS = [
    SamplingParams(temperature=0.9, top_p=0.9, max_tokens=12, ignore_eos=True),  # unseeded: the engine's generator
    SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1),
]


def _engine() -> LLMEngine:
    return LLMEngine(DEFAULT_MODEL_PATH, EngineConfig(num_kv_blocks=32, seed=7, enable_prefix_caching=True))


def test_warm_up_runs_a_prefill_and_a_decode_step_and_changes_no_later_token():
    prompts = random_prompts([20, 9, 33], 4096, seed=3)
    want = [(c.token_ids, c.logprobs) for c in _engine().generate(prompts, PARAMS)]

    engine = _engine()
    steps = []
    execute = engine.executor.execute

    def recording(batch):
        steps.append([(piece.num_tokens, piece.is_decode) for piece in batch.slices])
        return execute(batch)

    engine.executor.execute = recording
    seconds = warm_up_kernels(engine.executor, engine.allocator, engine.kv_cache, engine.sampler, engine.model_config.vocab_size, engine.max_model_len)
    assert seconds > 0
    assert steps == [[(8, False)], [(1, True)]], "a prefill of the warm-up prompt, then its decode step"
    assert engine.num_free_blocks == engine.kv_cache.num_blocks, "the warm-up's KV blocks were not given back"
    assert not engine.has_unfinished_requests() and not engine.scheduler.requests
    assert engine.allocator.drain_events() == [], "the warm-up left prefix-cache events for the router"

    got = [(c.token_ids, c.logprobs) for c in engine.generate(prompts, PARAMS)]
    assert got == want, "tokens after the warm-up differ from a fresh engine's"
    assert engine.num_free_blocks == engine.kv_cache.num_blocks
