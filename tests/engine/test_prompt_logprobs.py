"""A prompt's log-probabilities (vLLM's prompt_logprobs) are the model's, wherever its chunks fall."""

from __future__ import annotations

import math

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.errors import InvalidRequestError
from tests.checkpoints import random_prompts


def _reference(model, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every prompt position (row p scores token p + 1)."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def _assert_model_scores(entries, prompt: list[int], reference: torch.Tensor, num_top: int) -> None:
    assert len(entries) == len(prompt) - 1
    for position, entry in enumerate(entries):
        row, token = reference[position], prompt[position + 1]
        assert entry.token_id == token
        assert math.isclose(entry.logprob, float(row[token]), abs_tol=1e-4), (position, entry.logprob, float(row[token]))
        assert entry.rank == int((row > row[token]).sum()) + 1
        assert [t for t, _ in entry.top] == row.topk(num_top).indices.tolist()[:num_top]


@pytest.mark.parametrize("chunk", [512, 16, 7])
def test_prompt_logprobs_are_transformers_log_softmax_whatever_the_chunks(checkpoints, chunk):
    """Chunks of 16 (one block) and 7 (across block edges) split the 40-token prompt over steps
    it shares with a request that asks for none; with prefix caching on and the prompt's
    blocks cached by an earlier request, every position is still computed and scored."""
    path, model = checkpoints["llama"]
    engine = LLMEngine(path, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=chunk, enable_prefix_caching=True))
    prompt, other = random_prompts([40, 23], model.config.vocab_size, seed=31)
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))  # its blocks are cached now
    scored, plain = engine.generate(
        [prompt, other],
        [SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2), SamplingParams(max_tokens=3, temperature=0.0)],
    )
    _assert_model_scores(scored.prompt_logprobs, prompt, _reference(model, prompt), 2)
    assert plain.prompt_logprobs == []
    # The sampled tokens are what they are without the extra rows.
    alone = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert scored.token_ids == alone.token_ids


def test_prompt_logprobs_with_no_alternatives_and_a_one_token_prompt(checkpoints):
    path, model = checkpoints["llama"]
    engine = LLMEngine(path, EngineConfig(num_kv_blocks=32))
    (prompt,) = random_prompts([9], model.config.vocab_size, seed=8)
    scored, single = engine.generate([prompt, prompt[:1]], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    _assert_model_scores(scored.prompt_logprobs, prompt, _reference(model, prompt), 0)
    assert all(entry.top == [] for entry in scored.prompt_logprobs)
    assert single.prompt_logprobs == []  # the first token has no log-probability


def test_a_scored_prompt_takes_at_most_the_scored_rows_a_step_allows(checkpoints, monkeypatch):
    """Each scored position is a row of logits over the vocabulary: a step scores at most
    SCORED_LOGITS_BYTES' worth (here 8 rows), so a 40-token prompt takes 5 steps whatever the
    token budget, and its scores are still transformers'."""
    import engine.llm_engine

    path, model = checkpoints["llama"]
    vocab = model.config.vocab_size
    monkeypatch.setattr(engine.llm_engine, "SCORED_LOGITS_BYTES", 8 * vocab * 4 * 2)
    scorer = LLMEngine(path, EngineConfig(num_kv_blocks=32, max_num_batched_tokens=512, block_size=8))
    (prompt,) = random_prompts([40], vocab, seed=40)
    scorer.add_request("scored", prompt, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
    chunks = []
    while scorer.has_unfinished_requests():
        scorer.step()
        chunks.append(scorer.last_shape.num_prefill_tokens)
    assert chunks == [8] * 5
    seq_logprobs = scorer.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))[0].prompt_logprobs
    _assert_model_scores(seq_logprobs, prompt, _reference(model, prompt), 1)


@pytest.mark.parametrize("value", [-1, 21, 2.5])
def test_prompt_logprobs_out_of_range_is_refused_naming_the_field(value):
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(prompt_logprobs=value).validate()
    assert caught.value.field == "prompt_logprobs"
