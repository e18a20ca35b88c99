"""Sampling does what its parameters say: seeds, top-k/top-p/min-p, temperature, penalties."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.sampler import Sampler
from engine.sequence import Sequence
from tests.checkpoints import hf_greedy, random_prompts
from tests.sampling_reference import ExactFlashInferSampling
from tests.sampling_reference import reference_filtered as _reference_filtered

DRAWS = 6000


@pytest.fixture(scope="module")
def llama(checkpoints):
    path, model = checkpoints["llama"]
    return LLMEngine(path, EngineConfig(num_kv_blocks=128)), model


def _sample_many(logits: torch.Tensor, params: SamplingParams, seed: int = 0) -> torch.Tensor:
    """Token counts from DRAWS independent draws from one logits row."""
    sampler = Sampler(seed=seed)
    seqs = [Sequence(req_id=str(i), token_ids=[0], num_prompt_tokens=1, params=params) for i in range(DRAWS)]
    tokens, _ = zip(*sampler.sample(logits.repeat(DRAWS, 1), seqs))
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1]).float()


LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def _assert_frequencies(counts: torch.Tensor, expected_probs: torch.Tensor) -> None:
    # Four standard errors per token: a real mismatch is far larger, noise almost never is.
    freq = counts / counts.sum()
    tolerance = 4 * torch.sqrt(expected_probs * (1 - expected_probs) / counts.sum()) + 1e-3
    assert torch.all((freq - expected_probs).abs() <= tolerance), (freq, expected_probs)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_shapes_the_distribution(temperature):
    counts = _sample_many(LOGITS, SamplingParams(temperature=temperature))
    _assert_frequencies(counts, torch.softmax(LOGITS / temperature, dim=-1))


def test_top_p_keeps_the_smallest_nucleus_and_renormalises():
    probs = torch.softmax(LOGITS, dim=-1)  # 0.39, 0.24, 0.14, 0.09, ...
    counts = _sample_many(LOGITS, SamplingParams(temperature=1.0, top_p=0.7))
    nucleus = torch.zeros_like(probs)
    nucleus[:3] = probs[:3] / probs[:3].sum()  # 0.39 + 0.24 < 0.7 <= + 0.14
    assert counts[3:].sum() == 0
    _assert_frequencies(counts, nucleus)


def test_top_k_and_min_p_cut_the_tail():
    probs = torch.softmax(LOGITS, dim=-1)
    top2 = _sample_many(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert top2[2:].sum() == 0
    _assert_frequencies(top2, torch.cat([probs[:2] / probs[:2].sum(), torch.zeros(6)]))
    min_p = _sample_many(LOGITS, SamplingParams(temperature=1.0, min_p=0.3))
    kept = probs >= 0.3 * probs[0]
    assert min_p[~kept].sum() == 0 and min_p[kept].min() > 0


def test_same_seed_same_output_whatever_shares_the_batch(llama):
    engine, model = llama
    prompt, other = random_prompts([12, 30], model.config.vocab_size, seed=2)
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    (alone,) = engine.generate([prompt], params)
    together = engine.generate([other, prompt, other], [SamplingParams(max_tokens=16, temperature=1.0), params, SamplingParams(max_tokens=9, temperature=0.7)])
    assert together[1].token_ids == alone.token_ids
    (other_seed,) = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True))
    assert other_seed.token_ids != alone.token_ids


def test_a_negative_seed_is_a_seed_as_in_vllm(llama):
    """vLLM takes any 64-bit seed; -1 was refused (400)."""
    engine, model = llama
    (prompt,) = random_prompts([12], model.config.vocab_size, seed=3)
    runs = [engine.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True))[0].token_ids for seed in (-1, -1, -2)]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    # Python hashes integers modulo 2^61 - 1 (-1 as -2, 2^64 - 1 as 7): the draws' keys of these
    # seeds were alike.
    keys = set()
    for seed in (-1, -2, 7, 0, -8, 2**61 - 1, 2**63 - 1, -(2**63)):
        seq = Sequence(req_id="s", token_ids=[0], num_prompt_tokens=1, params=SamplingParams(seed=seed), generator=Sampler.make_generator(seed))
        keys.add(Sampler.draw_key(seq))
    assert len(keys) == 8


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.8, top_k=30, min_p=0.02),
                                    SamplingParams(temperature=1.2)])
def test_a_seeded_draw_does_not_depend_on_a_draft_beside_it(params):
    """A speculating engine verifies a row's draft beside rows that have none: those rows draw as
    in a step without drafts, so a seeded request repeats whether or not its neighbours speculate."""
    generator = torch.Generator().manual_seed(31)
    logits = torch.randn(2, 500, generator=generator) * 0.7
    seeded = [Sequence(req_id=f"s{i}", token_ids=[0] * (i % 5 + 1), num_prompt_tokens=1, params=dataclasses.replace(params, seed=i),
                       generator=Sampler.make_generator(i)) for i in range(40)]
    speculating = Sequence(req_id="d", token_ids=[0], num_prompt_tokens=1, params=SamplingParams(temperature=1.0))
    sampler = Sampler(seed=3)
    alone = [sampler.sample(logits[:1], [seq])[0][0] for seq in seeded]
    beside = [sampler.sample(logits, [seq, speculating], draft_token_ids=[None, 7])[0][0] for seq in seeded]
    assert beside == alone
    assert len(set(alone)) > 5, "the seeds give different draws"


def test_a_seeded_request_resumed_after_k_tokens_draws_the_rest_unchanged(llama):
    """What a stream migrated to another decode actor relies on: the prompt plus the k tokens
    already sent, with ``resumed(k)``, continues exactly as the uninterrupted request did."""
    engine, model = llama
    (prompt,) = random_prompts([20], model.config.vocab_size, seed=5)
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=77, repetition_penalty=1.2, ignore_eos=True)
    (whole,) = engine.generate([prompt], params)
    for k in (1, 9):
        (rest,) = engine.generate([prompt + whole.token_ids[:k]], params.resumed(k))
        assert whole.token_ids[:k] + rest.token_ids == whole.token_ids
    # Without the offset the draws restart at position 0: a different continuation.
    (naive,) = engine.generate([prompt + whole.token_ids[:9]], dataclasses.replace(params, max_tokens=15))
    assert naive.token_ids != whole.token_ids[9:]


def test_top_k_1_equals_greedy(llama):
    engine, model = llama
    prompts = random_prompts([7, 25], model.config.vocab_size, seed=8)
    greedy = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    top1 = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=1.3, top_k=1, ignore_eos=True))
    assert [g.token_ids for g in greedy] == [t.token_ids for t in top1]


def test_repetition_penalty_matches_transformers(llama):
    engine, model = llama
    (prompt,) = random_prompts([15], model.config.vocab_size, seed=6)
    model.generation_config.eos_token_id = None
    want = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, 15, dtype=torch.long),
        max_new_tokens=14,
        do_sample=False,
        repetition_penalty=1.8,
        pad_token_id=0,
    )[0, 15:].tolist()
    (got,) = engine.generate([prompt], SamplingParams(max_tokens=14, temperature=0.0, repetition_penalty=1.8, ignore_eos=True))
    assert got.token_ids == want
    assert want != hf_greedy(model, prompt, 14), "the penalty must change the output for this test to mean anything"


def test_logprobs_are_the_models_log_softmax(llama):
    engine, model = llama
    (prompt,) = random_prompts([10], model.config.vocab_size, seed=13)
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.8, seed=5, logprobs=3, ignore_eos=True))
    with torch.no_grad():
        full = torch.log_softmax(model(torch.tensor([prompt + out.token_ids])).logits[0].float(), dim=-1)
    assert len(out.logprobs) == 6
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = full[len(prompt) - 1 + i]
        assert entry.token_id == token
        assert math.isclose(entry.logprob, float(row[token]), abs_tol=1e-4)
        assert entry.rank == int((row > row[token]).sum()) + 1
        top_ids = row.topk(3).indices.tolist()
        assert [t for t, _ in entry.top] == top_ids


def test_min_tokens_matches_transformers_min_new_tokens(llama):
    """Short of min_tokens neither a stop token id nor EOS can be drawn (transformers masks the
    end tokens with min_new_tokens the same way), and the request runs on past them."""
    engine, model = llama
    (prompt,) = random_prompts([9], model.config.vocab_size, seed=21)
    greedy = hf_greedy(model, prompt, 10)
    at = next(i for i in range(1, 10) if greedy[i] not in greedy[:i])
    stop = greedy[at]
    (early,) = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop]))
    assert early.token_ids == greedy[: at + 1] and early.finish_reason == "stop"

    model.generation_config.eos_token_id = None
    want = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=10,
        min_new_tokens=at + 3, eos_token_id=stop, do_sample=False, pad_token_id=0,
    )[0, len(prompt):].tolist()
    params = SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop], min_tokens=at + 3)
    (held,) = engine.generate([prompt], params)
    assert len(held.token_ids) >= at + 3
    assert held.token_ids == want[: len(held.token_ids)] and (len(held.token_ids) == 10 or held.token_ids[-1] == stop)
    assert engine.num_free_blocks == engine.kv_cache.num_blocks


def test_min_tokens_above_max_tokens_is_refused():
    from engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as raised:
        SamplingParams(max_tokens=4, min_tokens=5).validate()
    assert raised.value.field == "min_tokens"


def test_draws_over_a_large_vocabulary_follow_it_and_never_take_a_zero():
    """The two-level inverse-CDF draw (blocks of 64) over a vocabulary that is no multiple of 64,
    with mass in a few scattered tokens and exact zeros around them."""
    from engine.sampler import _inverse_cdf

    probs = torch.zeros(1000)
    support = torch.tensor([0, 63, 64, 500, 977, 999])
    probs[support] = torch.tensor([0.05, 0.3, 0.15, 0.2, 0.1, 0.2])
    generator = torch.Generator().manual_seed(0)
    uniforms = torch.rand(DRAWS, generator=generator, dtype=torch.float64)
    counts = torch.bincount(_inverse_cdf(probs.expand(DRAWS, -1), uniforms), minlength=1000).float()
    assert counts.sum() == counts[support].sum(), "a token of probability 0 was drawn"
    _assert_frequencies(counts[support], probs[support])


def test_a_seeded_draw_does_not_depend_on_a_filtered_row_beside_it():
    """A top_p row in the batch once sorted every row, and the same uniform then picked another
    token from the sorted row: a migrated stream diverged from its own uninterrupted run."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 300, generator=generator)
    plain = SamplingParams(temperature=1.0, seed=7)
    nucleus = SamplingParams(temperature=0.9, top_p=0.8, seed=8)

    def draw(rows):
        seqs = [Sequence(req_id=str(i), token_ids=[0], num_prompt_tokens=1, params=p) for i, p in enumerate(rows)]
        for seq in seqs:
            seq.generator = Sampler.make_generator(seq.params.seed)
        return [token for token, _ in Sampler().sample(logits[: len(rows)], seqs)]

    for _ in range(20):
        logits = torch.randn(2, 300, generator=generator)
        assert draw([plain])[0] == draw([plain, nucleus])[0]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=50, top_p=0.8),
        SamplingParams(temperature=1.3, min_p=0.05),
        SamplingParams(temperature=1.0, top_k=7),
        # top_k -1 is "no top-k" as 0 is: it was taken for a top-k row (no normalizer), so that
        # top-p kept only the argmax, and a flat row's min-p survivors past the candidates raised.
        SamplingParams(temperature=0.7, top_p=0.9, top_k=-1),
        SamplingParams(temperature=1.3, min_p=0.05, top_k=-1),
    ],
)
def test_filters_over_a_large_vocabulary_give_the_full_sorts_distribution(params):
    """Filtered rows look for their survivors among their largest logits and sort the whole row
    only when they are not all there: a peaked row (inside) and a flat one (the full sort)."""
    generator = torch.Generator().manual_seed(5)
    peaked = torch.randn(20000, generator=generator) * 4
    flat = torch.randn(20000, generator=generator) * 0.01
    logits = torch.stack([peaked, flat])
    seqs = [Sequence(req_id=str(i), token_ids=[0], num_prompt_tokens=1, params=params) for i in range(2)]
    got = Sampler().probabilities(logits, seqs)
    for row in range(2):
        assert torch.allclose(got[row], _reference_filtered(logits[row], params), atol=1e-6), row


@pytest.mark.parametrize("rounds", [8, 1])
@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.0, top_p=0.3, min_p=0.02), SamplingParams(temperature=1.3, min_p=0.1)],
)
def test_top_p_and_min_p_draws_without_a_sort_follow_the_sorted_filters(params, rounds, monkeypatch):
    """Rows without top-k draw by rejection (no sort of the vocabulary); a row still undecided
    after the last round draws through the sorted path (one round: most of them): either way,
    the draws follow the full sort's distribution, peaked or flat, and never leave it."""
    import engine.sampler

    monkeypatch.setattr(engine.sampler, "_MAX_REJECTION_ROUNDS", rounds)
    generator = torch.Generator().manual_seed(11)
    for logits in (torch.randn(3000, generator=generator) * 4, torch.randn(3000, generator=generator) * 0.3):
        want = _reference_filtered(logits, params)
        counts = _sample_many(logits, params, seed=rounds)
        assert counts[want == 0].sum() == 0, "a token the filters remove was drawn"
        _assert_frequencies(counts, want)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_k=20, top_p=0.8),  # Qwen's generation config
        SamplingParams(temperature=1.0, top_k=50, top_p=0.95),
        SamplingParams(temperature=1.3, top_k=9, min_p=0.05),
        SamplingParams(temperature=1e-40, top_k=5),  # the largest logit, always
    ],
)
def test_unseeded_top_k_rows_drawn_without_the_host_follow_the_sorted_filters(params):
    """What an overlapped CUDA step draws for unseeded top-k rows (Sampler._draw_on_device: topk
    candidates, the filters, an inverse CDF over them, uniforms from a generator on the logits'
    device, nothing read by the host), here on the CPU: it follows the full sort's distribution,
    peaked or flat, and never leaves it; and a row beside it with other parameters changes nothing."""
    generator = torch.Generator().manual_seed(13)
    for logits in (torch.randn(3000, generator=generator) * 4, torch.randn(3000, generator=generator) * 0.3):
        if params.temperature < 1e-30:  # the reference's logits / temperature overflows: its limit
            want = torch.nn.functional.one_hot(logits.argmax(), logits.shape[-1]).float()
        else:
            want = _reference_filtered(logits, params)
        other = SamplingParams(temperature=2.0, top_k=3)
        batch = logits.repeat(DRAWS, 1)
        tokens = Sampler(seed=3)._draw_on_device(torch.cat([batch, logits.unsqueeze(0)]), [params] * DRAWS + [other])
        counts = torch.bincount(tokens[:DRAWS], minlength=logits.shape[-1]).float()
        assert counts[want == 0].sum() == 0, "a token the filters remove was drawn"
        _assert_frequencies(counts, want)
        assert int(tokens[-1]) in logits.topk(3).indices.tolist()


def test_the_host_free_inverse_cdf_never_lands_past_a_rows_last_drawable_token():
    """A uniform at the very top (or a sum rounded short of its total) lands on the row's last
    token of positive probability, never on a filtered one after it."""
    from engine.sampler import _inverse_cdf_no_sync

    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.2, 0.0, 0.8, 0.0], [1.0, 0.0, 0.0, 0.0]])
    assert _inverse_cdf_no_sync(probs, torch.ones(3, dtype=torch.float64)).tolist() == [1, 2, 0]
    assert _inverse_cdf_no_sync(probs, torch.tensor([0.0, 0.1, 0.99], dtype=torch.float64)).tolist() == [0, 0, 0]
    assert _inverse_cdf_no_sync(probs, torch.tensor([0.6, 0.3, 0.5], dtype=torch.float64)).tolist() == [1, 2, 0]


def test_a_mixed_batch_drawn_without_the_host_gives_each_row_its_own_distribution(monkeypatch):
    """Rows with top-k (drawn among their candidates) interleaved with rows without (handed to
    FlashInfer's kernels: top-p alone, min-p alone, both): every row gets a draw from its own
    parameters' distribution, in its own place, and FlashInfer gets only the rows without top-k,
    their temperatures floored at 1e-30."""
    import engine.sampler

    flashinfer = ExactFlashInferSampling()
    monkeypatch.setattr(engine.sampler, "_flashinfer_sampling", lambda: flashinfer)
    generator = torch.Generator().manual_seed(17)
    logits = torch.randn(4, 400, generator=generator, dtype=torch.float64) * 2
    kinds = [SamplingParams(temperature=0.7, top_k=20, top_p=0.8), SamplingParams(temperature=0.9, top_p=0.9),
             SamplingParams(temperature=1.1, min_p=0.1), SamplingParams(temperature=0.8, top_p=0.7, min_p=0.05)]
    rows = DRAWS // 2
    tokens = Sampler(seed=5)._draw_on_device(logits.float().repeat(rows, 1), kinds * rows)
    for index, params in enumerate(kinds):
        want = _reference_filtered(logits[index], params)
        counts = torch.bincount(tokens[index :: len(kinds)], minlength=400).double()
        assert counts[want == 0].sum() == 0, f"row kind {index}: a token its filters remove was drawn"
        _assert_frequencies(counts, want)
    assert flashinfer.temperatures == pytest.approx([0.9, 1.1, 0.8] * rows)
    tiny = Sampler(seed=5)._draw_on_device(logits[:1].float(), [SamplingParams(temperature=1e-40, top_p=0.5)])
    assert flashinfer.temperatures[-1] == pytest.approx(1e-30) and int(tiny) == int(logits[0].argmax())


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_k=20, top_p=0.8, seed=1),  # drawn among its top-k candidates
        SamplingParams(temperature=0.9, top_p=0.9, seed=1),  # a whole row, through FlashInfer's kernels
        SamplingParams(temperature=1.1, top_p=0.8, min_p=0.05, seed=1),  # a whole row, its top-p renormalization and min-p
    ],
)
def test_a_seeded_row_drawn_on_the_device_depends_on_its_key_alone_and_follows_its_filters(params, monkeypatch):
    """A seeded row drawn without the host (what a CUDA step, overlapped or not, draws for it):
    its token is a function of its logits and its key (seed and position) only: alone, among
    unseeded rows, or among other keys in another order, the same; and over many keys it follows
    its filters' distribution."""
    import engine.sampler

    monkeypatch.setattr(engine.sampler, "_flashinfer_sampling", lambda: ExactFlashInferSampling())
    generator = torch.Generator().manual_seed(23)
    logits = torch.randn(2, 400, generator=generator) * 0.5  # flat enough that the filters keep dozens
    unseeded = SamplingParams(temperature=1.0, top_p=0.95)
    sampler = Sampler(seed=7)
    alone = [int(sampler._draw_on_device(logits[:1], [params], [key])) for key in range(40)]
    beside = sampler._draw_on_device(logits[[1, 0, 1, 0]], [unseeded, params, params, params], [None, 5, None, 9]).tolist()
    assert beside[1] == alone[5] and beside[3] == alone[9]
    reordered = sampler._draw_on_device(logits[[0, 0]], [params, params], [9, 5]).tolist()
    assert reordered == [alone[9], alone[5]]
    # Beside a seeded row with no filter at all (top_p 1: not renormalized with the others).
    plain = SamplingParams(temperature=1.0, seed=3)
    mixed = sampler._draw_on_device(logits[[1, 0]], [plain, params], [3, 5]).tolist()
    assert mixed == [int(sampler._draw_on_device(logits[1:2], [plain], [3])), alone[5]]
    assert len(set(alone)) > 3, "the keys give different draws"
    tokens = sampler._draw_on_device(logits[:1].repeat(DRAWS, 1), [params] * DRAWS, list(range(DRAWS)))
    want = _reference_filtered(logits[0], params)
    counts = torch.bincount(tokens, minlength=400).float()
    assert counts[want == 0].sum() == 0, "a token the filters remove was drawn"
    _assert_frequencies(counts, want)



def test_a_seeded_top_k_draw_does_not_depend_on_a_neighbours_larger_k_among_tied_logits():
    """Tied logits (bfloat16 rounds many together) come back from topk in an order that depends
    on k: a keyed row takes its candidates with its own k, so a neighbour asking for more leaves
    its draw unchanged."""
    generator = torch.Generator().manual_seed(5)
    logits = torch.randint(0, 6, (1, 500), generator=generator).float()
    params = SamplingParams(temperature=1.0, top_k=20, seed=1)
    wider = SamplingParams(temperature=1.0, top_k=50)
    sampler = Sampler(seed=2)
    alone = [int(sampler._draw_on_device(logits, [params], [key])) for key in range(30)]
    beside = [sampler._draw_on_device(logits.repeat(2, 1), [wider, params], [None, key]).tolist()[1] for key in range(30)]
    assert beside == alone



def test_keyed_race_draws_each_token_with_its_probability_whatever_the_rows_beside_it():
    """The GPU's draw for seeded rows (engine.sampler.keyed_race, the exponential race with noise
    hashed from each row's key): over many keys, each token's frequency within 5 standard errors
    of its weight's share, never a token of weight 0; and a row's token depends on its weights
    and key alone: the same in any batch, at any place in it."""
    from engine.sampler import _min_p_kept, keyed_race

    generator = torch.Generator().manual_seed(3)
    weights = torch.softmax(torch.randn(40, generator=generator) * 2, dim=-1)
    weights[[3, 17]] = 0.0  # cut by a filter
    draws = 60_000
    tokens = keyed_race(weights.repeat(draws, 1), [1000 + 7 * i for i in range(draws)])
    freq = torch.bincount(tokens, minlength=40).double() / draws
    want = (weights / weights.sum()).double()
    assert freq[want == 0].sum() == 0
    assert torch.all((freq - want).abs() <= 5 * torch.sqrt(want * (1 - want) / draws) + 1e-3)

    others = torch.rand(5, 40, generator=generator)
    alone = keyed_race(weights.unsqueeze(0), [42])
    for place in range(5):
        batch = torch.cat([others[:place], weights.unsqueeze(0), others[place:]])
        keys = [9, 8, 7, 6, 5]
        keys.insert(place, 42)
        assert keyed_race(batch, keys)[place] == alone[0]
    assert keyed_race(weights.unsqueeze(0), [43]).shape == (1,)

    kept = _min_p_kept(weights.unsqueeze(0) * 3.0, torch.tensor([0.2]))
    assert torch.equal(kept[0] > 0, weights >= 0.2 * weights.max())


def test_a_tokens_rank_counts_the_tokens_at_least_as_likely_as_vllm_does():
    """vLLM's rank counts every token at least as likely as the chosen one: of two tied maxima
    each ranks 2 (pdserve said 1), a unique maximum 1."""
    from engine.sampler import LogprobTensors

    logits = torch.tensor([[2.0, 2.0, 0.5, -1.0], [3.0, 2.0, 0.5, -1.0]])
    ranks = LogprobTensors.of_rows(logits, [0, 1], [0, 0], torch.tensor([1, 0])).ranks.tolist()
    assert ranks == [2, 1]


@pytest.mark.parametrize(
    "params, drafted",
    [
        (SamplingParams(temperature=1e-50), False),
        (SamplingParams(temperature=1e-50), True),  # a draft verified at that temperature
        (SamplingParams(temperature=1e-50, top_p=0.9), False),
        (SamplingParams(temperature=1e-50, top_k=5), False),
        (SamplingParams(temperature=1.0, top_p=1e-50), False),
        (SamplingParams(temperature=1.0, top_p=1e-50, seed=4), False),
    ],
)
def test_a_temperature_or_top_p_below_float32s_range_draws_the_most_likely_token(params, drafted):
    """Temperatures and top_p are taken as any positive number; under float32's smallest they
    rounded to 0 where they divide or cut the logits, and the draw was the vocabulary's last
    token (0 / 0 = NaN), another of the top-k, or an IndexError that failed the request. Each is
    its limit now: the most likely token."""
    logits = torch.randn(50, generator=torch.Generator().manual_seed(2)) * 3
    argmax = int(logits.argmax())
    seqs = [Sequence(req_id=str(i), token_ids=[0], num_prompt_tokens=1, params=params) for i in range(20)]
    draft = [argmax if drafted else None] * 20
    tokens = [token for token, _ in Sampler(seed=1).sample(logits.repeat(20, 1), seqs, draft_token_ids=draft)]
    assert tokens == [argmax] * 20


def test_a_temperature_beyond_float32s_range_keeps_a_banned_token_banned():
    """A temperature over float32's largest rounded to inf, and a token allowed_token_ids (or a
    grammar) masked to -inf became -inf / inf = NaN: drawn. Now every allowed token is drawn
    about equally (the limit of any huge temperature), and no banned one."""
    logits = torch.randn(50, generator=torch.Generator().manual_seed(2)) * 3
    logits[5:] = float("-inf")  # what a mask leaves: 5 tokens allowed
    counts = _sample_many(logits, SamplingParams(temperature=1e39))
    assert counts[5:].sum() == 0
    _assert_frequencies(counts, torch.tensor([0.2] * 5 + [0.0] * 45))


def test_seeded_top_p_rows_that_fall_back_to_the_sort_draw_a_fresh_uniform(monkeypatch):
    """A seeded row still undecided after the rejection rounds draws through the sorted path.
    That draw re-seeded the row's generator and took round one's uniform again, which round
    one's rejection had conditioned: over many seeds, the draws leaned to the nucleus' larger
    tokens (64% against 56%). It goes on from the rounds' state now: exact."""
    import engine.sampler

    monkeypatch.setattr(engine.sampler, "_MAX_REJECTION_ROUNDS", 1)
    logits = torch.tensor([0.2, 0.45, 0.35]).log()
    params = SamplingParams(temperature=1.0, top_p=0.5)
    seqs = [Sequence(req_id=str(i), token_ids=[0], num_prompt_tokens=1, params=dataclasses.replace(params, seed=i),
                     generator=Sampler.make_generator(i)) for i in range(DRAWS)]
    tokens, _ = zip(*Sampler(seed=0).sample(logits.repeat(DRAWS, 1), seqs))
    counts = torch.bincount(torch.tensor(tokens), minlength=3).float()
    _assert_frequencies(counts, _reference_filtered(logits, params))


def test_a_seeded_rows_tokens_are_its_seeds_whether_or_not_it_got_a_draft():
    """How many drafts a sequence gets depends on its neighbours (the step's token budget, free
    blocks): its draft rows drew by an accept test and a residual draw, its other rows by the
    inverse CDF, so the same seed gave another token with a draft than without. A seeded row
    draws the same token either way now, and keeps the draft where that token is it."""
    generator = torch.Generator().manual_seed(41)
    logits = torch.randn(1, 300, generator=generator) * 2.5
    likely = int(logits.argmax())
    for params in (SamplingParams(temperature=1.0, seed=0), SamplingParams(temperature=0.8, top_p=0.9, seed=0), SamplingParams(temperature=1.0, top_k=20, seed=0)):
        seqs = [Sequence(req_id=f"s{i}", token_ids=[0], num_prompt_tokens=1, params=dataclasses.replace(params, seed=i),
                         generator=Sampler.make_generator(i)) for i in range(60)]
        sampler = Sampler(seed=3)
        alone = [sampler.sample(logits, [seq])[0][0] for seq in seqs]
        drafted = [sampler.sample(logits, [seq], draft_token_ids=[likely])[0][0] for seq in seqs]
        assert drafted == alone, params
        assert likely in alone and len(set(alone)) > 5


def test_a_seeded_sequences_draft_rows_each_draw_their_own_positions_token():
    """A sequence verifying k drafts is k + 1 rows sharing its generator. Drawn side by side,
    each row re-seeded that one generator in turn and drew from the last row's key: the tokens
    were not their positions' (and repeated across steps). Each row draws what its position
    draws alone."""
    from engine.speculation import DraftRow

    generator = torch.Generator().manual_seed(43)
    logits = torch.randn(1, 300, generator=generator) * 0.6
    for params in (SamplingParams(temperature=1.0, seed=0), SamplingParams(temperature=0.8, top_p=0.9, seed=0)):
        for seed in range(20):
            seq = Sequence(req_id="s", token_ids=[0], num_prompt_tokens=1, params=dataclasses.replace(params, seed=seed),
                           generator=Sampler.make_generator(seed))
            rows = [seq, DraftRow(seq, [5]), DraftRow(seq, [5, 9])]
            sampler = Sampler(seed=3)
            alone = [sampler.sample(logits, [row])[0][0] for row in rows]
            together = [token for token, _ in sampler.sample(logits.repeat(3, 1), rows, draft_token_ids=[5, 9, None])]
            assert together == alone, (params, seed)


def test_a_top_k_draw_kernel_that_fails_leaves_the_torch_ops(monkeypatch):
    """Where the top-k rows' Triton kernel (engine.triton_sampling) fails to build or launch, the
    rows are drawn by the torch ops, that step and after: the tokens of a sampler without it."""
    from types import SimpleNamespace

    import engine.sampler

    params = [SamplingParams(temperature=0.7, top_k=20, top_p=0.8)] * 8
    logits = torch.randn(8, 500, generator=torch.Generator().manual_seed(2)) * 3
    want = Sampler(seed=4)._draw_on_device(logits, params)
    launches = []

    def failing(*args):
        launches.append(1)
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(engine.sampler, "_fused_top_k_draws", lambda logits: True)
    monkeypatch.setattr(engine.sampler, "_triton_sampling", lambda: SimpleNamespace(MAX_CANDIDATES=4096, draw_among_top_k=failing))
    sampler = Sampler(seed=4)
    assert torch.equal(sampler._draw_on_device(logits, params), want)
    sampler._draw_on_device(logits, params)
    assert launches == [1] and sampler.fused_top_k_draws is False
