"""The engine on a CUDA GPU against transformers (CPU, float32) on tiny checkpoints of every
architecture and feature: biases, RoPE schedules, sliding windows (gather + SDPA on the GPU),
min_tokens. Run from the repository root on a GPU machine: ``python3 tools/check_cuda_engine.py``;
it prints one line per case and ends with the number of failures."""
import sys, tempfile, time, pathlib
sys.path.insert(0, ".")
import torch
from tests.checkpoints import build_checkpoint, hf_greedy, random_prompts
from engine import EngineConfig, LLMEngine, SamplingParams

print("torch", torch.__version__, torch.cuda.get_device_name(0))
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
H = 8
ROPES = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 64, "short_factor": [1.0 + 0.1 * i for i in range(H)], "long_factor": [1.5 + 0.4 * i for i in range(H)]},
}
cases = [
    ("llama", {}, None), ("mistral", {}, None), ("qwen2", {}, None), ("qwen3", {}, None),
    ("llama", {"attention_bias": True, "mlp_bias": True}, None),
    ("qwen3", {"attention_bias": True}, None),
    ("mistral", {"sliding_window": 12}, None),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1}, None),
    ("llama", {"rope_scaling": ROPES["yarn"], "max_position_embeddings": 256}, None),
    ("llama", {"rope_scaling": ROPES["dynamic"], "max_position_embeddings": 256}, None),
    ("llama", {"rope_scaling": ROPES["longrope"], "max_position_embeddings": 256}, 64),
]
failures = 0
for arch, overrides, max_len in cases:
    with tempfile.TemporaryDirectory() as tmp:
        model = build_checkpoint(arch, pathlib.Path(tmp), **overrides)
        prompts = random_prompts([5, 30, 45], model.config.vocab_size, seed=4)
        want = [hf_greedy(model, p, 12) for p in prompts]
        for dtype in ("float32",):
            engine = LLMEngine(tmp, EngineConfig(device="cuda", dtype=dtype, num_kv_blocks=64, long_prefill_chunk=16, max_num_batched_tokens=64, max_model_len=max_len))
            got = [c.token_ids for c in engine.generate(prompts, GREEDY)]
            ok = got == want
            failures += not ok
            print(f"{arch:8s} {str(overrides)[:70]:72s} {dtype}: {'OK' if ok else 'MISMATCH'}", flush=True)
            if not ok:
                print("  got ", got, "\n  want", want)
# min_tokens on CUDA (sampler masks on the device)
with tempfile.TemporaryDirectory() as tmp:
    model = build_checkpoint("llama", pathlib.Path(tmp))
    (prompt,) = random_prompts([9], model.config.vocab_size, seed=21)
    greedy = hf_greedy(model, prompt, 10)
    at = next(i for i in range(1, 10) if greedy[i] not in greedy[:i])
    engine = LLMEngine(tmp, EngineConfig(device="cuda", dtype="float32", num_kv_blocks=64))
    (early,) = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[greedy[at]]))
    (held,) = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[greedy[at]], min_tokens=at + 3))
    ok = early.token_ids == greedy[: at + 1] and len(held.token_ids) >= at + 3 and held.token_ids[:at] == greedy[:at]
    failures += not ok
    print("min_tokens on cuda:", "OK" if ok else f"MISMATCH early={early.token_ids} held={held.token_ids} greedy={greedy}")
print("FAILURES", failures)
sys.exit(1 if failures else 0)
