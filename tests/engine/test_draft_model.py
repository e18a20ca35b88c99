"""Draft-model speculation: a smaller model's guesses, verified by the target, change the steps
a request takes, never its tokens (greedy) or their distribution (sampled)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.default_model_path import DEFAULT_MODEL_PATH
from engine.errors import ModelLoadError
from engine.kv_cache import KVCache
from engine.speculation import SpeculativeConfig
from cluster.bench.scenarios.speculation import write_layer_skip_draft
from tests.checkpoints import assert_drawn_like, build_checkpoint, exact_top_k_sequences, hf_greedy, random_prompts

CODE_PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\ndef main():\n", "class Stack:\n    def __init__(self):\n"]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """The built-in model's first 2 of 4 layers: a draft that agrees with it part of the time."""
    return write_layer_skip_draft(DEFAULT_MODEL_PATH, tmp_path_factory.mktemp("draft") / "default-2-layers", 2)


@pytest.fixture(scope="module")
def code_prompts():
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_PATH)
    return [tokenizer(p)["input_ids"] for p in CODE_PROMPTS]


def _spec(draft, k: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", num_speculative_tokens=k, draft_model=str(draft))


def _engine(path=None, speculative=None, **fields) -> LLMEngine:
    return LLMEngine(path, EngineConfig(dtype=fields.pop("dtype", "float32"), num_threads=1, speculative=speculative, **fields))


def test_greedy_output_is_transformers_output(draft_dir, code_prompts):
    hf_model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_PATH, torch_dtype=torch.float32).eval()
    engine = _engine(speculative=_spec(draft_dir))
    out = engine.generate(code_prompts, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    for prompt, completion in zip(code_prompts, out):
        assert completion.token_ids == hf_greedy(hf_model, prompt, 64)
    drafted, accepted = engine.scheduler.num_draft_tokens, engine.scheduler.num_accepted_draft_tokens
    assert 0 < accepted < drafted
    assert engine.num_steps < len(code_prompts) * 64, "confirmed guesses saved steps"
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_the_two_caches_share_the_kv_budget(draft_dir):
    budget = 8 * 2**20
    engine = _engine(speculative=_spec(draft_dir), kv_cache_bytes=budget)
    per_block = engine.kv_cache.bytes_per_block + engine.scheduler.proposer.kv_cache.bytes_per_block
    assert engine.kv_cache.num_blocks == budget // per_block == engine.scheduler.proposer.kv_cache.num_blocks
    assert engine.scheduler.proposer.kv_cache.bytes_per_block == engine.kv_cache.bytes_per_block // 2  # 2 of 4 layers


def test_preemption_chunked_prefill_and_prefix_hits_keep_greedy_exact(checkpoints, tmp_path):
    path, hf_model = checkpoints["llama"]
    build_checkpoint("llama", tmp_path / "draft", seed=3, num_hidden_layers=1)
    prompts = random_prompts([40, 7, 63, 25, 40], hf_model.config.vocab_size, seed=5)
    prompts[4] = prompts[0][:32] + prompts[4][:8]
    engine = _engine(path, _spec(tmp_path / "draft", k=4), num_kv_blocks=24, max_num_batched_tokens=48, long_prefill_chunk=16)
    out = engine.generate(prompts, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    for prompt, completion in zip(prompts, out):
        assert completion.token_ids == hf_greedy(hf_model, prompt, 60)
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.num_draft_tokens > 0
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_a_draft_with_a_shorter_context_drafts_only_within_it(checkpoints, tmp_path, caplog):
    """Llama-2-7B (4,096 positions) with TinyLlama (2,048): past the draft's context a sequence
    decodes without drafts, instead of the draft failing at every step."""
    path, hf_model = checkpoints["llama"]  # 512 positions
    build_checkpoint("llama", tmp_path / "draft", seed=3, num_hidden_layers=1, max_position_embeddings=64)
    prompt = random_prompts([50], hf_model.config.vocab_size, seed=9)[0]
    engine = _engine(path, _spec(tmp_path / "draft", k=4))
    with caplog.at_level("ERROR"):
        out = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert out[0].token_ids == hf_greedy(hf_model, prompt, 40)
    assert not [r for r in caplog.records if "proposer failed" in r.getMessage()]
    assert engine.scheduler.num_draft_tokens > 0  # while the sequence was within the draft's 64 positions
    assert engine.num_steps > 64 - 50, "past position 64 every token took a step of its own"


def test_sampled_sequences_keep_the_models_joint_distribution(draft_dir):
    """Three sampled tokens: the second drawn by the draft from its own distribution and accepted
    with min(1, p/q) (else drawn from the residual), against transformers' exact probabilities."""
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_PATH, torch_dtype=torch.float32).eval()
    prompt = AutoTokenizer.from_pretrained(DEFAULT_MODEL_PATH)("def add(a, b):\n    return")["input_ids"]
    top_k, temperature = 3, 1.5

    frontier = exact_top_k_sequences(model, prompt, 3, temperature, top_k)
    engine = _engine(speculative=_spec(draft_dir, k=2), num_kv_blocks=2048, max_num_seqs=512, max_num_batched_tokens=4096)
    draws = 3000
    outs = engine.generate([prompt] * draws, SamplingParams(max_tokens=3, temperature=temperature, top_k=top_k, ignore_eos=True))
    drafted, accepted = engine.scheduler.num_draft_tokens, engine.scheduler.num_accepted_draft_tokens
    assert drafted == draws and 0 < accepted < drafted, "every second token was a guess, some confirmed"
    assert_drawn_like([tuple(out.token_ids) for out in outs], frontier)


def test_a_seeded_request_repeats_whatever_shares_its_batches(draft_dir, code_prompts):
    engine = _engine(speculative=_spec(draft_dir))
    params = SamplingParams(max_tokens=40, temperature=0.9, seed=77, ignore_eos=True)
    (alone,) = engine.generate([code_prompts[0]], params)
    others = SamplingParams(max_tokens=25, temperature=1.0, ignore_eos=True)
    crowd = engine.generate([code_prompts[1], code_prompts[0], code_prompts[2]], [others, params, others])
    assert crowd[1].token_ids == alone.token_ids


def test_a_draft_of_another_vocabulary_is_refused_by_name(checkpoints, draft_dir):
    path, _ = checkpoints["llama"]  # 384 tokens; the draft has the built-in model's 4096
    with pytest.raises(ModelLoadError, match="speculative.draft_model: .* vocabulary of 4096 tokens, the target model 384"):
        _engine(path, _spec(draft_dir))
    with pytest.raises(ValueError, match="speculative.draft_model"):
        EngineConfig(speculative=SpeculativeConfig(method="draft_model")).validate()


def test_bytes_per_block_of_matches_the_cache(checkpoints):
    engine = _engine(checkpoints["llama"][0], num_kv_blocks=4)
    assert KVCache.bytes_per_block_of(engine.model_config, 16, engine.dtype) == engine.kv_cache.bytes_per_block


def test_a_proposal_that_fails_partway_leaves_no_guess_counted_as_the_drafts_kv(draft_dir, code_prompts):
    """The draft fails after feeding its first guess (the step goes on without drafts): its KV
    counts as computed up to the sequence's own tokens, so the next proposal feeds the token
    emitted in the guess's place (it went on from past it: attending to the guess, or to no
    token at all); the output stays transformers'."""
    hf_model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_PATH, torch_dtype=torch.float32).eval()
    engine = _engine(speculative=_spec(draft_dir))
    proposer = engine.scheduler.proposer
    forward, calls, firsts = proposer._forward, [], []

    def flaky(seqs, inputs, first):
        calls.append(first)
        if first:
            firsts.append([(seqs[i].num_tokens, context, len(tokens)) for i, tokens, context in inputs])
        if len(calls) == 3:  # after its first guess was fed
            raise RuntimeError("the draft failed")
        return forward(seqs, inputs, first)

    proposer._forward = flaky
    (out,) = engine.generate(code_prompts[:1], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert out.token_ids == hf_greedy(hf_model, code_prompts[0], 24)
    # The proposal after the failed one starts at or before the sequence's last token, and feeds it.
    num_tokens, context, fed = firsts[1][0]
    assert context <= num_tokens - 1 and context + fed == num_tokens


def test_the_draft_guesses_no_end_for_a_request_short_of_its_min_tokens(draft_dir, code_prompts):
    """The target may not end such a request (its EOS has p = 0), and the draft's q had EOS
    mass, so a guess of it only wasted its row: the draft's sampler knows the target's ends."""
    from engine.sequence import Sequence

    engine = _engine(speculative=_spec(draft_dir))
    proposer = engine.scheduler.proposer
    eos = engine.eos_token_ids[0]
    seq = Sequence(req_id="r", token_ids=list(code_prompts[0]), num_prompt_tokens=len(code_prompts[0]),
                   params=SamplingParams(temperature=1.0, min_tokens=50, max_tokens=60))
    logits = torch.zeros(engine.model_config.vocab_size)
    logits[eos] = 20.0  # the draft is all but sure the answer ends here
    probs = proposer.sampler.probabilities(logits.unsqueeze(0), [seq])[0]
    assert float(probs[eos]) == 0.0
