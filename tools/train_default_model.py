"""Train pdserve's built-in default model: a small Llama that writes Python.

    python tools/train_default_model.py --out engine/default_model

The corpus is the running interpreter's own standard library (its ``.py`` sources, found
through ``sysconfig``), so training needs no download and no model hub. The run goes:

1. collect the library's modules, dropping tests and generated tables, and hold out a fixed
   set of files for validation (chosen by a hash of each relative path);
2. train a byte-level BPE tokenizer on the training files;
3. train a ``LlamaForCausalLM`` on random windows of the tokenized training files, with
   AdamW and a warmup + cosine learning-rate schedule, in bfloat16 autocast on the CPU;
4. save the weights as bfloat16 safetensors with the tokenizer and generation config, then
   reload the *saved* directory in float32 to measure validation perplexity, take sample
   generations, and write the model card (README.md) with those figures.

Every random choice is seeded, so the same stdlib and arguments give the same model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import re
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from hf_tokenizer import save_fast_tokenizer  # tools/ is on the path: these run as scripts

logger = logging.getLogger("train_default_model")

EOT = "<|endoftext|>"
# Test suites, Python 2 fixtures and the pydoc topic dump are not the library code we want
# the model to imitate; site-packages is not the standard library at all.
EXCLUDED_PARTS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "pydoc_data", "__pycache__"}
EXCLUDED_PREFIXES = ("config-", "_sysconfigdata")
# Codec and entity tables are mostly escape sequences; a few hundred KB of them teach a
# small model to babble hex. Density is escapes per 1000 characters: codec tables run 25-80,
# ordinary modules stay under 6, and the few small ones in between are constant tables too.
ESCAPE_RE = re.compile(r"\\x[0-9a-fA-F]{2}|\\u[0-9a-fA-F]{4}|0x[0-9a-fA-F]{2,}|\\[0-7]{3}")
MAX_ESCAPE_DENSITY = 10.0
# Identifiers keep their underscores (snake_case and dunders become whole tokens), digits and
# punctuation runs split as in GPT-2, and a newline with the indentation after it stays one
# piece, so BPE learns cheap tokens for each common indent level.
PRETOKENIZE_PATTERN = r" ?[\p{L}_][\p{L}\p{N}_]*| ?\p{N}+| ?[^\s\p{L}\p{N}_]+|\s+(?!\S)|\s+"
CHECK_SLICE_FILES = 4
# Packages later Pythons dropped (distutils in 3.12, lib2to3 in 3.13): a check slice drawn from
# them could not be recomputed there, and the test would have to skip.
REMOVED_IN_NEWER_PYTHONS = ("distutils/", "lib2to3/")
CHECK_SLICE_TOKENS = 512
SAMPLE_PROMPTS = ("def fibonacci(n):", "import os", "class Stack:")
# Greedy text from a model this small soon loops; light sampling is what reads like code.
SAMPLING = {"do_sample": True, "temperature": 0.7, "top_k": 40}
NUM_SAMPLE_TOKENS = 96


@dataclass(slots=True)
class Corpus:
    root: Path
    train_files: list[str]
    val_files: list[str]
    num_excluded_tables: int

    def read(self, rel: str) -> str:
        return (self.root / rel).read_text(encoding="utf-8")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="model directory to write")
    p.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]), help="corpus root")
    p.add_argument("--val-percent", type=float, default=4.0, help="share of files held out, by path hash")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--intermediate-size", type=int, default=688)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--max-positions", type=int, default=2048, help="max_position_embeddings in config.json")
    p.add_argument("--seq-len", type=int, default=256, help="training window in tokens")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr as a fraction of --lr")
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-windows", type=int, default=32, help="validation windows scored during training")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True, help="torch.compile the step")
    return p.parse_args()


def collect_corpus(root: Path, val_percent: float) -> Corpus:
    """The library's own modules under ``root``, split into train and held-out files."""
    train, val, num_tables = [], [], 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if EXCLUDED_PARTS.intersection(rel.parts[:-1]) or rel.parts[0].startswith(EXCLUDED_PREFIXES):
            continue
        if rel.name.startswith("test_") or rel.name.startswith(EXCLUDED_PREFIXES):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if len(ESCAPE_RE.findall(text)) * 1000 / max(len(text), 1) > MAX_ESCAPE_DENSITY:
            num_tables += 1
            continue
        (val if is_heldout(rel.as_posix(), val_percent) else train).append(rel.as_posix())
    if not train or not val:
        raise SystemExit(f"{root}: found {len(train)} training and {len(val)} held-out files; is this a stdlib?")
    return Corpus(root=root, train_files=train, val_files=val, num_excluded_tables=num_tables)


def is_heldout(rel_path: str, val_percent: float) -> bool:
    # A hash of the path, not a random draw: the split is the same on every run and machine.
    bucket = int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:4], "big") % 10_000
    return bucket < val_percent * 100


def train_tokenizer(corpus: Corpus, vocab_size: int) -> Tokenizer:
    """Byte-level BPE over the training files; ``<|endoftext|>`` (id 0) opens every file."""
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
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator((corpus.read(rel) for rel in corpus.train_files), trainer=trainer)
    # The leading EOT marks "start of a file", as in training, so a prompt is read as a file's opening.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B", special_tokens=[(EOT, tokenizer.token_to_id(EOT))]
    )
    return tokenizer


def encode_files(tokenizer: Tokenizer, texts: list[str]) -> torch.Tensor:
    """All files as one stream, each opened by EOT, which thereby also ends the file before it."""
    encodings = tokenizer.encode_batch(texts, add_special_tokens=True)
    return torch.tensor([i for enc in encodings for i in enc.ids], dtype=torch.long)


def build_model(args: argparse.Namespace, vocab_size: int, eot_id: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.max_positions,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,  # a third of the parameters at this size; tying costs nothing
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=eot_id,
    )
    return LlamaForCausalLM(config)


def lr_at(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cosine)


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.AdamW:
    # Norm gains stay undecayed; matrices (the tied embedding included) are decayed.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def windows(stream: torch.Tensor, seq_len: int, limit: int | None = None) -> torch.Tensor:
    """Consecutive non-overlapping windows of ``seq_len + 1`` tokens (inputs plus next targets)."""
    count = (len(stream) - 1) // seq_len
    if limit is not None:
        count = min(count, limit)
    starts = torch.arange(count) * seq_len
    return torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])


def batch_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


@torch.no_grad()
def mean_loss(model: torch.nn.Module, batches: torch.Tensor, batch_size: int, autocast: bool) -> float:
    """Token-weighted mean cross-entropy over ``batches`` (all windows have equal length)."""
    model.eval()
    total = 0.0
    for i in range(0, len(batches), batch_size):
        chunk = batches[i : i + batch_size]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            total += batch_loss(model, chunk).item() * len(chunk)
    model.train()
    return total / len(batches)


def train(model: LlamaForCausalLM, train_stream: torch.Tensor, val_batches: torch.Tensor, args) -> dict:
    """Run ``args.steps`` AdamW steps on random windows; returns the loss history."""
    optimizer = make_optimizer(model, args)
    generator = torch.Generator().manual_seed(args.seed)
    step_fn = torch.compile(batch_loss) if args.compile else batch_loss
    offsets = torch.arange(args.seq_len + 1)
    history = {"train": [], "val": []}
    smoothed, started, cpu_started = None, time.monotonic(), time.process_time()
    model.train()
    for step in range(args.steps):
        starts = torch.randint(0, len(train_stream) - args.seq_len - 1, (args.batch_size,), generator=generator)
        batch = train_stream[starts[:, None] + offsets]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = step_fn(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.item()
        smoothed = value if smoothed is None else 0.95 * smoothed + 0.05 * value
        last = step + 1 == args.steps
        if (step + 1) % 20 == 0 or last:
            elapsed = time.monotonic() - started
            history["train"].append((step + 1, smoothed))
            logger.info(
                "step %d/%d  loss %.3f (smoothed %.3f)  lr %.2e  %.0f tok/s  %.1f min",
                step + 1, args.steps, value, smoothed, lr_at(step, args),
                (step + 1) * args.batch_size * args.seq_len / elapsed, elapsed / 60,
            )
        if (step + 1) % args.eval_every == 0 or last:
            val = mean_loss(model, val_batches, args.batch_size, autocast=True)
            history["val"].append((step + 1, val))
            logger.info("step %d  val loss %.3f  (ppl %.2f)", step + 1, val, math.exp(val))
    history["train_seconds"] = time.monotonic() - started
    # On a shared machine wall time says little; CPU time (all threads) is what the run cost.
    history["train_cpu_seconds"] = time.process_time() - cpu_started
    return history


def save_model_dir(out: Path, model: LlamaForCausalLM, tokenizer: Tokenizer, args) -> None:
    """Write bfloat16 safetensors, config, generation config and a fast tokenizer to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    eot_id = tokenizer.token_to_id(EOT)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(
        bos_token_id=eot_id, eos_token_id=eot_id, pad_token_id=eot_id, do_sample=False, max_new_tokens=128
    )
    model.save_pretrained(out)
    save_fast_tokenizer(tokenizer, out, EOT, args.max_positions)


@torch.no_grad()
def evaluate_saved(out: Path, corpus: Corpus, args) -> dict:
    """Reload ``out`` through transformers in float32 and measure what the card reports."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    val_texts = [corpus.read(rel) for rel in corpus.val_files]
    val_stream = torch.tensor([i for t in val_texts for i in tokenizer(t).input_ids], dtype=torch.long)
    val_loss = mean_loss(model, windows(val_stream, args.seq_len), args.batch_size, autocast=False)
    # The test re-computes this slice on every run; keep it small enough for a few CPU seconds.
    check_rows = {}
    for rel in corpus.val_files:
        ids = tokenizer(corpus.read(rel)).input_ids
        if not rel.startswith(REMOVED_IN_NEWER_PYTHONS) and len(ids) >= CHECK_SLICE_TOKENS:
            check_rows[rel] = ids[:CHECK_SLICE_TOKENS]
        if len(check_rows) == CHECK_SLICE_FILES:
            break
    check_files = list(check_rows)
    check = torch.tensor(list(check_rows.values()))
    check_loss = batch_loss(model, check).item()
    samples = {}
    for prompt in SAMPLE_PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        for name, options in (("greedy", {"do_sample": False}), ("sampled", SAMPLING)):
            torch.manual_seed(args.seed)
            generated = model.generate(ids, max_new_tokens=NUM_SAMPLE_TOKENS, **options)
            samples[prompt, name] = tokenizer.decode(generated[0], skip_special_tokens=True)
            logger.info("%s sample for %r:\n%s", name, prompt, samples[prompt, name])
    return {
        "val_tokens": len(val_stream),
        "val_loss": val_loss,
        "check_files": check_files,
        "check_loss": check_loss,
        "samples": samples,
        "num_params": sum(p.numel() for p in model.parameters()),
    }


def write_card(out: Path, corpus: Corpus, args, stats: dict, history: dict, results: dict) -> None:
    """README.md with the data, the command, the figures and the samples; the test reads the check slice."""
    check = {
        "files": results["check_files"],
        "tokens_per_file": CHECK_SLICE_TOKENS,
        "perplexity": round(math.exp(results["check_loss"]), 4),
    }
    final_train = history["train"][-1][1]
    final_val = history["val"][-1][1]
    curve = "\n".join(f"| {step} | {loss:.3f} | {math.exp(loss):.2f} |" for step, loss in history["val"])
    sample_blocks = "\n\n".join(
        f"Prompt `{prompt}`, {name}:\n\n```python\n{text}\n```" for (prompt, name), text in results["samples"].items()
    )
    sampling = ", ".join(f"{key}={value}" for key, value in SAMPLING.items() if key != "do_sample")
    held_out = ", ".join(f"`{rel}`" for rel in corpus.val_files)
    command = "python tools/train_default_model.py " + " ".join(sys.argv[1:])
    card = f"""---
library_name: transformers
pipeline_tag: text-generation
license: other
license_name: psf-2.0
tags: [python, code, tiny, pdserve]
---

# pdserve default model

A {results['num_params'] / 1e6:.2f}M-parameter `LlamaForCausalLM` trained from scratch by pdserve's
`tools/train_default_model.py` on the Python {sys.version.split()[0]} standard library, so that pdserve
can show readable output on a machine with no access to a model hub. It writes Python-looking
text; it does not write correct programs.

## Model

| | |
|---|---|
| layers | {args.layers} |
| hidden size | {args.hidden_size} |
| MLP (SwiGLU) size | {args.intermediate_size} |
| attention heads | {args.heads} (head dim {args.hidden_size // args.heads}, no GQA) |
| vocabulary | {stats['vocab_size']} (byte-level BPE) |
| embeddings | tied input/output |
| parameters | {results['num_params']:,} |
| trained context | {args.seq_len} tokens (`max_position_embeddings` {args.max_positions}; text degrades past the trained context) |
| weights | bfloat16 safetensors |

Tokenizer: byte-level BPE trained with the `tokenizers` library on the training files. The
pre-tokenizer keeps identifiers with their underscores together and keeps a newline plus the
indentation after it in one piece, so indentation costs about one token per line.
`<|endoftext|>` (id {stats['eot_id']}) is BOS, EOS and padding: the tokenizer puts it before every
text, and in training it opened every file, so it also marks where the previous file ended.
Decoding `encode(text)` with `skip_special_tokens=True` gives `text` back exactly.

## Data

`.py` files under `{corpus.root}` (found with `sysconfig`), minus test suites (`test/`, `tests/`,
`idle_test/`, `test_*.py`), `site-packages`, `pydoc_data` and {corpus.num_excluded_tables} generated
tables (codecs, HTML entities; files with more than {MAX_ESCAPE_DENSITY:g} escape literals per 1000
characters). {len(corpus.train_files)} training files ({stats['train_tokens']:,} tokens) and
{len(corpus.val_files)} held-out files ({results['val_tokens']:,} tokens). A file is held out when the
first four bytes of the SHA-256 of its relative path, mod 10000, are below {args.val_percent * 100:g}.

Held-out files: {held_out}.

## Training

```
{command}
```

{args.steps} AdamW steps (betas 0.9/0.95, weight decay {args.weight_decay}, gradient clip 1.0) of
{args.batch_size} random {args.seq_len}-token windows ({args.steps * args.batch_size * args.seq_len / 1e6:.1f}M
tokens, {args.steps * args.batch_size * args.seq_len / stats['train_tokens']:.1f} epochs); learning rate
{args.lr:g}, {args.warmup_steps} warmup steps, cosine decay to {args.min_lr_ratio * args.lr:g}; bfloat16
autocast; seed {args.seed}; {args.threads} CPU threads. Training took {history['train_seconds'] / 60:.1f} minutes
of wall time and {history['train_cpu_seconds'] / 60:.1f} CPU-minutes over all threads ({stats['total_minutes']:.1f}
minutes of wall time in all, with tokenizer training and evaluation).

## Results

| | loss | perplexity |
|---|---|---|
| final train loss (smoothed, bf16 autocast) | {final_train:.3f} | {math.exp(final_train):.2f} |
| final validation loss during training (first {args.eval_windows} windows) | {final_val:.3f} | {math.exp(final_val):.2f} |
| **validation, saved bfloat16 weights, run in float32, all held-out files** | **{results['val_loss']:.3f}** | **{math.exp(results['val_loss']):.2f}** |
| check slice (see below) | {results['check_loss']:.3f} | {check['perplexity']:.2f} |

Validation loss during training:

| step | val loss | perplexity |
|---|---|---|
{curve}

The check slice is the first {CHECK_SLICE_TOKENS} tokens (BOS included) of each of the first
{CHECK_SLICE_FILES} held-out files of at least that length outside `distutils`/`lib2to3` (gone from later
Pythons), scored in float32 with transformers; pdserve's tests recompute it
and fail if it rises above the figure here plus a margin:

<!-- check-slice: {json.dumps(check)} -->

## Samples

{NUM_SAMPLE_TOKENS} new tokens from the saved weights in float32, greedy and sampled ({sampling},
`torch.manual_seed({args.seed})`). `generation_config.json` keeps greedy decoding as the default so
that runs are reproducible; for text to read, sample with {sampling}. Greedy output from a model
this small falls into loops.

{sample_blocks}

## License

Trained on the CPython standard library, which is distributed under the PSF License Agreement.
"""
    (out / "README.md").write_text(card)


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    started = time.monotonic()

    corpus = collect_corpus(args.stdlib.resolve(), args.val_percent)
    logger.info(
        "corpus %s: %d training files, %d held out, %d tables dropped",
        corpus.root, len(corpus.train_files), len(corpus.val_files), corpus.num_excluded_tables,
    )
    tokenizer = train_tokenizer(corpus, args.vocab_size)
    eot_id = tokenizer.token_to_id(EOT)
    train_texts = [corpus.read(rel) for rel in corpus.train_files]
    train_stream = encode_files(tokenizer, train_texts)
    val_stream = encode_files(tokenizer, [corpus.read(rel) for rel in corpus.val_files])
    num_chars = sum(len(t) for t in train_texts)
    logger.info(
        "tokenizer: %d tokens; train %d tokens (%.2f chars/token), val %d tokens",
        tokenizer.get_vocab_size(), len(train_stream), num_chars / len(train_stream), len(val_stream),
    )

    model = build_model(args, tokenizer.get_vocab_size(), eot_id)
    logger.info("model: %.2fM parameters", sum(p.numel() for p in model.parameters()) / 1e6)
    val_batches = windows(val_stream, args.seq_len, limit=args.eval_windows)
    history = train(model, train_stream, val_batches, args)

    save_model_dir(args.out, model, tokenizer, args)
    results = evaluate_saved(args.out, corpus, args)
    logger.info(
        "saved weights: val loss %.3f (ppl %.2f) over %d tokens; check slice ppl %.2f",
        results["val_loss"], math.exp(results["val_loss"]), results["val_tokens"], math.exp(results["check_loss"]),
    )
    stats = {
        "vocab_size": tokenizer.get_vocab_size(),
        "eot_id": eot_id,
        "train_tokens": len(train_stream),
        "total_minutes": (time.monotonic() - started) / 60,
    }
    write_card(args.out, corpus, args, stats, history, results)
    logger.info("wrote %s in %.1f minutes", args.out, stats["total_minutes"])


if __name__ == "__main__":
    main()
