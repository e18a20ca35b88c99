"""Speculative decoding on the decode pool, through the whole cluster (real actors, NIXL, gRPC,
the OpenAI API): output is transformers' greedy output whichever actor prefilled the prompt,
and every response and the metrics say what the drafts did."""

from __future__ import annotations

import concurrent.futures
import time
import urllib.request

import openai
import pytest

from cluster.bench.scenarios.speculation import write_layer_skip_draft
from engine.speculation import SpeculativeConfig
from router.config import Disaggregation, RouterConfig
from router.metrics import Metrics
from tests.checkpoints import hf_greedy, random_prompts
from tests.e2e.test_prefix_cache import _value
from tests.serving import Client, engine_config, running_deployment

MAX_TOKENS = 40
# Short prompts prefill on the decode actor (local prefill), long ones on the prefill actor.
PROMPT_LENGTHS = [5, 12, 40, 90, 150, 18]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculating_decode_actor_serves_transformers_output_and_reports_acceptance(ray_cluster, e2e_model, tmp_path, method):
    prompts = random_prompts(PROMPT_LENGTHS, e2e_model.vocab_size, seed=31)
    expected = [hf_greedy(e2e_model.hf_model, p, MAX_TOKENS) for p in prompts]
    metrics = Metrics("tiny")
    router = RouterConfig(disaggregation=Disaggregation.AUTO, local_prefill_max_tokens=20, http_port=0)
    speculative = SpeculativeConfig(num_speculative_tokens=3)
    if method == "draft_model":
        # The draft catches up on prompts the prefill actor computed: its KV never travels.
        draft = write_layer_skip_draft(e2e_model.path, tmp_path / "draft", 1)
        speculative = SpeculativeConfig(method="draft_model", num_speculative_tokens=3, draft_model=str(draft))
    decode_engine = engine_config(speculative=speculative)
    with running_deployment(e2e_model, 1, 1, router, metrics=metrics, decode_engine=decode_engine, health_interval_s=0.2) as deployment:
        port = metrics.serve(0)
        client = Client(deployment.address)
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            streams = list(pool.map(
                lambda p: client.generate(prompt_token_ids=p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True), prompts
            ))
        for prompt, stream, want in zip(prompts, streams, expected):
            assert stream.token_ids == want, f"prompt of {len(prompt)} tokens"
            assert bool(stream.last.prefill_worker_id) == (len(prompt) > 20)
            spec = stream.last.speculation
            # The first token came with the prompt; each decode step emitted one plus the drafts it confirmed.
            assert MAX_TOKENS - 1 == spec.decode_steps + spec.accepted_draft_tokens
            assert spec.accepted_draft_tokens <= spec.draft_tokens <= 3 * spec.decode_steps
            assert abs(spec.tokens_per_step - (1 + spec.accepted_draft_tokens / spec.decode_steps)) < 1e-9
            if spec.draft_tokens:
                assert abs(spec.acceptance_rate - spec.accepted_draft_tokens / spec.draft_tokens) < 1e-9
            if method == "draft_model":
                assert spec.draft_tokens > 0, "a draft model guesses for every request"
        accepted = sum(s.last.speculation.accepted_draft_tokens for s in streams)
        drafted = sum(s.last.speculation.draft_tokens for s in streams)
        assert accepted > 0, "the random model's greedy loops are what drafts catch"
        # Multi-token steps reach the client as one message per step, not token by token.
        assert any(len(m.token_ids) > 1 for s in streams for m in s.messages)

        # The OpenAI API reports the same drafts as OpenAI's predicted-output token counts.
        base_url = f"http://127.0.0.1:{deployment.http_port}/v1"
        with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60) as api:
            completion = api.completions.create(
                model=e2e_model.path.name, prompt=prompts[3], max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True}
            )
        details = completion.usage.completion_tokens_details
        assert details.accepted_prediction_tokens == streams[3].last.speculation.accepted_draft_tokens
        assert details.rejected_prediction_tokens == streams[3].last.speculation.draft_tokens - details.accepted_prediction_tokens

        for worker in client.wait_until_idle():
            assert worker.num_kv_blocks_used == 0, f"{worker.worker_id} leaked KV blocks"
        time.sleep(0.6)  # a health-loop refresh of the per-worker series
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        client.close()
    labels = 'model_name="tiny",role="decode",worker_id="decode-0"'
    openai_spec = details.accepted_prediction_tokens, details.accepted_prediction_tokens + details.rejected_prediction_tokens
    assert _value(text, f"pdserve:spec_decode_num_accepted_tokens_total{{{labels}}}") == accepted + openai_spec[0]
    assert _value(text, f"pdserve:spec_decode_num_draft_tokens_total{{{labels}}}") == drafted + openai_spec[1]
    assert _value(text, 'pdserve:spec_decode_acceptance_rate_count{model_name="tiny"}') == sum(
        1 for s in streams if s.last.speculation.draft_tokens
    ) + (1 if openai_spec[1] else 0)
