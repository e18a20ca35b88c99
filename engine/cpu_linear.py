"""CPU linear layers on oneDNN with their weights repacked once, at load.

``F.linear`` on a CPU goes to MKL, which repacks the weight on every call and, at the small
row counts of a decode step, runs far from the machine's peak: on the SmolLM2-135M shape,
float32, 2 threads, the 30 layers' matmuls took 67 ms at 32 rows against 41 ms through a
oneDNN weight packed ahead of time (42 vs 20 ms at 8 rows; 8.5 vs 10.7 ms per 512-row
prefill matmul). The packed kernel is also batch-invariant: a row's output is bit-identical
whatever other rows share the call, which MKL's is not. Results differ from MKL's by float
rounding only (a different summation order), as they already do between batch sizes there.

In bfloat16 where the CPU has avx512_bf16, the linears run on pdserve's own kernel instead
(``csrc/bf16_linear.cpp``, ``Bf16PairLinear``): weights packed as bfloat16 pairs, products on
vdpbf16ps. It streams a decode step's weights at the machine's memory bandwidth, where oneDNN
did not (SmolLM2-135M, 2 threads, all linears: 3 rows 9.1 vs 12.0 ms, 32 rows 24.8 vs 27.7), is
as fast at prefill sizes (512 rows 267 vs 264 ms), and sums every output in one fixed order, so
a row's result does not depend on the row count: oneDNN's bfloat16 kernels change with it.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine import native_kernels
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


class Bf16PairLinear(nn.Module):
    """``nn.Linear`` (no grad) in bfloat16 on pdserve's vdpbf16ps kernel, its weight packed as pairs."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach().contiguous()
        # A plain attribute, as PackedLinear's: the layout is the kernel's, not a checkpoint's.
        self.packed_weight = torch.empty_like(weight)
        if _kernel().pdserve_bf16_pack(weight.data_ptr(), self.out_features, self.in_features, self.packed_weight.data_ptr()) != 0:
            raise ValueError(f"no bfloat16 pair layout for a {self.out_features}x{self.in_features} weight")
        self.bias = None if linear.bias is None else linear.bias.detach().float().contiguous()

    @staticmethod
    def fits(linear: nn.Linear) -> bool:
        return (
            linear.weight.dtype == torch.bfloat16
            and linear.out_features % 16 == 0
            and linear.in_features % 2 == 0
            and bf16_pair_kernel_available()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        out = torch.empty((rows.shape[0], self.out_features), dtype=torch.bfloat16)
        status = _kernel().pdserve_bf16_linear(
            rows.data_ptr(),
            rows.shape[0],
            self.in_features,
            self.packed_weight.data_ptr(),
            None if self.bias is None else self.bias.data_ptr(),
            self.out_features,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"bfloat16 linear kernel failed on a {self.out_features}x{self.in_features} weight")
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _kernel():
    library = native_kernels.kernel()
    if library is None:
        raise RuntimeError("the CPU kernels are not built")
    return library


def bf16_pair_kernel_available() -> bool:
    """Whether this machine's kernel library was built with the bfloat16 pair linears."""
    library = native_kernels.kernel()
    return library is not None and library.pdserve_bf16_linear_available() == 1


def prepack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` inside ``model`` by a ``Bf16PairLinear`` where it fits, else
    by a ``PackedLinear``; return how many."""
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            try:
                packed = Bf16PairLinear(child) if Bf16PairLinear.fits(child) else PackedLinear(child)
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
