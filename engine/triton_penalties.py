"""The penalties over whole rows on CUDA as one Triton launch (engine.penalties keeps the state).

On a GPU ``PenaltyHistory`` applies vLLM's formulas to every penalised row's whole vocabulary,
as batched torch ops: about 40 launches a step (the slab rows gathered, a dozen [rows, vocab]
temporaries, the logits cloned and scattered back, the step in flight's tokens folded in by three
scatters), each pass over 64 rows of a 152k vocabulary tens of microseconds. Measured on an H200
(tools/gpu_check.py, section ``sampled_steps``, session 46): Qwen2.5's defaults (temperature 0.7,
top-k 20, top-p 0.8, repetition penalty 1.05) took the 1.5B shape's overlapped batch-64 decode
step from 2.56 ms (greedy) to 6.04 ms, where the same draw without the penalty took 3.36 ms.

Here one program per (penalised row, run of columns) reads the row's logits, its slab row's
``seen`` and output counts in place (no gather), applies the formulas in float32 and writes the
result; the token the step in flight sampled for the row (engine.overlap), still on the device, is
counted as seen and output once more by the program whose columns hold it, which also writes it
into the slabs: the history is brought up to date in the same launch.

The formulas are ``engine.penalties._apply_formulas``' in the same order, division correctly
rounded (``div_rn``) and no multiply-add contracted (``enable_fp_fusion=False``), so float32
logits come out as the torch ops give them. The kernel runs on a CPU too
under Triton's interpreter (``TRITON_INTERPRET=1``), where the tests hold it to the torch path
element for element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.host_to_device import to_device

_COLUMNS = 2048  # a program's run of vocabulary columns
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


@triton.jit(do_not_specialize=["num_rows"])  # the batch's penalised rows vary: one build for any count
def _penalties_kernel(
    logits_ptr, logits_stride, out_ptr, out_stride,
    rows_ptr, unread_ptr,
    seen_ptr, counts_ptr, slab_stride,
    params_ptr, num_rows, vocab, limit,
    COLUMNS: tl.constexpr,
):
    i = tl.program_id(0)
    cols = tl.program_id(1) * COLUMNS + tl.arange(0, COLUMNS)
    inside = cols < vocab
    row = tl.load(rows_ptr + i)
    slab = tl.load(rows_ptr + num_rows + i)
    source = tl.load(rows_ptr + 2 * num_rows + i)
    # The step in flight's token for this row (-1: none; the pointer is never read then).
    token = tl.load(unread_ptr + tl.maximum(source, 0), mask=source >= 0, other=-1)
    is_unread = inside & (cols == token)
    seen_at = seen_ptr + slab * slab_stride + cols
    counts_at = counts_ptr + slab * slab_stride + cols
    seen = (tl.load(seen_at, mask=inside, other=0) != 0) | is_unread
    counts = tl.load(counts_at, mask=inside, other=0.0)
    counts = tl.where(is_unread, counts + 1.0, counts)
    tl.store(seen_at, tl.full([COLUMNS], 1, tl.uint8), mask=is_unread)
    tl.store(counts_at, counts, mask=is_unread)

    repetition = tl.load(params_ptr + i)
    frequency = tl.load(params_ptr + num_rows + i)
    presence = tl.load(params_ptr + 2 * num_rows + i)
    values = tl.load(logits_ptr + row * logits_stride + cols, mask=inside, other=0.0).to(tl.float32)
    repeated = tl.where(values > 0, tl.math.div_rn(values, repetition), values * repetition)
    repeated = tl.where(repeated > limit, limit, tl.where(repeated < -limit, -limit, repeated))  # NaN stays NaN, as clamp_
    values = tl.where(repetition != 1.0, tl.where(seen, repeated, values), values)
    values = values - frequency * counts - presence * (counts > 0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, values.to(out_ptr.dtype.element_ty), mask=inside)


def apply_penalties(
    logits: torch.Tensor, batch_rows: list[int], slab_rows: list[int], unread_sources: list[int], unread_tokens: torch.Tensor | None,
    seen: torch.Tensor, output_counts: torch.Tensor, params: list,
) -> torch.Tensor:
    """``logits`` (float32, [rows, vocab]) with rows ``batch_rows`` penalised from their slab rows
    ``slab_rows`` of ``seen`` (bool) and ``output_counts`` (float32), each first counting
    ``unread_tokens[unread_sources[i]]`` (-1: no unread token), which it also writes into the
    slabs. A new tensor; the others rows' logits as they were."""
    device = logits.device
    count = len(batch_rows)
    rows = to_device([batch_rows, slab_rows, unread_sources], torch.long, device)
    penalties = to_device([[p.repetition_penalty for p in params], [p.frequency_penalty for p in params], [p.presence_penalty for p in params]],
                          torch.float32, device)
    # Every row penalised (a model's generation config gives all its requests the same): the
    # kernel writes each element, so nothing is copied first.
    out = torch.empty_like(logits) if count == logits.shape[0] else logits.clone()
    vocab = logits.shape[-1]
    _penalties_kernel[(count, triton.cdiv(vocab, _COLUMNS))](
        logits, logits.stride(0), out, out.stride(0),
        rows, unread_tokens if unread_tokens is not None else rows,
        seen.view(torch.uint8), output_counts, seen.stride(0),
        penalties, count, vocab, _FLOAT32_MAX,
        COLUMNS=_COLUMNS, enable_fp_fusion=False,  # no contracted multiply-subtract: torch's roundings
    )
    return out
