"""Which attention backend serves a cache, and the errors for one that cannot."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine, native_kernels
from engine.attention import CacheGeometry, select_backend
from engine.cuda_graphs import batch_buckets


def _geometry(device="cpu", dtype=torch.bfloat16, head_dim=64, quantized=False):
    return CacheGeometry(device=device, dtype=dtype, block_size=16, num_heads=9, num_kv_heads=3, head_dim=head_dim, quantized=quantized)


def test_auto_on_a_cpu_takes_the_kernels_where_they_build_and_sdpa_is_always_there():
    backend = select_backend("auto", _geometry(dtype=torch.float32))
    assert backend.name == ("cpu" if native_kernels.kernel() is not None else "sdpa")
    assert select_backend("sdpa", _geometry()).name == "sdpa"


def test_auto_on_cuda_keeps_sdpa_where_flashinfer_cannot_serve_the_cache():
    # Decided from the geometry alone: no GPU is touched.
    assert select_backend("auto", _geometry("cuda", torch.float32)).name == "sdpa"
    assert select_backend("auto", _geometry("cuda", head_dim=16)).name == "sdpa"


def test_auto_on_cuda_reads_a_quantized_cache_through_the_triton_kernels():
    assert select_backend("auto", _geometry("cuda", quantized=True)).name == "triton"
    assert select_backend("triton", _geometry("cuda", torch.float32, quantized=True)).name == "triton"
    # Triton's blocks are powers of two: another head size keeps gather + SDPA.
    assert select_backend("auto", _geometry("cuda", head_dim=80, quantized=True)).name == "sdpa"


@pytest.mark.parametrize(
    ("requested", "geometry", "problem"),
    [
        ("flashinfer", _geometry("cpu"), "runs on a CUDA device"),
        ("flashinfer", _geometry("cuda", torch.float32), "float32"),
        ("flashinfer", _geometry("cuda", head_dim=16), "head_dim 16"),
        ("flashinfer", _geometry("cuda", quantized=True), "quantized"),
        ("cpu", _geometry("cuda"), "runs on a CPU device"),
        ("triton", _geometry(), "runs on a CUDA device"),
        ("triton", _geometry("cuda"), "quantized"),
        ("triton", _geometry("cuda", head_dim=80, quantized=True), "powers of two"),
        ("tilelang", _geometry(), "must be one of"),
    ],
)
def test_a_backend_that_cannot_serve_the_cache_is_an_error_naming_the_field(requested, geometry, problem):
    with pytest.raises(ValueError, match="attention_backend") as error:
        select_backend(requested, geometry)
    assert problem in str(error.value)


def test_the_engine_config_refuses_an_unknown_backend_and_a_negative_graph_batch():
    with pytest.raises(ValueError, match="attention_backend: must be one of"):
        LLMEngine(None, EngineConfig(num_kv_blocks=16, attention_backend="flash"))
    with pytest.raises(ValueError, match="cuda_graph_max_batch"):
        LLMEngine(None, EngineConfig(num_kv_blocks=16, cuda_graph_max_batch=-1))


def test_graph_buckets_cover_every_batch_up_to_the_largest():
    buckets = batch_buckets(100)
    assert buckets[:4] == [1, 2, 4, 8] and buckets[-1] == 100
    assert all(any(b >= n for b in buckets) for n in range(1, 101))
    assert batch_buckets(1) == [1]


def test_an_fp8_cache_on_a_gpu_before_ada_is_read_through_sdpa(monkeypatch):
    """Triton compiles fp8 (e4m3) on compute capability 8.9 and up only: an fp8 cache on an A100,
    A10 or T4 took the Triton kernels and the first step raised. SDPA reads it there; int8 and
    newer GPUs keep Triton. (No GPU is touched: the capability is the test's.)"""
    import dataclasses

    capability = [(8, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    fp8 = dataclasses.replace(_geometry("cuda", quantized=True), cache_dtype=torch.float8_e4m3fn)
    int8 = dataclasses.replace(_geometry("cuda", quantized=True), cache_dtype=torch.int8)
    assert select_backend("auto", fp8).name == "sdpa"
    assert select_backend("auto", int8).name == "triton"
    with pytest.raises(ValueError, match="8.9"):
        select_backend("triton", fp8)
    capability[0] = (9, 0)
    assert select_backend("auto", fp8).name == "triton"
