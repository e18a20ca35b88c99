"""Which attention backend serves a model's cache: from the config's ``attention_backend`` and
what the device, dtype and cache can take.

``auto``: on a CPU the native kernels where they build and apply (engine.attention.cpu), on CUDA
FlashInfer where it is installed and the cache is float16/bfloat16 and not quantized, and the
Triton kernels for a quantized cache (engine.attention.triton_quantized); SDPA otherwise. A
backend named explicitly that cannot serve the cache is an error naming the field.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.attention import cpu, flashinfer_paged
from engine.attention.base import AttentionBackend
from engine.attention.sdpa import SdpaBackend
from engine.config import ATTENTION_BACKEND_NAMES

logger = logging.getLogger(__name__)



@dataclass(slots=True, frozen=True)
class CacheGeometry:
    """What a backend needs to know of one model's (or rank's) cache."""

    device: str
    dtype: torch.dtype  # the model's activations (a quantized cache keeps its own element type)
    block_size: int
    num_heads: int  # query heads (this rank's)
    num_kv_heads: int
    head_dim: int
    quantized: bool
    windows: frozenset[int | None] = frozenset({None})  # every layer's sliding window (None: full attention)
    cache_dtype: torch.dtype | None = None  # a quantized cache's element type (int8, float8_e4m3fn)

    @classmethod
    def of(cls, model_config, kv_cache, dtype: torch.dtype, device: str, num_heads: int | None = None) -> "CacheGeometry":
        """The geometry of ``kv_cache`` (an engine.kv_cache.KVCache) holding ``model_config``'s
        layers; ``num_heads``: a tensor-parallel rank's query heads (the model's by default)."""
        return cls(
            device=device,
            dtype=dtype,
            block_size=kv_cache.block_size,
            num_heads=num_heads or model_config.num_heads,
            num_kv_heads=kv_cache.num_kv_heads,
            head_dim=model_config.head_dim,
            quantized=kv_cache.quantized is not None,
            windows=frozenset(model_config.layer_windows or [None]),
            cache_dtype=kv_cache.dtype if kv_cache.quantized is not None else None,
        )

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


def select_backend(requested: str, geometry: CacheGeometry) -> AttentionBackend:
    """The backend for ``geometry`` (built: the CPU kernels compile here, not on the first step)."""
    if requested not in ATTENTION_BACKEND_NAMES:
        raise ValueError(f"attention_backend: must be one of {list(ATTENTION_BACKEND_NAMES)}, got {requested!r}")
    kind = torch.device(geometry.device).type
    if requested in ("auto", "cpu") and kind == "cpu":
        if cpu.prepare(geometry.device, geometry.dtype, geometry.head_dim, geometry.group):
            return cpu.CpuKernelBackend(geometry.device, geometry.block_size)
        if requested == "cpu":
            raise ValueError(
                f"attention_backend: cpu kernels cannot serve head_dim {geometry.head_dim}, {geometry.group} query heads per KV head, "
                f"{geometry.dtype} (or could not be built here: see the log)"
            )
    elif requested == "cpu":
        raise ValueError(f"attention_backend: cpu runs on a CPU device, not {geometry.device}")
    if requested in ("auto", "triton") and kind == "cuda":
        problem = _triton_problem(geometry)
        if problem is None:
            from engine.attention.triton_quantized import TritonQuantizedBackend

            return TritonQuantizedBackend(geometry.device, geometry.block_size)
        if requested == "triton":
            raise ValueError(f"attention_backend: triton cannot serve this cache: {problem}")
    elif requested == "triton":
        raise ValueError(f"attention_backend: triton runs on a CUDA device, not {geometry.device}")
    if requested in ("auto", "flashinfer") and kind == "cuda":
        problem = _flashinfer_problem(geometry)
        if problem is None:
            return flashinfer_paged.FlashInferBackend(
                geometry.device, geometry.block_size, geometry.num_heads, geometry.num_kv_heads, geometry.head_dim, geometry.dtype, set(geometry.windows)
            )
        if requested == "flashinfer":
            raise ValueError(f"attention_backend: flashinfer cannot serve this cache: {problem}")
        logger.info("attention: SDPA on %s (flashinfer: %s)", geometry.device, problem)
    elif requested == "flashinfer":
        raise ValueError(f"attention_backend: flashinfer runs on a CUDA device, not {geometry.device}")
    return SdpaBackend(geometry.device, geometry.block_size)


def _flashinfer_problem(geometry: CacheGeometry) -> str | None:
    """Why FlashInfer cannot serve ``geometry`` (None: it can)."""
    if geometry.dtype not in flashinfer_paged.SUPPORTED_DTYPES:
        return f"it has no {geometry.dtype} kernels (float16 and bfloat16 only)"
    if geometry.head_dim not in flashinfer_paged.SUPPORTED_HEAD_DIMS:
        return f"head_dim {geometry.head_dim} has no kernel (one of {list(flashinfer_paged.SUPPORTED_HEAD_DIMS)})"
    if geometry.quantized:
        return "a quantized cache's per-block scales are read by the SDPA backend"
    if not flashinfer_paged.available():
        return "the flashinfer package is not installed (pip install 'pdserve[cuda]')"
    return None


def _triton_problem(geometry: CacheGeometry) -> str | None:
    """Why the Triton kernels cannot serve ``geometry`` (None: they can)."""
    if not geometry.quantized:
        return "its kernels read a quantized (int8, fp8) cache; a plain one is FlashInfer's or SDPA's"
    try:
        from engine.attention import triton_quantized
    except Exception as exc:  # no triton in this environment
        return f"triton cannot be imported ({exc})"
    if not triton_quantized.applies(geometry.head_dim, geometry.block_size):
        return f"head_dim {geometry.head_dim} and block_size {geometry.block_size} must be powers of two"
    if geometry.cache_dtype == torch.float8_e4m3fn and torch.device(geometry.device).type == "cuda":
        # Triton compiles float8_e4m3fn (its fp8e4nv) on compute capability 8.9 and up only: the
        # first step's kernels raised on an A100, A10 or T4. SDPA's reads cast on any GPU.
        capability = torch.cuda.get_device_capability(torch.device(geometry.device))
        if capability < (8, 9):
            return f"an fp8 cache needs compute capability 8.9 or later (Ada, Hopper) for Triton, this GPU has {capability[0]}.{capability[1]}"
    return None
