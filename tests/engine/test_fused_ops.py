"""The fused elementwise kernels (engine/csrc/elementwise.cpp) compute what the torch ops they
replace compute, rounding as they do, and a model on them generates what transformers does."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams, fused_ops, native_kernels
from engine.rope import RotaryEmbedding
from tests.checkpoints import hf_greedy, random_prompts

pytestmark = pytest.mark.skipif(native_kernels.kernel() is None, reason="the CPU kernels cannot be built here")

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def torch_path(monkeypatch):
    """Run a block of fused_ops calls on torch ops instead of the kernels."""

    def switch(enabled: bool) -> None:
        monkeypatch.setattr(fused_ops, "ENABLED", enabled)

    return switch


def _agree(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: equal to float32 rounding; bfloat16: nearly always identical, and otherwise at
    most two bfloat16 steps apart (the sum of squares or expf may differ in float32's last bit,
    which flips an intermediate rounded to bfloat16 at a near-tie, and the next product carries it)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        return
    step = want.float().abs() * 2**-6 + 1e-30
    assert ((got.float() - want.float()).abs() <= step).all()
    assert (got == want).float().mean() > 0.99


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_add_rms_norm_is_the_residual_add_then_transformers_rmsnorm(torch_path, dtype, rows):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=generator).to(dtype)
    residual = (torch.randn(rows, 576, generator=generator) * 3).to(dtype)
    weight = (1 + torch.randn(576, generator=generator) * 0.1).to(dtype)
    torch_path(False)
    want_normed, want_residual = fused_ops.add_rms_norm(x, residual.clone(), weight, 1e-5)
    want_alone, _ = fused_ops.add_rms_norm(None, residual.clone(), weight, 1e-5)
    torch_path(True)
    stream = residual.clone()
    got_normed, got_residual = fused_ops.add_rms_norm(x, stream, weight, 1e-5)
    assert got_residual.data_ptr() == stream.data_ptr()  # the stream is updated in place
    assert torch.equal(got_residual, want_residual)  # one rounded add: exactly torch's
    _agree(got_normed, want_normed)
    _agree(fused_ops.add_rms_norm(None, residual.clone(), weight, 1e-5)[0], want_alone)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_silu_of_the_gate_times_up(torch_path, dtype):
    gate_up = (torch.randn(7, 2 * 1536, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    torch_path(False)
    want = fused_ops.silu_mul(gate_up)
    torch_path(True)
    _agree(fused_ops.silu_mul(gate_up), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_turns_q_and_k_heads_in_place_and_leaves_v(dtype):
    from engine.config import RopeConfig

    heads, kv_heads, head_dim, tokens = 9, 3, 64, 11
    rotary = RotaryEmbedding(RopeConfig(theta=100000.0), head_dim, 2048, dtype, "cpu")
    positions = torch.tensor([0, 1, 2, 3, 100, 101, 500, 501, 502, 1000, 2047])
    tables = rotary.tables(positions)
    cos, sin = tables.cos, tables.sin
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=torch.Generator().manual_seed(2)).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    want_q, want_k = RotaryEmbedding.rotate(q.reshape(tokens, heads, head_dim), k.reshape(tokens, kv_heads, head_dim), cos, sin)
    want_v = v.clone()
    assert fused_ops.rotate_heads_(qkv, heads + kv_heads, head_dim, tables)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    # bfloat16: bit for bit (every product is rounded, as torch's are); float32: to rounding
    # (the compiler may fuse a product into the subtraction).
    for got, want in ((q.reshape(tokens, heads, head_dim), want_q), (k.reshape(tokens, kv_heads, head_dim), want_k)):
        if dtype == torch.bfloat16:
            assert torch.equal(got, want)
        else:
            _agree(got, want)
    assert torch.equal(v, want_v)


@pytest.mark.parametrize("fused", [True, False])
def test_both_paths_generate_what_transformers_does(arch_checkpoint, torch_path, fused):
    """Every architecture (Qwen3's per-head norms keep the torch rotation), float32, greedy."""
    path, model = arch_checkpoint
    prompts = random_prompts([5, 23, 40], model.config.vocab_size, seed=7)
    expected = [hf_greedy(model, p, 8) for p in prompts]
    torch_path(fused)
    engine = LLMEngine(path, EngineConfig(num_kv_blocks=128, long_prefill_chunk=16, num_threads=1))
    got = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [c.token_ids for c in got] == expected


def test_flashinfers_rotation_gets_the_tables_and_views_it_needs(monkeypatch):
    """``rotate_qk_`` hands FlashInfer strided q/k views of qkv, the positions and the float32
    cos|sin cache; a stand-in doing what FlashInfer documents (neox halves, float32, one
    rounding, in place) must then give the torch rotation. The kernel itself is checked against
    it on a GPU (tools/gpu_check.py, section rope)."""
    import types

    from engine.config import RopeConfig

    def apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache, is_neox=True):
        assert is_neox and cos_sin_cache.dtype == torch.float32
        for x in (query, key):
            heads = x.view(x.shape[0], -1, head_size)
            half = head_size // 2
            cos, sin = cos_sin_cache[positions, :half].unsqueeze(1), cos_sin_cache[positions, half:].unsqueeze(1)
            x1, x2 = heads[..., :half].float(), heads[..., half:].float()
            heads.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype))

    fake = types.SimpleNamespace(rope=types.SimpleNamespace(apply_rope_with_cos_sin_cache_inplace=apply_rope_with_cos_sin_cache_inplace))
    monkeypatch.setattr(fused_ops, "_flashinfer_module", lambda: fake)
    heads, kv_heads, head_dim, tokens = 9, 3, 64, 6
    rotary = RotaryEmbedding(RopeConfig(theta=100000.0), head_dim, 2048, torch.bfloat16, "cpu", fused_cache=True)
    tables = rotary.tables(torch.tensor([0, 1, 7, 300, 1500, 2047]))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    q, k, v = (x.view(tokens, -1, head_dim) for x in qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1))
    want_q, want_k = RotaryEmbedding.rotate(q.float(), k.float(), tables.cos.float(), tables.sin.float())
    want_v = v.clone()
    assert fused_ops.rotate_qk_(q, k, tables)
    # Rotated in qkv itself; within bfloat16's rounding of the tables transformers uses.
    torch.testing.assert_close(q.float(), want_q, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(k.float(), want_k, rtol=2e-2, atol=2e-2)
    assert torch.equal(v, want_v)
    assert not fused_ops.rotate_qk_(q.float(), k.float(), tables), "float32 stays on the torch formula"
