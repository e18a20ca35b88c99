"""One request's values or failure never take down the engine or the requests batched with it."""

from __future__ import annotations

import pickle

import pytest

from engine import EngineConfig, FinishReason, InvalidRequestError, LLMEngine, SamplingParams
from engine.errors import RequestFailedError
from tests.checkpoints import hf_greedy, random_prompts

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _engine(checkpoints):
    path, _ = checkpoints["llama"]
    return LLMEngine(path, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=256))


@pytest.mark.parametrize(
    "extreme",
    [
        SamplingParams(max_tokens=8, temperature=1e-40, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=1e-40, top_p=0.5, top_k=5, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=1e-30, seed=7, ignore_eos=True, logprobs=2),
    ],
)
def test_a_vanishing_temperature_samples_the_greedy_token(checkpoints, extreme):
    """Dividing logits by 1e-40 overflowed to nan and crashed the actor: now it is greedy in effect."""
    engine = _engine(checkpoints)
    _, model = checkpoints["llama"]
    prompts = random_prompts([200, 9], model.config.vocab_size)
    done = engine.generate(prompts, [extreme, GREEDY])
    assert [c.finish_reason for c in done] == [FinishReason.LENGTH, FinishReason.LENGTH]
    assert [c.token_ids for c in done] == [hf_greedy(model, p, 8) for p in prompts]


@pytest.mark.parametrize("penalty", [1e-40, 1e40])
def test_an_extreme_repetition_penalty_finishes_without_disturbing_its_batch(checkpoints, penalty):
    engine = _engine(checkpoints)
    _, model = checkpoints["llama"]
    prompts = random_prompts([200, 9], model.config.vocab_size, seed=3)
    extreme = SamplingParams(max_tokens=8, temperature=1.0, repetition_penalty=penalty, seed=1, ignore_eos=True)
    done = engine.generate(prompts, [extreme, GREEDY])
    assert done[0].finish_reason is FinishReason.LENGTH and len(done[0].token_ids) == 8
    assert all(0 <= t < model.config.vocab_size for t in done[0].token_ids)
    assert done[1].token_ids == hf_greedy(model, prompts[1], 8)
    assert engine.num_free_blocks == 64


def test_a_request_whose_computation_raises_ends_alone_and_frees_its_blocks(checkpoints, monkeypatch):
    """A fault injected into the forward of one request: it ends with ERROR, the others go on exactly."""
    engine = _engine(checkpoints)
    _, model = checkpoints["llama"]
    prompts = random_prompts([40, 70, 17], model.config.vocab_size, seed=5)
    real_execute = engine.runner.execute

    def execute(batch):
        if any(piece.seq.req_id == "poison" and piece.seq.num_output_tokens >= 2 for piece in batch.slices):
            raise RuntimeError("injected fault")
        return real_execute(batch)

    monkeypatch.setattr(engine.runner, "execute", execute)
    engine.add_request("good-0", prompts[0], GREEDY)
    engine.add_request("poison", prompts[1], GREEDY)
    engine.add_request("good-1", prompts[2], GREEDY)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.req_id, []).append(out)
    poison = outputs["poison"][-1]
    assert poison.finished and poison.finish_reason is FinishReason.ERROR
    assert "injected fault" in poison.error and "computing this request failed" in poison.error
    assert sum(len(o.new_token_ids) for o in outputs["poison"]) == 2, "its tokens before the fault were kept"
    for req_id, prompt in (("good-0", prompts[0]), ("good-1", prompts[2])):
        tokens = [t for o in outputs[req_id] for t in o.new_token_ids]
        assert tokens == hf_greedy(model, prompt, 8)
        assert outputs[req_id][-1].finish_reason is FinishReason.LENGTH
    assert engine.num_free_blocks == 64, "the failed request's blocks are free"
    engine.add_request("poison", prompts[1], GREEDY)  # its id is free again
    assert engine.abort_request("poison")


def test_engine_errors_survive_pickling_as_ray_sends_them():
    """An error Ray cannot rebuild reaches the router as a bare RayTaskError (then INTERNAL)."""
    invalid = pickle.loads(pickle.dumps(InvalidRequestError("sampling.top_p", "must be in (0, 1], got 2")))
    assert (invalid.field, invalid.problem) == ("sampling.top_p", "must be in (0, 1], got 2")
    assert str(invalid) == "sampling.top_p: must be in (0, 1], got 2"
    failed = pickle.loads(pickle.dumps(RequestFailedError("computing this request failed: boom")))
    assert str(failed) == "computing this request failed: boom"
