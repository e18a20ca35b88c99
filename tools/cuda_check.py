"""Check the engine's CUDA path against transformers on a GPU machine (no Ray or NIXL needed).

    python tools/cuda_check.py [--json out.json]

1. Exactness: for each test architecture, random-weight checkpoints run through the engine on
   CUDA (float32, chunk sizes 7 and 64, several prompts batched) and through transformers'
   ``generate`` on CUDA; greedy tokens must be equal. bfloat16 reports the agreement rate.
2. Checkpoint features, float32, greedy against transformers on CUDA: attention and MLP
   biases, sliding windows (gather + SDPA on the GPU, prompts past the window), the yarn,
   dynamic and LongRoPE schedules, and min_tokens holding off a stop token.
3. The prefill actor's push rule: a step's KV, read right after an event recorded behind the
   step and synchronized (what ``PrefillWorker`` does before a NIXL push), equals the KV after a
   full device synchronization.
4. Speed: a decode step at batch 32 and context 600 on the SmolLM2-135M shape, the engine
   against transformers' forward with a static cache, both on the GPU, same dtype.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from tests.checkpoints import ARCHITECTURES, build_checkpoint, random_prompts  # noqa: E402


def _hf_greedy_cuda(model, prompt, max_new_tokens):
    ids = torch.tensor([prompt], device="cuda")
    model.generation_config.eos_token_id = None
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def check_exactness(workdir: Path) -> dict:
    results = {}
    for arch in ARCHITECTURES:
        path = workdir / arch
        model = build_checkpoint(arch, path).to("cuda")
        prompts = random_prompts([5, 40, 130, 257], model.config.vocab_size, seed=3)
        want = [_hf_greedy_cuda(model, p, 12) for p in prompts]
        for dtype in ("float32", "bfloat16"):
            for chunk in (7, 64):
                config = EngineConfig(device="cuda", dtype=dtype, num_kv_blocks=256, max_num_batched_tokens=96, long_prefill_chunk=chunk)
                engine = LLMEngine(path, config)
                got = [c.token_ids for c in engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))]
                agree = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w)) / sum(len(w) for w in want)
                results[f"{arch}/{dtype}/chunk{chunk}"] = {"exact": got == want, "token_agreement": agree}
                assert engine.num_free_blocks == engine.kv_cache.num_blocks, "blocks leaked"
    return results


_HALF_HEAD = 8  # rotation pairs of the test checkpoints' head (64 / 4 / 2)
FEATURES = {
    "llama/attention_bias+mlp_bias": ("llama", {"attention_bias": True, "mlp_bias": True}, None),
    "qwen3/attention_bias": ("qwen3", {"attention_bias": True}, None),
    "mistral/sliding_window": ("mistral", {"sliding_window": 12}, None),
    "qwen2/sliding_window_from_layer_1": ("qwen2", {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1}, None),
    "llama/yarn": ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, "max_position_embeddings": 256}, None),
    "llama/dynamic": ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings": 256}, None),
    "llama/longrope": ("llama", {"rope_scaling": {"rope_type": "longrope", "original_max_position_embeddings": 64,
                                                  "short_factor": [1.0 + 0.1 * i for i in range(_HALF_HEAD)],
                                                  "long_factor": [1.5 + 0.4 * i for i in range(_HALF_HEAD)]},
                                 "max_position_embeddings": 256}, 64),
}


def check_features(workdir: Path) -> dict:
    results = {}
    for name, (arch, overrides, max_model_len) in FEATURES.items():
        path = workdir / name.replace("/", "_")
        model = build_checkpoint(arch, path, **overrides).to("cuda")
        prompts = random_prompts([5, 30, 45], model.config.vocab_size, seed=4)
        want = [_hf_greedy_cuda(model, p, 12) for p in prompts]
        config = EngineConfig(device="cuda", dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64, long_prefill_chunk=16, max_model_len=max_model_len)
        got = [c.token_ids for c in LLMEngine(path, config).generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))]
        results[name] = got == want
    # min_tokens: a stop token id that would end the request early is held off on the device.
    path = workdir / "llama"
    model = build_checkpoint("llama", path / "min_tokens").to("cuda")
    (prompt,) = random_prompts([9], model.config.vocab_size, seed=21)
    greedy = _hf_greedy_cuda(model, prompt, 10)
    at = next(i for i in range(1, 10) if greedy[i] not in greedy[:i])
    engine = LLMEngine(path / "min_tokens", EngineConfig(device="cuda", dtype="float32", num_kv_blocks=64))
    (early,) = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[greedy[at]]))
    (held,) = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[greedy[at]], min_tokens=at + 3))
    results["min_tokens"] = early.token_ids == greedy[: at + 1] and len(held.token_ids) >= at + 3 and held.token_ids[:at] == greedy[:at]
    return results


def check_event_before_push(workdir: Path) -> bool:
    path = workdir / "llama"
    engine = LLMEngine(path, EngineConfig(device="cuda", num_kv_blocks=64, max_num_batched_tokens=512))
    engine.add_request("r", random_prompts([400], 384, seed=4)[0], SamplingParams(max_tokens=1))
    batch = engine.scheduler.schedule()
    engine.runner.execute(batch)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    seen = engine.kv_cache.tensor.clone()
    torch.cuda.synchronize()
    return bool(torch.equal(seen, engine.kv_cache.tensor)) and bool(seen.abs().sum() > 0)


def bench_decode(dtype_name: str, batch: int = 32, context: int = 600, steps: int = 32) -> dict:
    import transformers
    from transformers import StaticCache

    dtype = getattr(torch, dtype_name)
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=2048, rope_theta=100000.0, tie_word_embeddings=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        hf = transformers.LlamaForCausalLM(config).eval()
        hf.save_pretrained(tmp)
        hf = hf.to("cuda", dtype)
        engine = LLMEngine(tmp, EngineConfig(device="cuda", dtype=dtype_name, num_kv_blocks=batch * (context + steps + 16) // 16 + 64,
                                            max_num_batched_tokens=8192, max_num_seqs=batch))
        prompts = random_prompts([context] * batch, config.vocab_size, seed=5)
        for i, p in enumerate(prompts):
            engine.add_request(f"b{i}", p, SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True))
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.requests.values()):
            engine.step()
        for _ in range(4):
            engine.step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        ours = batch * steps / (time.perf_counter() - start)

        cache = StaticCache(config=config, max_batch_size=batch, max_cache_len=context + steps + 8, device="cuda", dtype=dtype)
        ids = torch.tensor(prompts, device="cuda")
        with torch.inference_mode():
            out = hf(ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(context, device="cuda"))
            token = out.logits[:, -1:].argmax(-1)
            for step in range(4 + steps):
                if step == 4:
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                pos = torch.tensor([context + step], device="cuda")
                out = hf(token, past_key_values=cache, use_cache=True, cache_position=pos)
                token = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
        theirs = batch * steps / (time.perf_counter() - start)
    return {"dtype": dtype_name, "batch": batch, "context": context, "pdserve_tok_s": ours, "transformers_tok_s": theirs, "ratio": ours / theirs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        report["exactness"] = check_exactness(Path(tmp))
        report["features"] = check_features(Path(tmp))
        report["event_before_push"] = check_event_before_push(Path(tmp))
    report["decode"] = [bench_decode("bfloat16"), bench_decode("float32")]
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    float32_exact = all(v["exact"] for k, v in report["exactness"].items() if "/float32/" in k)
    return 0 if float32_exact and all(report["features"].values()) and report["event_before_push"] else 1


if __name__ == "__main__":
    sys.exit(main())
