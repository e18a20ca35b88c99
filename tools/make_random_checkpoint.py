"""Build a random-weight Llama checkpoint of a real model's shape, with a working tokenizer.

    python tools/make_random_checkpoint.py --out /work/ckpt/smollm2-135m-fp32 --dtype float32

For benchmarks and load tests that need a model of realistic size without a model hub: the
weights are random (``transformers``' own initialisation, seeded) and the directory is what
``save_pretrained`` writes, so pdserve, transformers and vLLM load it alike. The tokenizer is a
byte-level BPE trained on the running interpreter's standard library, with the shape's special
tokens first; its vocabulary never exceeds the model's (a small corpus can leave it short, and
the unused embedding rows are simply never produced by the tokenizer).
"""

from __future__ import annotations

import argparse
import logging
import sysconfig
import time
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from hf_tokenizer import save_fast_tokenizer  # tools/ is on the path: these run as scripts

logger = logging.getLogger("make_random_checkpoint")

EOT = "<|endoftext|>"
# SmolLM2's first three ids; a chat template could use the last two.
SPECIAL_TOKENS = [EOT, "<|im_start|>", "<|im_end|>"]
# GPT-2 style pieces: words with their leading space, digit runs, punctuation runs, whitespace.
PRETOKENIZE_PATTERN = r" ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Enough text for tens of thousands of merges, small enough to train in well under a minute.
CORPUS_CHARS = 40_000_000

SHAPES = {
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    ),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="model directory to write")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]), help="tokenizer corpus root")
    return p.parse_args(argv)


def corpus_texts(root: Path, max_chars: int) -> list[str]:
    """The stdlib's ``.py`` files in sorted order, up to ``max_chars`` characters in all."""
    texts, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "dist-packages" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    if not texts:
        raise SystemExit(f"{root}: no Python sources to train the tokenizer on")
    return texts


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE with at most ``vocab_size`` ids; ``<|endoftext|>`` is id 0 and opens every text."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    eot_id = tokenizer.token_to_id(EOT)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B", special_tokens=[(EOT, eot_id)]
    )
    return tokenizer


def build(out: Path, shape: str, dtype: torch.dtype, seed: int, stdlib: Path) -> Path:
    """Write config, random weights, generation config and tokenizer of ``shape`` to ``out``."""
    config = LlamaConfig(**SHAPES[shape])
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.config.dtype = dtype
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        do_sample=False,
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)

    started = time.perf_counter()
    tokenizer = train_tokenizer(corpus_texts(stdlib, CORPUS_CHARS), config.vocab_size)
    if tokenizer.get_vocab_size() > config.vocab_size:
        raise SystemExit(f"tokenizer has {tokenizer.get_vocab_size()} ids, the model only {config.vocab_size}")
    logger.info("tokenizer: %d ids in %.1fs", tokenizer.get_vocab_size(), time.perf_counter() - started)
    save_fast_tokenizer(tokenizer, out, EOT, config.max_position_embeddings)
    num_params = sum(p.numel() for p in model.parameters())
    logger.info("wrote %s: %s shape, %.1fM parameters, %s", out, shape, num_params / 1e6, dtype)
    return out


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    build(args.out, args.shape, getattr(torch, args.dtype), args.seed, args.stdlib)


if __name__ == "__main__":
    main()
