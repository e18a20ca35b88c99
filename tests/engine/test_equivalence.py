"""The engine computes what transformers computes: greedy tokens and float32 logits."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.attention import SeqSlice
from engine.attention.block_tables import BlockTables
from tests.checkpoints import hf_greedy, random_prompts

PROMPT_LENGTHS = [1, 5, 17, 64, 150]
MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def references(checkpoints):
    """arch -> (prompts, transformers greedy continuations)."""
    refs = {}
    for arch, (_, model) in checkpoints.items():
        prompts = random_prompts(PROMPT_LENGTHS, model.config.vocab_size)
        refs[arch] = (prompts, [hf_greedy(model, p, MAX_NEW) for p in prompts])
    return refs


def _engine(path, chunk, **kwargs):
    budget = max(chunk or 512, 64)
    return LLMEngine(path, EngineConfig(num_kv_blocks=256, long_prefill_chunk=chunk, max_num_batched_tokens=budget, **kwargs))


@pytest.mark.parametrize("chunk", [1, 7, 16, 64, None])
def test_greedy_matches_transformers_alone_and_batched(arch_checkpoint, references, chunk):
    path, model = arch_checkpoint
    arch = model.config.model_type
    prompts, expected = references[arch]
    engine = _engine(path, chunk)
    for prompt, want in zip(prompts, expected):
        (alone,) = engine.generate([prompt], GREEDY)
        assert alone.token_ids == want, f"{arch} chunk={chunk} prompt len {len(prompt)} alone"
    batched = engine.generate(prompts, GREEDY)
    for prompt, got, want in zip(prompts, batched, expected):
        assert got.token_ids == want, f"{arch} chunk={chunk} prompt len {len(prompt)} batched"
    assert engine.num_free_blocks == engine.kv_cache.num_blocks


def test_requests_joining_a_running_batch_match_transformers(checkpoints, references):
    """Prompts that arrive while others decode share steps with them and still match."""
    path, _ = checkpoints["llama"]
    prompts, expected = references["llama"]
    engine = _engine(path, 16)
    done = {}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:
            index, prompt = pending.pop(0)
            engine.add_request(f"r{index}", prompt, GREEDY)
        for out in engine.step():
            done.setdefault(out.req_id, []).extend(out.new_token_ids)
        step += 1
    assert [done[f"r{i}"] for i in range(len(prompts))] == expected


def test_float32_logits_match_transformers_for_every_chunk_position(arch_checkpoint):
    """Logits of every position, computed chunk by chunk against the paged cache."""
    path, model = arch_checkpoint
    (prompt,) = random_prompts([45], model.config.vocab_size, seed=7)
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0].float()
    engine = _engine(path, 7)
    block_table = engine.allocator.allocate(engine.kv_cache.blocks_needed(len(prompt)))
    got = []
    for start in range(0, len(prompt), 7):
        end = min(start + 7, len(prompt))
        meta = engine.runner.attention.build([SeqSlice(0, start, end - start)], BlockTables.holding([block_table]).array)
        logits = engine.runner.model(
            torch.tensor(prompt[start:end]),
            torch.arange(start, end),
            engine.kv_cache,
            meta,
            torch.arange(end - start),
        )
        got.append(logits)
    torch.testing.assert_close(torch.cat(got), want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_checkpoints_load_and_track_transformers(tmp_path, dtype):
    """A checkpoint saved in bf16/fp16 runs in that dtype with logits close to transformers'."""
    from tests.checkpoints import build_checkpoint

    model = build_checkpoint("llama", tmp_path, dtype=dtype)
    engine = _engine(tmp_path, None)
    assert engine.dtype == dtype
    assert engine.kv_cache.tensor.dtype == dtype
    (prompt,) = random_prompts([30], model.config.vocab_size, seed=3)
    with torch.no_grad():
        want = model.to(dtype)(torch.tensor([prompt])).logits[0, -1].float()
    block_table = engine.allocator.allocate(engine.kv_cache.blocks_needed(len(prompt)))
    meta = engine.runner.attention.build([SeqSlice(0, 0, len(prompt))], BlockTables.holding([block_table]).array)
    got = engine.runner.model(torch.tensor(prompt), torch.arange(len(prompt)), engine.kv_cache, meta, torch.tensor([len(prompt) - 1]))[0]
    assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.999
    assert got.argmax() == want.argmax()


def test_float32_override_of_a_bf16_checkpoint_matches_float32_transformers(tmp_path):
    from tests.checkpoints import build_checkpoint

    model = build_checkpoint("qwen2", tmp_path, dtype=torch.bfloat16)
    # What float32 transformers computes from the very same (bf16-rounded) weights.
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    (prompt,) = random_prompts([20], model.config.vocab_size, seed=4)
    want = hf_greedy(reference, prompt, 8)
    engine = LLMEngine(tmp_path, EngineConfig(num_kv_blocks=64, dtype="float32"))
    (got,) = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert engine.dtype == torch.float32
    assert got.token_ids == want


def test_decode_gathered_in_small_groups_matches_transformers(checkpoints, references, monkeypatch):
    """Decode attention gathered a sequence at a time (as a long context does on a CPU) is unchanged."""
    import engine.attention.sdpa

    monkeypatch.setattr(engine.attention.sdpa, "GROUP_GATHER_BYTES", 1)
    path, _ = checkpoints["llama"]
    prompts, expected = references["llama"]
    batched = _engine(path, 16).generate(prompts, GREEDY)
    assert [c.token_ids for c in batched] == expected


@pytest.mark.parametrize("prepack", [True, False])
def test_both_linear_kernels_match_transformers(checkpoints, references, prepack):
    path, _ = checkpoints["qwen2"]
    prompts, expected = references["qwen2"]
    engine = _engine(path, 16, prepack_linear=prepack)
    kinds = {type(m).__name__ for m in engine.runner.model.modules()}
    assert ("PackedLinear" in kinds) == prepack
    assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == expected


@pytest.mark.parametrize("native", [True, False])
def test_both_attention_paths_match_transformers(checkpoints, references, native):
    """The CPU kernels (where this machine builds them) and the portable gather + SDPA path,
    through chunks with cached context."""
    from engine import native_kernels

    path, _ = checkpoints["llama"]
    prompts, expected = references["llama"]
    engine = _engine(path, 16, attention_backend="auto" if native else "sdpa")
    assert (engine.runner.attention.name == "cpu") == (native and native_kernels.kernel() is not None)
    assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == expected
