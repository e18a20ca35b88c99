"""LoRA serving benchmark: decode and prefill through adapters, against PEFT, in one run.

    python -m engine.bench_lora --threads 2 --adapters 4 --batches 8,32

On a random-weight checkpoint of SmolLM2-135M's shape (or ``--model``) with ``--adapters``
random rank-``--rank`` adapters on every projection, the engine and the outside reference take
turns, ``--repeats`` times:

* decode tokens/s of a batch whose sequences go round-robin through the adapters, through
  ``LLMEngine.step()``, against transformers + PEFT's own mixed-adapter batch (``adapter_names``,
  one forward for every adapter's rows) with a static cache, and against the engine's base model
  on the same batch (what the adapters cost);
* prefill tokens/s of one prompt through one adapter, against PEFT's forward over it.

PEFT is the reference a transformers user serving adapters has; it is a test dependency
(``pip install -e .[test]``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.bench import SMOLLM2_135M_SHAPE, _ratio, _summary, bench_prefill, decode_row, seat_decoding, write_random_checkpoint
from engine.bench_reference import TransformersReference
from engine.config import DTYPES, EngineConfig
from engine.llm_engine import LLMEngine

_MODULES = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_random_adapter(directory: Path, config: dict, rank: int, seed: int, std: float = 0.02) -> Path:
    """A PEFT LoRA adapter directory with random A and B (``std``) on every projection of
    ``config``'s shape, ``lora_alpha`` twice the rank (a scaling of 2)."""
    generator = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for block, modules in _MODULES.items():
            for module in modules:
                fan_in, fan_out = shapes[module]
                name = f"base_model.model.model.layers.{layer}.{block}.{module}."
                tensors[name + "lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * std
                tensors[name + "lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * std
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    adapter = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": [m for ms in _MODULES.values() for m in ms], "bias": "none"}
    (directory / "adapter_config.json").write_text(json.dumps(adapter))
    return directory


def _engine(model_dir: Path, adapters: dict[str, Path], dtype: str, num_blocks: int, max_seqs: int, prefix_caching: bool = True) -> LLMEngine:
    config = EngineConfig(
        dtype=dtype, num_kv_blocks=num_blocks, max_num_seqs=max_seqs, max_num_batched_tokens=2048, enable_prefix_caching=prefix_caching,
        lora_adapters={name: str(path) for name, path in adapters.items()},
    )
    return LLMEngine(model_dir, config)


def _decode_tok_s(engine: LLMEngine, lora_names: list[str | None], context: int, steps: int) -> float:
    seat_decoding(engine, len(lora_names), context, steps + 8, lora_names)
    engine.step()  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    for req_id in list(engine.scheduler.requests):
        engine.abort_request(req_id)
    return len(lora_names) * steps / elapsed


def run(model_dir: Path, adapters: dict[str, Path], args: argparse.Namespace) -> dict:
    reference = TransformersReference(model_dir, DTYPES[args.dtype], adapters)
    names = list(adapters)
    results: dict = {"decode": [], "prefill": None}
    for batch in [int(b) for b in args.batches.split(",") if b]:
        blocks = batch * (-(-(args.context + args.steps + 10) // 16)) + 8
        engine = _engine(model_dir, adapters, args.dtype, blocks, batch)
        mix = [names[i % len(names)] for i in range(batch)]
        ours, base, theirs = [], [], []
        for _ in range(args.repeats):
            theirs.append(reference.decode_tok_s(batch, args.context, args.steps, adapter_names=mix))
            ours.append(_decode_tok_s(engine, mix, args.context, args.steps))
            base.append(_decode_tok_s(engine, [None] * batch, args.context, args.steps))
        row = {"batch": batch, "adapters": len(set(mix)), "step": _summary(ours), "step_base": _summary(base), "peft": _summary(theirs)}
        row["ratio_vs_peft"] = _ratio(row["step"], row["peft"])
        row["ratio_vs_base"] = _ratio(row["step"], row["step_base"])
        results["decode"].append(row)
        del engine
    if args.prefill_len:
        prompt = [(j * 31) % 1000 + 3 for j in range(args.prefill_len)]
        # Each repeat computes the prompt again (no cached blocks).
        engine = _engine(model_dir, adapters, args.dtype, -(-args.prefill_len // 16) + 8, 1, prefix_caching=False)
        ours, theirs = [], []
        for _ in range(args.repeats):
            theirs.append(reference.prefill_tok_s(prompt, adapter_names=[names[0]]))
            ours.append(bench_prefill(engine, prompt, lora_name=names[0]))
        row = {"prompt": args.prefill_len, "step": _summary(ours), "peft": _summary(theirs)}
        row["ratio_vs_peft"] = _ratio(row["step"], row["peft"])
        results["prefill"] = row
    return results


def _print(results: dict, args: argparse.Namespace) -> None:
    print(f"decode through {args.adapters} rank-{args.rank} adapters (round-robin), context {args.context}, {args.dtype}, {args.threads} thread(s); tok/s best/median")
    print(f"{'batch':>5} {'step()':>15} {'step() base':>15} {'PEFT':>15} {'step/PEFT':>13} {'step/base':>13}")
    for row in results["decode"]:
        print(decode_row(row, ("step", "step_base", "peft"), ("ratio_vs_peft", "ratio_vs_base")))
    row = results["prefill"]
    if row:
        print(f"\nprefill of a {row['prompt']}-token prompt through one adapter: step() {row['step']['best']:.1f}/{row['step']['median']:.1f}, "
              f"PEFT {row['peft']['best']:.1f}/{row['peft']['median']:.1f}, ratio {row['ratio_vs_peft']['best']:.3f}/{row['ratio_vs_peft']['median']:.3f}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="checkpoint dir (default: random SmolLM2-135M shape; adapters are made for that shape)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batches", default="8,32")
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        shape = SMOLLM2_135M_SHAPE
        if args.model is not None:
            shape = json.loads((args.model / "config.json").read_text())
        model_dir = args.model or write_random_checkpoint(Path(tmp) / "smollm2-shape", shape, DTYPES[args.dtype])
        adapters = {f"lora{i}": write_random_adapter(Path(tmp) / f"lora{i}", shape, args.rank, seed=100 + i) for i in range(args.adapters)}
        results = run(model_dir, adapters, args)
    results.update(dtype=args.dtype, threads=args.threads, rank=args.rank)
    _print(results, args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
