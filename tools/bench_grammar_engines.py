"""Measure the two grammar engines pdserve could use for structured outputs, on this CPU.

    python tools/bench_grammar_engines.py --model /work/ckpt/smollm2-135m-fp32

For xgrammar and llguidance: the time to compile a JSON schema against the model's tokenizer,
and the time to compute one step's token mask (and accept the sampled token) per sequence, at
batch 1 and batch 32, walking the token ids of a valid answer so that every step is one a real
decode takes. Both run with one thread (the engine computes masks on its own thread, beside the
forward). Needs both libraries installed; pdserve itself depends only on the one it chose.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoTokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "email", "role", "tags", "address"],
    "additionalProperties": False,
}
ANSWER = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@analytical.com",
    "role": "admin",
    "tags": ["math", "engines", "poetry"],
    "address": {"city": "London", "zip": "10001"},
}


def bench_xgrammar(tokenizer, vocab_size: int, tokens: list[int], batch: int) -> dict:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    compile_ms = (time.perf_counter() - start) * 1e3
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    bitmask = xgr.allocate_token_bitmask(batch, vocab_size)
    logits = torch.randn(batch, vocab_size)
    steps = []
    for token in tokens:
        start = time.perf_counter()
        for row, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, row)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        for matcher in matchers:
            assert matcher.accept_token(token), "the answer's token was refused"
        steps.append(time.perf_counter() - start)
    return {"compile_ms": compile_ms, "step_ms": steps}


def bench_llguidance(tokenizer, vocab_size: int, tokens: list[int], batch: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(batch)]
    compile_ms = (time.perf_counter() - start) * 1e3
    assert not matchers[0].is_error(), matchers[0].get_error()
    bitmask = llguidance.torch.allocate_token_bitmask(batch, vocab_size)
    logits = torch.randn(batch, vocab_size)
    steps = []
    for token in tokens:
        start = time.perf_counter()
        for row, matcher in enumerate(matchers):
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, row)
        llguidance.torch.apply_token_bitmask_inplace(logits, bitmask)
        for matcher in matchers:
            assert matcher.consume_token(token), matcher.get_error()
        steps.append(time.perf_counter() - start)
    return {"compile_ms": compile_ms, "step_ms": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a checkpoint directory (its tokenizer is used)")
    parser.add_argument("--batches", default="1,32")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    vocab_size = json.load(open(f"{args.model}/config.json"))["vocab_size"]
    tokens = tokenizer(json.dumps(ANSWER), add_special_tokens=False)["input_ids"]
    print(f"tokenizer vocab {len(tokenizer)}, model vocab {vocab_size}, answer {len(tokens)} tokens")
    for batch in [int(b) for b in args.batches.split(",")]:
        for name, bench in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
            bench(tokenizer, vocab_size, tokens, batch)  # warm: the first compile builds caches
            result = bench(tokenizer, vocab_size, tokens, batch)
            steps = sorted(result["step_ms"])
            per_seq = [s * 1e3 / batch for s in steps]
            print(
                f"{name:10s} batch {batch:2d}: compile {result['compile_ms']:7.1f} ms; per step per sequence "
                f"median {statistics.median(per_seq) * 1e3:7.1f} us, p90 {per_seq[int(len(per_seq) * 0.9)] * 1e3:7.1f} us, "
                f"max {per_seq[-1] * 1e3:8.1f} us; whole step at this batch median {statistics.median(steps) * 1e3:6.2f} ms"
            )


if __name__ == "__main__":
    main()
