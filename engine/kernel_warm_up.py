"""Run each kind of step once before an engine takes requests, so that the kernels compiled on
first use are built at start-up rather than inside the first requests.

On CUDA, FlashInfer builds its kernel modules the first time each is called (seen on an H200
with 16 cores: its sampling module 135 s, rotary 72 s, the norms and SiLU 78 s, prefill
attention for one head size 53-65 s), and Triton compiles its kernels likewise. Without this, a
fresh server's "engine ready" would be followed by a first prompt that waits minutes for its
prefill kernel and a first sampled token that waits for the sampling module. vLLM does the same
at start-up (a dummy forward and a dummy sampler run).

The warm-up is a real prefill step and a real decode step of a short prompt through the engine's
executor (every tensor-parallel rank runs them too), in KV blocks taken from the allocator and
given back, then one draw per kind of sampling row through both of the sampler's paths (the
host's ``sample`` and the overlapped steps' ``sample_on_device``). Every draw is seeded (its own
generator, or on CUDA its draw key), so the engine's generator, and with it every later unseeded
draw, is as it was; the sequence never enters the scheduler, so no request, statistic or cached
prefix is left behind.
"""

from __future__ import annotations

import time

import torch

from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, ScheduledSlice
from engine.sequence import Sequence

# The warm-up prompt's length: several tokens, so the prefill kernel (not the decode one) runs.
_PROMPT_TOKENS = 8

# One row per family of sampling kernels: whole rows through FlashInfer's softmax and top-p
# kernel, top-p renormalization then min-p, top-k candidates (torch) with a repetition penalty
# (Qwen2.5's defaults; on CUDA the penalties' Triton kernel, engine.triton_penalties), and a
# greedy row asking for log-probabilities.
_DRAWS = (
    SamplingParams(temperature=0.8, top_p=0.9, seed=0),
    SamplingParams(temperature=0.8, top_p=0.9, min_p=0.05, seed=0),
    SamplingParams(temperature=0.8, min_p=0.05, seed=0),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05, seed=0),
    SamplingParams(temperature=0.0, logprobs=2),
)


def warm_up_kernels(executor, allocator, kv_cache, sampler: Sampler, vocab_size: int, max_model_len: int) -> float:
    """Run a prefill and a decode step and the sampler's draws once (see the module's docstring);
    the seconds it took."""
    started = time.perf_counter()
    num_prompt_tokens = max(1, min(_PROMPT_TOKENS, vocab_size, max_model_len - 1))
    prompt = list(range(num_prompt_tokens))
    seq = Sequence("kernel-warm-up", prompt, num_prompt_tokens, SamplingParams(temperature=0.8, top_p=0.9, seed=0, max_tokens=1),
                   generator=Sampler.make_generator(0))
    seq.block_table = allocator.allocate(kv_cache.blocks_needed(num_prompt_tokens + 1))
    try:
        logits = executor.execute(ScheduledBatch([ScheduledSlice(seq, num_prompt_tokens)]))
        (token, _), = sampler.sample(logits, [seq])
        seq.append_token(token)
        seq.num_computed_tokens = num_prompt_tokens
        logits = executor.execute(ScheduledBatch([ScheduledSlice(seq, 1)]))
        rows = [Sequence(f"kernel-warm-up-{i}", prompt, num_prompt_tokens, params, generator=Sampler.make_generator(params.seed))
                for i, params in enumerate(_DRAWS)]
        many = logits.expand(len(rows), -1).contiguous()
        sampler.sample(many, rows)
        if all(Sampler.draws_on_device(row, logits.device) for row in rows):
            sampler.sample_on_device(many, rows)
        if logits.device.type == "cuda":
            torch.cuda.synchronize(logits.device)
    finally:
        allocator.free(seq.block_table)
    return time.perf_counter() - started
