"""What a grammar costs a decode step: TPOT of JSON-schema-constrained decoding against plain
decoding, same engine, same batch, same number of tokens.

    python tools/bench_structured_decoding.py --model /work/ckpt/smollm2-135m-fp32 --batches 1,8

Median over ``--repeats`` interleaved runs of each. Each run decodes ``--tokens`` tokens per sequence (ignore_eos, so plain and constrained runs
produce as many) at temperature 1 with a seed per sequence, after a warm-up; the constrained
runs use a schema whose answers are long enough (an array of strings up to ``--tokens``).
TPOT: per sequence, the time from the first timed step to the step that finished it, over
its tokens after the first; averaged over the batch (a sequence whose answer ends early does not
make the others' look slower).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.structured_output import StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "lines": {"type": "array", "items": {"type": "string"}}},
    "required": ["title", "lines"],
    "additionalProperties": False,
}


def run(engine: LLMEngine, batch: int, tokens: int, structured: StructuredOutput | None) -> float:
    prompts = [[(7 * i + 13 * j) % 1000 + 5 for j in range(32)] for i in range(batch)]
    params = [
        SamplingParams(max_tokens=tokens, temperature=1.0, seed=i, ignore_eos=structured is None, structured=structured)
        for i in range(batch)
    ]
    seqs = [engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params[i]) for i, p in enumerate(prompts)]
    while any(s.num_output_tokens == 0 for s in seqs):  # prefill and first tokens: not timed
        engine.step()
    start = time.perf_counter()
    tpots: dict[str, float] = {}
    while engine.has_unfinished_requests():
        engine.step()
        now = time.perf_counter()
        for seq in seqs:
            if seq.is_finished and seq.req_id not in tpots:
                tpots[seq.req_id] = (now - start) / max(1, seq.num_output_tokens - 1)
    produced = sum(s.num_output_tokens for s in seqs) / batch
    return sum(tpots.values()) / len(tpots), produced


# Answers of bounded length, for counting how many validate.
BOUNDED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}


def count_valid(engine: LLMEngine, seeds: int, batch: int = 16) -> tuple[int, int, int]:
    """(valid, ended by the grammar, answers) over ``seeds`` sampled answers to BOUNDED."""
    import jsonschema
    import tokenizers

    tokenizer = tokenizers.Tokenizer.from_file(str(engine.model_path / "tokenizer.json"))
    structured = StructuredOutput("json_schema", json.dumps(BOUNDED))
    valid = ended = 0
    for first in range(0, seeds, batch):
        count = min(batch, seeds - first)
        prompts = [[(11 * s + 3 * j) % 5000 + 5 for j in range(16 + s % 48)] for s in range(first, first + count)]
        params = [SamplingParams(max_tokens=256, temperature=1.0, seed=s, structured=structured) for s in range(first, first + count)]
        for completion in engine.generate(prompts, params):
            ended += completion.finish_reason.value == "eos"
            try:
                jsonschema.validate(json.loads(tokenizer.decode(completion.token_ids, skip_special_tokens=True)), BOUNDED)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
    return valid, ended, seeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--validity", type=int, default=0, help="also count valid answers over this many seeds")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = LLMEngine(args.model, EngineConfig(num_threads=args.threads, dtype="float32"))
    structured = StructuredOutput("json_schema", json.dumps(SCHEMA))
    run(engine, 2, 8, structured)  # warm: the grammar tokenizer, kernels
    for batch in [int(b) for b in args.batches.split(",")]:
        plain, constrained = [], []
        run(engine, batch, args.tokens, None)  # the KV cache's blocks in the order every later run finds them
        for repeat in range(args.repeats):  # interleaved, each first in turn, so drift hits both alike
            for which in ((None, structured) if repeat % 2 == 0 else (structured, None)):
                (plain if which is None else constrained).append(run(engine, batch, args.tokens, which))
        # Medians: one run in several lands far from the rest (40 against 47-50 ms at batch 32).
        best_plain = statistics.median(t for t, _ in plain)
        best_constrained = statistics.median(t for t, _ in constrained)
        tokens = min(n for _, n in constrained)
        print(
            f"batch {batch:2d}: TPOT plain {best_plain * 1e3:6.2f} ms, json_schema {best_constrained * 1e3:6.2f} ms "
            f"({best_constrained / best_plain:.3f}x; constrained runs produced >= {tokens:.0f} tokens per sequence)"
        )
    if args.validity:
        valid, ended, total = count_valid(engine, args.validity)
        print(f"validity: {valid}/{total} sampled answers validate against their schema; {ended}/{total} ended where the grammar did")


if __name__ == "__main__":
    main()
