"""The bfloat16 pair linear (engine/csrc/bf16_linear.cpp) computes x W^T + b within the output's
own bfloat16 rounding, gives every row the same bits whatever shares its call, and a model
whose linears it runs tracks transformers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import EngineConfig, LLMEngine
from engine.attention import SeqSlice
from engine.attention.block_tables import BlockTables
from engine.cpu_linear import Bf16PairLinear, PackedLinear, bf16_pair_kernel_available, prepack_linears
from tests.checkpoints import build_checkpoint, random_prompts

pytestmark = pytest.mark.skipif(not bf16_pair_kernel_available(), reason="the CPU has no avx512_bf16")


def _linear(in_features: int, out_features: int, bias: bool, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.normal_(0, 0.05)
        if bias:
            linear.bias.normal_(0, 0.5)
    return linear.to(torch.bfloat16)


@pytest.mark.parametrize(("in_features", "out_features", "bias"), [(576, 960, False), (1536, 576, True), (64, 80, True), (2, 16, False)])
def test_matches_float64_within_the_outputs_own_rounding(in_features, out_features, bias):
    linear = _linear(in_features, out_features, bias, seed=in_features)
    x = torch.randn(13, in_features).to(torch.bfloat16)
    got = Bf16PairLinear(linear)(x)
    want = x.double() @ linear.weight.double().T + (linear.bias.double() if bias else 0)
    assert got.dtype == torch.bfloat16 and got.shape == (13, out_features)
    own_rounding = (want.to(torch.bfloat16).double() - want).abs()
    # One bfloat16 step of each output (2^-8 relative) at most, beyond the rounding itself.
    assert ((got.double() - want).abs() <= own_rounding + want.abs() * 2**-8 + 1e-6).all()
    # And no worse on the whole than torch's own bfloat16 matmul of the same values.
    theirs = linear(x).double()
    assert (got.double() - want).abs().mean() <= (theirs - want).abs().mean() * 1.25


def test_a_rows_result_is_the_same_in_any_batch():
    """Row counts cover the kernel's row tiles (6) and their remainders; 80 outputs leave a group of 1 vector."""
    linear = Bf16PairLinear(_linear(64, 80, True, seed=1))
    x = torch.randn(37, 64).to(torch.bfloat16)
    alone = torch.cat([linear(x[i : i + 1]) for i in range(37)])
    for rows in (2, 5, 6, 7, 12, 37):
        assert torch.equal(linear(x[:rows]), alone[:rows])
    assert torch.equal(linear(x.view(37, 1, 64)).view(37, 80), alone)


def test_shapes_the_pair_layout_cannot_hold_keep_onednn():
    model = nn.Sequential(_linear(64, 100, False, seed=2), _linear(100, 64, False, seed=3))
    assert not Bf16PairLinear.fits(model[0]) and Bf16PairLinear.fits(model[1])
    assert prepack_linears(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[1], Bf16PairLinear)


def test_a_bfloat16_model_on_pair_linears_tracks_transformers(tmp_path):
    """Qwen2's q/k/v biases included: last-token logits close to transformers' own bfloat16 forward."""
    model = build_checkpoint("qwen2", tmp_path, dtype=torch.bfloat16)
    engine = LLMEngine(tmp_path, EngineConfig(num_kv_blocks=64, num_threads=1))
    assert engine.dtype == torch.bfloat16
    assert any(isinstance(m, Bf16PairLinear) for m in engine.runner.model.modules())
    (prompt,) = random_prompts([30], model.config.vocab_size, seed=5)
    with torch.no_grad():
        want = model.to(torch.bfloat16)(torch.tensor([prompt])).logits[0, -1].float()
    block_table = engine.allocator.allocate(engine.kv_cache.blocks_needed(len(prompt)))
    meta = engine.runner.attention.build([SeqSlice(0, 0, len(prompt))], BlockTables.holding([block_table]).array)
    got = engine.runner.model(torch.tensor(prompt), torch.arange(len(prompt)), engine.kv_cache, meta, torch.tensor([len(prompt) - 1]))[0]
    assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.999
    assert got.argmax() == want.argmax()
