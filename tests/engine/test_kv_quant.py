"""A quantized KV cache (int8, fp8 e4m3): half the bytes, the same model within a rounding step."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from engine import EngineConfig, LLMEngine, SamplingParams, native_kernels
from engine.attention import cpu as cpu_attention
from engine.attention.kv_write import write_quantized_native, write_quantized_torch
from engine.config import ModelConfig
from engine.cpu_linear import bf16_pair_kernel_available
from engine.default_model_path import DEFAULT_MODEL_PATH
from engine.kv_accuracy import held_out_windows, perplexity
from engine.kv_cache import KVCache

KINDS = ["int8", "fp8_e4m3"]
pytestmark = pytest.mark.skipif(native_kernels.kernel() is None, reason="no CPU kernels here")


def _cache(kind: str, num_blocks: int = 6) -> KVCache:
    return KVCache(ModelConfig.from_model_dir(DEFAULT_MODEL_PATH), EngineConfig(kv_cache_dtype=kind, num_kv_blocks=num_blocks, block_size=8), torch.float32)


def _steps(seed: int = 0):
    """Writes as an engine makes them: two sequences' prompts in chunks, then a token per step,
    later tokens larger (so scales grow), and a block reused from offset 0 (a fresh start)."""
    g = torch.Generator().manual_seed(seed)
    steps = []
    for step, (positions, blocks) in enumerate([
        ([0, 1, 2, 3, 4], [1, 1, 1, 1, 1]),
        ([5, 6, 7, 8, 9, 0, 1], [1, 1, 1, 2, 2, 4, 4]),
        ([10, 2], [2, 4]),
        ([11, 3], [2, 4]),
        ([0, 1], [1, 1]),  # block 1 freed and taken again: its old range is forgotten
    ]):
        x = torch.randn(len(positions), 8, 32, generator=g) * (1 + step)
        steps.append((x, torch.tensor(blocks), torch.tensor([p % 8 for p in positions])))
    return steps


@pytest.mark.parametrize("kind", KINDS)
def test_the_write_kernel_follows_the_torch_rules_and_stays_within_a_step(kind):
    native, reference = _cache(kind), _cache(kind)
    written: dict[tuple[int, int], torch.Tensor] = {}
    for x, blocks, offsets in _steps():
        assert write_quantized_native(x, native.key_views[0], native.key_scales[0], blocks, offsets)
        write_quantized_torch(x, reference.key_views[0], reference.key_scales[0], blocks, offsets)
        for row, (b, o) in enumerate(zip(blocks.tolist(), offsets.tolist())):
            written[(b, o)] = x[row]
    # The same rules (the kernel's float arithmetic may round a scale's last bit otherwise, and
    # a value at a rounding tie then one code apart).
    assert torch.allclose(native.key_scales[0], reference.key_scales[0], rtol=1e-6, atol=0)
    codes_differ = native.key_views[0].view(torch.uint8) != reference.key_views[0].view(torch.uint8)
    assert codes_differ.float().mean() < 1e-3
    scales = native.key_scales[0]
    for (b, o), x in written.items():
        if b == 1 and o > 1:
            continue  # block 1 started again at offset 0: its later offsets are stale, never read
        got = native.key_views[0][b, o].float() * scales[b][:, None]
        step = scales[b][:, None].expand_as(x)
        # Rounded once when written and once more each time its block's scale grew after (up to
        # twice here): each rounding is off by half a step at most (int8), or 1/16 of the value
        # (e4m3's 3 mantissa bits) plus half a subnormal step.
        if kind == "int8":
            assert torch.all((got - x).abs() <= 1.5 * step * 1.0001), (b, o)
        else:
            assert torch.all((got - x).abs() <= 3 * (x.abs() / 16 + step * 2**-10) * 1.0001), (b, o)


def test_fp8_elements_are_torchs_e4m3():
    cache = _cache("fp8_e4m3")
    x = torch.randn(8, 8, 32) * torch.logspace(-4, 2, 8)[:, None, None]  # spans subnormals to the top
    blocks, offsets = torch.full((8,), 3), torch.arange(8)
    assert write_quantized_native(x, cache.key_views[0], cache.key_scales[0], blocks, offsets)
    scale = cache.key_scales[0][3]
    expected = (x / scale[None, :, None]).to(torch.float8_e4m3fn)
    assert torch.equal(cache.key_views[0][3].view(torch.uint8), expected.view(torch.uint8))
    assert torch.allclose(scale, x.abs().amax(dim=(0, 2)) / 448)


@pytest.mark.parametrize("kind", KINDS)
def test_attention_kernels_read_what_the_cache_holds(kind):
    """Decode and prefill attention over a quantized cache equal the same kernels over a float32
    cache holding the dequantized values."""
    quantized = _cache(kind)
    for x, blocks, offsets in _steps()[:4]:
        for layer_views, layer_scales in ((quantized.key_views, quantized.key_scales), (quantized.value_views, quantized.value_scales)):
            assert write_quantized_native(x, layer_views[0], layer_scales[0], blocks, offsets)
    keys = quantized.key_views[0].float() * quantized.key_scales[0][:, None, :, None]
    values = quantized.value_views[0].float() * quantized.value_scales[0][:, None, :, None]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 8, 32, generator=g)
    tables, lens = torch.tensor([[1, 2], [4, 4]]), torch.tensor([12, 4])
    got = cpu_attention.attend_decode(q, quantized.key_views[0], quantized.value_views[0], tables, lens, None, quantized.key_scales[0], quantized.value_scales[0])
    want = cpu_attention.attend_decode(q, keys, values, tables, lens)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    chunks = cpu_attention.PrefillChunks(
        first_rows=torch.tensor([0]), num_tokens=torch.tensor([5]), context_lens=torch.tensor([7]), tables=torch.tensor([[1, 2]])
    )
    q = torch.randn(5, 8, 32, generator=g)
    got = cpu_attention.attend_prefill(q, quantized.key_views[0], quantized.value_views[0], chunks, None, quantized.key_scales[0], quantized.value_scales[0])
    want = cpu_attention.attend_prefill(q, keys, values, chunks)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    # A bfloat16 model: where the CPU has avx512_bf16 the tiles are the dequantized values rounded
    # to bfloat16, as a bfloat16 cache holding them would be.
    # Elsewhere they stay float32, as over a float32 cache holding them.
    q16 = q.to(torch.bfloat16)
    got = cpu_attention.attend_prefill(q16, quantized.key_views[0], quantized.value_views[0], chunks, None, quantized.key_scales[0], quantized.value_scales[0])
    if bf16_pair_kernel_available():
        want = cpu_attention.attend_prefill(q16, keys.to(torch.bfloat16), values.to(torch.bfloat16), chunks)
    else:
        want = cpu_attention.attend_prefill(q16.float(), keys, values, chunks)
    assert torch.allclose(got.float(), want.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("kind", KINDS)
def test_a_block_takes_about_half_of_bfloat16s_bytes(kind):
    for config in (ModelConfig.from_model_dir(DEFAULT_MODEL_PATH),):
        bf16 = KVCache.bytes_per_block_of(config, 16, torch.bfloat16)
        assert KVCache.bytes_per_block_of(config, 16, torch.bfloat16, kind) <= 0.55 * bf16


@pytest.mark.parametrize("kind", KINDS)
def test_held_out_perplexity_stays_within_two_percent_and_greedy_choices_agree(kind):
    texts = held_out_windows(AutoTokenizer.from_pretrained(DEFAULT_MODEL_PATH), per_file=1)
    assert len(texts) >= 8, "the held-out standard-library files are where the training script left them"
    reference = perplexity(LLMEngine(None, EngineConfig(dtype="float32", num_threads=1, num_kv_blocks=32)), texts)
    quantized = perplexity(LLMEngine(None, EngineConfig(dtype="float32", num_threads=1, num_kv_blocks=32, kv_cache_dtype=kind)), texts)
    assert quantized.num_tokens == reference.num_tokens
    # Within 2% either way: rounding noise can even lower it a hair (int8: -0.0007% on an AVX2 CPU).
    assert 0.98 * reference.value <= quantized.value <= 1.02 * reference.value
    assert quantized.value != reference.value  # the cache did quantize
    # Greedy agreement, teacher-forced (one near-tie does not send the rest down another path).
    assert quantized.top1_agreement(reference) >= 0.97


@pytest.mark.parametrize("native", [True, False])
def test_int8_greedy_output_mostly_agrees_and_both_attention_paths_agree(native):
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_PATH)
    prompts = [tokenizer(p)["input_ids"] for p in ("def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\n")]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    plain = LLMEngine(None, EngineConfig(dtype="float32", num_threads=1)).generate(prompts, params)
    engine = LLMEngine(None, EngineConfig(dtype="float32", num_threads=1, kv_cache_dtype="int8", attention_backend="auto" if native else "sdpa", long_prefill_chunk=8))
    quantized = engine.generate(prompts, params)
    agree = sum(a == b for p, q in zip(plain, quantized) for a, b in zip(p.token_ids, q.token_ids))
    assert agree >= 0.9 * 48 * len(prompts)
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_with_speculation_preemption_prefix_hits_and_chunks_together():
    from engine.speculation import SpeculativeConfig

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_PATH)
    shared = tokenizer("import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser()\n")["input_ids"]
    prompts = [shared + tokenizer(tail)["input_ids"][1:] for tail in ("    args = parser", "    return 0\n", "    for arg in argv:\n", "    print(")]
    params = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    plain = LLMEngine(None, EngineConfig(dtype="float32", num_threads=1)).generate(prompts, params)
    # 14 blocks of 16 tokens cannot hold four sequences of ~30 + 80 tokens: preemptions.
    engine = LLMEngine(None, EngineConfig(
        dtype="float32", num_threads=1, kv_cache_dtype="int8", num_kv_blocks=14, long_prefill_chunk=8,
        speculative=SpeculativeConfig(num_speculative_tokens=3),
    ))
    out = engine.generate(prompts[:1], params)  # its prompt blocks stay cached for the others
    out += engine.generate(prompts[1:], params)
    assert [len(c.token_ids) for c in out] == [80] * len(prompts)
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.num_accepted_draft_tokens > 0
    assert engine.scheduler.num_prefix_hit_tokens > 0
    assert engine.allocator.num_free == engine.allocator.num_blocks
    agree = sum(a == b for p, q in zip(plain, out) for a, b in zip(p.token_ids, q.token_ids))
    assert agree >= 0.8 * 80 * len(prompts)
