"""The benchmark's arithmetic on synthetic timestamps, against answers worked out by hand."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics

import pytest

from cluster.bench.arrivals import ArrivalSpec, arrival_offsets, phased_offsets
from cluster.bench.cli import add_bench_parser, bench_spec_from_args
from cluster.bench.client import RequestRecord, ServerTiming
from cluster.bench.metrics import SLO, compute_metrics, distribution, e2e_ms, itls_ms, meets_slo, metrics_by_tag, percentile, tpot_ms, ttft_ms
from cluster.bench.report import format_slo, format_summary, result_document, run_to_dict, write_json
from cluster.bench.sweep import bisection_bounds, max_rate_meeting, run_sweep
from cluster.bench.workloads import ModelLimits, WorkloadSpec, build_workload


def record(index, send_s, chunk_s, chunk_tokens=None, end_s=None, prompt_len=10, tag="", **overrides) -> RequestRecord:
    chunk_tokens = chunk_tokens or [1] * len(chunk_s)
    fields = dict(
        index=index,
        req_id=f"r{index}",
        tag=tag,
        prompt_len=prompt_len,
        max_tokens=sum(chunk_tokens),
        scheduled_s=send_s,
        send_s=send_s,
        chunk_s=list(chunk_s),
        chunk_tokens=chunk_tokens,
        end_s=chunk_s[-1] if end_s is None else end_s,
        usage_completion_tokens=sum(chunk_tokens),
        finish_reason="length",
        timing=ServerTiming(router_queue_ms=1.0, prefill_compute_ms=50.0, kv_transfer_ms=5.0, time_to_first_token_ms=90.0, decode_ms=300.0, total_ms=400.0),
    )
    fields.update(overrides)
    return RequestRecord(**fields)


def failed(index, send_s) -> RequestRecord:
    return RequestRecord(index, f"r{index}", "", 10, 4, send_s, send_s, end_s=send_s + 0.01, error="UNAVAILABLE: no decode worker")


# -- per request ----------------------------------------------------------------------------


def test_one_token_per_chunk():
    # Sent at 1.0 s; tokens at 1.2, 1.3, 1.5, 1.6 s; the stream ends with the last one.
    r = record(0, 1.0, [1.2, 1.3, 1.5, 1.6])
    assert ttft_ms(r) == pytest.approx(200.0)
    assert e2e_ms(r) == pytest.approx(600.0)
    assert tpot_ms(r) == pytest.approx((600.0 - 200.0) / 3)  # 133.33: three tokens after the first
    assert itls_ms(r) == pytest.approx([100.0, 200.0, 100.0])


def test_chunks_with_several_tokens_and_a_final_message_without_tokens():
    # 4 tokens in 3 chunks (1, 2, 1) at 0.1, 0.3, 0.4 s; the last message (no tokens) at 0.5 s.
    r = record(0, 0.0, [0.1, 0.3, 0.4], chunk_tokens=[1, 2, 1], end_s=0.5)
    assert r.output_tokens == 4
    assert ttft_ms(r) == pytest.approx(100.0)
    assert e2e_ms(r) == pytest.approx(500.0)  # E2E runs to the end of the stream
    assert tpot_ms(r) == pytest.approx(400.0 / 3)  # per token, not per chunk
    assert itls_ms(r) == pytest.approx([200.0, 100.0])  # per gap between chunks


def test_one_token_output_has_no_tpot_and_cannot_miss_a_tpot_slo():
    r = record(0, 0.0, [0.25])
    assert tpot_ms(r) is None and itls_ms(r) == []
    assert meets_slo(r, SLO(ttft_ms=300, tpot_ms=1))
    assert not meets_slo(r, SLO(ttft_ms=200))


def test_failed_request_has_no_latency_and_never_meets_an_slo():
    r = failed(0, 0.0)
    assert not r.ok
    assert ttft_ms(r) is None and e2e_ms(r) is None and tpot_ms(r) is None and itls_ms(r) == []
    assert not meets_slo(r, SLO())
    aborted = record(1, 0.0, [0.1, 0.2], finish_reason="abort")
    assert not aborted.ok


# -- distributions --------------------------------------------------------------------------


def test_percentiles_interpolate_between_closest_ranks():
    values = [float(v) for v in range(10, 0, -1)]  # 10..1, unsorted on purpose
    assert percentile(values, 50) == pytest.approx(5.5)  # rank 4.5: halfway between 5 and 6
    assert percentile(values, 90) == pytest.approx(9.1)  # rank 8.1: 9 + 0.1 * (10 - 9)
    assert percentile(values, 99) == pytest.approx(9.91)  # rank 8.91
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 10.0
    assert percentile([7.0], 99) == 7.0
    d = distribution(values)
    assert (d.count, d.mean, d.p50, d.min, d.max) == (10, 5.5, 5.5, 1.0, 10.0)
    assert distribution([]).mean is None
    with pytest.raises(ValueError):
        percentile([], 50)


# -- a run ----------------------------------------------------------------------------------


def four_records() -> list[RequestRecord]:
    return [
        # TTFT 100, TPOT (400-100)/3 = 100, E2E 400: within TTFT<=250 and TPOT<=150
        record(0, 0.0, [0.1, 0.2, 0.3, 0.4], prompt_len=10, tag="short"),
        # TTFT 300 (misses the TTFT SLO), TPOT (600-300)/3 = 100
        record(1, 0.5, [0.8, 0.9, 1.0, 1.1], prompt_len=20, tag="long"),
        # TTFT 200, TPOT (1000-200)/3 = 266.7 (misses the TPOT SLO)
        record(2, 1.0, [1.2, 1.4, 1.6, 2.0], prompt_len=30, tag="short"),
        failed(3, 1.5),
    ]


def test_run_metrics_by_hand():
    m = compute_metrics(four_records(), duration_s=2.0, slo=SLO(ttft_ms=250, tpot_ms=150))
    assert (m.num_requests, m.completed, m.failed) == (4, 3, 1)
    assert m.total_input_tokens == 60 and m.total_output_tokens == 12  # failed one not counted
    assert m.request_throughput == pytest.approx(1.5)  # 3 completed / 2 s
    assert m.output_throughput == pytest.approx(6.0)  # 12 tokens / 2 s
    assert m.total_token_throughput == pytest.approx(36.0)  # (60 + 12) / 2 s
    assert m.goodput == pytest.approx(0.5)  # only request 0 meets both SLOs: 1 / 2 s
    assert m.slo_attainment == pytest.approx(0.25)  # 1 of 4 sent, the failure counts as a miss
    assert m.ttft_ms.mean == pytest.approx(200.0) and m.ttft_ms.p50 == pytest.approx(200.0)
    assert m.ttft_ms.p99 == pytest.approx(298.0)  # rank 1.98 of [100, 200, 300]: 200 + 0.98 * 100
    assert m.tpot_ms.mean == pytest.approx((100 + 100 + 800 / 3) / 3)
    assert m.e2e_ms.max == pytest.approx(1000.0)
    # ITL over every gap of every stream: 100,100,100 | 100,100,100 | 200,200,400
    assert m.itl_ms.count == 9
    assert m.itl_ms.mean == pytest.approx(1400 / 9)
    assert m.itl_ms.p50 == pytest.approx(100.0)
    assert m.itl_ms.p90 == pytest.approx(240.0)  # rank 7.2: 200 + 0.2 * (400 - 200)
    assert m.stages_ms["kv_transfer_ms"].mean == pytest.approx(5.0) and m.stages_ms["kv_transfer_ms"].count == 3


def test_no_slo_means_every_completed_request_is_good():
    m = compute_metrics(four_records(), duration_s=2.0)
    assert m.goodput == pytest.approx(m.request_throughput) and m.slo_attainment == pytest.approx(0.75)
    assert compute_metrics(four_records(), duration_s=2.0, slo=SLO(e2e_ms=500)).goodput == pytest.approx(0.5)


def test_metrics_by_tag_share_the_run_duration():
    by_tag = metrics_by_tag(four_records(), duration_s=2.0, slo=SLO(ttft_ms=250, tpot_ms=150))
    assert set(by_tag) == {"short", "long"}
    assert by_tag["short"].completed == 2 and by_tag["short"].request_throughput == pytest.approx(1.0)
    assert by_tag["long"].ttft_ms.mean == pytest.approx(300.0)


def test_json_is_strict_and_holds_derived_fields(tmp_path):
    records = four_records()
    m = compute_metrics(records, 2.0, SLO(ttft_ms=250, tpot_ms=150))
    path = write_json(tmp_path / "r.json", result_document("bench", {"rate": math.inf}, run_to_dict(m, records)))
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    doc = json.loads(text)
    assert doc["config"]["rate"] is None
    assert [r["meets_slo"] for r in doc["records"]] == [True, False, False, False]
    assert doc["records"][2]["tpot_ms"] == pytest.approx(800 / 3)
    assert doc["records"][3]["ttft_ms"] is None and doc["records"][3]["send_s"] == 1.5
    table = format_summary(m, "hand")
    assert "TTFT<=250ms, TPOT<=150ms" in table and "0.500" in table and "25.0%" in table
    assert format_slo(SLO(ttft_ms=10748.63, e2e_ms=2000)) == "TTFT<=10748.6ms, E2E<=2000ms"


# -- sweep ----------------------------------------------------------------------------------


def test_max_rate_is_the_top_of_the_passing_prefix():
    points = [(1.0, 1.0), (2.0, 0.9), (4.0, 0.85), (8.0, 0.95)]  # 8 passing after 4 failed is noise
    assert max_rate_meeting(points) == 2.0  # exactly 90% passes
    assert max_rate_meeting(points, target=0.95) == 1.0
    assert max_rate_meeting([(1.0, 0.5), (2.0, 1.0)]) is None
    assert max_rate_meeting(list(reversed(points))) == 2.0  # order of the points does not matter
    assert bisection_bounds(points) == (2.0, 4.0)
    assert bisection_bounds([(1.0, 1.0), (2.0, 1.0)]) is None  # nothing failed: nothing to bisect


def test_sweep_runs_the_grid_then_bisects():
    template = compute_metrics(four_records(), 2.0)
    tried = []

    async def run_at(rate):
        tried.append(rate)
        return dataclasses.replace(template, slo_attainment=1.0 if rate <= 3.0 else 0.5)

    import asyncio

    result = asyncio.run(run_sweep(run_at, [4.0, 1.0, 2.0, 8.0], refine_steps=2))
    # grid in rising order, then (2+4)/2 = 3 passes, then (3+4)/2 = 3.5 fails
    assert tried == [1.0, 2.0, 4.0, 8.0, 3.0, 3.5]
    assert result.max_rate == 3.0
    assert [p.rate for p in result.points] == [1.0, 2.0, 3.0, 3.5, 4.0, 8.0]
    with pytest.raises(ValueError):
        asyncio.run(run_sweep(run_at, [math.inf]))


# -- arrivals and workloads -----------------------------------------------------------------


def test_arrivals_have_the_requested_rate_exactly_as_vllm_draws_them():
    """vLLM's bench serve: a gap before every request, all scaled so that the last is sent at
    num_requests / rate whatever the seed (unscaled, 200 requests at 4/s ended at 44-56 s over
    seeds 0-19: an offered load, and a measured throughput, a seed's luck off vLLM's)."""
    assert arrival_offsets(5, ArrivalSpec(rate=math.inf)) == [0.0] * 5
    for seed in range(20):
        offsets = arrival_offsets(200, ArrivalSpec(rate=4.0, seed=seed))
        assert offsets == sorted(offsets) and offsets[0] > 0
        assert offsets[-1] == pytest.approx(50.0)
    assert arrival_offsets(4001, ArrivalSpec(rate=4.0, seed=3)) == arrival_offsets(4001, ArrivalSpec(rate=4.0, seed=3))  # seeded
    # Infinite burstiness: evenly spaced (it was a gamma of shape inf: NaN offsets, all sent at once).
    assert arrival_offsets(4, ArrivalSpec(rate=2.0, burstiness=math.inf)) == pytest.approx([0.5, 1.0, 1.5, 2.0])

    def cv2(burstiness):  # squared coefficient of variation of the gaps: 1 / shape
        o = arrival_offsets(4001, ArrivalSpec(rate=4.0, burstiness=burstiness, seed=1))
        gaps = [b - a for a, b in zip(o, o[1:])]
        return statistics.pvariance(gaps) / statistics.mean(gaps) ** 2

    assert cv2(1.0) == pytest.approx(1.0, rel=0.15)  # Poisson
    assert cv2(0.25) == pytest.approx(4.0, rel=0.2)  # bursty
    with pytest.raises(ValueError, match="burstiness"):
        arrival_offsets(3, ArrivalSpec(rate=1.0, burstiness=0))


def test_phased_arrivals_follow_each_phase_rate():
    offsets = phased_offsets([(200.0, 1.0), (0.0, 5.0), (200.0, 4.0)], seed=2)
    first = sum(1 for t in offsets if t < 200.0)
    second = len(offsets) - first
    assert offsets[0] == 0.0 and offsets == sorted(offsets) and offsets[-1] < 400.0
    assert first == pytest.approx(200, rel=0.2) and second == pytest.approx(800, rel=0.15)


LIMITS = ModelLimits(vocab_size=50, max_context_len=4096, eos_token_ids=(2,))


def test_synthetic_workloads():
    fixed = build_workload(WorkloadSpec(num_requests=5, input_len=7, output_len=3), LIMITS)
    assert [(len(r.prompt_token_ids), r.max_tokens, r.prompt_len) for r in fixed] == [(7, 3, 7)] * 5
    assert all(2 not in r.prompt_token_ids and all(0 <= t < 50 for t in r.prompt_token_ids) for r in fixed)
    assert fixed == build_workload(WorkloadSpec(num_requests=5, input_len=7, output_len=3), LIMITS)  # seeded
    ranged = build_workload(WorkloadSpec(num_requests=50, input_len=100, output_len=10, range_ratio=0.5), LIMITS)
    assert all(50 <= r.prompt_len <= 150 and 5 <= r.max_tokens <= 15 for r in ranged)
    assert len({r.prompt_len for r in ranged}) > 10
    mixed = build_workload(WorkloadSpec(kind="mixed", num_requests=10, input_len=8, long_input_len=64, long_fraction=0.3), LIMITS)
    assert sorted(r.tag for r in mixed).count("long") == 3
    assert all(r.prompt_len == (64 if r.tag == "long" else 8) for r in mixed)
    shared = build_workload(WorkloadSpec(kind="prefix", num_requests=20, num_prefixes=2, prefix_len=16, input_len=4), LIMITS)
    groups = {}
    for r in shared:
        groups.setdefault(r.tag, set()).add(tuple(r.prompt_token_ids[:16]))
    assert set(groups) == {"prefix-0", "prefix-1"} and all(len(p) == 1 for p in groups.values())
    with pytest.raises(ValueError, match="context"):
        build_workload(WorkloadSpec(input_len=4000, output_len=200), LIMITS)
    with pytest.raises(ValueError, match="range_ratio"):
        build_workload(WorkloadSpec(range_ratio=1.5), LIMITS)


def test_sharegpt_workload(tmp_path):
    data = [
        {"conversations": [{"from": "human", "value": "Tell me about the sea, please."}, {"from": "gpt", "value": "x" * 40}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "a long enough reply here"}]},  # prompt too short
        {"conversations": [{"from": "human", "value": "only one turn"}]},
        {"id": "malformed"},
        {"conversations": [{"from": "human", "value": "What is two plus two?"}, {"from": "gpt", "value": "y" * 80}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    requests = build_workload(WorkloadSpec(kind="sharegpt", num_requests=10, dataset_path=str(path), seed=4), LIMITS)
    assert sorted(r.prompt_text for r in requests) == ["Tell me about the sea, please.", "What is two plus two?"]
    assert sorted(r.max_tokens for r in requests) == [10, 20]  # estimated at 4 bytes per token
    fixed = build_workload(WorkloadSpec(kind="sharegpt", dataset_path=str(path), fixed_output_len=True, output_len=6), LIMITS)
    assert {r.max_tokens for r in fixed} == {6}
    with pytest.raises(ValueError, match="dataset_path"):
        build_workload(WorkloadSpec(kind="sharegpt"), LIMITS)


def test_sharegpt_is_the_set_vllms_bench_serve_keeps_with_its_flags(tmp_path):
    """vLLM keeps prompts of at most 1,024 tokens and pairs of at most 2,048; its
    --sharegpt-output-len fixes every request's length; and it leaves the end of a real
    conversation to the model (no ignore_eos), as the synthetic workloads do not."""
    data = [  # (no tokenizer: four bytes a token)
        {"conversations": [{"from": "human", "value": "p" * 4200}, {"from": "gpt", "value": "x" * 40}]},  # prompt > 1,024
        {"conversations": [{"from": "human", "value": "q" * 4000}, {"from": "gpt", "value": "y" * 4400}]},  # pair > 2,048
        {"conversations": [{"from": "human", "value": "What is two plus two?"}, {"from": "gpt", "value": "y" * 80}]},
        {"conversations": [{"from": "human", "value": "r" * 1851}, {"from": "gpt", "value": "y" * 80}]},  # ~463 tokens: kept
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    limits = ModelLimits(vocab_size=50, max_context_len=32768)
    kept = build_workload(WorkloadSpec(kind="sharegpt", num_requests=10, dataset_path=str(path), seed=4), limits)
    assert sorted(len(r.prompt_text) for r in kept) == [len("What is two plus two?"), 1851]
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    spec = bench_spec_from_args(parser.parse_args(["bench", "--address", "a:1", "--dataset-name", "sharegpt", "--dataset-path", str(path),
                                                   "--sharegpt-output-len", "7"]))
    assert spec.workload.fixed_output_len and spec.workload.output_len == 7 and spec.ignore_eos is False
    assert bench_spec_from_args(parser.parse_args(["bench", "--address", "a:1"])).ignore_eos is True
    random = bench_spec_from_args(parser.parse_args(["bench", "--address", "a:1", "--output-len", "64", "--sharegpt-output-len", "7"])).workload
    assert (random.output_len, random.fixed_output_len) == (64, False)  # a ShareGPT flag, as in vLLM
    # --model-dir's tokenizer counts where it has one; a SentencePiece-only checkpoint's lengths are estimated.
    sentencepiece = tmp_path / "spm"
    sentencepiece.mkdir()
    (sentencepiece / "config.json").write_text(json.dumps({"vocab_size": 50}))
    args = parser.parse_args(["bench", "--backend", "openai", "--base-url", "http://x", "--model-dir", str(sentencepiece),
                              "--dataset-name", "sharegpt", "--dataset-path", str(path)])
    assert bench_spec_from_args(args).workload.tokenizer_path is None
    with pytest.raises(ValueError, match="tokenizer: cannot load"):
        build_workload(WorkloadSpec(kind="sharegpt", dataset_path=str(path), tokenizer_path=str(sentencepiece)), limits)


def test_bench_flags_become_a_spec():
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["bench", "--address", "127.0.0.1:1", "--workload", "mixed", "--request-rate", "2.5", "--burstiness", "0.5", "--max-concurrency", "4", "--slo-ttft-ms", "300", "--sweep", "1,2,4", "--no-ignore-eos"]
    )
    spec = bench_spec_from_args(args)
    assert args.bench_handler.__name__ == "run_bench" and args.sweep == [1.0, 2.0, 4.0]
    assert (spec.workload.kind, spec.arrivals.rate, spec.arrivals.burstiness, spec.max_concurrency) == ("mixed", 2.5, 0.5, 4)
    assert spec.slo == SLO(ttft_ms=300.0) and spec.ignore_eos is False
    assert parser.parse_args(["bench", "--address", "a:1"]).request_rate == math.inf
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--address", "a:1", "--request-rate", "0"])


def test_request_goodput_is_written_only_where_an_slo_was_set_as_vllm_writes_it():
    """Without an SLO every request "met" it: the key equalled request_throughput, and a script
    reading it took every request for within its objectives."""
    from cluster.bench.report import vllm_keys

    records = [record(0, 0.0, [0.2, 0.3]), record(1, 0.1, [0.9, 1.0])]
    assert vllm_keys(compute_metrics(records, 1.0))["request_goodput"] is None
    assert vllm_keys(compute_metrics(records, 1.0, SLO(ttft_ms=500.0)))["request_goodput"] == pytest.approx(1.0)


def test_random_lengths_span_vllms_range():
    """[floor(len (1 - r)), ceil(len (1 + r))]: the top was one token short (140 for 128 and 0.1)."""
    from cluster.bench.workloads import _jitter
    import random as random_module

    rng = random_module.Random(0)
    drawn = {_jitter(rng, 128, 0.1) for _ in range(5000)}
    assert min(drawn) == 115 and max(drawn) == 141


def test_warm_up_requests_keep_to_max_concurrency():
    """As vLLM's warm-up goes through its semaphore: all were sent at once."""
    import asyncio

    from cluster.bench.client import BenchClient, ClientConfig

    in_flight, most = [0], [0]

    class Counting(BenchClient):
        async def _send(self, index, request, offset, req_id=None):
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
            await asyncio.sleep(0.01)
            in_flight[0] -= 1
            return record(index, 0.0, [0.01])

    asyncio.run(Counting(ClientConfig("127.0.0.1:1", max_concurrency=2)).warm_up([None] * 6))
    assert most[0] == 2
