"""The prefill and decode scheduling policies hand a request over exactly.

Blocks are copied between the two engines' caches in-process here (the real actors push
them over NIXL); what this checks is the seam: a decode engine that admits a sequence
whose KV another engine computed continues it token for token like transformers.
"""

from __future__ import annotations

import pytest

from decode_workers.scheduler import DecodeScheduler
from engine import EngineConfig, LLMEngine, SamplingParams
from prefill_workers.scheduler import PrefillScheduler
from tests.checkpoints import build_checkpoint, hf_greedy, random_prompts


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("handoff")
    return path, build_checkpoint("qwen3", path)


@pytest.mark.parametrize("chunk", [7, 64])
def test_prefill_then_remote_decode_matches_transformers(checkpoint, chunk):
    path, model = checkpoint
    prompts = random_prompts([5, 40, 100], model.config.vocab_size, seed=3)
    expected = [hf_greedy(model, p, 10) for p in prompts]
    prefill = LLMEngine(path, EngineConfig(num_kv_blocks=64, long_prefill_chunk=chunk, max_num_batched_tokens=chunk), scheduler_cls=PrefillScheduler)
    decode = LLMEngine(path, EngineConfig(num_kv_blocks=64), scheduler_cls=DecodeScheduler)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    destinations = {}
    for i, prompt in enumerate(prompts):
        seq = decode.make_sequence(f"r{i}", prompt, params)
        destinations[seq.req_id] = decode.scheduler.reserve(seq)
        prefill.add_request(f"r{i}", prompt, params)
    first_tokens = {}
    while prefill.has_unfinished_requests():
        for out in prefill.step():
            first_tokens[out.req_id] = out.new_token_ids[0]
    assert decode.num_free_blocks < 64
    for req_id, dst in destinations.items():
        src = prefill.scheduler.held[req_id].block_table
        decode.kv_cache.tensor[dst] = prefill.kv_cache.tensor[src]
        prefill.scheduler.release(req_id)
        decode.scheduler.admit_remote(req_id, first_tokens[req_id])
    assert prefill.num_free_blocks == 64
    tokens = {req_id: [tok] for req_id, tok in first_tokens.items()}
    while decode.has_unfinished_requests():
        for out in decode.step():
            tokens[out.req_id].extend(out.new_token_ids)
    assert [tokens[f"r{i}"] for i in range(3)] == expected
    assert decode.num_free_blocks == 64


def test_aborting_a_reservation_returns_its_blocks(checkpoint):
    path, _ = checkpoint
    decode = LLMEngine(path, EngineConfig(num_kv_blocks=16, block_size=16), scheduler_cls=DecodeScheduler)
    seq = decode.make_sequence("r", list(range(3, 51)), SamplingParams(max_tokens=4))
    assert len(decode.scheduler.reserve(seq)) == 3  # 48 prompt tokens: 3 full blocks written by prefill
    assert decode.num_free_blocks == 12  # plus one of headroom for the first decode token
    big = decode.make_sequence("big", list(range(3, 196)), SamplingParams(max_tokens=1))
    assert decode.scheduler.reserve(big) is None, "a reservation larger than the free pool is refused"
    assert decode.num_free_blocks == 12
    decode.abort_request("r")
    assert decode.num_free_blocks == 16


def test_sampled_token_survives_its_json_form():
    from engine.sequence import TokenLogprob, sampled_token_from_json, sampled_token_to_json

    logprob = TokenLogprob(42, -0.25, 1, [(42, -0.25), (7, -1.5)])
    assert sampled_token_from_json(sampled_token_to_json(42, logprob)) == (42, logprob)
    assert sampled_token_from_json(sampled_token_to_json(9, None)) == (9, None)
