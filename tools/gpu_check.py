"""Check and measure the engine's CUDA path against transformers on a GPU machine (no Ray or NIXL needed).

    python tools/gpu_check.py [--json out.json] [--sections decode,sampling,agreement,exactness,features,push,prefill]

1. Exactness: for each test architecture, random-weight checkpoints run through the engine on
   CUDA (float32, chunk sizes 7 and 64, several prompts batched) and through transformers'
   ``generate`` on CUDA; greedy tokens must be equal. bfloat16 reports the agreement rate.
2. Checkpoint features, float32, greedy against transformers on CUDA: attention and MLP
   biases, sliding windows (gather + SDPA on the GPU, prompts past the window), the yarn,
   dynamic and LongRoPE schedules, and min_tokens holding off a stop token.
3. The prefill actor's push rule: a step's KV, read right after an event recorded behind the
   step and synchronized (what ``PrefillWorker`` does before a NIXL push), equals the KV after a
   full device synchronization.
4. Decode: a decode step (engine.step(): scheduler, forward, greedy sampling) at context 600 on
   the SmolLM2-135M shape and a 1.5B-class shape (Qwen2-1.5B's dimensions on the Llama
   architecture), random bfloat16 weights, against transformers' eager forward with a static
   cache, both on the GPU: the engine as configured (FlashInfer and CUDA graphs where
   installed), FlashInfer without graphs, and SDPA without graphs. The fraction of HBM
   bandwidth a step reaches (weights plus the KV it reads, over the step time), against the
   bandwidth of a device-to-device copy measured in the same run and the card's nominal figure.
5. Sampling: the engine's sampler on a batch of 64 rows of the 1.5B shape's vocabulary (Qwen's
   defaults, top-k with top-p, top-p alone, temperature alone), tokens left on the device as an
   overlapped step leaves them and read after each call; and the device draws' distribution
   against the filters' exact one (section ``sampling``).
6. Agreement: bfloat16 greedy tokens of the FlashInfer engine (with graphs) against the SDPA
   engine and transformers, on the 135M shape.
7. Prefill: tokens/s of 8 prompts of 1024 tokens, the engine against transformers' SDPA forward.
8. Rotation: FlashInfer's fused in-place rotary embedding on strided q/k views against the
   float32 formula (section ``rope``, first: seconds).
9. Quantized caches: the Triton write and decode kernels (int8, fp8) against the torch write
   and dequantize + SDPA, and the 1.5B shape's batch-64 decode step with an fp8 cache through
   Triton and through SDPA (section ``quantized``).
10. The KV write: the one-launch Triton write of keys and values against two indexed stores,
   equal bytes and microseconds per layer, eager and from a graph (section ``kv_write``).
11. Overlapped steps (``async_scheduling``): greedy and FlashInfer-drawn tokens equal to steps
   run one at a time (section ``overlap``); the decode section times the variant ``overlapped``.
12. Where a 1.5B decode step's time goes: its attention alone per FlashInfer kernel and layout
   (``attention_kernels``, ``attention_fa3``), its projections alone per cuBLAS choice
   (``gemms``), and a profile of the step with the GPU's busy time per step (``profile``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
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

SHAPES = {
    "135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, max_position_embeddings=4096, rope_theta=100000.0, tie_word_embeddings=True),
    "1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, max_position_embeddings=4096, rope_theta=1000000.0, tie_word_embeddings=True),
}
NOMINAL_HBM_BYTES_S = {"H100": 3.35e12, "H200": 4.8e12}


def check_fused_rotation() -> dict:
    """FlashInfer's in-place rotation of strided q/k views of a qkv row (engine.fused_ops.rotate_qk_)
    against the rotation in float32, bfloat16 inputs; v untouched."""
    from engine import fused_ops
    from engine.config import RopeConfig
    from engine.rope import RotaryEmbedding

    heads, kv_heads, head_dim, tokens = 12, 2, 128, 64
    rotary = RotaryEmbedding(RopeConfig(theta=1000000.0), head_dim, 4096, torch.bfloat16, "cuda")
    tables = rotary.tables(torch.randint(0, 4096, (tokens,), device="cuda"))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda", dtype=torch.bfloat16)
    q, k, v = (x.view(tokens, -1, head_dim) for x in qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1))
    cos, sin = rotary.cos_sin_cache[tables.positions].chunk(2, dim=-1)
    want_q, want_k = RotaryEmbedding.rotate(q.float(), k.float(), cos.unsqueeze(1), sin.unsqueeze(1))
    want_v = v.clone()
    fused = fused_ops.rotate_qk_(q, k, tables)
    error = max(float((q.float() - want_q).abs().max()), float((k.float() - want_k).abs().max()))
    return {"fused": fused, "max_abs_error": error, "ok": fused and error < 0.05 and bool(torch.equal(v, want_v))}


def check_kv_write() -> dict:
    """The one-launch Triton KV write (engine.attention.triton_kv_write) against two indexed
    stores: equal bytes, and microseconds per layer at batch 64 of the 1.5B shape (2 KV heads of
    128), eager (host launch cost included) and replayed from a graph of 28 layers (device only);
    then the rotation fused into the write against FlashInfer's rotation and the write."""
    from engine.attention import triton_kv_write

    blocks, block_size, heads, dim, rows, layers = 512, 16, 2, 128, 64, 28
    cache = torch.zeros(blocks, layers, 2, block_size, heads, dim, dtype=torch.bfloat16, device="cuda")
    reference = cache.clone()
    qkv = torch.randn(rows, 16 * dim, dtype=torch.bfloat16, device="cuda")
    k, v = qkv[:, 12 * dim : 14 * dim].view(rows, heads, dim), qkv[:, 14 * dim :].view(rows, heads, dim)
    slot_blocks = torch.randperm(blocks, device="cuda")[:rows]
    slot_offsets = torch.randint(0, block_size, (rows,), device="cuda")

    def indexed():
        for layer in range(layers):
            reference[slot_blocks, layer, 0, slot_offsets] = k
            reference[slot_blocks, layer, 1, slot_offsets] = v

    def triton_write():
        for layer in range(layers):
            triton_kv_write.write_pair(k, v, cache[:, layer, 0], cache[:, layer, 1], slot_blocks, slot_offsets)

    result = {"equal": None}
    for name, fn in (("indexed", indexed), ("triton", triton_write)):
        result[f"{name}_eager_us_per_layer"] = cuda_seconds(fn, 3, 20) / layers * 1e6
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        result[f"{name}_graph_us_per_layer"] = cuda_seconds(graph.replay, 3, 50) / layers * 1e6
    result["equal"] = bool(torch.equal(cache, reference))
    result.update(_rotate_and_write(qkv, slot_blocks, slot_offsets, blocks, block_size, layers))
    result["ok"] = result["equal"] and result["rotate_and_write_ok"]
    return result


def _rotate_and_write(qkv: torch.Tensor, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor, blocks: int, block_size: int, layers: int) -> dict:
    """The rotation fused into the write (triton_kv_write.rotate_and_write_pair, what a layer
    runs on CUDA) against FlashInfer's rotation then the Triton write: the same q, k and cache
    up to a rounding (the same float32 formula, contracted differently), and microseconds per
    layer replayed from a graph of ``layers`` layers (the rotation in place each time)."""
    from engine import fused_ops
    from engine.attention import triton_kv_write
    from engine.config import RopeConfig
    from engine.rope import RotaryEmbedding

    rows, dim, heads, kv_heads = qkv.shape[0], 128, 12, 2
    rotary = RotaryEmbedding(RopeConfig(theta=1000000.0), dim, 4096, torch.bfloat16, "cuda")
    tables = rotary.tables(torch.randint(0, 4096, (rows,), device="cuda"))
    copies = {name: (qkv.clone(), torch.zeros(blocks, layers, 2, block_size, kv_heads, dim, dtype=torch.bfloat16, device="cuda")) for name in ("fused", "split")}

    def views(x):
        return (x[:, : heads * dim].view(rows, heads, dim), x[:, heads * dim : (heads + kv_heads) * dim].view(rows, kv_heads, dim),
                x[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim))

    def fused(layer_count: int = layers):
        x, cache = copies["fused"]
        for layer in range(layer_count):
            triton_kv_write.rotate_and_write_pair(*views(x), cache[:, layer, 0], cache[:, layer, 1], slot_blocks, slot_offsets, tables.positions, rotary.cos_sin_cache)

    def split(layer_count: int = layers):
        x, cache = copies["split"]
        for layer in range(layer_count):
            q, k, v = views(x)
            fused_ops.rotate_qk_(q, k, tables)
            triton_kv_write.write_pair(k, v, cache[:, layer, 0], cache[:, layer, 1], slot_blocks, slot_offsets)

    fused(1)
    split(1)
    torch.cuda.synchronize()
    qkv_error = float((copies["fused"][0].float() - copies["split"][0].float()).abs().max())
    cache_error = float((copies["fused"][1].float() - copies["split"][1].float()).abs().max())
    result = {"rotate_and_write_max_abs_diff": max(qkv_error, cache_error)}
    result["rotate_and_write_ok"] = result["rotate_and_write_max_abs_diff"] < 0.05
    result["rotate_and_write_graph_us_per_layer"] = graph_us(fused, repeats=10) / layers
    result["rope_then_write_graph_us_per_layer"] = graph_us(split, repeats=10) / layers
    return result


def check_quantized_kernels(workdir: Path) -> dict:
    """The Triton kernels for an int8/fp8 cache (engine.attention.triton_quantized) on the GPU:
    the write against the torch rules, decode attention against dequantize + SDPA, a decode
    step of the 1.5B shape with an fp8 cache through each (eager) and through the Triton kernels
    replayed from CUDA graphs, and the same greedy tokens replayed and eager."""
    from engine.attention.base import SeqSlice
    from engine.attention.block_tables import BlockTables
    from engine.attention.kv_write import write_quantized_torch
    from engine.attention.sdpa import SdpaBackend
    from engine.attention.triton_quantized import TritonQuantizedBackend
    from engine.config import ModelConfig
    from engine.kv_cache import KVCache
    from engine.speculation import SpeculativeConfig

    if not (workdir / "1.5b" / "config.json").exists():
        random_hf_model("1.5b", workdir / "1.5b")
        torch.cuda.empty_cache()
    model_config = ModelConfig.from_model_dir(workdir / "1.5b")
    result = {}
    for kind in ("int8", "fp8_e4m3"):
        caches = {name: KVCache(model_config, EngineConfig(device="cuda", kv_cache_dtype=kind, num_kv_blocks=64), torch.bfloat16) for name in ("triton", "sdpa")}
        sample = caches["sdpa"]
        heads, dim = sample.key_views[0].shape[2:]
        tables = BlockTables.holding([list(range(i * 8, i * 8 + 8)) for i in range(4)]).array
        slices = [SeqSlice(0, 100, 1, decode=True), SeqSlice(1, 60, 3, decode=True), SeqSlice(2, 0, 120), SeqSlice(3, 40, 50)]
        rows = sum(s.num_tokens for s in slices)
        generator = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(rows, model_config.num_heads, dim, device="cuda", generator=generator, dtype=torch.bfloat16)
        k, v = (torch.randn(rows, heads, dim, device="cuda", generator=generator, dtype=torch.bfloat16) * 3 for _ in range(2))
        context = torch.randn(64 * 16, heads, dim, device="cuda", generator=generator)
        for cache in caches.values():  # the same earlier context, written the torch way
            for view, scales in ((cache.key_views[0], cache.key_scales[0]), (cache.value_views[0], cache.value_scales[0])):
                write_quantized_torch(context, view, scales, torch.arange(64, device="cuda").repeat_interleave(16), torch.arange(16, device="cuda").repeat(64))
        out = {}
        for name, backend in (("triton", TritonQuantizedBackend("cuda", 16)), ("sdpa", SdpaBackend("cuda", 16))):
            cache = caches[name]
            meta = backend.build(slices, tables)
            out[name] = meta.forward(q, k, v, cache.key_views[0], cache.value_views[0], None, cache.key_scales[0], cache.value_scales[0]).float()
        differ = (caches["triton"].tensor != caches["sdpa"].tensor).float().mean().item()
        error = (out["triton"] - out["sdpa"]).abs().max().item()
        scale = out["sdpa"].abs().max().item()
        # Both outputs are bfloat16 rounded from float32 sums in different orders: two units in
        # the last place of the largest output is rounding, not a wrong kernel (the
        # H200 run of session 27: int8 0.0625 at outputs of magnitude 4 to 8, where a unit is 0.03125).
        result[kind] = {"write_bytes_differing": differ, "attention_max_abs_error": error, "output_max_abs": scale,
                        "ok": differ < 1e-3 and error <= 2 * 2.0 ** (math.floor(math.log2(scale)) - 7)}
    for name in ("triton", "sdpa"):
        result[f"fp8_decode_b64_{name}_ms"] = engine_decode_ms(workdir / "1.5b", 64, 600, 10, kv_cache_dtype="fp8_e4m3", attention_backend=name, cuda_graph_max_batch=0)
    # Replayed from CUDA graphs (the Triton kernels over fixed buffers), and the same greedy
    # tokens replayed and eager.
    result["fp8_decode_b64_triton_graphs_ms"] = engine_decode_ms(workdir / "1.5b", 64, 600, 10, kv_cache_dtype="fp8_e4m3", attention_backend="triton")
    prompts = random_prompts([9, 40, 17, 64, 3, 25, 33, 12], SHAPES["1.5b"]["vocab_size"], seed=8)
    replayed = replayed_and_eager(workdir / "1.5b", prompts, [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)] * len(prompts),
                                  num_kv_blocks=128, kv_cache_dtype="fp8_e4m3", attention_backend="triton")
    result["fp8_graphs"], result["fp8_eager"] = replayed["replayed"], replayed["eager"]
    result["fp8_graphs_equal_eager"] = replayed["equal"]
    # Speculative decoding's draft rows with an int8 cache: a sequence's rows share a block,
    # which a graph's quantized write cannot take (those steps run eagerly); the same tokens
    # with graphs on and off. Code-like prompts, so that n-gram drafts are proposed and accepted.
    repeating = [[7, 8, 9, 10, 11] * 6 + [7, 8], [20, 21, 22] * 9 + [20]] * 4
    speculative = replayed_and_eager(workdir / "1.5b", repeating, [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * len(repeating),
                                     num_kv_blocks=128, kv_cache_dtype="int8", attention_backend="triton",
                                     speculative=SpeculativeConfig(num_speculative_tokens=4))
    result["int8_speculative_graphs_equal_eager"] = speculative["equal"]
    result["ok"] = (result["int8"]["ok"] and result["fp8_e4m3"]["ok"] and result["fp8_graphs_equal_eager"] and result["fp8_graphs"]
                    and result["int8_speculative_graphs_equal_eager"])
    return result


def replayed_and_eager(path: Path, prompts: list, params: list, **config) -> dict:
    """Greedy bfloat16 generation with CUDA graphs and without, the engine otherwise ``config``'s:
    whether the tokens are equal, whether the first engine replays graphs at all (and the
    buckets it captured through adapters), whether the second runs eagerly. The prompts are
    prefilled in one step and then decode together: with a bucket's number of them, every
    decode step multiplies matrices of the same shapes both ways."""
    tokens, result = {}, {}
    for graphs in (True, False):
        engine = LLMEngine(path, EngineConfig(device="cuda", dtype="bfloat16", max_num_batched_tokens=2048, **config,
                                              **({} if graphs else {"cuda_graph_max_batch": 0})))
        tokens[graphs] = [o.token_ids for o in engine.generate(prompts, params)]
        captured = engine.runner.graphs
        if graphs:
            result["replayed"], result["adapter_graphs"] = captured is not None, sorted(captured.adapter_graphs) if captured is not None else []
        else:
            result["eager"] = captured is None
        engine.runner.graphs = None
        del engine, captured
        torch.cuda.empty_cache()
    result["equal"] = tokens[True] == tokens[False]
    return result


def random_hf_model(shape: str, directory: Path):
    """transformers' Llama with ``shape``'s dimensions and random weights, saved as a bfloat16 checkpoint."""
    import transformers

    config = transformers.LlamaConfig(**SHAPES[shape])
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(directory)
    return model


def cuda_seconds(fn, warmup: int, repeats: int) -> float:
    """Seconds per call of ``fn`` on the GPU, after ``warmup`` calls, the device synchronized around."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy (read + write counted), the practical HBM ceiling."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / cuda_seconds(lambda: dst.copy_(src), 3, 10)


def engine_decode_ms(path: Path, batch: int, context: int, steps: int, **overrides) -> float:
    """Mean ms of an engine.step() at ``batch`` sequences decoding from ``context`` (KV taken as cached)."""
    from engine import fused_ops
    from engine.attention import flashinfer_paged

    fused_ops.ENABLED = overrides.pop("fused_ops", True)
    flashinfer_paged.DECODE_SPLIT_KV = overrides.pop("decode_split_kv", True)
    try:
        return _engine_decode_ms(path, batch, context, steps, **overrides)
    finally:
        fused_ops.ENABLED = True
        flashinfer_paged.DECODE_SPLIT_KV = True


@contextlib.contextmanager
def _host_phases(engine, totals: dict):
    """Time the host's phases of the engine's steps into ``totals`` (seconds, by phase): what a
    step's host work is made of, and how long the host waits for the step in flight (``wait``:
    reading its tokens). An overlapped step whose host works longer than the GPU computes leaves
    the GPU idle: the wait is then near zero."""
    from engine import overlap

    def wrap(owner, name, label):
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[label] = totals.get(label, 0.0) + time.perf_counter() - started
        setattr(owner, name, timed)
        return fn

    wrapped = [(owner, name, wrap(owner, name, label)) for owner, name, label in (
        (engine.scheduler, "schedule", "schedule"), (engine.runner, "prepare", "inputs"), (engine.runner, "run", "forward_launch"),
        (engine.sampler, "sample_on_device", "sample_launch"), (engine.sampler, "sample", "sample_and_wait"),
        (engine.scheduler, "resolve", "update"), (engine.scheduler, "update", "update"), (overlap.InFlightStep, "read", "wait"),
    )]
    try:
        yield totals
    finally:
        for owner, name, fn in wrapped:
            if owner is overlap.InFlightStep:
                setattr(owner, name, fn)
            else:
                delattr(owner, name)  # the instance's wrapper: the class's method again


def _engine_decode_ms(path: Path, batch: int, context: int, steps: int, profile: Path | None = None, lora_names: list[str | None] | None = None,
                      sampling: SamplingParams | None = None, host_phases: dict | None = None, **overrides) -> float:
    from engine.bench import seat_decoding

    block = overrides.get("block_size", 16)
    blocks = batch * (-(-(context + steps + 16) // block)) + 16
    engine = LLMEngine(path, EngineConfig(device="cuda", dtype="bfloat16", num_kv_blocks=blocks, max_num_seqs=batch,
                                          max_num_batched_tokens=max(2048, batch), max_model_len=context + steps + 64, **overrides))
    seat_decoding(engine, batch, context, steps + 16, lora_names, sampling)
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / steps * 1e3
    if host_phases is not None:
        totals: dict[str, float] = {}
        with _host_phases(engine, totals):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
            total = time.perf_counter() - start
        host_phases.update({name: round(seconds / steps * 1e3, 4) for name, seconds in totals.items()})
        host_phases["step"] = round(total / steps * 1e3, 4)
        host_phases["rest"] = round((total - sum(totals.values())) / steps * 1e3, 4)
    if profile is not None:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                engine.step()
            torch.cuda.synchronize()
        averages = prof.key_averages()
        profile.write_text(averages.table(sort_by="self_cpu_time_total", row_limit=25) + "\n" + averages.table(sort_by="self_cuda_time_total", row_limit=25))
        # The GPU's busy time per step against the step's: what a step loses to gaps between
        # kernels and to the host.
        profile.with_suffix(".json").write_text(json.dumps({"step_ms": elapsed, **device_time_split(averages, 5)}))
    engine.runner.graphs = None
    del engine
    torch.cuda.empty_cache()
    return elapsed


KERNEL_KINDS = (  # by kernel name, first match: what a step's device time went to
    # FlashInfer's attention kernels (its norms and activations are flashinfer:: too: other),
    # torch SDPA's flash and memory-efficient ones; first, as some carry cutlass:: in their names.
    ("attention", ("batchdecode", "batchprefill", "singleprefill", "mergestate", "flash_fwd", "fmha")),
    ("gemm", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas")),
    ("copies", ("memcpy", "memset")),
)


def device_time_split(averages, steps: int) -> dict:
    """A profile's device time per step (kernels and copies, one stream), in all and by kind
    (``KERNEL_KINDS``; the rest is norms, activations, rotation, KV writes, sampling)."""
    from torch.autograd import DeviceType

    split = {"device_busy_ms_per_step": 0.0}
    for event in averages:
        if event.device_type != DeviceType.CUDA:
            continue
        name = event.key.lower()
        kind = next((kind for kind, marks in KERNEL_KINDS if any(mark in name for mark in marks)), "other")
        ms = event.self_device_time_total / steps / 1e3
        split["device_busy_ms_per_step"] += ms
        split[f"{kind}_ms_per_step"] = split.get(f"{kind}_ms_per_step", 0.0) + ms
    return {k: round(v, 4) for k, v in split.items()}


def transformers_decode_ms(model, batch: int, context: int, steps: int) -> float:
    """Mean ms of transformers' eager forward of one token per row with a static cache."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_batch_size=batch, max_cache_len=context + steps + 8, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(3, model.config.vocab_size, (batch, context), device="cuda")
    with torch.inference_mode():
        out = model(ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(context, device="cuda"))
        token = out.logits[:, -1:].argmax(-1)
        for step in range(3 + steps):
            if step == 3:
                torch.cuda.synchronize()
                start = time.perf_counter()
            out = model(token, past_key_values=cache, use_cache=True, cache_position=torch.tensor([context + step], device="cuda"))
            token = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / steps * 1e3
    del cache, out
    torch.cuda.empty_cache()
    return elapsed


def decode_bytes(model, batch: int, context: int) -> int:
    """What a decode step must read: every weight once (the tied head counted once) and each row's KV."""
    config = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    head_dim = config.hidden_size // config.num_attention_heads
    kv = batch * context * config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 2
    return weights + kv


def bench_decode(workdir: Path, shape: str, batches: list[int], variants: dict[str, dict], context: int = 600, steps: int = 20) -> list[dict]:
    path = workdir / shape
    model = random_hf_model(shape, path)
    rows = []
    for batch in batches:
        row = {"shape": shape, "batch": batch, "context": context, "transformers_ms": transformers_decode_ms(model, batch, context, steps)}
        for name, overrides in variants.items():
            try:
                row[f"{name}_ms"] = engine_decode_ms(path, batch, context, steps, **overrides)
                row[f"{name}_vs_transformers"] = row["transformers_ms"] / row[f"{name}_ms"]
            except Exception as exc:  # one variant failing still reports the others
                row[f"{name}_error"] = repr(exc)[-500:]
        best = min((row[k] for k in row if k.endswith("_ms") and k != "transformers_ms"), default=None)
        if best:
            row["hbm_bytes_s"] = decode_bytes(model, batch, context) / (best / 1e3)
        print(json.dumps(row), flush=True)
        rows.append(row)
    del model
    torch.cuda.empty_cache()
    return rows


def bench_sampling(batch: int = 64) -> dict:
    """The sampler's cost for ``batch`` rows of the 1.5B shape's vocabulary on the GPU, per set of
    parameters: ``_ms``, what an overlapped step pays (``sample_on_device``: tokens left on the
    device, calls queued back to back), and ``_read_ms``, a step run one at a time (``sample``:
    the tokens read by the host after each call); seeded rows draw on the device too, keyed by
    seed and position (a top-k row's uniform made on the host, whole rows by ``keyed_race``
    together). Then the draws' distribution (``check_device_draws``)."""
    from engine.sampler import Sampler
    from engine.sequence import Sequence

    vocab = SHAPES["1.5b"]["vocab_size"]
    sampler = Sampler(seed=0)
    logits = torch.randn(batch, vocab, device="cuda") * 4
    cases = {
        "qwen_defaults": SamplingParams(temperature=0.7, top_p=0.8, top_k=20, max_tokens=100),
        "top_p_top_k": SamplingParams(temperature=0.8, top_p=0.95, top_k=50, max_tokens=100),
        "top_p": SamplingParams(temperature=0.8, top_p=0.95, max_tokens=100),
        "temperature_only": SamplingParams(temperature=0.8, max_tokens=100),
    }
    result = {"batch": batch, "vocab": vocab}
    for name, params in cases.items():
        seqs = [Sequence(f"{name}{i}", [1, 2, 3], 3, params) for i in range(batch)]
        result[name + "_ms"] = cuda_seconds(lambda seqs=seqs: sampler.sample_on_device(logits, seqs), 3, 20) * 1e3
        result[name + "_read_ms"] = cuda_seconds(lambda seqs=seqs: sampler.sample(logits, seqs), 3, 20) * 1e3
    for name in ("top_p_top_k", "top_p"):
        # As the engine makes a seeded request's sequence: the seed in its parameters (draw_key reads it there) and a generator from it.
        seeded = [Sequence(f"z{i}", [1, 2, 3], 3, dataclasses.replace(cases[name], seed=i), generator=Sampler.make_generator(i)) for i in range(batch)]
        result[f"{name}_seeded_ms"] = cuda_seconds(lambda seeded=seeded: sampler.sample_on_device(logits, seeded), 3, 20) * 1e3
        result[f"{name}_seeded_read_ms"] = cuda_seconds(lambda seeded=seeded: sampler.sample(logits, seeded), 3, 20) * 1e3
    result["kernels_us"] = sampling_kernel_us(logits)
    result["draws"] = check_device_draws()
    result["penalties"] = check_fused_penalties(batch, vocab)
    result["top_k_draws"] = check_fused_top_k_draws(batch, vocab)
    result["ok"] = result["draws"]["ok"] and result["penalties"]["ok"] and result["top_k_draws"]["ok"]
    return result


def check_fused_top_k_draws(batch: int, vocab: int) -> dict:
    """Top-k rows' filters and draw in one launch (engine.triton_sampling) against the torch ops,
    on ``batch`` rows of ``vocab`` with Qwen2.5's defaults: the tokens picked for the same
    candidates and uniforms (equal but where a uniform falls within rounding of a boundary: the
    kernel sums in another order), and the milliseconds per call each way, ``topk`` included."""
    from engine.sampler import _inverse_cdf_no_sync, _top_k_candidates
    from engine.triton_sampling import draw_among_top_k

    generator = torch.Generator(device="cuda").manual_seed(1)
    params = [SamplingParams(temperature=0.7, top_k=20, top_p=0.8)] * batch
    logits = torch.randn(batch, vocab, device="cuda", generator=generator) * 4
    uniforms = torch.rand(batch, device="cuda", dtype=torch.float64, generator=generator)

    def torch_ops():
        probs, candidates = _top_k_candidates(logits, params)
        return candidates.gather(1, _inverse_cdf_no_sync(probs, uniforms).unsqueeze(1)).squeeze(1)

    def fused():  # topk too, as the torch ops take it inside _top_k_candidates
        top, ids = logits.topk(20, dim=-1)
        return draw_among_top_k(top, ids, [0.7] * batch, [20] * batch, [0.8] * batch, [0.0] * batch, uniforms)

    equal = int((torch_ops() == fused()).sum())
    return {"rows": batch, "equal_picks": equal, "torch_ms": round(cuda_seconds(torch_ops, 3, 20) * 1e3, 4),
            "fused_ms": round(cuda_seconds(fused, 3, 20) * 1e3, 4), "ok": equal >= batch - 1}


def check_fused_penalties(batch: int, vocab: int, context: int = 600) -> dict:
    """The penalties in one Triton launch (engine.triton_penalties) against the torch ops over
    whole rows, on ``batch`` rows of ``vocab`` with histories of ``context`` tokens: equal logits
    after a step that folds in the step in flight's tokens (repetition alone, as Qwen2.5's
    defaults: exactly; with frequency, within the rounding of a contracted multiply-subtract), equal
    histories, and the milliseconds per call each way (the host's launches included, as an
    overlapped step pays them)."""
    from engine.model_runner import PendingSamples
    from engine.penalties import PenaltyHistory
    from engine.sequence import Sequence

    generator = torch.Generator(device="cuda").manual_seed(0)
    result = {"ok": True}
    for name, params in {"repetition": SamplingParams(temperature=0.7, repetition_penalty=1.05, max_tokens=100),
                         "all_three": SamplingParams(temperature=0.7, repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.2, max_tokens=100)}.items():
        histories = {"fused": PenaltyHistory(whole_rows=True, fused=True), "torch": PenaltyHistory(whole_rows=True, fused=False)}
        seqs = [Sequence(f"p{i}", [(7 * i + j) % 5000 for j in range(context)], context - 50, params) for i in range(batch)]
        logits = torch.randn(batch, vocab, device="cuda", generator=generator) * 4
        sampled = torch.randint(0, vocab, (batch,), device="cuda", generator=generator)
        for seq in seqs:
            seq.num_pending_tokens = 1
        pending = PendingSamples(sampled, {id(seq): row for row, seq in enumerate(seqs)})
        got = {way: history.apply(logits, seqs, pending) for way, history in histories.items()}
        exact = torch.equal(got["fused"], got["torch"])
        close = torch.allclose(got["fused"], got["torch"], rtol=1e-6, atol=1e-6)
        same_history = all(torch.equal(getattr(histories["fused"], slab), getattr(histories["torch"], slab)) for slab in ("seen", "output_counts"))
        for seq in seqs:
            seq.num_pending_tokens = 0
        entry = {"exact": exact, "close": close, "same_history": same_history}
        for way, history in histories.items():
            entry[f"{way}_ms"] = round(cuda_seconds(lambda history=history: history.apply(logits, seqs), 3, 20) * 1e3, 4)
        result[name] = entry
        result["ok"] = result["ok"] and same_history and (exact if name == "repetition" else close)
    return result


def graph_us(fn, repeats: int = 20) -> float:
    """Microseconds of GPU time per call of ``fn``: ``repeats`` calls captured in one CUDA graph
    and replayed, so the host's launches do not count (a step overlapped with the next one's
    launches pays the GPU time)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e6


def bench_sampled_steps(workdir: Path, batch: int = 64, context: int = 600) -> dict:
    """The 1.5B shape's decode step at ``batch`` (overlapped, graphs) greedy and with each
    sampler setting of ``bench_sampling``: a draw's share of a step is what it adds to one."""
    path = workdir / "1.5b"
    if not (path / "config.json").exists():
        random_hf_model("1.5b", path)
        torch.cuda.empty_cache()
    settings = {
        "greedy": SamplingParams(temperature=0.0),
        "top_p": SamplingParams(temperature=0.8, top_p=0.95),
        "top_p_top_k": SamplingParams(temperature=0.8, top_p=0.95, top_k=50),
        "qwen_defaults": SamplingParams(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05),
    }
    result = {name: _engine_decode_ms(path, batch, context, 20, sampling=params) for name, params in settings.items()}
    for name in settings:
        result[name + "_share"] = (result[name] - result["greedy"]) / result[name]
    return result


def bench_attention_kernels_by_page(batch: int = 64, context: int = 600, blocks: tuple[int, ...] = (16, 32, 64)) -> dict:
    """``bench_attention_kernels`` at each page (block) size: a step's attention reads its KV a
    page at a time, and pages of 16 tokens (the engine's default, vLLM's too) may cost FlashInfer
    more page-table reads and smaller loads than a larger block would (``decode`` times the
    whole step with ``--variants block32,block64``)."""
    return {f"page_{block}": bench_attention_kernels(batch, context, block=block) for block in blocks}


def bench_attention_kernels(batch: int = 64, context: int = 600, backends: tuple[str, ...] = ("fa2",), block: int = 16) -> dict:
    """The 1.5B shape's decode attention alone (12 query heads, 2 KV heads of 128, pages of
    ``block`` tokens, ``batch`` sequences of ``context`` tokens), one layer's call timed in CUDA graphs, for each
    way FlashInfer offers to run it: its CUDA-core decode kernel, its tensor-core one (the
    engine's choice at 6 query heads per KV head) with and without splitting the KV, and the
    engine's cache layout ([blocks, block, KV heads, dim], passed as a strided HND view) against
    a contiguous HND cache. Each with the KV bytes it reads per second: what a decode step's
    attention could reach."""
    import flashinfer

    from engine.attention.flashinfer_paged import WORKSPACE_BYTES, PagedTables

    heads, kv_heads, dim = 12, 2, 128
    pages_per_seq = -(-context // block)
    num_pages = batch * pages_per_seq + 1
    generator = torch.Generator(device="cuda").manual_seed(0)
    engine_layout = [torch.randn(num_pages, block, kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=generator) for _ in range(2)]
    contiguous = [t.transpose(1, 2).contiguous() for t in engine_layout]
    layouts = {"engine_layout": tuple(t.transpose(1, 2) for t in engine_layout), "contiguous_hnd": tuple(contiguous)}
    order = torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(1)).numpy().reshape(batch, pages_per_seq)
    tables = PagedTables.of(order, np.full(batch, context, dtype=np.int64), block)
    q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16, generator=generator)
    out = torch.empty_like(q)
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    kv_bytes = 2 * batch * context * kv_heads * dim * 2
    result = {"kv_bytes": kv_bytes}
    variants = {}
    if "fa2" in backends:
        variants = {"cuda_cores": (False, "fa2", {}), "tensor_cores": (True, "fa2", {}), "tensor_cores_no_split": (True, "fa2", {"disable_split_kv": True})}
    variants.update({f"tensor_cores_{b}": (True, b, {}) for b in backends if b != "fa2"})
    reference = None
    for name, (tensor_cores, backend, plan_options) in variants.items():
        for layout, paged in layouts.items():
            key = f"{name}/{layout}"
            try:
                wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    workspace, "HND", use_cuda_graph=True, use_tensor_cores=tensor_cores, backend=backend,
                    paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32, device="cuda"),
                    paged_kv_indices_buffer=torch.zeros(tables.indices.numel(), dtype=torch.int32, device="cuda"),
                    paged_kv_last_page_len_buffer=torch.zeros(batch, dtype=torch.int32, device="cuda"),
                )
                wrapper.plan(tables.indptr, tables.indices, tables.last_page_len, heads, kv_heads, dim, block,
                             q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, **plan_options)
                wrapper.run(q, paged, out=out)
                got = out.float().clone()
                reference = got if reference is None else reference
                micros = graph_us(lambda: wrapper.run(q, paged, out=out), repeats=50)
                result[key] = {"us": round(micros, 2), "tb_s": round(kv_bytes / micros / 1e6, 2),
                               "max_abs_diff_vs_first": float((got - reference).abs().max())}
            except Exception as error:
                result[key] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
                try:
                    torch.cuda.synchronize()
                except Exception:  # a broken capture can leave the device erroring: the next variant says so
                    pass
    return result


def bench_gemms(rows: tuple[int, ...] = (1, 64)) -> dict:
    """The 1.5B shape's projections alone (bfloat16, ``rows`` tokens), each timed in CUDA graphs
    as the engine calls it (``F.linear``: cuBLAS's pick), with cuBLASLt preferred, and with the
    operands swapped (weight times activations transposed): microseconds and the weight bytes
    read per second. The small ones (q|k|v, o_proj) ran at about 1 TB/s in a decode step's
    profile on an H200: is a better kernel a library setting away?"""
    import torch.nn.functional as F

    shape = SHAPES["1.5b"]
    hidden, inter, heads, kv_heads = shape["hidden_size"], shape["intermediate_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    dim = hidden // heads
    projections = {"qkv_proj": ((heads + 2 * kv_heads) * dim, hidden), "o_proj": (hidden, hidden), "gate_up_proj": (2 * inter, hidden),
                   "down_proj": (hidden, inter), "lm_head": (shape["vocab_size"], hidden)}
    generator = torch.Generator(device="cuda").manual_seed(0)
    result = {}
    default_library = torch.backends.cuda.preferred_blas_library()
    for name, (out_features, in_features) in projections.items():
        weight = torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16, generator=generator)
        for count in rows:
            x = torch.randn(count, in_features, device="cuda", dtype=torch.bfloat16, generator=generator)
            entry = {}
            for variant in ("linear", "cublaslt", "swapped"):
                call = (lambda: torch.mm(weight, x.t())) if variant == "swapped" else (lambda: F.linear(x, weight))
                try:
                    torch.backends.cuda.preferred_blas_library("cublaslt" if variant == "cublaslt" else default_library)
                    micros = graph_us(call, repeats=50)
                    entry[variant] = {"us": round(micros, 2), "tb_s": round(weight.numel() * 2 / micros / 1e6, 2)}
                except Exception as error:
                    entry[variant] = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
                finally:  # the sections after this one run on the default library
                    torch.backends.cuda.preferred_blas_library(default_library)
            result[f"{name}/{count}"] = entry
        del weight
    return result


def _top_k_by_slices(logits: torch.Tensor, k: int, slice_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k in two stages (each slice's, then among those): an alternative to torch.topk's one
    block per row, timed against it (on an H200, session 27: 284 us against 165 at 64 x 152k, so
    the sampler keeps torch.topk)."""
    rows, width = logits.shape
    end = width // slice_width * slice_width
    values, ids = logits[:, :end].reshape(rows, -1, slice_width).topk(k, dim=-1)
    ids += torch.arange(0, end, slice_width, device=logits.device).unsqueeze(1)
    values, ids = values.reshape(rows, -1), ids.reshape(rows, -1)
    if end < width:
        tail_values, tail_ids = logits[:, end:].topk(min(k, width - end), dim=-1)
        values, ids = torch.cat([values, tail_values], dim=1), torch.cat([ids, tail_ids + end], dim=1)
    top, where = values.topk(k, dim=-1)
    return top, ids.gather(1, where)


def sampling_kernel_us(logits: torch.Tensor) -> dict:
    """The GPU time of each piece a draw is made of, for ``logits`` [rows, vocab] float32:
    torch.topk over whole rows against two stages at several slice widths, FlashInfer's softmax with temperatures and its draws over the probabilities: what the
    sampler's paths are made of. (Not FlashInfer's top-k kernels: their radix module's JIT build
    did not finish in 9 minutes on an H200, session 22.)"""
    import flashinfer.sampling as fs

    rows = logits.shape[0]
    temperatures = torch.full((rows,), 0.8, device="cuda")
    top_p = torch.full((rows,), 0.95, device="cuda")
    probs = fs.softmax(logits, temperature=temperatures)
    cases = {"torch_topk_50": lambda: logits.topk(50, dim=-1), "torch_topk_20": lambda: logits.topk(20, dim=-1)}
    for width in (1024, 4096, 16384):
        cases[f"two_stage_topk_50_slice_{width}"] = lambda width=width: _top_k_by_slices(logits, 50, width)
    cases.update({
        "flashinfer_softmax_temperature": lambda: fs.softmax(logits, temperature=temperatures),
        "flashinfer_top_p_from_probs": lambda: fs.top_p_sampling_from_probs(probs, top_p, seed=1, offset=0),
        "flashinfer_sampling_from_probs": lambda: fs.sampling_from_probs(probs, seed=1, offset=0),
        "flashinfer_top_p_from_probs_nondeterministic": lambda: fs.top_p_sampling_from_probs(probs, top_p, deterministic=False, seed=1, offset=0),
        "torch_softmax": lambda: torch.softmax(logits, dim=-1),
        "torch_argmax": lambda: logits.argmax(dim=-1),
    })
    want = logits.topk(50, dim=-1).values
    result = {"two_stage_equal": bool(torch.equal(_top_k_by_slices(logits, 50, 4096)[0], want))}
    for name, fn in cases.items():
        try:
            result[name] = round(graph_us(fn), 1)
        except Exception as error:  # a piece that cannot be captured is timed with the host's launches
            torch.cuda.synchronize()
            result[name] = round(cuda_seconds(fn, 3, 20) * 1e6, 1)
            result[name + "_not_captured"] = str(error)[:200]
    return result


def check_device_draws(draws: int = 100_000) -> dict:
    """Unseeded rows drawn on the GPU (Sampler._draw_on_device: top-k rows among their candidates,
    the others through FlashInfer's softmax and top-p or min-p kernels) against the filters' exact
    distribution (the tests' reference: a full sort), ``draws`` rows at once: no token outside it,
    each token's frequency within 5 standard errors (+ 0.001)."""
    from engine.sampler import Sampler
    from tests.sampling_reference import reference_filtered

    generator = torch.Generator().manual_seed(21)
    logits = torch.randn(256, generator=generator, dtype=torch.float64) * 3
    cases = {
        "qwen_defaults": SamplingParams(temperature=0.7, top_p=0.8, top_k=20),
        "top_k_min_p": SamplingParams(temperature=1.3, top_k=40, min_p=0.05),
        "top_p": SamplingParams(temperature=0.9, top_p=0.9),
        "min_p": SamplingParams(temperature=1.1, min_p=0.1),  # FlashInfer's min-p kernel
        "top_p_min_p": SamplingParams(temperature=0.8, top_p=0.7, min_p=0.05),  # its top-p renormalization, then min-p
        "temperature_only": SamplingParams(temperature=1.2),
    }
    result = {}
    # Seeded rows (keyed: engine.sampler.keyed_race over FlashInfer's filtered rows), each its own key.
    keyed = {"top_p_keyed": cases["top_p"], "top_p_min_p_keyed": cases["top_p_min_p"], "min_p_keyed": cases["min_p"], "temperature_only_keyed": cases["temperature_only"]}
    for name, params in {**cases, **keyed}.items():
        want = reference_filtered(logits, params)
        keys = list(range(10**6, 10**6 + draws)) if name.endswith("_keyed") else None
        tokens = Sampler(seed=1)._draw_on_device(logits.float().cuda().repeat(draws, 1), [params] * draws, keys)
        counts = torch.bincount(tokens.cpu(), minlength=256).double()
        freq = counts / draws
        error = (freq - want).abs() / torch.sqrt(want * (1 - want) / draws).clamp_min(1e-12)
        inside = bool(counts[want == 0].sum() == 0)
        close = bool(torch.all((freq - want).abs() <= 5 * torch.sqrt(want * (1 - want) / draws) + 1e-3))
        result[name] = {"outside_support": not inside, "max_standard_errors": float(error[want > 0].max()),
                        "total_variation": float(0.5 * (freq - want).abs().sum()), "ok": inside and close}
    result["keyed_rows_152k"] = check_keyed_rows_repeat()
    result["ok"] = all(v["ok"] for v in result.values())
    return result


def check_keyed_rows_repeat(rows: int = 64) -> dict:
    """Seeded rows of the 1.5B shape's vocabulary drawn on the device (top-p, some with min-p or
    top_p 1): the same tokens drawn twice, and with the rows in another order (a row's draw is
    its probabilities' and its key's); and how many stay the same in a batch of half the size,
    where FlashInfer's softmax may round differently (reported, not required)."""
    from engine.sampler import Sampler

    generator = torch.Generator(device="cuda").manual_seed(12)
    logits = torch.randn(rows, SHAPES["1.5b"]["vocab_size"], device="cuda", generator=generator) * 4
    params = [SamplingParams(temperature=0.8, top_p=[0.9, 1.0, 0.7][i % 3], min_p=0.02 if i % 4 == 0 else 0.0) for i in range(rows)]
    keys = [10**9 + 17 * i for i in range(rows)]
    sampler = Sampler(seed=2)
    first = sampler._draw_on_device(logits, params, keys).tolist()
    again = sampler._draw_on_device(logits, params, keys).tolist()
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(3)).tolist()
    shuffled = sampler._draw_on_device(logits[order], [params[i] for i in order], [keys[i] for i in order]).tolist()
    half = sampler._draw_on_device(logits[: rows // 2], params[: rows // 2], keys[: rows // 2]).tolist()
    result = {"repeat": first == again, "reordered": all(shuffled[j] == first[i] for j, i in enumerate(order)),
              "same_in_half_batch": sum(a == b for a, b in zip(half, first)) / len(half)}
    result["ok"] = result["repeat"] and result["reordered"]
    return result


def check_agreement(workdir: Path) -> dict:
    """bfloat16 greedy tokens: FlashInfer (graphs on) against SDPA, and each against transformers."""
    path = workdir / "agreement"
    model = random_hf_model("135m", path)
    prompts = random_prompts([17, 100, 300, 640, 5, 64, 250, 33], SHAPES["135m"]["vocab_size"], seed=9)
    want = [_hf_greedy_cuda(model, p, 24) for p in prompts]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    got = {}
    for name, overrides in {"flashinfer": {"attention_backend": "flashinfer"}, "sdpa": {"attention_backend": "sdpa", "cuda_graph_max_batch": 0}}.items():
        engine = LLMEngine(path, EngineConfig(device="cuda", dtype="bfloat16", num_kv_blocks=512, max_num_batched_tokens=256, long_prefill_chunk=96, **overrides))
        got[name] = [c.token_ids for c in engine.generate(prompts, params)]
        assert engine.num_free_blocks == engine.kv_cache.num_blocks, "blocks leaked"
        got[name + "_graphs_captured"] = sorted(engine.runner.graphs.graphs) if engine.runner.graphs else []

    def agree(a, b):
        return sum(x == y for p, q in zip(a, b) for x, y in zip(p, q)) / sum(len(p) for p in b)

    return {"flashinfer_vs_sdpa": agree(got["flashinfer"], got["sdpa"]), "flashinfer_vs_transformers": agree(got["flashinfer"], want),
            "sdpa_vs_transformers": agree(got["sdpa"], want), "graphs_captured": got["flashinfer_graphs_captured"]}


def check_overlap(workdir: Path) -> dict:
    """Overlapped steps (async_scheduling, engine.overlap) against steps run one at a time, both
    FlashInfer with graphs, bfloat16, the 135M shape: the same greedy tokens (and logprobs) and the same
    FlashInfer-drawn tokens (unseeded top-k/top-p: the engine's generator seeds each step's draw
    alike; seeded top-p: keyed by seed and position), every block back, and steps launched before the last one's tokens were read."""
    path = workdir / "overlap"
    if not (path / "config.json").exists():
        random_hf_model("135m", path)
        torch.cuda.empty_cache()
    prompts = random_prompts([17, 100, 300, 640, 5, 64, 250, 33], SHAPES["135m"]["vocab_size"], seed=11)
    result = {}
    for kind, params in (("greedy", SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=2)),
                         ("sampled", SamplingParams(max_tokens=48, temperature=0.8, top_k=50, top_p=0.9, ignore_eos=True)),
                         # Seeded, without top-k: each row's FlashInfer call keyed by seed and position.
                         ("seeded", SamplingParams(max_tokens=48, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)),
                         # Qwen2.5-Instruct's generation_config: penalties counted on the device.
                         ("qwen_defaults", SamplingParams(max_tokens=48, temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05, ignore_eos=True))):
        tokens = {}
        for overlap in (False, True):
            engine = LLMEngine(path, EngineConfig(device="cuda", dtype="bfloat16", num_kv_blocks=512, max_num_batched_tokens=256,
                                                  long_prefill_chunk=96, async_scheduling=overlap, seed=5))
            launched = []
            if overlap:
                run = engine._run_overlapped
                engine._run_overlapped = lambda batch: launched.append(1) or run(batch)
            tokens[overlap] = [(c.token_ids, [(lp.token_id, lp.logprob, lp.rank, lp.top) for lp in c.logprobs]) for c in engine.generate(prompts, params)]
            assert engine.num_free_blocks == engine.kv_cache.num_blocks, "blocks leaked"
            if overlap:
                result[f"{kind}_steps_overlapped"] = len(launched)
            del engine
            torch.cuda.empty_cache()
        result[f"{kind}_equal"] = tokens[True] == tokens[False]
    kinds = ("greedy", "sampled", "seeded", "qwen_defaults")
    result["ok"] = all(result[f"{kind}_equal"] and result[f"{kind}_steps_overlapped"] > 40 for kind in kinds)
    return result


def check_prefill_without_logits(workdir: Path) -> dict:
    """A prompt longer than a step's token budget, bfloat16 with the fused kernels: its first
    chunks end mid-prompt, so those steps need no logits and the final norm gets no rows (FlashInfer's
    norm refused such a launch: the 1P+1D serve check of session 27 lost its long prompts to it)."""
    path = workdir / "overlap"
    if not (path / "config.json").exists():
        random_hf_model("135m", path)
        torch.cuda.empty_cache()
    prompts = random_prompts([300, 200], SHAPES["135m"]["vocab_size"], seed=3)
    engine = LLMEngine(path, EngineConfig(device="cuda", dtype="bfloat16", num_kv_blocks=128, max_num_batched_tokens=64, long_prefill_chunk=64))
    outputs = engine.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    result = {"tokens": [len(o.token_ids) for o in outputs], "blocks_back": engine.num_free_blocks == engine.kv_cache.num_blocks}
    result["ok"] = result["tokens"] == [4, 4] and result["blocks_back"]
    return result


def check_stage_chunks() -> dict:
    """A pipeline stage's activations handed on over Ray (the next stage has no NIXL inbox for
    them: a prompt past its slots, or every slot taken) leave GPU memory as host arrays and come
    back onto the GPU, bit for bit (they once could not leave it: ``.numpy()`` of a CUDA tensor)."""
    from engine.model import StageActivations
    from workers.pipeline import StageChunk

    hidden = torch.randn(7, 64, dtype=torch.bfloat16, device="cuda")
    residual = torch.randn_like(hidden)
    back = StageChunk.of("r", 1, 0, StageActivations(hidden, residual), skip=2).activations("cuda")
    ok = back.hidden.is_cuda and back.residual.is_cuda and torch.equal(back.hidden, hidden[2:]) and torch.equal(back.residual, residual[2:])
    return {"ok": bool(ok)}


def bench_prefill(workdir: Path, shape: str = "1.5b", prompts: int = 8, length: int = 1024) -> dict:
    path = workdir / shape
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    ids = torch.randint(3, model.config.vocab_size, (prompts, length), device="cuda")
    with torch.inference_mode():
        theirs = prompts * length / cuda_seconds(functools.partial(model, ids, use_cache=False, logits_to_keep=1), 2, 3)
    del model
    torch.cuda.empty_cache()
    engine = LLMEngine(path, EngineConfig(device="cuda", dtype="bfloat16", num_kv_blocks=prompts * length // 16 + 64, max_num_batched_tokens=prompts * length,
                                          long_prefill_chunk=length, max_num_seqs=prompts, enable_prefix_caching=False))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    token_lists = ids.tolist()
    ours = prompts * length / cuda_seconds(lambda: engine.generate(token_lists, params), 1, 3)
    result = {"shape": shape, "prompts": prompts, "length": length, "pdserve_tok_s": ours, "transformers_tok_s": theirs, "ratio": ours / theirs}
    # Where the engine's prefill spends the device's time (one generate: one step of every prompt).
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate(token_lists, params)
        torch.cuda.synchronize()
    result["pdserve_ms"] = prompts * length / ours * 1e3
    result.update(device_time_split(prof.key_averages(), 1))
    del engine
    torch.cuda.empty_cache()
    return result


def check_lora(workdir: Path) -> dict:
    """LoRA adapters on CUDA (engine.lora): the base model and two adapters in one batch, float32,
    each equal to transformers' greedy with that adapter merged into the weights (W + 2 B A; no
    PEFT on the lent machine); and the decode step at batch 32 (135M shape, bfloat16, context 600)
    with the batch spread round-robin over 4 random rank-16 adapters (replayed from the adapter
    graphs, and eagerly), against the same engine's base-model step (CUDA graphs); and the same
    bfloat16 tokens through adapters with graphs and without."""
    import copy

    from safetensors.torch import load_file

    from engine.bench_lora import write_random_adapter

    path = workdir / "lora"
    model = build_checkpoint("llama", path / "base").to("cuda")
    shape = model.config.to_dict()
    references = {None: model}
    for name, seed in (("a", 1), ("b", 2)):
        write_random_adapter(path / name, shape, 8, seed=seed, std=0.3)
        merged = copy.deepcopy(model)
        params = dict(merged.named_parameters())
        tensors = load_file(str(path / name / "adapter_model.safetensors"))
        with torch.no_grad():
            for key, a in tensors.items():
                if key.endswith("lora_A.weight"):
                    b = tensors[key.replace("lora_A", "lora_B")]
                    params[key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")] += 2.0 * (b @ a).to("cuda")
        references[name] = merged
    config = EngineConfig(device="cuda", dtype="float32", num_kv_blocks=128, max_num_batched_tokens=64, long_prefill_chunk=16,
                          lora_adapters={name: str(path / name) for name in ("a", "b")})
    engine = LLMEngine(path / "base", config)
    jobs = [(prompt, name) for prompt in random_prompts([5, 30, 45], model.config.vocab_size, seed=4) for name in (None, "a", "b")]
    got = engine.generate([p for p, _ in jobs], [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, lora_name=n) for _, n in jobs])
    exact = {f"{name}/{len(prompt)}": out.token_ids == _hf_greedy_cuda(references[name], prompt, 12) for (prompt, name), out in zip(jobs, got)}
    changed = any(out.token_ids != base.token_ids for out, base in zip(got[1::3], got[0::3]))
    engine.runner.graphs = None  # its captured graphs' memory goes with it
    del engine
    torch.cuda.empty_cache()
    big = workdir / "135m"
    if not (big / "config.json").exists():
        random_hf_model("135m", big)
        torch.cuda.empty_cache()
    dirs = {f"l{i}": str(write_random_adapter(workdir / f"lora_135m_{i}", SHAPES["135m"], 16, seed=i)) for i in range(4)}
    # Replayed and eager decode steps through adapters compute alike (both engine.lora.RowSlots):
    # the same bfloat16 tokens for a mix of adapters and the base model, graphs on and off.
    prompts = random_prompts([9, 40, 17, 64, 3, 25, 33, 12], SHAPES["135m"]["vocab_size"], seed=6)
    names = [None, "l0", "l1", "l2", "l3", "l0", None, "l2"]
    replayed = replayed_and_eager(big, prompts, [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, lora_name=n) for n in names],
                                  num_kv_blocks=256, lora_adapters=dirs)
    adapter_graphs = replayed["adapter_graphs"]
    base_ms = _engine_decode_ms(big, 32, 600, 20, lora_adapters=dirs)
    lora_ms = _engine_decode_ms(big, 32, 600, 20, lora_names=[f"l{i % 4}" for i in range(32)], lora_adapters=dirs)
    eager_ms = _engine_decode_ms(big, 32, 600, 20, lora_names=[f"l{i % 4}" for i in range(32)], lora_adapters=dirs, cuda_graph_max_batch=0)
    graphs_equal = replayed["equal"]
    return {
        "exact": exact, "adapters_change_output": changed, "graphs_equal_eager": graphs_equal, "adapter_graphs": adapter_graphs,
        "base_step_ms": base_ms, "lora_step_ms": lora_ms, "lora_eager_step_ms": eager_ms,
        "lora_vs_base": base_ms / lora_ms, "ok": all(exact.values()) and changed and graphs_equal and bool(adapter_graphs),
    }


SECTIONS = ("rope", "stage_chunks", "no_logits", "kv_write", "overlap", "quantized", "sampling", "sampled_steps", "attention_kernels", "gemms", "profile", "decode", "agreement", "prefill", "exactness", "features", "push", "lora", "attention_fa3")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--batches-135m", default="1,8,32,128")
    parser.add_argument("--batches-1.5b", dest="batches_15b", default="1,32,64")
    parser.add_argument("--variants", default="pdserve,overlapped,unfused,flashinfer_eager,sdpa_eager", help="engine configurations the decode section times")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    sections = args.sections.split(",")
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}

    def save(name, value):
        report[name] = value
        print(name, json.dumps(value), flush=True)
        if args.json:
            args.json.write_text(json.dumps(report, indent=2))

    def section(name, fn, *a):
        if name not in sections:
            return
        start = time.perf_counter()
        try:
            save(name, fn(*a))
        except Exception:
            import traceback

            save(name + "_error", traceback.format_exc()[-3000:])
        save(name + "_seconds", round(time.perf_counter() - start, 1))

    variants = {"pdserve": {}, "overlapped": {"async_scheduling": True}, "unfused": {"fused_ops": False}, "no_split_kv": {"decode_split_kv": False},
                "block32": {"block_size": 32}, "block64": {"block_size": 64}, "flashinfer_eager": {"attention_backend": "flashinfer", "cuda_graph_max_batch": 0},
                "sdpa_eager": {"attention_backend": "sdpa", "cuda_graph_max_batch": 0}}
    variants = {name: overrides for name, overrides in variants.items() if name in args.variants.split(",")}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if "decode" in sections:
            save("copy_bandwidth_bytes_s", copy_bandwidth())
            nominal = next((v for k, v in NOMINAL_HBM_BYTES_S.items() if k in report["device"]), None)
            save("nominal_hbm_bytes_s", nominal)
        # The quick sections and the figures still open first: a lent machine's time runs out.
        section("rope", check_fused_rotation)
        section("stage_chunks", check_stage_chunks)
        section("no_logits", check_prefill_without_logits, workdir)
        section("kv_write", check_kv_write)
        section("overlap", check_overlap, workdir)
        section("quantized", check_quantized_kernels, workdir)
        section("sampling", bench_sampling)
        section("sampled_steps", bench_sampled_steps, workdir)
        section("attention_kernels", bench_attention_kernels_by_page)
        section("gemms", bench_gemms)
        if "profile" in sections and args.json:
            def profile():
                if not (workdir / "1.5b" / "config.json").exists():
                    random_hf_model("1.5b", workdir / "1.5b")  # saved; the model itself is dropped
                    torch.cuda.empty_cache()
                result = {}
                for name, overlapped in (("one_at_a_time", False), ("overlapped", True)):
                    table = args.json.with_name(f"profile_1.5b_b64{'_overlapped' if overlapped else ''}.txt")
                    phases: dict = {}
                    result[f"{name}_ms"] = _engine_decode_ms(workdir / "1.5b", 64, 600, 10, profile=table, host_phases=phases, async_scheduling=overlapped)
                    result[f"{name}_device_busy_ms"] = json.loads(table.with_suffix(".json").read_text())["device_busy_ms_per_step"]
                    result[f"{name}_host_ms"] = phases  # per step, by phase (wait: for the step in flight)
                return result

            section("profile", profile)
        batches = {"1.5b": [int(b) for b in args.batches_15b.split(",") if b], "135m": [int(b) for b in args.batches_135m.split(",") if b]}
        section("decode", lambda: (bench_decode(workdir, "1.5b", batches["1.5b"], {k: v for k, v in variants.items() if k != "flashinfer_eager"}) if batches["1.5b"] else [])
                + (bench_decode(workdir, "135m", batches["135m"], variants) if batches["135m"] else []))
        section("agreement", check_agreement, workdir)
        section("prefill", bench_prefill, workdir)
        section("exactness", check_exactness, workdir)
        section("features", check_features, workdir)
        section("push", check_event_before_push, workdir)
        section("lora", check_lora, workdir)
        # Last: FlashInfer's Hopper (FA3) kernels are a JIT build of minutes on a fresh machine.
        section("attention_fa3", bench_attention_kernels, 64, 600, ("fa3",))
    float32_exact = all(v["exact"] for k, v in report.get("exactness", {}).items() if "/float32/" in k)
    rope_ok = all(report.get(name, {}).get("ok", True) for name in ("rope", "stage_chunks", "no_logits", "kv_write", "overlap", "quantized", "sampling", "lora"))
    crashed = [name for name in report if name.endswith("_error")]
    return 0 if float32_exact and rope_ok and not crashed and all(report.get("features", {}).values()) and report.get("push", True) else 1


if __name__ == "__main__":
    sys.exit(main())
