"""dtype "auto": bfloat16 where the device multiplies it natively, float32 elsewhere."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine import device_caps
from engine.device_caps import native_bf16, resolve_dtype

ZEN4_FLAGS = frozenset({"avx2", "avx512f", "avx512_bf16"})
SAPPHIRE_RAPIDS_FLAGS = frozenset({"avx2", "avx512f", "amx_bf16", "amx_tile"})
AVX2_ONLY_FLAGS = frozenset({"avx", "avx2", "fma"})


@pytest.fixture
def cpu_with(monkeypatch):
    def set_flags(flags: frozenset[str]) -> None:
        monkeypatch.setattr(device_caps, "cpu_flags", lambda: flags)

    return set_flags


@pytest.mark.parametrize("flags, native", [(ZEN4_FLAGS, True), (SAPPHIRE_RAPIDS_FLAGS, True), (AVX2_ONLY_FLAGS, False), (frozenset(), False)])
def test_native_bf16_follows_the_cpu_flags(cpu_with, flags, native):
    cpu_with(flags)
    assert native_bf16("cpu") is native


@pytest.mark.parametrize("checkpoint", [torch.float32, torch.bfloat16, torch.float16])
def test_auto_on_a_cpu(cpu_with, checkpoint):
    cpu_with(ZEN4_FLAGS)
    assert resolve_dtype("auto", checkpoint, "cpu") == torch.bfloat16
    cpu_with(AVX2_ONLY_FLAGS)
    assert resolve_dtype("auto", checkpoint, "cpu") == torch.float32


def test_auto_on_a_gpu(monkeypatch):
    monkeypatch.setattr(device_caps, "native_bf16", lambda device: True)
    assert resolve_dtype("auto", torch.float32, "cuda") == torch.bfloat16
    assert resolve_dtype("auto", torch.float16, "cuda") == torch.float16  # the checkpoint's half stays
    monkeypatch.setattr(device_caps, "native_bf16", lambda device: False)
    assert resolve_dtype("auto", torch.bfloat16, "cuda") == torch.float32


def test_none_and_names_are_unchanged(cpu_with):
    cpu_with(AVX2_ONLY_FLAGS)
    assert resolve_dtype(None, torch.float16, "cpu") == torch.float16
    assert resolve_dtype("float32", torch.bfloat16, "cpu") == torch.float32
    with pytest.raises(ValueError, match="dtype: must be one of"):
        resolve_dtype("fp8", torch.float32, "cpu")


def test_forcing_emulated_bf16_warns_with_the_missing_flags(cpu_with, caplog):
    cpu_with(AVX2_ONLY_FLAGS)
    with caplog.at_level(logging.WARNING, logger="engine.device_caps"):
        assert resolve_dtype("bfloat16", torch.float32, "cpu") == torch.bfloat16
    assert "emulated" in caplog.text and "avx512_bf16" in caplog.text and "amx_bf16" in caplog.text
    caplog.clear()
    cpu_with(ZEN4_FLAGS)
    with caplog.at_level(logging.WARNING, logger="engine.device_caps"):
        resolve_dtype("bfloat16", torch.float32, "cpu")
    assert "emulated" not in caplog.text


def test_engine_config_accepts_auto_and_rejects_nonsense():
    EngineConfig(dtype="auto").validate()
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="float8").validate()


@pytest.mark.parametrize("flags, want", [(AVX2_ONLY_FLAGS, torch.float32), (ZEN4_FLAGS, torch.bfloat16)])
def test_engine_with_auto_loads_and_generates(checkpoints, cpu_with, flags, want):
    cpu_with(flags)
    path, _ = checkpoints["llama"]
    # Packed bf16 kernels need the flags for real; this test only pretends to have them.
    engine = LLMEngine(path, EngineConfig(dtype="auto", num_kv_blocks=32, prepack_linear=False))
    assert engine.dtype == want
    assert engine.kv_cache.tensor.dtype == want
    (done,) = engine.generate([[5, 9, 13, 2]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(done.token_ids) == 4
