"""Speculative decoding (n-gram drafts) changes how many steps a request takes, never its tokens
(greedy) or their distribution (sampled)."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.default_model_path import DEFAULT_MODEL_PATH
from engine.cpu_linear import bf16_pair_kernel_available
from engine.sampler import Sampler
from engine.sequence import Sequence
from engine.speculation import DraftWindow, NgramIndex, NgramProposer, Proposal, SpeculativeConfig
from tests.checkpoints import assert_drawn_like, exact_top_k_sequences, hf_greedy, random_prompts

CODE_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "for i in range(10):\n    print(i)\n",
]


@pytest.fixture(scope="module")
def code_prompts():
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_PATH)
    return [tokenizer(p)["input_ids"] for p in CODE_PROMPTS]


@pytest.fixture(scope="module")
def default_hf_model():
    return AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_PATH, torch_dtype=torch.float32).eval()


def _engine(path=None, speculative: SpeculativeConfig | None = None, **fields) -> LLMEngine:
    config = EngineConfig(dtype=fields.pop("dtype", "float32"), num_threads=1, speculative=speculative, **fields)
    return LLMEngine(path, config)


def test_ngram_index_proposes_what_followed_the_latest_longest_match():
    index = NgramIndex(range(1, 4))
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    index.extend(tokens)
    # Suffix (5, 2, 3) never occurred before; (2, 3) last occurred at 5..6, followed by 7, 8, 5.
    assert index.lookup(tokens, 3) == [7, 8, 5]
    assert index.lookup(tokens, 10) == [7, 8, 5, 2, 3]  # up to the sequence's end
    tokens += [7]
    index.extend(tokens)
    assert index.lookup(tokens, 2) == [8, 5]  # (3, 7) matched at 6..7
    assert index.lookup([4, 4, 6], 2) == []


@pytest.mark.parametrize("num_speculative_tokens", [1, 4])
def test_greedy_output_is_transformers_output_with_fewer_steps(code_prompts, default_hf_model, num_speculative_tokens):
    plain = _engine()
    spec = _engine(speculative=SpeculativeConfig(num_speculative_tokens=num_speculative_tokens))
    params = SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)
    plain_out = plain.generate(code_prompts, params)
    spec_out = spec.generate(code_prompts, params)
    for prompt, a, b in zip(code_prompts, plain_out, spec_out):
        assert b.token_ids == a.token_ids
        assert b.token_ids == hf_greedy(default_hf_model, prompt, 96)
    drafted, accepted = spec.scheduler.num_draft_tokens, spec.scheduler.num_accepted_draft_tokens
    assert 0 < accepted < drafted, "drafts were proposed, some confirmed and some not"
    assert spec.num_steps < plain.num_steps, "confirmed drafts saved steps"
    assert spec.allocator.num_free == spec.allocator.num_blocks


def test_counts_per_request_add_up(code_prompts):
    engine = _engine(speculative=SpeculativeConfig(num_speculative_tokens=3))
    seqs = [engine.add_request(f"r{i}", p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)) for i, p in enumerate(code_prompts)]
    while engine.has_unfinished_requests():
        engine.step()
    for seq in seqs:
        assert seq.num_output_tokens == 40
        # The first token came with the prompt; each decode step emitted one plus what it confirmed.
        assert seq.num_output_tokens - 1 == seq.num_decode_steps + seq.num_accepted_draft_tokens
        assert seq.num_accepted_draft_tokens <= seq.num_draft_tokens <= 3 * seq.num_decode_steps
    assert sum(s.num_draft_tokens for s in seqs) == engine.scheduler.num_draft_tokens


def test_chunked_prefill_preemption_and_prefix_cache_keep_greedy_exact(checkpoints):
    path, hf_model = checkpoints["llama"]
    prompts = random_prompts([40, 7, 63, 25, 40], hf_model.config.vocab_size, seed=5)
    prompts[4] = prompts[0][:32] + prompts[4][:8]  # shares two cached blocks with the first
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1)
    # 24 blocks of 16 tokens cannot hold five sequences of up to 63 + 60 tokens: preemptions.
    engine = _engine(path, spec, num_kv_blocks=24, max_num_batched_tokens=48, long_prefill_chunk=16)
    out = engine.generate(prompts, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    for prompt, completion in zip(prompts, out):
        assert completion.token_ids == hf_greedy(hf_model, prompt, 60)
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.num_accepted_draft_tokens > 0
    assert engine.allocator.num_free == engine.allocator.num_blocks


@pytest.mark.skipif(not bf16_pair_kernel_available(), reason="row-invariant bfloat16 linears need avx512_bf16")
def test_bfloat16_greedy_output_is_bit_for_bit_the_same_as_without_speculation(code_prompts):
    params = SamplingParams(max_tokens=96, temperature=0, ignore_eos=True, logprobs=0)
    plain = _engine(dtype="bfloat16").generate(code_prompts, params)
    spec_engine = _engine(dtype="bfloat16", speculative=SpeculativeConfig(num_speculative_tokens=4))
    spec = spec_engine.generate(code_prompts, params)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    # Not just the same argmax: the same bits at every position, drafted or not.
    assert [[lp.logprob for lp in c.logprobs] for c in spec] == [[lp.logprob for lp in c.logprobs] for c in plain]
    assert spec_engine.scheduler.num_accepted_draft_tokens > 0


def test_a_stop_token_inside_confirmed_drafts_ends_the_request_there(code_prompts):
    params = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    reference = _engine().generate(code_prompts, params)
    # Stop at the 30th token's id: often inside a run of drafts the model confirms.
    stops = [c.token_ids[29] for c in reference]
    spec_engine = _engine(speculative=SpeculativeConfig(num_speculative_tokens=4))
    for prompt, expected, stop in zip(code_prompts, reference, stops):
        (out,) = spec_engine.generate([prompt], SamplingParams(max_tokens=80, temperature=0, ignore_eos=True, stop_token_ids=[stop]))
        assert out.token_ids == expected.token_ids[: expected.token_ids.index(stop) + 1]
        assert out.finish_reason.value == "stop"
    assert spec_engine.allocator.num_free == spec_engine.allocator.num_blocks


def test_max_tokens_is_exact_however_many_drafts_would_be_confirmed(code_prompts):
    engine = _engine(speculative=SpeculativeConfig(num_speculative_tokens=8))
    for max_tokens in (1, 2, 3, 17):
        out = engine.generate(code_prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        assert [len(c.token_ids) for c in out] == [max_tokens] * len(code_prompts)


# -- sampled requests keep the target's distribution ------------------------------------

DRAWS = 6000
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def _verify_many(params: SamplingParams, draft: int, seed: int = 0) -> torch.Tensor:
    """Token counts from DRAWS rows that each verify ``draft`` against LOGITS."""
    sampler = Sampler(seed=seed)
    seqs = [Sequence(req_id=str(i), token_ids=[0], num_prompt_tokens=1, params=params) for i in range(DRAWS)]
    tokens, _ = zip(*sampler.sample(LOGITS.repeat(DRAWS, 1), seqs, [draft] * DRAWS))
    return torch.bincount(torch.tensor(tokens), minlength=LOGITS.shape[-1]).float()


def _assert_frequencies(counts: torch.Tensor, expected: torch.Tensor) -> None:
    freq = counts / counts.sum()
    tolerance = 4 * torch.sqrt(expected * (1 - expected) / counts.sum()) + 1e-3
    assert torch.all((freq - expected).abs() <= tolerance), (freq, expected)


@pytest.mark.parametrize("draft", [0, 3, 7])
@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_verifying_a_draft_leaves_the_distribution_as_it_was(draft, temperature):
    counts = _verify_many(SamplingParams(temperature=temperature), draft)
    _assert_frequencies(counts, torch.softmax(LOGITS / temperature, dim=-1))


def test_a_draft_the_filters_remove_is_never_emitted():
    counts = _verify_many(SamplingParams(temperature=1.0, top_k=3), draft=5)
    expected = torch.zeros(8)
    expected[:3] = torch.softmax(LOGITS[:3], dim=-1)
    assert counts[3:].sum() == 0
    _assert_frequencies(counts, expected)


def test_sampled_sequences_keep_the_models_joint_distribution():
    """Three sampled tokens after a repetitive prompt (the second a verified draft, the third
    drawn after it) against the exact probabilities transformers gives each of the 27 outcomes."""
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_PATH, torch_dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_PATH)
    prompt = tokenizer("x = x + 1\nx = x + 1\nx = x + 1\nx = x")["input_ids"]
    top_k, temperature = 3, 1.3

    exact = exact_top_k_sequences(model, prompt, 3, temperature, top_k)
    engine = _engine(speculative=SpeculativeConfig(num_speculative_tokens=2), num_kv_blocks=2048, max_num_seqs=512,
                     max_num_batched_tokens=4096)
    params = SamplingParams(max_tokens=3, temperature=temperature, top_k=top_k, ignore_eos=True)
    draws = 3000
    outs = engine.generate([prompt] * draws, params)
    # Each request's second token was a draft verified by rejection sampling wherever the prompt
    # had a match for its first: most of them, some confirmed and some not.
    drafted, accepted = engine.scheduler.num_draft_tokens, engine.scheduler.num_accepted_draft_tokens
    assert drafted > draws // 2 and 0 < accepted < drafted
    assert_drawn_like([tuple(out.token_ids) for out in outs], exact)


def test_a_seeded_request_repeats_whatever_shares_its_batches(code_prompts):
    engine = _engine(speculative=SpeculativeConfig(num_speculative_tokens=3))
    params = SamplingParams(max_tokens=48, temperature=0.8, seed=1234, ignore_eos=True)
    (alone,) = engine.generate([code_prompts[0]], params)
    others = SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True)
    crowd = engine.generate([code_prompts[1], code_prompts[0], code_prompts[2]], [others, params, others])
    assert crowd[1].token_ids == alone.token_ids
    assert engine.scheduler.num_accepted_draft_tokens > 0


def test_config_errors_name_the_field():
    for fields, name in (
        ({"method": "medusa"}, "speculative.method"),
        ({"num_speculative_tokens": 0}, "speculative.num_speculative_tokens"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "speculative.prompt_lookup_max"),
    ):
        with pytest.raises(ValueError, match=name):
            EngineConfig(speculative=SpeculativeConfig(**fields)).validate()


def test_logprobs_are_reported_for_every_emitted_token(code_prompts):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2)
    (plain,) = _engine().generate([code_prompts[2]], params)
    spec_engine = _engine(speculative=SpeculativeConfig(num_speculative_tokens=4))
    (spec,) = spec_engine.generate([code_prompts[2]], params)
    assert spec.token_ids == plain.token_ids
    assert [lp.token_id for lp in spec.logprobs] == spec.token_ids
    for a, b in itertools.zip_longest(spec.logprobs, plain.logprobs):
        assert a.rank == b.rank == 1 and a.logprob == pytest.approx(b.logprob, abs=1e-4)
    assert spec_engine.scheduler.num_accepted_draft_tokens > 0


def test_the_draft_window_follows_how_drafts_fare():
    window = DraftWindow(4)
    assert window.room() == 4
    window.update(4, 4)
    assert window.room() == 4  # at the limit
    window.update(4, 1)
    assert window.room() == 2  # one past the last accepted draft
    window.update(2, 2)
    assert window.room() == 3
    window.update(3, 0)  # nothing accepted: one draft next, then pauses of 1, 3, 7 steps between tries
    rooms = []
    for _ in range(16):
        room = window.room()
        rooms.append(room)
        if room:
            window.update(room, 0)
    assert rooms == [1, 0, 1, 0, 0, 0, 1] + [0] * 7 + [1, 0]
    window.update(1, 1)  # a success ends the pauses
    assert window.room() == 2


def test_an_adaptive_window_spends_few_rows_where_drafts_fail(code_prompts):
    """A proposer whose drafts are never right: the output is the same, and the adaptive window
    verifies a fraction of the rows a fixed one does."""

    class Wrong(NgramProposer):
        def propose(self, seqs, rooms):
            return [Proposal([(seq.token_ids[-1] + 1) % 4096] * room) for seq, room in zip(seqs, rooms)]

    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    drafted = {}
    for adaptive in (False, True):
        engine = _engine(speculative=SpeculativeConfig(num_speculative_tokens=4, adaptive=adaptive))
        engine.scheduler.proposer = Wrong(engine.config.speculative)
        out = engine.generate(code_prompts, params)
        assert [c.token_ids for c in out] == [c.token_ids for c in _engine().generate(code_prompts, params)]
        drafted[adaptive] = engine.scheduler.num_draft_tokens
    # Four drafts per decode step, but never past max_tokens: 3, 2, 1 and 0 at the last four.
    assert drafted[False] == (4 * 59 + 3 + 2 + 1) * len(code_prompts)
    assert drafted[True] < drafted[False] / 10


def test_drafts_confirmed_up_to_a_stop_token_all_count_as_accepted(code_prompts):
    """Drafts [a, stop, c] with the target agreeing on a and stop: the request ends at the stop,
    and both matched drafts count as accepted (the metrics and the adaptive window said one)."""
    from engine.scheduler import ScheduledSlice

    engine = _engine(speculative=SpeculativeConfig(num_speculative_tokens=3))
    engine.add_request("r", code_prompts[0], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[7]))
    engine.step()  # the prompt and its first token
    seq = engine.scheduler.requests["r"]
    piece = ScheduledSlice(seq, 4, draft_token_ids=[11, 7, 13])
    before = engine.scheduler.num_accepted_draft_tokens
    emitted = engine.scheduler._take_tokens(piece, [(11, None), (7, None), (5, None)], 0.0, kv_upto=None)
    assert emitted == [11, 7] and seq.is_finished
    assert engine.scheduler.num_accepted_draft_tokens - before == 2 and seq.num_accepted_draft_tokens == 2
