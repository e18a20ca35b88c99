"""A quantized KV cache through the disaggregated path: the prefill actor's int8 blocks (elements
and scales, one run of bytes each) travel over NIXL as they are, and the decode actor carries on
from them exactly as one engine would have."""

from __future__ import annotations

import pytest
import torch

from engine import LLMEngine, SamplingParams
from engine.kv_cache import KVCache
from router.config import Disaggregation, RouterConfig
from tests.checkpoints import random_prompts
from tests.serving import Client, engine_config, running_deployment

MAX_TOKENS = 16


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_quantized_blocks_travel_as_they_are_at_half_the_bytes(ray_cluster, e2e_model, kind):
    prompts = random_prompts([20, 45, 70], e2e_model.vocab_size, seed=9)
    config = engine_config(kv_cache_dtype=kind)
    # One engine doing both halves, one request at a time with the same chunking: the reference.
    local = LLMEngine(e2e_model.path, engine_config(kv_cache_dtype=kind))
    expected = [local.generate([p], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))[0].token_ids for p in prompts]
    quantized_block = local.kv_cache.bytes_per_block
    bf16_block = KVCache.bytes_per_block_of(local.model_config, local.kv_cache.block_size, torch.bfloat16)
    assert quantized_block <= 0.55 * bf16_block
    router = RouterConfig(disaggregation=Disaggregation.ALWAYS)
    with running_deployment(e2e_model, 1, 1, router, prefill_engine=config, decode_engine=config) as deployment:
        client = Client(deployment.address)
        for prompt, want in zip(prompts, expected):
            stream = client.generate(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            assert stream.token_ids == want
            assert stream.last.prefill_worker_id, "prefilled on the prefill actor"
            assert stream.last.timing.kv_bytes_transferred == -(-len(prompt) // local.kv_cache.block_size) * quantized_block
        for worker in client.wait_until_idle():
            assert worker.num_kv_blocks_used == 0, f"{worker.worker_id} leaked KV blocks"
        client.close()
