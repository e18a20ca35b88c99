"""The decoder layer's elementwise work as one call each: residual add + RMSNorm, the rotary
embedding of q and k, SiLU(gate) * up.

On a CPU with the kernel library (``engine.native_kernels``, ``csrc/elementwise.cpp``) each is
one pass in C++ with the GIL released; on CUDA with FlashInfer installed, FlashInfer's fused
kernels (16-bit); elsewhere (float32 on CUDA, float16 on a CPU, no compiler) the same
formulas run as torch ops. Both round as transformers does, op by op (see the C++ source), so
switching paths moves logits by float32 summation order only. ``ENABLED`` turns the kernels
off (tests compare the two paths).

SmolLM2-135M shape, bfloat16, 2 threads: the ~40 torch ops per layer these replace were ~5 ms
of a 21 ms decode step at 3 sequences.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from engine import native_kernels

ENABLED = True
_KERNEL_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _library(*tensors: torch.Tensor):
    """The kernel library if it can take these tensors (CPU, float32/bfloat16, contiguous)."""
    if not ENABLED:
        return None
    first = tensors[0]
    if first.device.type != "cpu" or first.dtype not in _KERNEL_DTYPES:
        return None
    if any(t.dtype != first.dtype or not t.is_contiguous() for t in tensors):
        return None
    return native_kernels.kernel()


def _flashinfer(*tensors: torch.Tensor):
    """FlashInfer, if these tensors are ones its fused kernels take (CUDA, 16-bit, 2-D, dense)."""
    if not ENABLED:
        return None
    first = tensors[0]
    if first.device.type != "cuda" or first.dtype not in (torch.float16, torch.bfloat16) or first.dim() != 2:
        return None
    if first.shape[0] == 0:
        # A prefill step whose chunks all end mid-prompt needs no logits: the final norm gets
        # no rows, a launch of no blocks, which FlashInfer's kernels refuse (invalid argument).
        return None
    if any(t.dtype != first.dtype or not t.is_contiguous() for t in tensors):
        return None
    return _flashinfer_module()


@functools.cache
def _flashinfer_module():
    try:
        import flashinfer
    except Exception:
        return None
    return flashinfer


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual + x`` (the new residual; written into ``residual`` on the kernel paths) and its
    RMSNorm times ``weight``. ``x`` None: the norm of ``residual`` alone."""
    cols = residual.shape[-1]
    flashinfer = _flashinfer(residual, *([] if x is None else [x]))
    if flashinfer is not None and weight.dtype == residual.dtype:
        if x is None:
            return flashinfer.norm.rmsnorm(residual, weight, eps), residual
        flashinfer.norm.fused_add_rmsnorm(x, residual, weight, eps)  # residual += x, then x = its norm
        return x, residual
    library = _library(residual, weight, *([] if x is None else [x]))
    if library is None:
        if x is not None:
            residual = residual + x
        return _rms_norm_torch(residual, weight, eps), residual
    out = torch.empty_like(residual)
    library.pdserve_add_rms_norm(
        None if x is None else x.data_ptr(),
        residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        residual.numel() // cols,
        cols,
        eps,
        _KERNEL_DTYPES[residual.dtype],
        torch.get_num_threads(),
    )
    return out, residual


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 and cast back before the weight, as transformers does.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up`` [..., 2 * inter] (gate | up) -> SiLU(gate) * up [..., inter]."""
    inter = gate_up.shape[-1] // 2
    flashinfer = _flashinfer(gate_up)
    if flashinfer is not None:
        return flashinfer.activation.silu_and_mul(gate_up)
    library = _library(gate_up)
    if library is None:
        gate, up = gate_up.split(inter, dim=-1)
        return F.silu(gate) * up
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype)
    library.pdserve_silu_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * inter), inter, _KERNEL_DTYPES[gate_up.dtype], torch.get_num_threads())
    return out


def rotate_heads_(qkv: torch.Tensor, num_heads: int, head_dim: int, tables) -> bool:
    """Rotate, in place, the first ``num_heads`` heads of every row of ``qkv`` [tokens, width]
    (q's heads then k's) by ``tables`` (engine.rope.RopeTables: cos/sin [tokens, 1, head_dim / 2]).
    False: not done (no kernel for these tensors); the caller rotates another way."""
    if _library(qkv) is None:
        return False  # before the tables' cos/sin: on CUDA nothing need look them up
    cos, sin = tables.cos, tables.sin
    library = _library(qkv, cos, sin)
    if library is None:
        return False
    library.pdserve_rotary(
        qkv.data_ptr(), qkv.shape[0], qkv.shape[1], num_heads, head_dim, cos.data_ptr(), sin.data_ptr(), _KERNEL_DTYPES[qkv.dtype], torch.get_num_threads()
    )
    return True


def rotates_from_table(q: torch.Tensor, k: torch.Tensor, tables) -> bool:
    """Whether q and k take FlashInfer's rotation formula (float32, from the float32 cos|sin
    table, one rounding) rather than transformers' (the tables in the model's dtype): the fused
    ops on, a table made (CUDA), 16-bit q and k. Float32 stays on transformers' formula, exact."""
    return ENABLED and tables.cos_sin_cache is not None and q.dtype in (torch.float16, torch.bfloat16) and k.dtype == q.dtype


def rotate_qk_(q: torch.Tensor, k: torch.Tensor, tables) -> bool:
    """Rotate q [tokens, heads, dim] and k [tokens, kv_heads, dim] (views; rows may be strided)
    in place by ``tables`` (engine.rope.RopeTables) through FlashInfer's kernel: one launch
    where the torch formula takes about a dozen per layer. False: not done; the caller rotates
    with torch. FlashInfer rotates in float32 from float32 tables and rounds once (transformers
    rounds the tables and each product to the model's dtype): bfloat16 results move by a rounding."""
    if not rotates_from_table(q, k, tables):
        return False
    flashinfer = _flashinfer_module()
    if flashinfer is None:
        return False
    flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(tables.positions, q, k, q.shape[-1], tables.cos_sin_cache, is_neox=True)
    return True
