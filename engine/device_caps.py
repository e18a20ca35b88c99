"""What the device computes fast, and the dtype ``auto`` resolves to there.

``auto`` means the fastest dtype that is still exact to the checkpoint's intent: bfloat16
where the hardware multiplies it natively (a CPU with AVX512-BF16 or AMX, a CUDA GPU that
supports it), float32 elsewhere. On a CPU without those instructions bfloat16 is emulated,
measured about 5x slower than float32 for prefill, so ``auto`` never picks it there and an
explicit request for it logs a warning. A float16 checkpoint on a GPU stays float16.
"""

from __future__ import annotations

import functools
import importlib
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# Either flag gives a CPU native bfloat16 dot products (AVX512-BF16 on Zen 4 and Cooper Lake
# onwards, AMX tiles on Sapphire Rapids onwards).
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
AUTO = "auto"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags Linux reports (empty where /proc/cpuinfo is unavailable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def native_bf16(device: str) -> bool:
    """True where ``device`` multiplies bfloat16 in hardware rather than emulating it."""
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if kind == "cpu":
        return any(flag in cpu_flags() for flag in CPU_BF16_FLAGS)
    return False


def resolve_dtype(requested: str | None, checkpoint_dtype: torch.dtype, device: str) -> torch.dtype:
    """The dtype an engine runs in: ``requested`` by name, the checkpoint's (None), or ``auto``."""
    from engine.config import DTYPES

    if requested is None:
        dtype = checkpoint_dtype
    elif requested == AUTO:
        if torch.device(device).type == "cuda" and checkpoint_dtype == torch.float16:
            dtype = torch.float16  # the checkpoint's own half precision, native on every GPU
        else:
            dtype = torch.bfloat16 if native_bf16(device) else torch.float32
        logger.info("dtype auto on %s: %s (checkpoint %s)", device, dtype, checkpoint_dtype)
    elif requested in DTYPES:
        dtype = DTYPES[requested]
    else:
        raise ValueError(f"dtype: must be one of {sorted([*DTYPES, AUTO])}, got {requested!r}")
    if dtype == torch.bfloat16 and not native_bf16(device):
        logger.warning("%s", emulated_bf16_warning(device))
    return dtype


def emulated_bf16_warning(device: str) -> str:
    if torch.device(device).type == "cpu":
        detail = f"this CPU has none of the flags {', '.join(CPU_BF16_FLAGS)}"
    else:
        detail = f"{device} does not support bfloat16 natively"
    return f"bfloat16 is emulated on {device} ({detail}): expect steps several times slower than float32; dtype auto would pick float32"


@functools.cache
def triton_module(name: str):
    """The engine's Triton module ``name`` (``engine.triton_penalties``), or None where Triton
    cannot be imported (it comes with CUDA torch): its callers fall back to torch ops."""
    try:
        return importlib.import_module(name)
    except Exception:
        return None
