"""CPU linear layers on oneDNN with their weights repacked once, at load.

``F.linear`` on a CPU goes to MKL, which repacks the weight on every call and, at the small
row counts of a decode step, runs far from the machine's peak: on the SmolLM2-135M shape,
float32, 2 threads, the 30 layers' matmuls took 67 ms at 32 rows against 41 ms through a
oneDNN weight packed ahead of time (42 vs 20 ms at 8 rows; 8.5 vs 10.7 ms per 512-row
prefill matmul). The packed kernel is also batch-invariant: a row's output is bit-identical
whatever other rows share the call, which MKL's is not. Results differ from MKL's by float
rounding only (a different summation order), as they already do between batch sizes there.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine.device_caps import native_bf16

logger = logging.getLogger(__name__)

# Row count the packing is tuned for; any row count works with the packed weight.
BATCH_HINT = 32


def can_prepack(device: str, dtype: torch.dtype) -> bool:
    """Whether this torch build and device can run packed oneDNN linears in ``dtype``."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight") or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and native_bf16(device))


class PackedLinear(nn.Module):
    """``nn.Linear`` (no grad) with the weight in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear, batch_hint: int = BATCH_HINT):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        # A plain attribute, not a parameter: an opaque oneDNN tensor has no place in a
        # state dict, and the original weight may be shared (tied embeddings).
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def prepack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` inside ``model`` by a ``PackedLinear``; return how many."""
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            try:
                packed = PackedLinear(child)
                # oneDNN picks its kernel at the first call; a CPU it has none for fails here,
                # at load, and keeps the plain layer instead of failing a request later.
                with torch.inference_mode():
                    packed(torch.zeros((1, child.in_features), dtype=child.weight.dtype))
            except RuntimeError as exc:
                logger.warning("oneDNN cannot run %s in %s here, keeping torch's matmul: %s", name, child.weight.dtype, exc)
                return replaced
            setattr(module, name, packed)
            replaced += 1
    return replaced
