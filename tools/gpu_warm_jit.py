"""Build FlashInfer's JIT kernels the engine uses, in parallel, before a GPU check runs.

FlashInfer compiles each kernel module on its first use, one after another: on an H200 the
first check of a session spent about 150 s there (rope 49 s, norm 43 s, prefill 27 s, decode
15 s, ...), a sixth of a lent machine's 15 minutes. Here each module is built in its own process
(the machine has 16 cores; FlashInfer locks each module's build, so a check started meanwhile
waits only for the modules it needs), through the engine's own code paths, so the builds are
exactly the specializations a check will ask for: the fused norms, SiLU*mul and rotation, the
sampling kernels, and the attention backend's decode and prefill kernels for the test shapes' head
sizes (64: the 135M shape, 9 query / 3 KV heads; 128: the 1.5B shape, 12 / 2).

    python tools/gpu_warm_jit.py [--export DIR] [--deadline SECONDS]

``--deadline`` (default 240 s) stops waiting for builds still running then, names them, and ends
their processes: in session 22 one build (FlashInfer's radix top-k, since dropped) ran past 9
minutes and took the whole call, and with it the lease.

``--export DIR`` then packs the compiled modules (the .so files of FlashInfer's cache) into
DIR/fi_jit.tar.xz: carried to a later machine, tools/gpu_run.sh places them where FlashInfer
loads ahead-of-time modules (flashinfer/data/aot/NAME/NAME.so), which it loads without building;
left in its JIT cache without their objects and ninja's log, ninja would build them again.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _fused_ops() -> None:
    import torch

    from engine import fused_ops

    x = torch.randn(4, 576, device="cuda", dtype=torch.bfloat16)
    weight = torch.ones(576, device="cuda", dtype=torch.bfloat16)
    fused_ops.add_rms_norm(None, x.clone(), weight, 1e-5)
    fused_ops.add_rms_norm(x.clone(), x.clone(), weight, 1e-5)
    fused_ops.silu_mul(torch.randn(4, 2 * 1536, device="cuda", dtype=torch.bfloat16))


def _rotation() -> None:
    import flashinfer
    import torch

    q = torch.randn(4, 9, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(4, 3, 64, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(32, 64, device="cuda", dtype=torch.float32)
    flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(torch.arange(4, device="cuda"), q, k, 64, cache, is_neox=True)


def _draw(vocab: int, params) -> None:
    """Draw rows of ``params`` through the sampler's device path (engine.sampler._draw_on_device)."""
    import torch

    from engine.sampler import Sampler

    Sampler()._draw_on_device(torch.randn(4, vocab, device="cuda"), [params] * 4)


def _sampling() -> None:
    from engine.sampling_params import SamplingParams

    _draw(1000, SamplingParams(temperature=0.8, top_p=0.9))  # FlashInfer's softmax and top-p
    _draw(1000, SamplingParams(temperature=0.8, top_p=0.9, min_p=0.05))  # its top-p renormalization and min-p (the same module)


def _attention(heads: int, kv_heads: int, head_dim: int) -> None:
    import torch

    from engine.attention.base import SeqSlice
    from engine.attention.block_tables import BlockTables
    from engine.attention.flashinfer_paged import FlashInferBackend

    block_size = 16
    backend = FlashInferBackend("cuda", block_size, heads, kv_heads, head_dim, torch.bfloat16, {None})
    cache = torch.zeros(8, block_size, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    tables = BlockTables.holding([[0, 1], [2, 3]]).array
    slices = [SeqSlice(0, 20, 1, decode=True), SeqSlice(1, 0, 9)]
    q = torch.randn(10, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(10, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    backend.build(slices, tables).forward(q, k, v, cache, cache.clone(), None)


BUILDS = {
    "fused_ops": (_fused_ops, ()),
    "rotation": (_rotation, ()),
    "sampling": (_sampling, ()),
    "attention_64": (_attention, (9, 3, 64)),
    "attention_128": (_attention, (12, 2, 128)),
}


def _run(name: str) -> tuple[str, float, str | None]:
    fn, args = BUILDS[name]
    start = time.perf_counter()
    try:
        fn(*args)
        import torch

        torch.cuda.synchronize()
        return name, time.perf_counter() - start, None
    except Exception as exc:  # one build failing still leaves the others built
        return name, time.perf_counter() - start, repr(exc)[-400:]


def export(directory: Path) -> Path:
    """The compiled modules of FlashInfer's JIT cache, and those a carried archive placed among its
    ahead-of-time modules, as one archive (the sources and objects stay): every module this
    machine had, for the next."""
    import importlib.util

    roots = [Path(os.environ.get("FLASHINFER_WORKSPACE_BASE", Path.home()))]
    spec = importlib.util.find_spec("flashinfer")
    if spec is not None and spec.submodule_search_locations:
        roots.append(Path(spec.submodule_search_locations[0]) / "data" / "aot")
    directory.mkdir(parents=True, exist_ok=True)
    command = ["tar", "-I", "xz -T0", "-cf", str(directory / "fi_jit.tar.xz")]
    for root in roots:
        libraries = sorted(str(p.relative_to(root)) for p in root.rglob("*.so")) if root.is_dir() else []
        if libraries:
            command += ["-C", str(root), *libraries]
    subprocess.run(command, check=True)
    return directory / "fi_jit.tar.xz"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--export", type=Path)
    parser.add_argument("--export-only", action="store_true", help="pack what is built, build nothing")
    parser.add_argument("--deadline", type=float, default=240.0, help="seconds to wait for the builds")
    args = parser.parse_args()
    if args.export_only:
        archive = export(args.export)
        print(f"jit: exported {archive} ({archive.stat().st_size / 2**20:.1f} MiB)", flush=True)
        return 0
    start = time.perf_counter()
    waiting = set(BUILDS)
    with multiprocessing.get_context("spawn").Pool(len(BUILDS)) as pool:  # leaving it terminates the workers
        results = pool.imap_unordered(_run, BUILDS)
        while waiting:
            try:
                name, seconds, error = results.next(timeout=max(0.0, start + args.deadline - time.perf_counter()))
            except multiprocessing.TimeoutError:
                print(f"jit: {', '.join(sorted(waiting))} not built within {args.deadline:.0f} s; their processes ended", flush=True)
                break
            waiting.discard(name)
            print(f"jit {name}: {seconds:.1f} s" + (f" FAILED {error}" if error else ""), flush=True)
    if not waiting:
        print(f"jit: every build done in {time.perf_counter() - start:.1f} s", flush=True)
    if args.export:
        archive = export(args.export)
        print(f"jit: exported {archive} ({archive.stat().st_size / 2**20:.1f} MiB)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
