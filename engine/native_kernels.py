"""The machine's native kernel library: small C++ kernels in ``engine/csrc``, built per machine.

One library carries the CPU attention kernels (``engine.attention.cpu``), the quantized KV write
(``engine.attention.kv_write``), the bfloat16 linear layers of ``engine.cpu_linear``
(``csrc/bf16_linear.cpp``, built only where the CPU has avx512_bf16), the fused elementwise ops
of ``engine.fused_ops`` (``csrc/elementwise.cpp``) and the tensor-parallel ranks' shared-memory
all-reduce (``csrc/shm_allreduce.cpp``, ``engine.parallel.shm``).

All are plain C++ with AVX2 or AVX-512 intrinsics, compiled with the system's ``g++`` on
first use (seconds, once per machine) into one library in ``~/.cache/pdserve/kernels`` under
a name keyed by the sources, the compiler and the CPU's instruction-set flags (built with
``-march=native``, so a build from another CPU is never loaded), and called through ctypes,
which releases the GIL for the call. Their threads are torch's own OpenMP pool. Where they
cannot be built (no compiler, no AVX2), every caller keeps its torch path.
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

logger = logging.getLogger(__name__)

_SOURCE_DIR = Path(__file__).with_name("csrc")
_SOURCES = ("paged_decode_attention.cpp", "paged_prefill_attention.cpp", "bf16_linear.cpp", "elementwise.cpp", "kv_quant.cpp", "shm_allreduce.cpp")
_HEADERS = ("simd.h",)
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


def vector_width() -> int:
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
    sources = [(_SOURCE_DIR / name).read_text() for name in (*_SOURCES, *_HEADERS)]
    key = hashlib.sha256("\0".join([*sources, version, _cpu_flags(), *_COMPILE_FLAGS, *_LINK_FLAGS]).encode())
    target = _cache_dir() / f"paged_attention_{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Built under a temporary name, then renamed: processes building at once never see half a file.
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            objects = [Path(scratch) / f"{Path(name).stem}.o" for name in _SOURCES]
            built = Path(scratch) / target.name
            commands = [[compiler, *_COMPILE_FLAGS, str(_SOURCE_DIR / name), "-o", str(obj)] for name, obj in zip(_SOURCES, objects)]
            commands.append([compiler, *map(str, objects), "-o", str(built), *_LINK_FLAGS])
            for command in commands:
                result = subprocess.run(command, capture_output=True, text=True)
                if result.returncode != 0:
                    raise RuntimeError(f"{' '.join(command[:2])}... failed: {result.stderr.strip()[-2000:]}")
            os.replace(built, target)
        logger.info("built the native CPU kernels: %s", target)
    library = ctypes.CDLL(str(target))
    library.pdserve_paged_decode.restype = ctypes.c_int
    pointer, int64 = ctypes.c_void_p, ctypes.c_int64
    library.pdserve_paged_decode.argtypes = [
        pointer, pointer, pointer, ctypes.c_int,  # q, key cache, value cache, element kind
        int64, int64, int64, int64, int64,  # n, kv heads, group, head_dim, block size
        int64, int64, int64, int64, int64, int64,  # block, token and head strides of keys, values
        pointer, pointer, int64, int64, int64,  # key and value scales, their block strides, their head stride (quantized caches)
        pointer, int64, pointer, pointer,  # tables, table width, lens, out
        ctypes.c_float, ctypes.c_int, int64,  # scale, threads, sliding window (0: none)
    ]
    library.pdserve_paged_prefill.restype = ctypes.c_int
    library.pdserve_paged_prefill.argtypes = [
        pointer, pointer, pointer, ctypes.c_int,  # q, key cache, value cache, element kind
        int64, pointer, pointer, pointer, pointer, int64,  # chunks, first rows, tokens, contexts, tables, width
        int64, int64, int64, int64,  # kv heads, group, head_dim, block size
        int64, int64, int64, int64, int64, int64,  # block, token and head strides of keys, values
        pointer, pointer, int64, int64, int64,  # key and value scales, their block strides, their head stride (quantized caches)
        pointer, ctypes.c_float, ctypes.c_int, int64,  # out, scale, threads, sliding window (0: none)
        ctypes.c_int,  # bfloat16 model: a quantized cache's tiles may be bfloat16 (avx512_bf16)
    ]
    library.pdserve_kv_quant_write.restype = None
    library.pdserve_kv_quant_write.argtypes = [
        pointer, ctypes.c_int, int64, int64, int64,  # src, bf16, tokens, heads, head_dim
        pointer, pointer, pointer,  # slot blocks, slot offsets, cache
        int64, int64, int64, pointer, int64, int64, ctypes.c_int,  # block, token, head strides, scales, scale block and head strides, fp8
    ]
    library.pdserve_bf16_linear_available.restype = ctypes.c_int
    library.pdserve_bf16_pack.restype = ctypes.c_int
    library.pdserve_bf16_pack.argtypes = [pointer, int64, int64, pointer]  # weight, N, K, packed
    library.pdserve_bf16_linear.restype = ctypes.c_int
    library.pdserve_bf16_linear.argtypes = [pointer, int64, int64, pointer, pointer, int64, pointer, ctypes.c_int]  # x, M, K, packed, bias, N, y, threads
    library.pdserve_add_rms_norm.restype = None
    library.pdserve_add_rms_norm.argtypes = [pointer, pointer, pointer, pointer, int64, int64, ctypes.c_float, ctypes.c_int, ctypes.c_int]  # x, residual, weight, out, rows, cols, eps, bf16, threads
    library.pdserve_silu_mul.restype = None
    library.pdserve_silu_mul.argtypes = [pointer, pointer, int64, int64, ctypes.c_int, ctypes.c_int]  # gate_up, out, rows, inter, bf16, threads
    library.pdserve_rotary.restype = None
    library.pdserve_rotary.argtypes = [pointer, int64, int64, int64, int64, pointer, pointer, ctypes.c_int, ctypes.c_int]  # qkv, rows, row stride, heads, head_dim, cos, sin, bf16, threads
    library.pdserve_shm_header_bytes.restype = int64
    library.pdserve_shm_header_bytes.argtypes = [int64]
    library.pdserve_shm_allreduce.restype = ctypes.c_int
    library.pdserve_shm_allreduce.argtypes = [pointer, int64, int64, int64, pointer, int64, ctypes.c_int, ctypes.c_uint64, ctypes.c_double]  # region, rank, world, slot bytes, data, n, bf16, seq, timeout
    library.pdserve_shm_abort.restype = None
    library.pdserve_shm_abort.argtypes = [pointer, int64]
    library.pdserve_vector_width.restype = ctypes.c_int
    if library.pdserve_vector_width() != vector_width():
        raise RuntimeError("kernel vector width does not match the CPU flags")
    return library


def kernel() -> ctypes.CDLL | None:
    """The compiled kernel, building it on the first call; None where it cannot be built."""
    global _library, _build_tried
    if _build_tried:  # every linear and elementwise op asks, every step: no lock once settled
        return _library
    with _lock:
        if not _build_tried:
            try:
                _library = _build()
            except Exception as exc:  # no compiler, no AVX2, an exotic platform
                logger.warning("native CPU kernels unavailable, the torch paths run instead: %s", exc)
            _build_tried = True  # only now: a reader without the lock must see the library set
        return _library
