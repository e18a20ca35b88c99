"""Engine microbenchmark against transformers, in the same process and the same run.

    python -m engine.bench --model /work/ckpt/smollm2-135m-fp32 --dtype float32 --threads 2

The model is a checkpoint directory (a random-weight one of SmolLM2-135M's shape unless
``--model`` is given). For each measurement the engine and the outside reference
(transformers' eager forward with a static cache, ``engine.bench_reference``) take turns,
``--repeats`` times, so a noisy shared machine slows both alike; the tables give the best
and the median of the repeats and the ratio pdserve / transformers of each:

* decode tokens/s at several batch sizes through ``LLMEngine.step()`` (scheduler, sampler
  and bookkeeping included), through a raw loop over the engine's model with inputs built
  in bulk (its ceiling), and through transformers;
* prefill tokens/s of one long prompt through ``step()`` in chunks of several sizes, and
  through one transformers forward over the whole prompt;
* scoring tokens/s of that prompt (``prompt_logprobs``: every position's log-probability, rank
  and top alternatives) through ``step()``, and through transformers' forward with every
  position's logits and the same arithmetic over them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.attention.sdpa import SdpaMetadata
from engine.bench_reference import TransformersReference
from engine.config import DTYPES, EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

SMOLLM2_135M_SHAPE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write_random_checkpoint(directory: Path, config: dict, dtype: torch.dtype, seed: int = 0) -> Path:
    """A Hugging Face style checkpoint with random weights of ``config``'s shape."""
    generator = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_size, kv_size = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.02).to(dtype)

    tensors = {"model.embed_tokens.weight": rand(config["vocab_size"], hidden), "model.norm.weight": torch.ones(hidden, dtype=dtype)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(hidden, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=dtype),
            p + "self_attn.q_proj.weight": rand(q_size, hidden),
            p + "self_attn.k_proj.weight": rand(kv_size, hidden),
            p + "self_attn.v_proj.weight": rand(kv_size, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, q_size),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
        }
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({**config, "dtype": str(dtype).removeprefix("torch.")}))
    return directory


def _decode_engine(model_dir: Path, dtype: str, batch: int, context: int, steps: int) -> LLMEngine:
    blocks_per_seq = -(-(context + steps + 8) // 16)
    # Room for the scheduled run and the raw loop side by side.
    config = EngineConfig(dtype=dtype, num_kv_blocks=2 * batch * blocks_per_seq + 8, max_num_seqs=batch, max_num_batched_tokens=2048)
    return LLMEngine(model_dir, config)


def seat_decoding(engine: LLMEngine, batch: int, context: int, max_tokens: int, lora_names: list[str | None] | None = None,
                  sampling: SamplingParams | None = None) -> None:
    """Put ``batch`` sequences straight into decode, their ``context`` tokens' KV taken as cached
    (sequence i through adapter ``lora_names[i]`` where given; greedy unless ``sampling`` says).

    A decode step costs the same whatever the cache holds; skipping the prompts' prefill
    keeps a batch-32 run at a long context from spending minutes before the timed steps.
    """
    params = dataclasses.replace(sampling or SamplingParams(temperature=0.0), max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        lora_name = lora_names[i] if lora_names else None
        engine.add_request(f"d{i}", [(7 * i + j) % 1000 + 3 for j in range(context)], dataclasses.replace(params, lora_name=lora_name))
    scheduler = engine.scheduler
    for seq in list(scheduler.waiting):
        seq.block_table = engine.allocator.allocate(engine.kv_cache.blocks_needed(context + 1))
        seq.num_computed_tokens = context
        seq.token_ids.append(5)  # its first output token, as if the prompt's step sampled it
        scheduler._admit(seq)


def bench_scheduled_decode(engine: LLMEngine, batch: int, context: int, steps: int) -> float:
    """Decode tokens/s through step(), once every sequence is past its prompt."""
    seat_decoding(engine, batch, context, steps + 8)
    engine.step()  # warm-up decode step
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    for req_id in list(engine.scheduler.requests):
        engine.abort_request(req_id)
    return batch * steps / elapsed


def bench_raw_decode(engine: LLMEngine, batch: int, context: int, steps: int) -> float:
    """The engine's ceiling: its model and cache, inputs built with a few tensor ops per step."""
    block_size = engine.kv_cache.block_size
    blocks_per_seq = -(-(context + steps + 2) // block_size)
    block_tables = torch.tensor(engine.allocator.allocate(batch * blocks_per_seq)).view(batch, blocks_per_seq)
    rows = torch.arange(batch)
    key_positions = torch.arange(blocks_per_seq * block_size)
    tokens = torch.full((batch,), 5, dtype=torch.long)
    model = engine.runner.model
    positions = torch.full((batch,), context, dtype=torch.long)

    def one_step() -> None:
        nonlocal tokens
        meta = SdpaMetadata(
            slot_blocks=block_tables[rows, positions // block_size],
            slot_offsets=positions % block_size,
            num_single=batch,
            single_block_tables=block_tables,
            single_mask=(key_positions.unsqueeze(0) <= positions.unsqueeze(1)).view(batch, 1, 1, -1),
        )
        tokens = model(tokens, positions, engine.kv_cache, meta, rows).argmax(dim=-1)
        positions.add_(1)

    one_step()
    start = time.perf_counter()
    for _ in range(steps):
        one_step()
    elapsed = time.perf_counter() - start
    engine.allocator.free(block_tables.flatten().tolist())
    return batch * steps / elapsed


def _prefill_engine(model_dir: Path, dtype: str, prompt_len: int, chunk: int | None) -> LLMEngine:
    budget = chunk or prompt_len
    # No prefix caching: every repeat prefills the same prompt, and each must compute all of it.
    config = EngineConfig(
        dtype=dtype,
        num_kv_blocks=prompt_len // 16 + 8,
        max_num_batched_tokens=budget,
        long_prefill_chunk=chunk,
        enable_prefix_caching=False,
    )
    engine = LLMEngine(model_dir, config)
    engine.generate([[3 + j for j in range(64)]], SamplingParams(max_tokens=1))  # warm-up
    return engine


def bench_prefill(engine: LLMEngine, prompt: list[int], prompt_logprobs: int | None = None, lora_name: str | None = None) -> float:
    """Prefill tokens/s of one prompt, from add_request to its first token; with
    ``prompt_logprobs``, scoring it (every position's log-probability and alternatives); with
    ``lora_name``, through that adapter."""
    engine.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=prompt_logprobs, lora_name=lora_name))
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return len(prompt) / (time.perf_counter() - start)


def _summary(samples: list[float]) -> dict:
    return {"best": max(samples), "median": statistics.median(samples), "samples": samples}


def _ratio(ours: dict, theirs: dict) -> dict:
    return {"best": ours["best"] / theirs["best"], "median": ours["median"] / theirs["median"]}


def run_decode(model_dir: Path, args: argparse.Namespace, reference: TransformersReference) -> list[dict]:
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        engine = _decode_engine(model_dir, args.dtype, batch, args.context, args.steps)
        step_s, raw_s, hf_s = [], [], []
        for _ in range(args.repeats):
            hf_s.append(reference.decode_tok_s(batch, args.context, args.steps))
            step_s.append(bench_scheduled_decode(engine, batch, args.context, args.steps))
            raw_s.append(bench_raw_decode(engine, batch, args.context, args.steps))
        row = {"batch": batch, "step": _summary(step_s), "raw": _summary(raw_s), "transformers": _summary(hf_s)}
        row["ratio_step_vs_transformers"] = _ratio(row["step"], row["transformers"])
        row["ratio_raw_vs_transformers"] = _ratio(row["raw"], row["transformers"])
        rows.append(row)
        del engine
    return rows


def run_prefill(model_dir: Path, args: argparse.Namespace, reference: TransformersReference) -> list[dict]:
    return _run_prompt(model_dir, args, bench_prefill, reference.prefill_tok_s)


def run_scoring(model_dir: Path, args: argparse.Namespace, reference: TransformersReference) -> list[dict]:
    top = args.score_top
    return _run_prompt(model_dir, args, lambda engine, prompt: bench_prefill(engine, prompt, top), lambda prompt: reference.score_tok_s(prompt, top))


def _run_prompt(model_dir: Path, args: argparse.Namespace, ours, theirs) -> list[dict]:
    """One long prompt through ``ours(engine, prompt)`` at each chunk size and ``theirs(prompt)``,
    taking turns ``args.repeats`` times."""
    prompt = [(j * 31) % 1000 + 3 for j in range(args.prefill_len)]
    chunks = [int(c) or None for c in args.chunks.split(",")]
    engines = {chunk: _prefill_engine(model_dir, args.dtype, args.prefill_len, chunk) for chunk in chunks}
    samples: dict = {chunk: [] for chunk in chunks}
    reference_s = []
    for _ in range(args.repeats):
        reference_s.append(theirs(prompt))
        for chunk, engine in engines.items():
            samples[chunk].append(ours(engine, prompt))
    reference_summary = _summary(reference_s)
    rows = []
    for chunk in chunks:
        mine = _summary(samples[chunk])
        rows.append({"chunk": chunk, "step": mine, "transformers": reference_summary, "ratio_vs_transformers": _ratio(mine, reference_summary)})
    return rows


def _print_tables(results: dict, args: argparse.Namespace) -> None:
    print(f"decode, context {args.context}, {args.steps} steps x {args.repeats} repeats, {args.dtype}, {args.threads} thread(s); tok/s best/median")
    print(f"{'batch':>5} {'step()':>15} {'raw loop':>15} {'transformers':>15} {'step/tf':>13} {'raw/tf':>13}")
    for row in results["decode"]:
        print(decode_row(row, ("step", "raw", "transformers"), ("ratio_step_vs_transformers", "ratio_raw_vs_transformers")))
    print(f"\nprefill of a {args.prefill_len}-token prompt (transformers: one forward, logits of the last token only)")
    print(f"{'chunk':>9} {'step()':>15} {'transformers':>15} {'step/tf':>13}")
    _print_prefill_rows(results["prefill"])
    if results.get("scoring"):
        print(f"\nscoring that prompt (prompt_logprobs {args.score_top}; transformers: one forward, every position's logits)")
        print(f"{'chunk':>9} {'step()':>15} {'transformers':>15} {'step/tf':>13}")
        _print_prefill_rows(results["scoring"])


def decode_row(row: dict, samples: tuple[str, ...], ratios: tuple[str, ...]) -> str:
    """One decode table line: the batch, each sample's best/median tok/s, each ratio's best/median."""
    cells = [f"{row[k]['best']:7.1f}/{row[k]['median']:7.1f}" for k in samples]
    quotients = [f"{row[k]['best']:6.3f}/{row[k]['median']:6.3f}" for k in ratios]
    return f"{row['batch']:>5} " + " ".join(f"{cell:>15}" for cell in cells) + " " + " ".join(f"{q:>13}" for q in quotients)


def _print_prefill_rows(rows: list[dict]) -> None:
    for row in rows:
        ours, theirs, ratio = row["step"], row["transformers"], row["ratio_vs_transformers"]
        print(
            f"{row['chunk'] or 'whole':>9} {ours['best']:7.1f}/{ours['median']:7.1f} "
            f"{theirs['best']:7.1f}/{theirs['median']:7.1f} {ratio['best']:6.3f}/{ratio['median']:6.3f}"
        )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="checkpoint dir (default: random SmolLM2-135M shape)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--context", type=int, default=600, help="tokens each decoding sequence already holds")
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per repeat")
    parser.add_argument("--repeats", type=int, default=3, help="turns each side takes; best and median are reported")
    parser.add_argument("--prefill-len", type=int, default=1536, help="prompt tokens (below the model's context)")
    parser.add_argument("--chunks", default="512,0", help="prefill chunk sizes, 0 = unchunked")
    parser.add_argument("--score-top", type=int, default=1, help="alternatives per scored prompt token; -1: no scoring run")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or write_random_checkpoint(Path(tmp) / "smollm2-shape", SMOLLM2_135M_SHAPE, DTYPES[args.dtype])
        reference = TransformersReference(model_dir, DTYPES[args.dtype])
        results: dict = {"dtype": args.dtype, "threads": args.threads, "context": args.context}
        results["decode"] = run_decode(model_dir, args, reference) if args.batches else []
        results["prefill"] = run_prefill(model_dir, args, reference) if args.prefill_len else []
        results["scoring"] = run_scoring(model_dir, args, reference) if args.prefill_len and args.score_top >= 0 else []
    _print_tables(results, args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
