"""The prefix-cache scenario's table tells the truth: what each cluster computed, served from its
caches and pushed, from the requests' own usage and timing (a small run on the test model)."""

from __future__ import annotations

import json

from cluster.bench.cli import build_parser
from cluster.bench.scenarios import prefix_cache


def test_the_prefix_scenario_counts_what_caching_saved(ray_cluster, e2e_model, tmp_path):
    args = build_parser().parse_args([
        "bench-scenario", "prefix-cache", "--model", str(e2e_model.path), "--out", str(tmp_path), "--no-progress",
        "--num-requests", "6", "--num-prefixes", "1", "--prefix-len", "64", "--suffix-len", "8", "--output-len", "3",
        "--request-rate", "2", "--num-prefill", "1", "--num-decode", "1", "--configs", "off,kv_aware",
    ])
    outcome = prefix_cache.run(args)
    assert outcome.ok
    rows = json.loads(outcome.json_path.read_text())["rows"]
    off, kv_aware = rows["off"], rows["kv_aware"]
    assert off["completed"] == kv_aware["completed"] == 6
    assert off["prompt_tokens"] == kv_aware["prompt_tokens"] == 6 * 72
    # Without caching every prompt token is computed and all 5 blocks of each prompt are pushed.
    assert off["prompt_tokens_computed"] == off["prompt_tokens"] and off["cached_prompt_tokens"] == 0
    block_bytes = off["kv_bytes"] // (6 * 5)
    assert off["kv_bytes"] == 6 * 5 * block_bytes
    # With caching, a request that found the prefix computed its 8 own tokens (and the rest of the
    # last block: the cache holds whole blocks) and received at most its last 2 blocks.
    assert kv_aware["cached_prompt_tokens"] > 0 and kv_aware["cached_prompt_tokens"] % 16 == 0
    assert kv_aware["prompt_tokens_computed"] == kv_aware["prompt_tokens"] - kv_aware["cached_prompt_tokens"]
    assert kv_aware["kv_bytes"] < off["kv_bytes"]
    assert "| kv_aware |" in (tmp_path / "comparison.md").read_text()
