"""What a quantized KV cache costs in accuracy: perplexity through the engine's own cache.

Each text runs through the engine's model in prefill chunks over a sequence of the engine's
blocks, so every chunk's queries attend keys and values read back from the cache (quantized
ones, for an int8 or fp8 cache) — the chunks before it and its own. The negative log-likelihood
of every next token is summed: exp(mean) is the perplexity. Run the same texts through an
unquantized engine for the reference.

    python -m engine.kv_accuracy [--model DIR] [--dtype float32] [--chunk 32]

Without ``--model``: the built-in model on its held-out standard-library files (the files
``tools/train_default_model.py`` kept out of training, listed in the model's README).
"""

from __future__ import annotations

import argparse
import math
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.attention import SeqSlice
from engine.attention.block_tables import BlockTables
from engine.config import EngineConfig
from engine.default_model_path import DEFAULT_MODEL_PATH
from engine.llm_engine import LLMEngine

# The built-in model's held-out files (engine/default_model/README.md), relative to the stdlib.
HELD_OUT_FILES = (
    "asyncio/subprocess.py", "dataclasses.py", "encodings/base64_codec.py", "idlelib/config_key.py", "importlib/_abc.py",
    "multiprocessing/process.py", "ntpath.py", "pyclbr.py", "sre_parse.py", "timeit.py", "weakref.py",
)


@dataclass(slots=True)
class Perplexity:
    nll: float  # summed over tokens
    num_tokens: int
    top1: list[int] = field(default_factory=list)  # the most likely next token at every position

    def top1_agreement(self, other: "Perplexity") -> float:
        """Share of positions where both runs' most likely next token is the same (greedy
        agreement, teacher-forced: no divergence compounds)."""
        return sum(a == b for a, b in zip(self.top1, other.top1)) / max(1, len(self.top1))

    @property
    def value(self) -> float:
        return math.exp(self.nll / self.num_tokens)


def held_out_windows(tokenizer, window: int = 256, per_file: int = 4) -> list[list[int]]:
    """Up to ``per_file`` consecutive ``window``-token pieces of each held-out file."""
    root = Path(sysconfig.get_paths()["stdlib"])
    pieces = []
    for name in HELD_OUT_FILES:
        path = root / name
        if not path.is_file():
            continue
        ids = tokenizer(path.read_text(), add_special_tokens=False)["input_ids"]
        pieces.extend(ids[i : i + window] for i in range(0, min(len(ids), per_file * window) - window + 1, window))
    return pieces


@torch.inference_mode()
def perplexity(engine: LLMEngine, texts: list[list[int]], chunk: int = 32) -> Perplexity:
    """Teacher-forced perplexity of ``texts`` through ``engine``'s model and KV cache, in chunks."""
    nll, count, top1 = 0.0, 0, []
    block_size = engine.kv_cache.block_size
    for ids in texts:
        block_table = engine.allocator.allocate(-(-len(ids) // block_size))
        try:
            for start in range(0, len(ids) - 1, chunk):
                end = min(start + chunk, len(ids) - 1)
                meta = engine.runner.attention.build([SeqSlice(0, start, end - start)], BlockTables.holding([block_table]).array)
                logits = engine.runner.model(
                    torch.tensor(ids[start:end]), torch.arange(start, end), engine.kv_cache, meta, torch.arange(end - start)
                )
                nll += float(F.cross_entropy(logits.float(), torch.tensor(ids[start + 1 : end + 1]), reduction="sum"))
                count += end - start
                top1.extend(logits.argmax(dim=-1).tolist())
        finally:
            engine.allocator.free(block_table)
    return Perplexity(nll, count, top1)


def main() -> None:
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_PATH)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--chunk", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    texts = held_out_windows(AutoTokenizer.from_pretrained(args.model))
    results = {}
    for kv_dtype in ("auto", "int8", "fp8_e4m3"):
        engine = LLMEngine(args.model, EngineConfig(dtype=args.dtype, kv_cache_dtype=kv_dtype, num_threads=args.threads, num_kv_blocks=64))
        results[kv_dtype] = perplexity(engine, texts, args.chunk)
        base = results["auto"]
        print(
            f"kv {kv_dtype:9s} perplexity {results[kv_dtype].value:8.4f} ({results[kv_dtype].value / base.value - 1:+.2%} against the "
            f"{args.dtype} cache), top-1 agreement {results[kv_dtype].top1_agreement(base):.2%} over {results[kv_dtype].num_tokens} "
            f"tokens; {engine.kv_cache.bytes_per_block} bytes per block"
        )


if __name__ == "__main__":
    main()
