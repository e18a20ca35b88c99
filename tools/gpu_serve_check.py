"""One prefill actor and one decode actor sharing one GPU, serving a bounded workload end to end.

    python tools/gpu_serve_check.py [--gpus-per-actor 0.5] [--num-requests 64] [--json out.json]

What a GPU user runs first: ``pdserve up`` (Ray started locally, the router's gRPC and HTTP
APIs on 127.0.0.1) with one prefill and one decode actor, each given half the GPU, the KV cache
pushed from the prefill actor's VRAM into the decode actor's over NIXL after every chunk, on a
random-weight model of SmolLM2-135M's shape in bfloat16 (the built-in model's tokenizer); then
``pdserve bench``'s mixed workload (long prompts among short ones, streamed) against it. Reports
the benchmark's summary (TTFT, TPOT, throughput, errors), what each actor's engine runs on (its
"engine ready" line: attention backend, CUDA graphs, overlapped steps) and, from the router's Prometheus
metrics before and after it, each worker's steps during the benchmark: how many, their mean
time and the share of the benchmark spent inside them (a decode actor whose steps take little of
its time while its TPOT is long is paced by what happens between them). Exits non-zero if a
request failed.

``--gpus-per-actor 0`` runs the same deployment on the CPU (a dry run of this script).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PDSERVE = [sys.executable, "-m", "cluster.cli"]


def make_checkpoint(directory: Path) -> Path:
    """Random bfloat16 weights of SmolLM2-135M's shape, with the built-in model's tokenizer."""
    import torch

    from engine.bench import SMOLLM2_135M_SHAPE, write_random_checkpoint
    from engine.default_model_path import DEFAULT_MODEL_PATH

    write_random_checkpoint(directory, SMOLLM2_135M_SHAPE, torch.bfloat16)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(DEFAULT_MODEL_PATH) / name, directory / name)
    return directory


def serve(model: Path, gpus: float, state: Path, log: Path, async_scheduling: bool | None = None, dtype: str = "bfloat16") -> tuple[subprocess.Popen, str, str]:
    """``pdserve up`` in the foreground (in a child process); its router's and its metrics' addresses once it serves.
    ``async_scheduling``: whether the decode actor overlaps its steps (engine.overlap; None: pdserve's default, on for GPUs)."""
    placement = ["--prefill-gpus", str(gpus), "--decode-gpus", str(gpus)] if gpus else ["--prefill-cpus", "0.5", "--decode-cpus", "0.5"]
    overlap = [] if async_scheduling is None else ["--async-scheduling" if async_scheduling else "--no-async-scheduling"]
    process = subprocess.Popen(
        # INFO: the workers log what their engines run on (report["engines"]).
        [*PDSERVE, "--log-level", "info", "--state-file", str(state), "up", *overlap, "--model", str(model), "--prefill", "1", "--decode", "1", *placement,
         "--disaggregation", "always", "--dtype", dtype, "--host", "127.0.0.1", "--port", "0", "--http-port", "0", "--metrics-port", "0", "--admin-port", "0"],
        stdout=subprocess.PIPE, stderr=log.open("w"), text=True, cwd=ROOT,
    )
    printed: dict[str, str] = {}
    while "metrics on" not in printed:  # Ray relays the actors' logs to stdout too
        line = process.stdout.readline()
        if not line and process.poll() is not None:
            raise RuntimeError(f"pdserve up exited with {process.returncode}: {log.read_text()[-3000:]}")
        for start in ("pdserve serving on", "metrics on"):
            if line.startswith(start + " "):
                printed[start] = line.split()[len(start.split())]
    # Keep reading what it prints: a full pipe would block its logging, and so the deployment.
    threading.Thread(target=lambda: collections.deque(process.stdout, maxlen=0), daemon=True).start()
    return process, printed["pdserve serving on"], printed["metrics on"].removeprefix("http://").removesuffix("/metrics")


def bench(address: str, num_requests: int, out: Path, long_input_len: int = 2048) -> dict:
    """``pdserve bench``'s mixed workload against ``address``; its summary."""
    subprocess.run(
        [*PDSERVE, "bench", "--address", address, "--workload", "mixed", "--num-requests", str(num_requests), "--input-len", "256",
         "--long-input-len", str(long_input_len), "--long-fraction", "0.125", "--output-len", "64", "--request-rate", "8", "--ignore-eos",
         "--timeout", "300", "--out", str(out), "--no-plots", "--no-progress"],
        check=True, cwd=ROOT, timeout=900,
    )
    result = json.loads((out / "bench.json").read_text())
    return {key: value for key, value in result.items() if not isinstance(value, (dict, list))}  # the summary, not each record


def flashinfer_version() -> str:
    """FlashInfer's version as the actors will import it (they inherit this PYTHONPATH), or why not."""
    try:
        import flashinfer
    except Exception as exc:  # noqa: BLE001 - any failure to import means the same here
        return f"missing ({exc!r})"[:300]
    return getattr(flashinfer, "__version__", "unknown version")


def scrape_steps(metrics_address: str) -> dict[str, dict[str, float]]:
    """Per worker, its ``pdserve:engine_steps`` and ``pdserve:engine_step_seconds`` totals (router.metrics)."""
    import re
    import urllib.request

    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=30).read().decode()
    totals: dict[str, dict[str, float]] = {}
    for name, labels, value in re.findall(r"^pdserve:(engine_steps_total|engine_step_seconds_total)\{([^}]*)\} (\S+)$", text, re.MULTILINE):
        worker = re.search(r'worker_id="([^"]*)"', labels).group(1)
        totals.setdefault(worker, {})[name.removesuffix("_total")] = float(value)
    return totals


def step_report(before: dict, after: dict, seconds: float) -> dict[str, dict[str, float]]:
    """Each worker's steps between two scrapes: count, mean ms, and busy share of ``seconds``."""
    report = {}
    for worker, totals in after.items():
        steps = totals.get("engine_steps", 0.0) - before.get(worker, {}).get("engine_steps", 0.0)
        busy = totals.get("engine_step_seconds", 0.0) - before.get(worker, {}).get("engine_step_seconds", 0.0)
        report[worker] = {"steps": steps, "mean_step_ms": busy / steps * 1e3 if steps else 0.0, "busy_share": busy / seconds if seconds else 0.0}
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus-per-actor", type=float, default=0.5)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--model", type=Path, help="serve this checkpoint instead of a random one of SmolLM2-135M's shape "
                        "(e.g. engine/default_model: steps of a millisecond or two on a CPU show what paces tokens beside the step)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--long-input-len", type=int, default=2048, help="the mixed workload's long prompts (the built-in model's context is 2048 in all)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, help="whether the decode actor overlaps its steps (engine.overlap; default: pdserve's, on for GPUs)")
    args = parser.parse_args()
    report: dict = {"gpus_per_actor": args.gpus_per_actor, "async_scheduling": args.async_scheduling, "model": str(args.model or "smollm2-135m-shape"), "dtype": args.dtype}
    report["flashinfer"] = flashinfer_version()
    if args.gpus_per_actor and report["flashinfer"].startswith("missing"):
        # Without it the actors decode on the portable SDPA path, eagerly: not what a GPU user runs.
        print(f"gpu_serve_check: FlashInfer is {report['flashinfer']}; the actors will attend through SDPA", file=sys.stderr, flush=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = args.model or make_checkpoint(work / "smollm2-135m-shape")
        process, address, metrics_address = serve(model, args.gpus_per_actor, work / "state.json", work / "up.log", args.async_scheduling, args.dtype)
        report["startup_s"] = round(time.monotonic() - started, 1)
        try:
            before, bench_started = scrape_steps(metrics_address), time.monotonic()
            report["bench"] = bench(address, args.num_requests, work / "bench", args.long_input_len)
            time.sleep(1.5)  # the router reads the workers' reports when scraped, none older than 1 s
            report["worker_steps"] = step_report(before, scrape_steps(metrics_address), time.monotonic() - bench_started)
        except Exception as exc:  # still stop the deployment and report what it logged
            report["error"] = repr(exc)[-2000:]
        finally:
            process.send_signal(signal.SIGINT)
            try:
                process.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                process.kill()
            up_log = (work / "up.log").read_text()
            # What each actor's engine runs on (attention backend, graphs, overlap) and its KV size.
            report["engines"] = [line[-400:] for line in up_log.splitlines() if "engine ready:" in line or "attention: SDPA" in line or "KV cache" in line]
            report["up_log_tail"] = up_log[-4000:]
            report["up_returncode"] = process.returncode
    report["seconds"] = round(time.monotonic() - started, 1)
    text = json.dumps(report, indent=2)
    print(text, flush=True)
    if args.json:
        args.json.write_text(text)
    served = "error" not in report and report["bench"]["failed"] == 0 and report["bench"]["completed"] == args.num_requests
    return 0 if served and report["up_returncode"] == 0 else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
