"""Decode attention on a CPU straight from the paged cache: a small C++ kernel, built per machine.

Why: SDPA needs each decode sequence's keys and values contiguous, so the portable path
copies every sequence's blocks out of the cache, pads a gather group to its longest member,
and only then attends. On the SmolLM2-135M shape (float32, 2 threads, batch 32 of 64-1024
tokens) that copy plus SDPA took ~150 ms of a ~280 ms decode step; the kernel in
``csrc/paged_decode_attention.cpp`` reads each key and value once, in place, with no
padding, and the step takes ~150 ms.

The kernel is plain C++ with AVX2 or AVX-512 intrinsics, compiled with the system's ``g++``
on first use (a few seconds, once per machine) into ``~/.cache/pdserve/kernels`` under a
name keyed by the source, the compiler and the CPU's instruction-set flags (it is built with
``-march=native``, so a build from another CPU is never loaded), and called through ctypes,
which releases the GIL for the call. Its threads are torch's own OpenMP pool. Where it cannot be built (no compiler, no AVX2) or does
not apply (another device or dtype, a head size or group it was not built for), the engine
keeps gather + SDPA.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode_attention.cpp"
_MAX_GROUP = 8  # query heads per KV head the kernel was instantiated for
_HEAD_VECTORS = (1, 2, 4, 8, 16)  # head_dim as this many vectors of the machine's width
_DTYPES = (torch.float32, torch.bfloat16)
# -ffast-math when compiling the kernel (vectorized expf, reassociated sums), never when
# linking it: linked with it, the library carries crtfastmath, which switches the whole
# process to flush-to-zero on load (a temperature of 1e-40 then divided to nan).
_COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-c"]
_LINK_FLAGS = ["-shared", "-fopenmp", "-lmvec", "-lm"]

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_build_tried = False


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return ""


def _vector_width() -> int:
    return 16 if "avx512f" in _cpu_flags().split() else 8


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "pdserve" / "kernels"


def _build() -> ctypes.CDLL:
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or $CXX) on PATH")
    if "avx2" not in _cpu_flags().split():
        raise RuntimeError("the CPU has no AVX2")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    source = _SOURCE.read_text()
    key = hashlib.sha256("\0".join([source, version, _cpu_flags(), *_COMPILE_FLAGS, *_LINK_FLAGS]).encode())
    target = _cache_dir() / f"paged_decode_{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Built under a temporary name, then renamed: processes building at once never see half a file.
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            obj, built = Path(scratch) / "kernel.o", Path(scratch) / target.name
            for command in (
                [compiler, *_COMPILE_FLAGS, str(_SOURCE), "-o", str(obj)],
                [compiler, str(obj), "-o", str(built), *_LINK_FLAGS],
            ):
                result = subprocess.run(command, capture_output=True, text=True)
                if result.returncode != 0:
                    raise RuntimeError(f"{' '.join(command[:2])}... failed: {result.stderr.strip()[-2000:]}")
            os.replace(built, target)
        logger.info("built the CPU decode-attention kernel: %s", target)
    library = ctypes.CDLL(str(target))
    library.pdserve_paged_decode.restype = ctypes.c_int
    pointer, int64 = ctypes.c_void_p, ctypes.c_int64
    library.pdserve_paged_decode.argtypes = [
        pointer, pointer, pointer, ctypes.c_int,  # q, key cache, value cache, bf16
        int64, int64, int64, int64, int64,  # n, kv heads, group, head_dim, block size
        int64, int64, int64, int64, int64, int64,  # block, token and head strides of keys, values
        pointer, int64, pointer, pointer,  # tables, table width, lens, out
        ctypes.c_float, ctypes.c_int,  # scale, threads
    ]
    library.pdserve_vector_width.restype = ctypes.c_int
    if library.pdserve_vector_width() != _vector_width():
        raise RuntimeError("kernel vector width does not match the CPU flags")
    return library


def kernel() -> ctypes.CDLL | None:
    """The compiled kernel, building it on the first call; None where it cannot be built."""
    global _library, _build_tried
    with _lock:
        if not _build_tried:
            _build_tried = True
            try:
                _library = _build()
            except Exception as exc:  # no compiler, no AVX2, an exotic platform
                logger.warning("CPU decode-attention kernel unavailable, decode attends through gather + SDPA: %s", exc)
        return _library


def applies(device: torch.device | str, dtype: torch.dtype, head_dim: int, group: int) -> bool:
    """Whether the kernel can serve this cache (without building it)."""
    return (
        torch.device(device).type == "cpu"
        and dtype in _DTYPES
        and head_dim in tuple(v * _vector_width() for v in _HEAD_VECTORS)
        and 1 <= group <= _MAX_GROUP
    )


def prepare(device: torch.device | str, dtype: torch.dtype, head_dim: int, group: int) -> bool:
    """Build the kernel now if it applies: an engine calls this at start, not on its first step."""
    return applies(device, dtype, head_dim, group) and kernel() is not None


def attend(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lens: torch.Tensor,
) -> torch.Tensor:
    """Attention of n single-token queries q [n, H, D] over their blocks -> [n, H, D] in q's dtype.

    key/value caches [num_blocks, block_size, kv_heads, head_dim] (any block stride, the rest
    dense); block_tables [n, width] and lens [n] int64 (tokens attended, the new one included).
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    for cache in (key_cache, value_cache):
        if cache.stride(3) != 1 or cache.stride(2) != head_dim or cache.dtype not in _DTYPES:
            raise ValueError(f"KV cache layout {tuple(cache.shape)}/{cache.stride()} {cache.dtype} not supported")
    queries = q.float().contiguous()
    tables = block_tables.contiguous()
    lengths = lens.contiguous()
    out = torch.empty_like(queries)
    status = _library.pdserve_paged_decode(
        queries.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        int(key_cache.dtype == torch.bfloat16),
        n,
        num_kv_heads,
        num_heads // num_kv_heads,
        head_dim,
        key_cache.shape[1],
        key_cache.stride(0),
        value_cache.stride(0),
        key_cache.stride(1),
        value_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(2),
        tables.data_ptr(),
        tables.shape[1],
        lengths.data_ptr(),
        out.data_ptr(),
        head_dim**-0.5,
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(f"no kernel built for head_dim {head_dim} with {num_heads // num_kv_heads} query heads per KV head")
    return out.to(q.dtype)
