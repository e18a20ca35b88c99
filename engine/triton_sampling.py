"""A top-k row's filters and draw on CUDA as one Triton launch, after ``torch.topk``.

``Sampler._draw_among_top_k`` takes each row's largest logits with ``torch.topk``, then as torch
ops applies the temperature, top-k, top-p and min-p (``_filter_sorted``), takes the softmax and
draws by inverse CDF (``_inverse_cdf_no_sync``): about 70 launches over [rows, k] tensors of a
few dozen columns each, each costing the host more than the GPU. Measured on an H200
(tools/gpu_check.py, section ``sampled_steps``, session 46): temperature 0.8 with top-k 50 and
top-p 0.95 took the 1.5B shape's overlapped batch-64 decode step from 2.65 ms (the same without
top-k) to 3.36 ms, of which ``torch.topk`` over 64 x 152k is about 0.17 ms.

Here one program per row does all of it over the row's candidates (the largest top_k, sorted
descending, at most ``MAX_CANDIDATES``), with the same formulas in the same order: the logits
shifted by the row's largest and divided by its temperature (correctly rounded), top-k by rank,
top-p on the probabilities over the top-k survivors (the mass before a token reaching top_p drops
it), min-p against the largest, the first candidate always kept, then the softmax of what is kept
and the first candidate whose float64 cumulative probability exceeds the row's uniform times the
total (never past the last candidate of positive probability). The sums and scans round in
another order than torch's and a GPU's exp and log are its fast approximations, so a uniform
within a few units in the last place of a boundary may land on the neighbouring token (a seeded
request can draw another token than on a worker without Triton); the distribution is the same. The kernel runs on a CPU under
Triton's interpreter (``TRITON_INTERPRET=1``), where the tests hold it to the torch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.host_to_device import to_device

MAX_CANDIDATES = 4096  # a row's candidates in one program; rows asking more take the torch ops


# Triton compiles a kernel for each value of its constexprs and for each integer argument's
# "is 1 / divisible by 16" class: the row count and width vary step by step, so they are not
# specialized, and rows of up to 64 candidates (chat models' top-k) share one block size, the one
# the engine's warm-up builds (engine.kernel_warm_up): no compiling inside a step.
_MIN_BLOCK = 64


@triton.jit(do_not_specialize=["width", "num_rows"])
def _draw_kernel(top_ptr, ids_ptr, width, params_ptr, num_rows, uniforms_ptr, out_ptr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < width
    top = tl.load(top_ptr + row * width + cols, mask=inside, other=float("-inf"))
    largest = tl.load(top_ptr + row * width)
    temperature = tl.load(params_ptr + row)
    top_k = tl.load(params_ptr + num_rows + row)
    top_p = tl.load(params_ptr + 2 * num_rows + row)
    min_p = tl.load(params_ptr + 3 * num_rows + row)
    values = tl.math.div_rn(top - largest, temperature)

    removed = (cols.to(tl.float32) >= top_k) | (cols >= width)
    masked = tl.where(removed, float("-inf"), values)
    peak = tl.max(masked, axis=0)
    norm = tl.log(tl.sum(tl.exp(masked - peak), axis=0)) + peak
    probs = tl.exp(masked - norm)
    mass_before = tl.cumsum(probs, axis=0) - probs
    removed = removed | (mass_before >= top_p)
    removed = removed | (probs < min_p * tl.max(probs, axis=0))  # the largest is the first candidate's
    removed = removed & (cols != 0)  # the most likely token always survives

    kept = tl.where(removed, float("-inf"), values)
    weights = tl.exp(kept - tl.max(kept, axis=0))
    probs = tl.math.div_rn(weights, tl.sum(weights, axis=0))
    cdf = tl.cumsum(probs.to(tl.float64), axis=0)
    total = tl.max(tl.where(inside, cdf, 0.0), axis=0)  # the scan's last value
    target = tl.load(uniforms_ptr + row) * total
    pick = tl.sum((inside & (cdf <= target)).to(tl.int32), axis=0)  # the first index whose sum exceeds it
    last_positive = tl.max(tl.where(probs > 0, cols, 0), axis=0)
    pick = tl.minimum(pick, last_positive)
    tl.store(out_ptr + row, tl.load(ids_ptr + row * width + pick))


def draw_among_top_k(top: torch.Tensor, token_ids: torch.Tensor, temperatures: list[float], top_ks: list[int], top_ps: list[float],
                     min_ps: list[float], uniforms: torch.Tensor) -> torch.Tensor:
    """One token id per row from its candidates ``top`` (float32 logits, [rows, width], each row
    descending, as ``torch.topk`` gives them) and their ``token_ids``, by the row's parameters
    (temperature held in range, top_k >= 1, top_p held above 0, min_p) and its ``uniforms``
    (float64 in [0, 1))."""
    rows, width = top.shape
    params = to_device([temperatures, [float(k) for k in top_ks], top_ps, min_ps], torch.float32, top.device)
    out = torch.empty(rows, dtype=torch.long, device=top.device)
    _draw_kernel[(rows,)](top.contiguous(), token_ids.contiguous(), width, params, rows, uniforms, out, BLOCK=max(_MIN_BLOCK, triton.next_power_of_2(width)))
    return out
