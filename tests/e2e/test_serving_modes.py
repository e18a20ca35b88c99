"""Greedy output through the whole cluster equals transformers, in every serving mode."""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Iterator

import pytest

from router.config import Disaggregation, RouterConfig
from tests.checkpoints import hf_greedy, random_prompts
from tests.serving import Client, following_router, running_deployment

# Some prompts span more than ten 32-token chunks; short ones share steps with long ones.
PROMPT_LENGTHS = [3, 9, 17, 25, 40, 64, 130, 350, 420, 12]
MAX_TOKENS = 12

MODES = {
    "disaggregated": (1, 1, Disaggregation.ALWAYS),
    "aggregated": (0, 1, Disaggregation.AUTO),  # no prefill actor at all
    "conditional": (1, 1, Disaggregation.AUTO),
}


@pytest.fixture(scope="module")
def one_and_one(ray_cluster, e2e_model):
    """1P+1D, durable: the modes with a prefill actor route over it with routers of their own."""
    with running_deployment(e2e_model, 1, 1, RouterConfig(), name="serving-modes", durable_workers=True) as deployment:
        yield deployment


@contextlib.contextmanager
def _deployment_for(mode: str, e2e_model, request) -> Iterator:
    num_prefill, num_decode, disaggregation = MODES[mode]
    router = RouterConfig(disaggregation=disaggregation, local_prefill_max_tokens=20)
    if num_prefill == 0:
        with running_deployment(e2e_model, num_prefill, num_decode, router) as deployment:
            yield deployment
    else:
        with following_router(request.getfixturevalue("one_and_one"), router) as deployment:
            yield deployment


def _references(e2e_model, mode: str):
    """Prompts of each mode's own (two modes share workers: no prefix of one is cached for the
    other) and transformers' greedy continuations."""
    prompts = random_prompts(PROMPT_LENGTHS, e2e_model.vocab_size, seed=42 + list(MODES).index(mode))
    return prompts, [hf_greedy(e2e_model.hf_model, p, MAX_TOKENS) for p in prompts]


@pytest.mark.parametrize("mode", list(MODES))
def test_concurrent_greedy_requests_match_transformers(ray_cluster, e2e_model, mode, request):
    prompts, expected = _references(e2e_model, mode)
    with _deployment_for(mode, e2e_model, request) as deployment:
        client = Client(deployment.address)
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            streams = list(
                pool.map(
                    lambda p: client.generate(prompt_token_ids=p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
                    prompts,
                )
            )
        for prompt, stream, want in zip(prompts, streams, expected):
            assert stream.token_ids == want, f"{mode}: prompt of {len(prompt)} tokens"
            assert stream.last.finish_reason == 1  # LENGTH
            assert stream.last.usage.prompt_tokens == len(prompt)
            assert stream.last.usage.completion_tokens == MAX_TOKENS
        prefilled_remotely = [bool(s.last.prefill_worker_id) for s in streams]
        if mode == "disaggregated":
            assert all(prefilled_remotely)
            assert all(s.last.timing.prefill_compute_ms > 0 for s in streams)
        elif mode == "aggregated":
            assert not any(prefilled_remotely)
        else:
            # Prompts up to 20 tokens stay on the decode actor, longer ones go to the prefill actor.
            assert prefilled_remotely == [len(p) > 20 for p in prompts]
        for worker in client.wait_until_idle():
            assert worker.num_kv_blocks_used == 0, f"{worker.worker_id} leaked KV blocks"
        client.close()
