"""The CPU decode-attention kernel computes softmax(q k^T / sqrt(d)) v over a sequence's blocks."""

from __future__ import annotations

import random

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams, cpu_decode_attention
from tests.checkpoints import build_checkpoint, hf_greedy, random_prompts

pytestmark = pytest.mark.skipif(
    "avx2" not in cpu_decode_attention._cpu_flags().split(), reason="the kernel is built for x86 CPUs with AVX2"
)

BLOCK_SIZE = 16


def _reference(q, key_cache, value_cache, tables, lens):
    """Float64 attention of each query over its own blocks' first ``len`` tokens."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    out = torch.empty(n, num_heads, head_dim, dtype=torch.float64)
    for b in range(n):
        length = int(lens[b])
        blocks = tables[b, : -(-length // BLOCK_SIZE)]
        keys = key_cache[blocks].double().flatten(0, 1)[:length]  # [len, KVH, D]
        values = value_cache[blocks].double().flatten(0, 1)[:length]
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
    return cpu_decode_attention._vector_width()


def test_the_kernel_builds_on_this_machine():
    assert cpu_decode_attention.kernel() is not None


@pytest.mark.parametrize("vectors", [1, 2, 4, 8])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_kernel_matches_float64_attention(vectors, group):
    # Lengths on both sides of block boundaries, one token, and a long one.
    lengths = [1, 15, 16, 17, 33, 300, 1000]
    head_dim = vectors * _width()
    q, key_cache, value_cache, tables, lens = _random_case(2, group, head_dim, torch.float32, lengths)
    assert cpu_decode_attention.applies("cpu", torch.float32, head_dim, group)
    got = cpu_decode_attention.attend(q, key_cache, value_cache, tables, lens)
    torch.testing.assert_close(got.double(), _reference(q, key_cache, value_cache, tables, lens), rtol=0, atol=2e-6)


def test_bfloat16_cache_matches_float64_attention_of_the_same_values():
    lengths = [5, 64, 250]
    q, key_cache, value_cache, tables, lens = _random_case(3, 3, 4 * _width(), torch.bfloat16, lengths, seed=3)
    got = cpu_decode_attention.attend(q, key_cache, value_cache, tables, lens)
    assert got.dtype == torch.bfloat16
    want = _reference(q, key_cache, value_cache, tables, lens)
    # Computed in float32 from the exact bfloat16 inputs; only the output is rounded to bfloat16.
    torch.testing.assert_close(got.double(), want, rtol=1 / 128, atol=1 / 256)


def test_each_sequence_reads_only_its_own_blocks_and_length():
    """Poisoning every block a sequence does not own, and its tokens past its length, changes nothing."""
    lengths = [20, 7]
    q, key_cache, value_cache, tables, lens = _random_case(1, 2, 2 * _width(), torch.float32, lengths, seed=5)
    before = cpu_decode_attention.attend(q, key_cache, value_cache, tables, lens)
    owned = {int(tables[0, 0]), int(tables[0, 1]), int(tables[1, 0])}
    for block in range(key_cache.shape[0]):
        if block not in owned:
            key_cache[block] = float("nan")
            value_cache[block] = float("nan")
    key_cache[tables[0, 1], 4:] = 1e30  # sequence 0 holds 16 + 4 tokens
    key_cache[tables[1, 0], 7:] = 1e30
    after = cpu_decode_attention.attend(q, key_cache, value_cache, tables, lens)
    assert torch.equal(before, after)


def test_shapes_it_was_not_built_for_keep_the_portable_path():
    width = _width()
    assert not cpu_decode_attention.applies("cpu", torch.float32, 3 * width, 2)
    assert not cpu_decode_attention.applies("cpu", torch.float32, 2 * width, 9)
    assert not cpu_decode_attention.applies("cpu", torch.float16, 2 * width, 2)
    assert not cpu_decode_attention.applies("cuda", torch.float32, 2 * width, 2)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_greedy_output_matches_transformers_through_the_kernel(tmp_path, arch):
    """A GQA model whose head size the kernel serves: the engine's decode runs on it and keeps
    transformers' greedy tokens, alone and batched with prompts across block boundaries."""
    path = tmp_path / arch
    model = build_checkpoint(arch, path, hidden_size=96, head_dim=2 * _width(), num_attention_heads=6, num_key_value_heads=2)
    prompts = random_prompts([1, 16, 17, 90], model.config.vocab_size)
    expected = [hf_greedy(model, p, 10) for p in prompts]
    engine = LLMEngine(path, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=64, long_prefill_chunk=32))
    assert engine.runner.native_decode
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    assert [c.token_ids for c in engine.generate(prompts, greedy)] == expected
    assert engine.allocator.num_free == engine.kv_cache.num_blocks


def test_loading_the_kernel_leaves_the_process_floating_point_mode_alone():
    """Linked with -ffast-math, the library switched the process to flush-to-zero on load, and a
    request's temperature of 1e-40 then divided to nan in the sampler."""
    assert cpu_decode_attention.kernel() is not None
    tiny = torch.tensor([1e-40])
    assert tiny.item() > 0
    assert (torch.tensor([0.0]) / tiny).item() == 0.0
