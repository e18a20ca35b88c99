"""`pdserve bench` against a live local deployment: a complete, self-consistent JSON and the plots."""

from __future__ import annotations

import argparse
import json

import pytest

from cluster.bench.cli import add_bench_parser
from cluster.bench.sweep import max_rate_meeting
from router.config import Disaggregation, RouterConfig
from tests.serving import running_deployment

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
NUM_REQUESTS = 24
OUTPUT_LEN = 6


@pytest.fixture(scope="module")
def deployment(ray_session, e2e_model):
    # Every prompt through the prefill actor, so each stage of the timing breakdown is exercised.
    with running_deployment(e2e_model, 1, 1, RouterConfig(disaggregation=Disaggregation.ALWAYS)) as d:
        yield d


def bench(address: str, out, *flags: str) -> int:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--address", address, "--out", str(out), "--no-progress", *flags])
    return args.bench_handler(args)


def assert_png(path) -> None:
    import matplotlib.image

    data = open(path, "rb").read()
    assert data.startswith(PNG_SIGNATURE), path
    assert matplotlib.image.imread(path).shape[0] > 100


def assert_consistent(run: dict, num_requests: int) -> None:
    """Counts match, every record's derived fields follow from its raw timestamps."""
    metrics, records = run["metrics"], run["records"]
    assert metrics["num_requests"] == len(records) == num_requests
    assert metrics["completed"] == num_requests and metrics["failed"] == 0
    for r in records:
        assert r["ok"] and r["error"] == "" and r["finish_reason"] == "length"
        # ignore_eos: exactly the requested number of tokens, streamed and in the usage
        assert r["output_tokens"] == r["max_tokens"] == r["usage_completion_tokens"] == OUTPUT_LEN
        assert r["prompt_len"] in (12, 40, 96)
        assert r["scheduled_s"] <= r["send_s"] + 1e-3 and r["chunk_s"] == sorted(r["chunk_s"])
        assert r["send_s"] < r["chunk_s"][0] <= r["chunk_s"][-1] <= r["end_s"]
        assert 0 < r["ttft_ms"] <= r["e2e_ms"]
        assert r["ttft_ms"] == pytest.approx(1000 * (r["chunk_s"][0] - r["send_s"]))
        assert r["tpot_ms"] == pytest.approx((r["e2e_ms"] - r["ttft_ms"]) / (OUTPUT_LEN - 1))
        assert len(r["itl_ms"]) == len(r["chunk_s"]) - 1
        timing = r["timing"]
        assert 0 < timing["time_to_first_token_ms"] <= timing["total_ms"]
        # The router's clock starts after the client's send and its first token leaves before
        # the client reads it (slack for timer granularity).
        assert timing["time_to_first_token_ms"] <= r["ttft_ms"] + 5
        assert r["prefill_worker_id"] and r["decode_worker_id"]
    duration = metrics["duration_s"]
    assert duration >= max(r["end_s"] for r in records) - 1e-6
    assert metrics["total_output_tokens"] == sum(r["output_tokens"] for r in records)
    assert metrics["total_input_tokens"] == sum(r["prompt_len"] for r in records)
    assert metrics["request_throughput"] == pytest.approx(num_requests / duration)
    assert metrics["output_throughput"] == pytest.approx(metrics["total_output_tokens"] / duration)
    good = sum(r["meets_slo"] for r in records)
    assert metrics["goodput"] == pytest.approx(good / duration)
    assert metrics["slo_attainment"] == pytest.approx(good / num_requests)
    assert metrics["ttft_ms"]["count"] == num_requests
    assert metrics["ttft_ms"]["mean"] == pytest.approx(sum(r["ttft_ms"] for r in records) / num_requests)
    assert metrics["itl_ms"]["count"] == sum(len(r["itl_ms"]) for r in records)
    assert metrics["e2e_ms"]["max"] == pytest.approx(max(r["e2e_ms"] for r in records))
    assert metrics["stages_ms"]["prefill_compute_ms"]["count"] == num_requests


def test_bench_run_writes_consistent_json_and_plots(deployment, tmp_path, capsys):
    flags = ["--workload", "mixed", "--num-requests", str(NUM_REQUESTS), "--input-len", "12", "--long-input-len", "96", "--long-fraction", "0.25"]
    flags += ["--output-len", str(OUTPUT_LEN), "--request-rate", "40", "--max-concurrency", "6", "--num-warmup", "2", "--seed", "5"]
    flags += ["--slo-ttft-ms", "5000", "--slo-tpot-ms", "2000"]
    assert bench(deployment.address, tmp_path, *flags) == 0
    assert "Request throughput" in capsys.readouterr().out
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["schema"] == "pdserve-bench/1" and doc["kind"] == "bench"
    assert doc["config"]["address"] == deployment.address and doc["config"]["workload"]["kind"] == "mixed"
    assert_consistent(doc, NUM_REQUESTS)
    assert set(doc["metrics_by_tag"]) == {"long", "short"}
    assert doc["metrics_by_tag"]["long"]["num_requests"] == 6  # 25% of 24
    assert sorted(p.rsplit("/", 1)[-1] for p in doc["plots"]) == ["latency_cdf.png", "stage_breakdown.png"]
    for path in doc["plots"]:
        assert_png(path)


def test_sweep_writes_every_rate_and_the_curve(deployment, tmp_path):
    """Each rate's run sends prompts of its own: the same prompts again were prefix-cache hits,
    and every rate after the first measured a warm cache."""
    flags = ["--num-requests", "8", "--input-len", "40", "--output-len", str(OUTPUT_LEN), "--sweep", "20,80", "--num-warmup", "1"]
    flags += ["--slo-ttft-ms", "5000", "--slo-tpot-ms", "2000"]
    assert bench(deployment.address, tmp_path, *flags) == 0
    doc = json.loads((tmp_path / "sweep.json").read_text())
    assert doc["kind"] == "sweep" and [run["rate"] for run in doc["runs"]] == [20.0, 80.0]
    for run in doc["runs"]:
        assert_consistent(run, 8)
        assert sum(record["cached_prompt_tokens"] for record in run["records"]) == 0
    assert doc["max_rate"] == max_rate_meeting([(run["rate"], run["metrics"]["slo_attainment"]) for run in doc["runs"]], 0.9)
    assert any(p.endswith("rate_sweep.png") for p in doc["plots"])
    for path in doc["plots"]:
        assert_png(path)


def test_vllm_flag_names_and_the_openai_backend_write_vllms_keys(deployment, e2e_model, tmp_path):
    """vLLM's `bench serve` command line, pointed at pdserve's OpenAI API: the same client
    code measures it, and the JSON carries vLLM's keys, equal to pdserve's own figures."""
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    base_url = f"http://127.0.0.1:{deployment.http_port}"
    args = parser.parse_args([
        "bench", "--backend", "openai", "--base-url", base_url, "--model-dir", str(e2e_model.path), "--out", str(tmp_path),
        "--no-progress", "--dataset-name", "random", "--num-prompts", "6", "--random-input-len", "12",
        "--random-output-len", str(OUTPUT_LEN), "--num-warmups", "1", "--goodput", "ttft:5000", "tpot:2000", "--no-plots",
    ])
    assert args.bench_handler(args) == 0
    doc = json.loads((tmp_path / "bench.json").read_text())
    metrics = doc["metrics"]
    assert doc["config"]["backend"] == "openai" and doc["config"]["slo"] == {"ttft_ms": 5000.0, "tpot_ms": 2000.0, "e2e_ms": None}
    assert doc["completed"] == metrics["completed"] == 6 and doc["failed"] == 0
    assert doc["total_output_tokens"] == 6 * OUTPUT_LEN and doc["total_input_tokens"] == 6 * 12
    assert all(r["output_tokens"] == OUTPUT_LEN and r["ok"] for r in doc["records"])
    for vllm_name, ours in (("ttft", "ttft_ms"), ("tpot", "tpot_ms"), ("itl", "itl_ms"), ("e2el", "e2e_ms")):
        assert doc[f"mean_{vllm_name}_ms"] == pytest.approx(metrics[ours]["mean"])
        assert doc[f"median_{vllm_name}_ms"] == pytest.approx(metrics[ours]["p50"])
        assert doc[f"p99_{vllm_name}_ms"] == pytest.approx(metrics[ours]["p99"])
        assert doc[f"std_{vllm_name}_ms"] >= 0
    assert doc["output_throughput"] == pytest.approx(metrics["output_throughput"])
    assert doc["request_goodput"] == pytest.approx(metrics["goodput"])


def test_without_matplotlib_the_json_is_written_and_a_warning_says_why(deployment, tmp_path, monkeypatch, caplog):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a))
    flags = ["--num-requests", "4", "--input-len", "12", "--output-len", str(OUTPUT_LEN), "--num-warmup", "0"]
    assert bench(deployment.address, tmp_path, *flags) == 0
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["plots"] == [] and doc["completed"] == 4
    assert "matplotlib is not installed" in caplog.text
