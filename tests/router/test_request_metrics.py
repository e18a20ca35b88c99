"""Per-request Prometheus series as vLLM's dashboards and autoscalers read them: vLLM's finish
reasons, tokens counted as they stream, latencies of minutes in their own buckets, and vLLM's
prefix on request."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest

from router.metrics import Metrics
from router.output_stream import OutputChunk, StreamEnd, TimingBreakdown
from router.session import GenerationSession


def _samples(metrics: Metrics) -> dict[str, float]:
    out = {}
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_every_finish_reason_is_vllms_and_shown_from_the_start():
    """Most requests end at an end-of-sequence token: vLLM counts them as "stop"; they were
    "eos", so a dashboard's stop count missed them."""
    metrics = Metrics("m")
    before = _samples(metrics)
    assert {before[f'pdserve:request_success_total{{finished_reason="{r}",model_name="m"}}'] for r in ("stop", "length", "abort", "error")} == {0.0}
    metrics.requests("eos").inc()
    metrics.requests("stop").inc()
    after = _samples(metrics)
    assert after['pdserve:request_success_total{finished_reason="stop",model_name="m"}'] == 2
    assert not any('finished_reason="eos"' in name for name in after)


def test_a_request_of_minutes_falls_in_a_bucket_of_its_own():
    """The largest bucket was 60 s: every longer request read as exactly 60 s at any quantile."""
    metrics = Metrics("m")
    metrics.e2e.observe(95.0)
    samples = _samples(metrics)
    assert samples['pdserve:e2e_request_latency_seconds_bucket{le="80.0",model_name="m"}'] == 0
    assert samples['pdserve:e2e_request_latency_seconds_bucket{le="160.0",model_name="m"}'] == 1


def test_vllms_prefix_on_request():
    metrics = Metrics("m", "vllm:")
    names = _samples(metrics)
    assert 'vllm:request_success_total{finished_reason="stop",model_name="m"}' in names
    assert not any(name.startswith("pdserve:") for name in names)
    with pytest.raises(ValueError, match="metrics_prefix"):
        Metrics("m", "sglang:")


def test_tokens_and_the_first_tokens_time_count_as_they_stream_also_for_an_abandoned_request():
    """They were counted when a request finished: an abandoned one's (a client that gave up on a
    slow first token) never reached the time-to-first-token histogram, and a long generation's
    tokens came in one burst at its end."""
    metrics = Metrics("m")
    arrival = time.monotonic() - 2.0
    active = SimpleNamespace(
        last_message_at=None, request=SimpleNamespace(prompt_token_ids=list(range(7)), sampling_params=SimpleNamespace(max_tokens=16)),
        assembler=SimpleNamespace(timing=SimpleNamespace(arrival=arrival, first_token_sent=None), num_completion_tokens=0),
    )
    session = SimpleNamespace(router=SimpleNamespace(metrics=metrics, traffic=None), active=active)
    GenerationSession._observe(session, OutputChunk(token_ids=[5, 6], text="ab"))
    GenerationSession._observe(session, OutputChunk(token_ids=[7], text="c"))
    samples = _samples(metrics)
    assert samples['pdserve:time_to_first_token_seconds_count{model_name="m"}'] == 1
    assert samples['pdserve:time_to_first_token_seconds_sum{model_name="m"}'] >= 2.0
    assert samples['pdserve:prompt_tokens_total{model_name="m"}'] == 7
    assert samples['pdserve:generation_tokens_total{model_name="m"}'] == 3
    # Its end, later, counts no token again.
    active.assembler.num_completion_tokens, active.assembler.timing.first_token_sent = 3, arrival + 2.0
    session.router.traffic = SimpleNamespace(on_finished=lambda *args: None)
    phases = TimingBreakdown(router_queue_ms=300.0, prefill_queue_ms=200.0, prefill_compute_ms=400.0, kv_transfer_ms=100.0)
    GenerationSession._observe(session, OutputChunk(end=StreamEnd("eos", 7, 3, phases)))
    samples = _samples(metrics)
    # vLLM's per-request phases and sizes, which its dashboards chart.
    assert samples['pdserve:request_queue_time_seconds_sum{model_name="m"}'] == pytest.approx(0.5)
    assert samples['pdserve:request_prefill_time_seconds_sum{model_name="m"}'] == pytest.approx(0.5)
    assert samples['pdserve:request_decode_time_seconds_count{model_name="m"}'] == 1
    assert samples['pdserve:request_params_max_tokens_sum{model_name="m"}'] == 16
    assert samples['pdserve:request_generation_tokens_sum{model_name="m"}'] == 3
    assert samples['pdserve:request_time_per_output_token_seconds_count{model_name="m"}'] == 1
    assert samples['pdserve:prompt_tokens_total{model_name="m"}'] == 7 and samples['pdserve:generation_tokens_total{model_name="m"}'] == 3
    assert samples['pdserve:request_success_total{finished_reason="stop",model_name="m"}'] == 1


def test_routers_sharing_a_port_answer_every_routers_series_each_under_its_own_label():
    """/metrics on a port the routers share: each router's samples once, labelled with it (so
    each series grows monotonically whichever router takes the scrape, and sums over the label
    are the deployment's); one that stopped publishing is left out once stale."""
    import asyncio

    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from router.metrics import Metrics
    from router.metrics_exchange import MetricsExchange, merged_exposition

    texts = {}
    for name, finished in (("router-0", 3), ("router-1", 5)):
        metrics = Metrics("m")
        for _ in range(finished):
            metrics.observe_finished("stop", 0.1, 0.5, 4)
        texts[name] = generate_latest(metrics.registry)
    families = {f.name: f for f in text_string_to_metric_families(merged_exposition(texts).decode())}
    success = [(s.labels["router"], s.value) for s in families["pdserve:request_success"].samples if s.labels["finished_reason"] == "stop"]
    assert success == [("router-0", 3.0), ("router-1", 5.0)]
    latency = families["pdserve:e2e_request_latency_seconds"].samples
    assert {s.labels["router"] for s in latency} == {"router-0", "router-1"} and families["pdserve:e2e_request_latency_seconds"].type == "histogram"

    async def exchange_rounds():
        exchange = MetricsExchange(stale_s=0.05)
        await exchange.publish("router-0", texts["router-0"])
        await exchange.publish("router-1", texts["router-1"])
        both = sorted(await exchange.collect())
        await asyncio.sleep(0.1)
        await exchange.publish("router-1", texts["router-1"])
        return both, sorted(await exchange.collect())

    assert asyncio.run(exchange_rounds()) == (["router-0", "router-1"], ["router-1"])
