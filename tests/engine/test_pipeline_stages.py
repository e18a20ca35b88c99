"""Pipeline stages in the engine (issue 27's foundation): a prompt prefilled chunk by chunk
through stages that each compute a contiguous range of layers, each stage writing only its
layers' KV, hands the decode engine exactly what one engine computes: the decode engine, given
every stage's layer runs of every block (the byte runs a stage would push), continues the
prompt token for token like transformers, for any stage boundaries and chunking."""

from __future__ import annotations

import pytest
import torch

from decode_workers.scheduler import DecodeScheduler
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.attention import SeqSlice
from engine.attention.block_tables import TableUpdate
from engine.model import StageActivations
from engine.model_runner import StepInput
from tests.checkpoints import build_checkpoint, hf_greedy, random_prompts

NUM_LAYERS = 4
MAX_NEW = 8


@pytest.fixture(scope="module")
def four_layer_checkpoints(tmp_path_factory):
    built = {}
    for arch in ("llama", "qwen3"):
        path = tmp_path_factory.mktemp(f"stages_{arch}")
        built[arch] = (path, build_checkpoint(arch, path, num_hidden_layers=NUM_LAYERS))
    return built


def _prefill_through_stages(stages: list[tuple[LLMEngine, range]], prompt: list[int], chunk: int) -> tuple[list[int], int]:
    """Prefill ``prompt`` chunk by chunk through the stages; (the block ids used, the first token)."""
    block_table = stages[0][0].allocator.allocate(-(-len(prompt) // 16))
    for engine, _ in stages[1:]:
        assert engine.allocator.allocate(len(block_table)) == block_table  # fresh engines: the same ids
    first_token = None
    for start in range(0, len(prompt), chunk):
        end = min(start + chunk, len(prompt))
        last = end == len(prompt)
        step = StepInput(prompt[start:end], list(range(start, end)), [end - start - 1] if last else [], [SeqSlice(0, start, end - start)], [TableUpdate(0, 0, block_table)])
        activations = None
        for engine, layers in stages:
            out = engine.runner.run_stage(step, layers, activations)
            if layers.stop < NUM_LAYERS:
                assert isinstance(out, StageActivations) and out.hidden.shape[0] == end - start
                activations = out
        if last:
            first_token = int(out.argmax(dim=-1)[0])
    return block_table, first_token


@pytest.mark.parametrize("bounds", [(0, 2, 4), (0, 1, 4), (0, 3, 4), (0, 1, 2, 4)])
@pytest.mark.parametrize("chunk", [7, 16, 64])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_stages_of_layers_hand_decode_what_one_engine_computes(four_layer_checkpoints, arch, bounds, chunk):
    path, model = four_layer_checkpoints[arch]
    prompt = random_prompts([45], model.config.vocab_size, seed=len(bounds) + chunk)[0]
    config = EngineConfig(num_kv_blocks=32, dtype="float32")
    stages = [(LLMEngine(path, config), range(a, b)) for a, b in zip(bounds, bounds[1:])]
    block_table, first_token = _prefill_through_stages(stages, prompt, chunk)

    decode = LLMEngine(path, config, scheduler_cls=DecodeScheduler)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    seq = decode.make_sequence("r", prompt, params)
    dst = decode.scheduler.reserve(seq).block_ids
    # Each stage's layers of each block, as the byte runs it would push: nothing else is copied.
    decoded = decode.kv_cache.tensor.view(32, -1).view(torch.uint8)
    for engine, layers in stages:
        source = engine.kv_cache.tensor.view(32, -1).view(torch.uint8)
        for offset, length in engine.kv_cache.layer_runs(layers):
            decoded[dst, offset : offset + length] = source[block_table, offset : offset + length]
    decode.scheduler.admit_remote("r", first_token)
    tokens = [first_token]
    while decode.has_unfinished_requests():
        for out in decode.step():
            tokens.extend(out.new_token_ids)
    assert tokens == hf_greedy(model, prompt, MAX_NEW), f"{arch} stages {bounds} chunk {chunk}"
    assert decode.num_free_blocks == 32


def test_layer_runs_of_all_stages_cover_each_block_once(four_layer_checkpoints):
    path, _ = four_layer_checkpoints["llama"]
    for kv_cache_dtype in ("auto", "int8"):
        engine = LLMEngine(path, EngineConfig(num_kv_blocks=4, kv_cache_dtype=kv_cache_dtype))
        covered = torch.zeros(engine.kv_cache.bytes_per_block, dtype=torch.int32)
        for layers in (range(0, 1), range(1, 3), range(3, 4)):
            for offset, length in engine.kv_cache.layer_runs(layers):
                covered[offset : offset + length] += 1
        assert bool((covered == 1).all()), kv_cache_dtype
