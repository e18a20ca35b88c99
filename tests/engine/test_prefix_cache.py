"""Prefix caching: a prompt's cached full blocks are reused, never recomputed, and never change
the output. Every greedy output is checked against transformers."""

from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.block_allocator import BlockAllocator, CacheEvent, chained_block_hashes
from tests.checkpoints import hf_greedy, random_prompts

BLOCK = 8
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _run(engine: LLMEngine, req_id: str, prompt: list[int]) -> tuple[list[int], int]:
    """Generate alone; return the output and how many prompt tokens the engine computed."""
    seq = engine.add_request(req_id, prompt, SamplingParams(**{f: getattr(GREEDY, f) for f in GREEDY.__dataclass_fields__}))
    scheduled_before = engine.num_scheduled_tokens
    out = []
    while engine.has_unfinished_requests():
        for result in engine.step():
            out.extend(result.new_token_ids)
    decode_steps = len(out) - 1  # the first token comes from the prompt's last chunk
    return out, engine.num_scheduled_tokens - scheduled_before - decode_steps, seq


# -- the allocator ------------------------------------------------------------------------


def test_freed_full_blocks_stay_cached_and_come_back_by_hash():
    allocator = BlockAllocator(4)
    hashes = chained_block_hashes(list(range(16)), BLOCK)
    blocks = allocator.allocate(2)
    for block_id, block_hash in zip(blocks, hashes):
        allocator.set_hash(block_id, block_hash)
    allocator.free(blocks)
    assert allocator.num_free == 4 and allocator.num_cached_free == 2
    assert allocator.take_cached(hashes) == blocks
    assert allocator.num_free == 2 and [allocator.ref_count(b) for b in blocks] == [1, 1]
    # A second holder shares them; they are freed only when both let go.
    assert allocator.take_cached(hashes[:1]) == blocks[:1]
    allocator.free(blocks)
    assert allocator.ref_count(blocks[0]) == 1 and allocator.num_free == 3
    allocator.free(blocks[:1])
    assert allocator.num_free == 4


def test_allocation_takes_empty_blocks_before_evicting_and_evicts_a_prefix_from_its_tail():
    allocator = BlockAllocator(4)
    allocator.record_events = True
    hashes = chained_block_hashes(list(range(24)), BLOCK)
    blocks = allocator.allocate(3)
    for block_id, block_hash in zip(blocks, hashes):
        allocator.set_hash(block_id, block_hash)
    allocator.free(blocks)
    assert allocator.drain_events() == [CacheEvent(h, stored=True) for h in hashes]
    (fresh,) = allocator.allocate(1)
    assert fresh not in blocks, "an empty block goes first; the cache keeps all three"
    assert allocator.num_cached_prefix(hashes) == 3
    allocator.allocate(1)
    assert allocator.num_cached_prefix(hashes) == 2, "the prefix's last block is evicted first"
    assert allocator.drain_events() == [CacheEvent(hashes[2], stored=False)]
    assert allocator.take_cached(hashes) == blocks[:2]


def test_a_second_copy_of_a_block_stays_private_and_is_not_cached():
    allocator = BlockAllocator(4)
    (block_hash,) = chained_block_hashes(list(range(8)), BLOCK)
    first, second = allocator.allocate(2)
    allocator.set_hash(first, block_hash)
    allocator.set_hash(second, block_hash)  # two prompts that missed together computed it twice
    allocator.free([second])
    assert allocator.num_cached_free == 0
    assert allocator.take_cached([block_hash]) == [first]


def test_with_caching_off_nothing_is_kept():
    allocator = BlockAllocator(2, enable_prefix_caching=False)
    (block_hash,) = chained_block_hashes(list(range(8)), BLOCK)
    (block,) = allocator.allocate(1)
    allocator.set_hash(block, block_hash)
    allocator.free([block])
    assert allocator.take_cached([block_hash]) == [] and allocator.num_cached_free == 0


# -- the engine ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(checkpoints):
    return checkpoints["llama"]


def _engine(path, **overrides) -> LLMEngine:
    config = dict(num_kv_blocks=64, block_size=BLOCK, long_prefill_chunk=7, max_num_batched_tokens=64)
    config.update(overrides)
    return LLMEngine(path, EngineConfig(**config))


@pytest.mark.parametrize(
    "shared, suffix",
    [
        (16, 5),  # the shared part ends on a block boundary
        (19, 6),  # mid-block: the partial block is recomputed
        (24, 0),  # the same prompt again, a multiple of the block: its last block is recomputed
        (17, 0),  # the same prompt again, one token into a block
    ],
)
def test_a_repeated_prefix_is_not_computed_again_and_output_matches_transformers(llama, shared, suffix):
    path, model = llama
    first_prompt, tail = random_prompts([shared + 3, suffix], model.config.vocab_size, seed=shared)
    base = first_prompt[:shared]
    second_prompt = base + tail if suffix else list(base)
    first_prompt = base + first_prompt[shared:]
    engine = _engine(path)
    out1, computed1, seq1 = _run(engine, "first", first_prompt)
    out2, computed2, seq2 = _run(engine, "second", second_prompt)
    assert out1 == hf_greedy(model, first_prompt, 6)
    assert out2 == hf_greedy(model, second_prompt, 6)
    reusable = min(shared, len(second_prompt) - 1) // BLOCK * BLOCK
    assert seq1.num_cached_tokens == 0 and computed1 == len(first_prompt)
    assert seq2.num_cached_tokens == reusable
    assert computed2 == len(second_prompt) - reusable
    assert engine.num_free_blocks == engine.kv_cache.num_blocks
    stats = engine.scheduler
    assert stats.num_prefix_hit_tokens == reusable
    assert stats.num_prefix_query_tokens == len(first_prompt) + len(second_prompt)


def test_caching_off_computes_every_prompt_in_full(llama):
    path, model = llama
    (prompt,) = random_prompts([30], model.config.vocab_size)
    engine = _engine(path, enable_prefix_caching=False)
    _run(engine, "a", prompt)
    _, computed, seq = _run(engine, "b", prompt)
    assert computed == len(prompt) and seq.num_cached_tokens == 0
    assert engine.allocator.num_cached_free == 0


def test_prompts_sharing_a_prefix_in_one_batch_match_transformers(llama):
    """A running request's finished blocks serve a request that arrives while it decodes."""
    path, model = llama
    prefix, *suffixes = random_prompts([33, 4, 9, 1], model.config.vocab_size, seed=5)
    prompts = [prefix + s for s in suffixes]
    engine = _engine(path)
    engine.add_request("r0", prompts[0], GREEDY)
    outputs: dict[str, list[int]] = {}
    for step in range(200):
        if step == 8:
            for i in (1, 2):
                engine.add_request(f"r{i}", prompts[i], GREEDY)
        for result in engine.step():
            outputs.setdefault(result.req_id, []).extend(result.new_token_ids)
        if step > 8 and not engine.has_unfinished_requests():
            break
    for i, prompt in enumerate(prompts):
        assert outputs[f"r{i}"] == hf_greedy(model, prompt, 6), f"r{i}"
    assert engine.scheduler.num_prefix_hit_tokens >= 2 * 32
    assert engine.num_free_blocks == engine.kv_cache.num_blocks


def test_under_eviction_pressure_outputs_stay_exact_and_blocks_come_back(llama):
    """A cache of 12 blocks, prompts of 4-5 blocks: hits, partial hits and evictions mix."""
    path, model = llama
    base = random_prompts([40, 40, 40], model.config.vocab_size, seed=11)
    prompts = [base[0], base[1], base[0][:24] + base[2][:10], base[2], base[0], base[1][:33]]
    engine = _engine(path, num_kv_blocks=12)
    for i, prompt in enumerate(prompts):
        out, computed, seq = _run(engine, f"r{i}", prompt)
        assert out == hf_greedy(model, prompt, 6), f"prompt {i}"
        assert computed == len(prompt) - seq.num_cached_tokens
    assert engine.allocator.num_evictions > 0
    assert engine.scheduler.num_prefix_hit_tokens > 0
    assert engine.num_free_blocks == engine.kv_cache.num_blocks


def test_a_preempted_sequence_resumes_from_its_cached_blocks_and_matches_transformers(llama):
    """Too few blocks for both: one is preempted; its blocks stay cached and its recompute
    takes them back instead of computing its prompt again."""
    path, model = llama
    prompts = random_prompts([30, 30], model.config.vocab_size, seed=3)
    engine = _engine(path, num_kv_blocks=10, max_num_batched_tokens=64, long_prefill_chunk=None)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    seqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    scheduled = 0
    while engine.has_unfinished_requests():
        engine.step()
    scheduled = engine.num_scheduled_tokens
    assert engine.scheduler.num_preemptions > 0
    for seq, prompt in zip(seqs, prompts):
        assert seq.output_token_ids == hf_greedy(model, prompt, 20)
    # Without the cache, every preemption would recompute its whole sequence.
    no_cache = _engine(path, num_kv_blocks=10, max_num_batched_tokens=64, long_prefill_chunk=None, enable_prefix_caching=False)
    for i, p in enumerate(prompts):
        no_cache.add_request(f"r{i}", p, params)
    while no_cache.has_unfinished_requests():
        no_cache.step()
    assert no_cache.scheduler.num_preemptions > 0
    assert scheduled < no_cache.num_scheduled_tokens
    assert engine.num_free_blocks == engine.kv_cache.num_blocks


def test_a_cache_salt_shares_a_prefix_only_with_requests_of_the_same_salt(llama):
    """vLLM's cache_salt: one tenant's prompts cannot be found in (or timed through) another's
    cache hits; requests of one salt still share, and the output is the same either way."""
    path, model = llama
    (prompt,) = random_prompts([30], model.config.vocab_size, seed=3)
    engine = _engine(path)

    def run(req_id: str, salt: str | None):
        seq = engine.add_request(req_id, prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, cache_salt=salt))
        out = []
        while engine.has_unfinished_requests():
            for result in engine.step():
                out.extend(result.new_token_ids)
        return out, seq.num_cached_tokens

    first, cached = run("a", "tenant-a")
    assert cached == 0 and first == hf_greedy(model, prompt, 6)
    assert run("b", "tenant-b") == (first, 0)
    assert run("c", None) == (first, 0)  # unsalted requests share only with unsalted ones
    assert run("d", "tenant-a") == (first, 24)
    with pytest.raises(Exception, match="cache_salt"):
        engine.add_request("e", prompt, SamplingParams(max_tokens=2, cache_salt=""))


@pytest.mark.parametrize("overlapped", [False, True])
def test_identical_prompts_arriving_together_compute_their_shared_blocks_once(llama, overlapped):
    """n > 1 choices, or a burst of one system prompt: requests admitted in one step each
    computed the whole prompt and held their own copy of its blocks (vLLM shares them). The
    later ones now wait for the first's blocks, also where steps overlap (its blocks are hashed
    a step after they are launched); every output still matches transformers."""
    path, model = llama
    (prompt, other) = random_prompts([37, 21], model.config.vocab_size, seed=5)
    engine = _engine(path, async_scheduling=overlapped)
    scheduled_before = engine.num_scheduled_tokens
    choices = [engine.add_request(f"choice-{i}", prompt, GREEDY) for i in range(4)]
    unrelated = engine.add_request("other", other, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    reusable = (len(prompt) - 1) // BLOCK * BLOCK
    assert [seq.num_cached_tokens for seq in choices] == [0, reusable, reusable, reusable]
    assert unrelated.num_cached_tokens == 0, "a prompt sharing nothing waited"
    decode_steps = 5 * (GREEDY.max_tokens - 1)
    assert engine.num_scheduled_tokens - scheduled_before - decode_steps == len(prompt) + 3 * (len(prompt) - reusable) + len(other)
    expected = hf_greedy(model, prompt, 6)
    assert all(seq.output_token_ids == expected for seq in choices)
    assert unrelated.output_token_ids == hf_greedy(model, other, 6)
    assert engine.num_free_blocks == engine.kv_cache.num_blocks


def test_an_urgent_prompt_waits_for_no_twin_of_lower_priority(llama):
    """A waiting prompt waits for a running one with its prefix only where that one computes the
    block this step. Waiting for any such twin, an urgent prompt sat behind a low-priority one
    that more important work kept from computing: with strict priority, for good."""
    path, model = llama
    system, tail_low, tail_high = random_prompts([32, 8, 8], model.config.vocab_size, seed=9)
    engine = _engine(path, priority_max_wait_s=None)
    low = engine.add_request("low", system + tail_low, GREEDY, priority=-5)
    engine.step()  # its first chunk
    high = engine.add_request("high", system + tail_high, GREEDY, priority=5)
    engine.step()
    assert high.num_computed_tokens > 0, "the urgent prompt waited for the low-priority one"
    while engine.has_unfinished_requests():
        engine.step()
    assert high.output_token_ids == hf_greedy(model, system + tail_high, 6)
    assert low.output_token_ids == hf_greedy(model, system + tail_low, 6)
