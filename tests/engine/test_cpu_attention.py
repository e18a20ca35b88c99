"""The CPU attention kernels compute softmax(q k^T / sqrt(d)) v over a sequence's blocks: decode
for one query per sequence, prefill for chunks of queries, causally, after a cached context."""

from __future__ import annotations

import random

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams, native_kernels
from engine.attention import cpu as cpu_attention
from engine.attention.cpu import PrefillChunks
from tests.checkpoints import build_checkpoint, hf_greedy, random_prompts

pytestmark = pytest.mark.skipif(
    "avx2" not in native_kernels._cpu_flags().split(), reason="the kernel is built for x86 CPUs with AVX2"
)

BLOCK_SIZE = 16


def _reference(q, key_cache, value_cache, tables, lens, window=None):
    """Float64 attention of each query over its own blocks' first ``len`` tokens (the last
    ``window`` of them under a sliding window)."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    out = torch.empty(n, num_heads, head_dim, dtype=torch.float64)
    for b in range(n):
        length = int(lens[b])
        blocks = tables[b, : -(-length // BLOCK_SIZE)]
        start = max(0, length - window) if window else 0
        keys = key_cache[blocks].double().flatten(0, 1)[start:length]  # [len, KVH, D]
        values = value_cache[blocks].double().flatten(0, 1)[start:length]
        for head in range(num_heads):
            kv_head = head // (num_heads // num_kv_heads)
            scores = keys[:, kv_head] @ q[b, head].double() / head_dim**0.5
            out[b, head] = torch.softmax(scores, dim=0) @ values[:, kv_head]
    return out


def _random_case(num_kv_heads, group, head_dim, dtype, lengths, seed=0):
    """A block-major cache (every layer of a block together, as engine.kv_cache lays it out) and
    shuffled, padded block tables, for one layer in the middle."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in lengths) + 3
    cache = torch.randn(num_blocks, 3, 2, BLOCK_SIZE, num_kv_heads, head_dim, generator=generator).to(dtype)
    key_cache, value_cache = cache[:, 1, 0], cache[:, 1, 1]
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = []
    for n in lengths:
        tables.append([free.pop() for _ in range(-(-n // BLOCK_SIZE))])
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables])
    q = torch.randn(len(lengths), num_kv_heads * group, head_dim, generator=generator).to(dtype)
    return q, key_cache, value_cache, padded, torch.tensor(lengths)


def _width() -> int:
    return native_kernels.vector_width()


def test_the_kernel_builds_on_this_machine():
    assert native_kernels.kernel() is not None


@pytest.mark.parametrize("vectors", [1, 2, 4, 8])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_kernel_matches_float64_attention(vectors, group):
    # Lengths on both sides of block boundaries, one token, and a long one.
    lengths = [1, 15, 16, 17, 33, 300, 1000]
    head_dim = vectors * _width()
    q, key_cache, value_cache, tables, lens = _random_case(2, group, head_dim, torch.float32, lengths)
    assert cpu_attention.applies("cpu", torch.float32, head_dim, group)
    got = cpu_attention.attend_decode(q, key_cache, value_cache, tables, lens)
    torch.testing.assert_close(got.double(), _reference(q, key_cache, value_cache, tables, lens), rtol=0, atol=2e-6)


def test_bfloat16_cache_matches_float64_attention_of_the_same_values():
    lengths = [5, 64, 250]
    q, key_cache, value_cache, tables, lens = _random_case(3, 3, 4 * _width(), torch.bfloat16, lengths, seed=3)
    got = cpu_attention.attend_decode(q, key_cache, value_cache, tables, lens)
    assert got.dtype == torch.bfloat16
    want = _reference(q, key_cache, value_cache, tables, lens)
    # Computed in float32 from the exact bfloat16 inputs; only the output is rounded to bfloat16.
    torch.testing.assert_close(got.double(), want, rtol=1 / 128, atol=1 / 256)


def test_each_sequence_reads_only_its_own_blocks_and_length():
    """Poisoning every block a sequence does not own, and its tokens past its length, changes nothing."""
    lengths = [20, 7]
    q, key_cache, value_cache, tables, lens = _random_case(1, 2, 2 * _width(), torch.float32, lengths, seed=5)
    before = cpu_attention.attend_decode(q, key_cache, value_cache, tables, lens)
    owned = {int(tables[0, 0]), int(tables[0, 1]), int(tables[1, 0])}
    for block in range(key_cache.shape[0]):
        if block not in owned:
            key_cache[block] = float("nan")
            value_cache[block] = float("nan")
    key_cache[tables[0, 1], 4:] = 1e30  # sequence 0 holds 16 + 4 tokens
    key_cache[tables[1, 0], 7:] = 1e30
    after = cpu_attention.attend_decode(q, key_cache, value_cache, tables, lens)
    assert torch.equal(before, after)


def test_shapes_it_was_not_built_for_keep_the_portable_path():
    width = _width()
    assert not cpu_attention.applies("cpu", torch.float32, 3 * width, 2)
    assert not cpu_attention.applies("cpu", torch.float32, 2 * width, 9)
    assert not cpu_attention.applies("cpu", torch.float16, 2 * width, 2)
    assert not cpu_attention.applies("cuda", torch.float32, 2 * width, 2)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_greedy_output_matches_transformers_through_the_kernel(tmp_path, arch):
    """A GQA model whose head size the kernels serve: the engine's decode and chunked prefill run
    on them and keep transformers' greedy tokens, alone and batched with prompts across block
    and chunk boundaries."""
    path = tmp_path / arch
    model = build_checkpoint(arch, path, hidden_size=96, head_dim=2 * _width(), num_attention_heads=6, num_key_value_heads=2)
    prompts = random_prompts([1, 16, 17, 90], model.config.vocab_size)
    expected = [hf_greedy(model, p, 10) for p in prompts]
    engine = LLMEngine(path, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=64, long_prefill_chunk=32))
    assert engine.runner.attention.name == "cpu"
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    assert [c.token_ids for c in engine.generate(prompts, greedy)] == expected
    assert engine.allocator.num_free == engine.kv_cache.num_blocks


def test_loading_the_kernel_leaves_the_process_floating_point_mode_alone():
    """Linked with -ffast-math, the library switched the process to flush-to-zero on load, and a
    request's temperature of 1e-40 then divided to nan in the sampler."""
    assert native_kernels.kernel() is not None
    tiny = torch.tensor([1e-40])
    assert tiny.item() > 0
    assert (torch.tensor([0.0]) / tiny).item() == 0.0


# -- prefill -----------------------------------------------------------------------------


def _prefill_case(num_kv_heads, group, head_dim, dtype, chunks, seed=0):
    """Chunks as (context_len, num_tokens): each its own sequence, with shuffled blocks holding
    context + chunk (the chunk's keys already written, as the engine writes them first)."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    totals = [context + tokens for context, tokens in chunks]
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in totals) + 3
    cache = torch.randn(num_blocks, 3, 2, BLOCK_SIZE, num_kv_heads, head_dim, generator=generator).to(dtype)
    key_cache, value_cache = cache[:, 1, 0], cache[:, 1, 1]
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // BLOCK_SIZE))] for n in totals]
    width = max(len(t) for t in tables)
    rows = [0]
    for _, tokens in chunks:
        rows.append(rows[-1] + tokens)
    meta = PrefillChunks(
        first_rows=torch.tensor(rows[:-1]),
        num_tokens=torch.tensor([tokens for _, tokens in chunks]),
        context_lens=torch.tensor([context for context, _ in chunks]),
        tables=torch.tensor([t + [t[0]] * (width - len(t)) for t in tables]),
    )
    q = torch.randn(rows[-1], num_kv_heads * group, head_dim, generator=generator).to(dtype)
    return q, key_cache, value_cache, meta


def _prefill_reference(q, key_cache, value_cache, meta, window=None):
    """Float64 causal attention of each chunk over its context and itself (the latest
    ``window`` keys of each query under a sliding window)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // key_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for first, tokens, context, table in zip(meta.first_rows.tolist(), meta.num_tokens.tolist(), meta.context_lens.tolist(), meta.tables):
        total = context + tokens
        blocks = table[: -(-total // BLOCK_SIZE)]
        keys = key_cache[blocks].double().flatten(0, 1)[:total].repeat_interleave(group, dim=1)  # [total, H, D]
        values = value_cache[blocks].double().flatten(0, 1)[:total].repeat_interleave(group, dim=1)
        queries = q[first : first + tokens].double()
        scores = torch.einsum("thd,khd->htk", queries, keys) / head_dim**0.5
        key_pos, query_pos = torch.arange(total).unsqueeze(0), torch.arange(context, total).unsqueeze(1)
        visible = key_pos <= query_pos
        if window:
            visible &= key_pos > query_pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[first : first + tokens] = torch.einsum("htk,khd->thd", torch.softmax(scores, dim=-1), values)
    return out


# Chunks from position 0 and after a context, across block (16) and key-tile (2 vectors) edges,
# shorter and longer than a query tile (32), several in one call.
PREFILL_CHUNKS = [(0, 2), (0, 100), (15, 17), (31, 65), (500, 33), (64, 64)]


@pytest.mark.parametrize("vectors", [1, 2, 4, 8])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_prefill_kernel_matches_float64_causal_attention(vectors, group):
    head_dim = vectors * _width()
    q, key_cache, value_cache, meta = _prefill_case(2, group, head_dim, torch.float32, PREFILL_CHUNKS)
    got = cpu_attention.attend_prefill(q, key_cache, value_cache, meta)
    torch.testing.assert_close(got.double(), _prefill_reference(q, key_cache, value_cache, meta), rtol=0, atol=2e-6)


@pytest.mark.parametrize("vectors", [1, 2, 4, 8])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("window", [None, 33])
def test_prefill_kernel_on_a_bfloat16_cache_matches_float64_attention_of_the_same_values(vectors, group, window):
    """Where the CPU multiplies bfloat16 natively the products run on bfloat16 pairs (queries and
    softmax weights rounded to bfloat16): the error stays within the output's own rounding."""
    chunks = [(0, 40), (300, 130), *PREFILL_CHUNKS]
    q, key_cache, value_cache, meta = _prefill_case(3, group, vectors * _width(), torch.bfloat16, chunks, seed=4)
    got = cpu_attention.attend_prefill(q, key_cache, value_cache, meta, window)
    assert got.dtype == torch.bfloat16
    want = _prefill_reference(q, key_cache, value_cache, meta, window)
    torch.testing.assert_close(got.double(), want, rtol=1 / 128, atol=1 / 256)


def test_prefill_reads_only_its_own_blocks_and_nothing_after_each_query():
    """Poisoning every block the chunks do not own and every token after the chunks' ends changes
    nothing: no query sees a later key, and no key past a sequence's length is read."""
    q, key_cache, value_cache, meta = _prefill_case(1, 2, 2 * _width(), torch.float32, [(20, 30), (0, 7)], seed=6)
    before = cpu_attention.attend_prefill(q, key_cache, value_cache, meta)
    owned = set(meta.tables[0, :4].tolist()) | {int(meta.tables[1, 0])}
    for block in range(key_cache.shape[0]):
        if block not in owned:
            key_cache[block] = float("nan")
            value_cache[block] = float("nan")
    key_cache[meta.tables[0, 3], 2:] = 1e30  # sequence 0 holds 48 + 2 tokens
    value_cache[meta.tables[0, 3], 2:] = float("nan")
    key_cache[meta.tables[1, 0], 7:] = 1e30
    value_cache[meta.tables[1, 0], 7:] = float("nan")
    assert torch.equal(before, cpu_attention.attend_prefill(q, key_cache, value_cache, meta))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_attends_bit_for_bit_the_same_however_it_is_chunked(dtype):
    """What a query gets does not depend on where its chunk starts or what shares the call: the
    promise that a seeded request repeats exactly however its prompt was chunked (bfloat16: the
    pairs path where the CPU has avx512_bf16, else widened tiles)."""
    q, key_cache, value_cache, whole = _prefill_case(3, 3, 4 * _width(), dtype, [(0, 300)], seed=8)
    table = whole.tables[0].tolist()
    pieces = [(0, 100), (100, 1), (101, 36), (137, 1 + 31), (169, 131)]  # one-token chunks are chunks too
    split = PrefillChunks(
        first_rows=torch.tensor([start for start, _ in pieces]),
        num_tokens=torch.tensor([tokens for _, tokens in pieces]),
        context_lens=torch.tensor([start for start, _ in pieces]),
        tables=torch.tensor([table] * len(pieces)),
    )
    assert torch.equal(
        cpu_attention.attend_prefill(q, key_cache, value_cache, whole), cpu_attention.attend_prefill(q, key_cache, value_cache, split)
    )



@pytest.mark.parametrize("window", [1, 5, 16, 33, 70])
def test_sliding_windows_in_both_kernels_match_float64_attention(window):
    """Each query attends its latest ``window`` keys: windows inside a block, on block and tile
    edges, and wider than a query tile, where whole tiles before a row's window are skipped."""
    q, key_cache, value_cache, meta = _prefill_case(3, 3, 4 * _width(), torch.float32, PREFILL_CHUNKS, seed=9)
    got = cpu_attention.attend_prefill(q, key_cache, value_cache, meta, window)
    torch.testing.assert_close(got.double(), _prefill_reference(q, key_cache, value_cache, meta, window), rtol=0, atol=2e-6)
    lengths = [1, 15, 16, 17, 33, 300]
    q, key_cache, value_cache, tables, lens = _random_case(3, 3, 4 * _width(), torch.float32, lengths, seed=10)
    got = cpu_attention.attend_decode(q, key_cache, value_cache, tables, lens, window)
    torch.testing.assert_close(got.double(), _reference(q, key_cache, value_cache, tables, lens, window), rtol=0, atol=2e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prompts_logprobs_are_the_same_bits_however_it_is_chunked(tmp_path, dtype):
    """Whole, in chunks of 16 (33 tokens: 16 + 16 + a one-token chunk) and a token at a time: a
    one-token piece of a prompt goes through the prefill kernel like any chunk, not the decode
    kernel, so the logits do not change in their last bit. (bfloat16 needs the row-invariant
    pair linears; where the CPU lacks avx512_bf16 only float32 is promised.)"""
    from engine.cpu_linear import bf16_pair_kernel_available

    if dtype == "bfloat16" and not bf16_pair_kernel_available():
        pytest.skip("bfloat16 linears on oneDNN here: not row-invariant")
    model = build_checkpoint("llama", tmp_path)
    (prompt,) = random_prompts([33], model.config.vocab_size, seed=12)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3)
    results = []
    for chunk in (None, 16, 1):
        engine = LLMEngine(tmp_path, EngineConfig(num_kv_blocks=32, dtype=dtype, long_prefill_chunk=chunk, num_threads=1))
        (completion,) = engine.generate([prompt], params)
        results.append([(lp.token_id, lp.logprob, lp.top) for lp in completion.logprobs])
    assert results[1] == results[0]
    assert results[2] == results[0]
