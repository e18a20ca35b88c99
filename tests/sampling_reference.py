"""The sampling filters' exact distribution, by a full sort of the row: the reference the sampler's
draws are held to (tests/engine/test_sampling.py, and tools/gpu_check.py on a GPU)."""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


def reference_filtered(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """top-k, then top-p and min-p on the renormalized rest, over the whole sorted row."""
    values, order = (logits / params.temperature).sort(descending=True)
    probs = torch.softmax(values, dim=-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if params.top_k > 0:
        keep[params.top_k :] = False
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    keep &= (probs.cumsum(0) - probs) < params.top_p
    keep &= probs >= params.min_p * probs[0]
    keep[0] = True
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return torch.zeros_like(kept).scatter_(0, order, kept / kept.sum())
