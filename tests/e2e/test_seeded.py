"""The seed promise as stated in the proto: a seeded sampled request repeats exactly, whatever
shares its batches and however its prompt is chunked: in float32 everywhere, in bfloat16 where
the CPU has avx512_bf16 (its linears run on pdserve's row-invariant kernel; oneDNN's bfloat16
kernels change with the row count)."""

from __future__ import annotations

import concurrent.futures

import pytest

from engine.cpu_linear import bf16_pair_kernel_available
from router.config import Disaggregation, RouterConfig
from tests.checkpoints import random_prompts
from tests.serving import Client, engine_config, running_deployment


def _burst(client: Client, jobs: list[tuple[list[int], dict]]) -> list[list[int]]:
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(client.generate, timeout=120, prompt_token_ids=p, **s) for p, s in jobs]
        return [f.result(timeout=150).token_ids for f in futures]


@pytest.mark.parametrize(
    "dtype",
    ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(not bf16_pair_kernel_available(), reason="no avx512_bf16: bfloat16 linears on oneDNN"))],
)
def test_seeded_requests_repeat_exactly_in_a_burst(ray_cluster, e2e_model, dtype):
    prompts = random_prompts([40 + 37 * i for i in range(10)], e2e_model.vocab_size, seed=51)
    seeded = [dict(max_tokens=12, temperature=1.0, top_p=0.95, seed=100 + i, ignore_eos=True) for i in range(10)]
    noise = random_prompts([90, 300, 17], e2e_model.vocab_size, seed=52)
    unseeded = dict(max_tokens=20, temperature=1.0, ignore_eos=True)
    router = RouterConfig(disaggregation=Disaggregation.AUTO, local_prefill_max_tokens=64)
    engine = engine_config(dtype=dtype)
    with running_deployment(e2e_model, 1, 1, router, prefill_engine=engine, decode_engine=engine) as deployment:
        client = Client(deployment.address)
        first = _burst(client, list(zip(prompts, seeded)))
        # Again, in the opposite order and beside other traffic: other batches, other chunk cuts.
        jobs = [(n, unseeded) for n in noise] + list(zip(prompts, seeded))[::-1]
        second = _burst(client, jobs)[len(noise):][::-1]
        assert second == first
        alone = client.generate(prompt_token_ids=prompts[3], **seeded[3]).token_ids
        assert alone == first[3]
        other_seed = client.generate(prompt_token_ids=prompts[3], **{**seeded[3], "seed": 7}).token_ids
        assert other_seed != first[3]
        client.close()
