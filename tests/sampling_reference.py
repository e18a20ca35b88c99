"""The sampling filters' exact distribution, by a full sort of the row: the reference the sampler's
draws are held to (tests/engine/test_sampling.py, and tools/gpu_check.py on a GPU), and an exact
stand-in for FlashInfer's sampling kernels on the CPU."""

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


class ExactFlashInferSampling:
    """A stand-in for FlashInfer's ``softmax``, ``top_p_sampling_from_probs``, ``top_p_renorm_probs``
    and ``min_p_sampling_from_probs`` (CUDA only), exact
    in torch on the CPU, recording what it was given: for the rows of a mixed batch that
    ``_draw_on_device`` hands to FlashInfer (tools/gpu_check.py draws through the real kernels)."""

    def __init__(self) -> None:
        self.temperatures: list[float] = []

    def softmax(self, logits, temperature):
        self.temperatures += temperature.tolist()
        return torch.softmax(logits / temperature.unsqueeze(1), dim=-1)

    def top_p_sampling_from_probs(self, probs, top_p, seed, offset):
        return _multinomial(self.top_p_renorm_probs(probs, top_p), seed)

    def top_p_renorm_probs(self, probs, top_p, is_deterministic=False):  # exact either way
        ordered, order = probs.sort(dim=-1, descending=True)
        kept = ordered * ((ordered.cumsum(dim=-1) - ordered) < top_p.unsqueeze(1))
        kept = torch.zeros_like(probs).scatter_(1, order, kept)
        return kept / kept.sum(dim=-1, keepdim=True)

    def min_p_sampling_from_probs(self, probs, min_p, seed, offset):
        # At min_p 0 the real kernel counts tokens of probability 0 as drawable (its edge case
        # can return one): rows without min-p must never come here.
        assert bool((min_p > 0).all()), "a row without min-p was given to FlashInfer's min-p kernel"
        kept = probs * (probs >= min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True))
        return _multinomial(kept, seed)


def _multinomial(weights: torch.Tensor, seed: int) -> torch.Tensor:
    """One draw per row, proportional to ``weights``, from a generator seeded with ``seed``."""
    return torch.multinomial(weights, 1, generator=torch.Generator().manual_seed(seed % 2**63)).squeeze(1).int()
