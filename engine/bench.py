"""Engine microbenchmark: scheduled decode vs a raw forward loop, and chunked prefill.

Run as ``python -m engine.bench``. Everything is measured in one process on one model (a
random-weight checkpoint with SmolLM2-135M's shape unless ``--model`` is given), so the
ratios are meaningful even on a noisy shared machine:

* decode tokens/s at several batch sizes through ``LLMEngine.step()`` against a raw loop
  that calls the same model on the same KV cache with tensors prepared in bulk and no
  scheduler, sampler or bookkeeping (the ceiling);
* prefill tokens/s of one long prompt in chunks of several sizes against unchunked.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.attention import AttentionMetadata
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

SMOLLM2_135M_SHAPE = {
    "architectures": ["LlamaForCausalLM"],
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
    head_dim = hidden // config["num_attention_heads"]
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


def _decode_engine(model_dir: Path, dtype: str, batch: int, context: int) -> LLMEngine:
    blocks_per_seq = -(-(context + 64) // 16)
    config = EngineConfig(dtype=dtype, num_kv_blocks=batch * blocks_per_seq + 8, max_num_seqs=batch, max_num_batched_tokens=2048)
    return LLMEngine(model_dir, config)


def bench_scheduled_decode(engine: LLMEngine, batch: int, context: int, steps: int) -> float:
    """Decode tokens/s through step(), once every sequence is past its prompt."""
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{i}", [(7 * i + j) % 1000 + 3 for j in range(context)], params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.requests.values()):
        engine.step()
    engine.step()  # warm-up decode step
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    for req_id in list(engine.scheduler.requests):
        engine.abort_request(req_id)
    return batch * steps / elapsed


def bench_raw_decode(engine: LLMEngine, batch: int, context: int, steps: int) -> float:
    """The ceiling: the same model and cache, inputs built with a few tensor ops per step."""
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
        meta = AttentionMetadata(
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


def bench_prefill(model_dir: Path, dtype: str, prompt_len: int, chunk: int | None) -> float:
    """Prefill tokens/s of one prompt, from add_request to its first token."""
    budget = chunk or prompt_len
    engine = LLMEngine(model_dir, EngineConfig(dtype=dtype, num_kv_blocks=prompt_len // 16 + 8, max_num_batched_tokens=budget, long_prefill_chunk=chunk))
    prompt = [(j * 31) % 1000 + 3 for j in range(prompt_len)]
    engine.generate([prompt[:64]], SamplingParams(max_tokens=1))  # warm-up
    engine.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return prompt_len / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="checkpoint dir (default: random SmolLM2-135M shape)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens of each decoding sequence")
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per batch size")
    parser.add_argument("--prefill-len", type=int, default=2048)
    parser.add_argument("--chunks", default="128,512,0", help="prefill chunk sizes, 0 = unchunked")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or write_random_checkpoint(Path(tmp) / "smollm2-shape", SMOLLM2_135M_SHAPE, getattr(torch, args.dtype))
        results: dict = {"dtype": args.dtype, "threads": args.threads, "decode": [], "prefill": []}
        print(f"decode, context {args.context} tokens, {args.steps} steps, dtype {args.dtype}, {args.threads} thread(s)")
        print(f"{'batch':>6} {'step() tok/s':>14} {'raw tok/s':>12} {'ratio':>7}")
        for batch in [int(b) for b in args.batches.split(",")]:
            engine = _decode_engine(model_dir, args.dtype, batch, args.context)
            raw = bench_raw_decode(engine, batch, args.context, args.steps)
            scheduled = bench_scheduled_decode(engine, batch, args.context, args.steps)
            results["decode"].append({"batch": batch, "scheduled_tok_s": scheduled, "raw_tok_s": raw, "ratio": scheduled / raw})
            print(f"{batch:>6} {scheduled:>14.1f} {raw:>12.1f} {scheduled / raw:>7.3f}")
            del engine
        print(f"\nprefill of a {args.prefill_len}-token prompt")
        print(f"{'chunk':>10} {'tok/s':>10} {'vs unchunked':>13}")
        chunks = [int(c) or None for c in args.chunks.split(",")]
        rates = {chunk: bench_prefill(model_dir, args.dtype, args.prefill_len, chunk) for chunk in chunks}
        unchunked = rates.get(None)
        for chunk, rate in rates.items():
            ratio = rate / unchunked if unchunked else float("nan")
            results["prefill"].append({"chunk": chunk, "tok_s": rate, "ratio_vs_unchunked": ratio})
            print(f"{chunk or 'unchunked':>10} {rate:>10.1f} {ratio:>13.3f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
