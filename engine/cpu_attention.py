"""Attention on a CPU straight from the paged cache: small C++ kernels, built per machine.

Decode (``csrc/paged_decode_attention.cpp``): SDPA needs each decode sequence's keys and
values contiguous, so the portable path copies every sequence's blocks out of the cache, pads
a gather group to its longest member, and only then attends. On the SmolLM2-135M shape
(float32, 2 threads, batch 32 of 64-1024 tokens) that copy plus SDPA took ~150 ms of a ~280 ms
decode step; the kernel reads each key and value once, in place, with no padding, and the step
takes ~150 ms.

Prefill (``csrc/paged_prefill_attention.cpp``): a chunk with cached context needs an explicit
causal mask in SDPA, so torch's CPU flash kernel computes the masked half too, after the
context is gathered out of the blocks; attention was 28% of a prefill step. The kernel is
flash attention in tiles that skips every tile after a query's position: 512 queries over
512 + 512 keys in ~6.5 ms against SDPA's ~11 ms, 512 causal queries in ~3 ms against ~5. On a
bfloat16 cache with avx512_bf16 the tiles stay bfloat16 and the products run on vdpbf16ps:
~3.5 ms for the first case, and the engine's bfloat16 prefill went from 943 to 1,117 tok/s.

The same library carries the bfloat16 linear layers of ``engine.cpu_linear``
(``csrc/bf16_linear.cpp``, built only where the CPU has avx512_bf16), the fused
elementwise ops of ``engine.fused_ops`` (``csrc/elementwise.cpp``) and the tensor-parallel
ranks' shared-memory all-reduce (``csrc/shm_allreduce.cpp``, ``engine.parallel.shm``).

All are plain C++ with AVX2 or AVX-512 intrinsics, compiled with the system's ``g++`` on
first use (seconds, once per machine) into one library in ``~/.cache/pdserve/kernels`` under
a name keyed by the sources, the compiler and the CPU's instruction-set flags (built with
``-march=native``, so a build from another CPU is never loaded), and called through ctypes,
which releases the GIL for the call. Their threads are torch's own OpenMP pool. Where they
cannot be built (no compiler, no AVX2) or do not apply (another device or dtype, a head size
or group they were not built for), the engine keeps gather + SDPA.
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
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE_DIR = Path(__file__).with_name("csrc")
_SOURCES = ("paged_decode_attention.cpp", "paged_prefill_attention.cpp", "bf16_linear.cpp", "elementwise.cpp", "kv_quant.cpp", "shm_allreduce.cpp")
_HEADERS = ("simd.h",)
_MAX_GROUP = 8  # query heads per KV head the kernel was instantiated for
_HEAD_VECTORS = (1, 2, 4, 8, 16)  # head_dim as this many vectors of the machine's width
# The cache element types the kernels read, as their ``kind`` argument; the last two are
# quantized (engine.kv_cache), with a float32 scale per block and KV head.
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.float8_e4m3fn: 3}
_DTYPES = tuple(_KINDS)
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
        logger.info("built the CPU attention kernels: %s", target)
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
    library.pdserve_vector_width.restype = ctypes.c_int
    if library.pdserve_vector_width() != _vector_width():
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
                logger.warning("CPU attention kernels unavailable, attention gathers blocks for SDPA: %s", exc)
            _build_tried = True  # only now: a reader without the lock must see the library set
        return _library


def applies(device: torch.device | str, dtype: torch.dtype, head_dim: int, group: int) -> bool:
    """Whether the kernels can serve this cache (without building them)."""
    return (
        torch.device(device).type == "cpu"
        and dtype in _DTYPES
        and head_dim in tuple(v * _vector_width() for v in _HEAD_VECTORS)
        and 1 <= group <= _MAX_GROUP
    )


def prepare(device: torch.device | str, dtype: torch.dtype, head_dim: int, group: int) -> bool:
    """Build the kernels now if they apply: an engine calls this at start, not on its first step."""
    return applies(device, dtype, head_dim, group) and kernel() is not None


def _check_layout(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    for cache in (key_cache, value_cache):
        if cache.stride(3) != 1 or cache.dtype not in _DTYPES:
            raise ValueError(f"KV cache layout {tuple(cache.shape)}/{cache.stride()} {cache.dtype} not supported")


def _cache_geometry(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[int, ...]:
    """Block size, then the block, token and head strides of keys and values, as the kernels take them."""
    return (
        key_cache.shape[1],
        key_cache.stride(0),
        value_cache.stride(0),
        key_cache.stride(1),
        value_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(2),
    )


def _scale_args(key_cache: torch.Tensor, key_scales: torch.Tensor | None, value_scales: torch.Tensor | None) -> tuple:
    """The kernels' scale arguments: pointers, block strides and the head stride, or nulls for an
    unquantized cache."""
    if key_cache.dtype not in (torch.int8, torch.float8_e4m3fn):
        return (None, None, 0, 0, 1)
    if key_scales is None or value_scales is None or key_scales.stride(1) != value_scales.stride(1):
        raise ValueError("a quantized KV cache needs its per-block key and value scales [num_blocks, kv_heads]")
    return (key_scales.data_ptr(), value_scales.data_ptr(), key_scales.stride(0), value_scales.stride(0), key_scales.stride(1))


def write_quantized(
    x: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor
) -> bool:
    """Quantize x [tokens, kv_heads, head_dim] into an int8 or fp8 cache at its slots, raising each
    touched block's per-head scale as needed (csrc/kv_quant.cpp). False: no kernel here."""
    library = kernel()
    if library is None or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    x = x.contiguous()
    library.pdserve_kv_quant_write(
        x.data_ptr(), int(x.dtype == torch.bfloat16), x.shape[0], x.shape[1], x.shape[2],
        slot_blocks.data_ptr(), slot_offsets.data_ptr(), cache.data_ptr(),
        cache.stride(0), cache.stride(1), cache.stride(2), scales.data_ptr(), scales.stride(0), scales.stride(1),
        int(cache.dtype == torch.float8_e4m3fn),
    )
    return True


def attend_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lens: torch.Tensor,
    window: int | None = None,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of n single-token queries q [n, H, D] over their blocks -> [n, H, D] in q's dtype.

    key/value caches [num_blocks, block_size, kv_heads, head_dim] (any block, token and head
    strides; each row dense); block_tables [n, width] and lens [n] int64 (tokens attended, the new one included);
    ``window``: a sliding window's size (each query attends its latest ``window`` keys).
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    _check_layout(q, key_cache, value_cache)
    queries = q.float().contiguous()
    tables = block_tables.contiguous()
    lengths = lens.contiguous()
    out = torch.empty_like(queries)
    status = _library.pdserve_paged_decode(
        queries.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        _KINDS[key_cache.dtype],
        n,
        num_kv_heads,
        num_heads // num_kv_heads,
        head_dim,
        *_cache_geometry(key_cache, value_cache),
        *_scale_args(key_cache, key_scales, value_scales),
        tables.data_ptr(),
        tables.shape[1],
        lengths.data_ptr(),
        out.data_ptr(),
        head_dim**-0.5,
        torch.get_num_threads(),
        window or 0,
    )
    if status != 0:
        raise ValueError(f"no kernel built for head_dim {head_dim} with {num_heads // num_kv_heads} query heads per KV head")
    return out.to(q.dtype)


@dataclass(slots=True)
class PrefillChunks:
    """A step's multi-token chunks as the prefill kernel reads them, built once per step.

    Each chunk's query rows are consecutive in the step's packed tokens; its own keys and
    values are in the cache (written before attention), after its ``context_len`` cached ones.
    """

    first_rows: torch.Tensor  # [chunks] int64: the chunk's first row among the rows passed
    num_tokens: torch.Tensor  # [chunks] int64
    context_lens: torch.Tensor  # [chunks] int64
    tables: torch.Tensor  # [chunks, width] int64: blocks covering context + chunk


def attend_prefill(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    chunks: PrefillChunks,
    window: int | None = None,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed chunks q [T, H, D] over their context and themselves -> [T, H, D];
    under a sliding ``window`` each query attends its latest ``window`` keys only."""
    rows, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    _check_layout(q, key_cache, value_cache)
    queries = q.float().contiguous()
    out = torch.empty_like(queries)
    status = _library.pdserve_paged_prefill(
        queries.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        _KINDS[key_cache.dtype],
        chunks.first_rows.numel(),
        chunks.first_rows.data_ptr(),
        chunks.num_tokens.data_ptr(),
        chunks.context_lens.data_ptr(),
        chunks.tables.data_ptr(),
        chunks.tables.shape[1],
        num_kv_heads,
        num_heads // num_kv_heads,
        head_dim,
        *_cache_geometry(key_cache, value_cache),
        *_scale_args(key_cache, key_scales, value_scales),
        out.data_ptr(),
        head_dim**-0.5,
        torch.get_num_threads(),
        window or 0,
        int(q.dtype == torch.bfloat16),
    )
    if status != 0:
        raise ValueError(f"no kernel built for head_dim {head_dim}")
    return out.to(q.dtype)
