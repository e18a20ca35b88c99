"""The requests a benchmark sends: what each prompt is and how many tokens it must produce.

Synthetic prompts are random token ids (no tokenizer needed on the client, lengths exact);
every generator is seeded so that two runs, or two clusters compared by a scenario, see the
very same requests. With ``ignore_eos`` a request produces exactly ``max_tokens`` tokens,
which is what makes throughput comparable across runs.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

WORKLOAD_KINDS = ("random", "mixed", "prefix", "sharegpt")


@dataclass(slots=True)
class ModelLimits:
    """What the served model allows: from the router's GetModelInfo, or from its directory."""

    vocab_size: int
    max_context_len: int
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_model_dir(cls, model_dir: Path, max_context_len: int | None = None) -> "ModelLimits":
        """The checkpoint's limits; the context is ``max_context_len`` if served shorter than its own."""
        config = json.loads((Path(model_dir) / "config.json").read_text())
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
        context = max_context_len or int(config.get("max_position_embeddings", 2048))
        return cls(vocab_size=int(config["vocab_size"]), max_context_len=context, eos_token_ids=eos_ids)


@dataclass(slots=True)
class BenchRequest:
    """One request to send. Exactly one of ``prompt_token_ids`` and ``prompt_text`` is set."""

    max_tokens: int
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None
    tag: str = ""  # the request's class within a workload ("long", "short", "prefix-2"), for per-class metrics
    prompt_len: int = 0  # tokens, exact for token-id prompts, estimated for text without a tokenizer


@dataclass(slots=True)
class WorkloadSpec:
    """Which requests to build; fields not used by ``kind`` are ignored."""

    kind: str = "random"
    num_requests: int = 100
    input_len: int = 128
    output_len: int = 64
    range_ratio: float = 0.0  # lengths drawn uniformly from [len * (1 - r), len * (1 + r)]
    # mixed: a share of long prompts among short ones (short = input_len)
    long_fraction: float = 0.2
    long_input_len: int = 1024
    # prefix: num_prefixes shared prefixes of prefix_len tokens, each request adds input_len own tokens
    num_prefixes: int = 4
    prefix_len: int = 256
    # sharegpt: a JSON list of {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}
    dataset_path: str | None = None
    tokenizer_path: str | None = None  # a tokenizer.json (or a directory with one) to count ShareGPT tokens
    fixed_output_len: bool = False  # sharegpt: output_len for every request instead of the reply's length
    seed: int = 0

    def validate(self) -> None:
        if self.kind not in WORKLOAD_KINDS:
            raise ValueError(f"workload: must be one of {', '.join(WORKLOAD_KINDS)}, got {self.kind!r}")
        for name in ("num_requests", "input_len", "output_len", "long_input_len", "num_prefixes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio: must be in [0, 1), got {self.range_ratio}")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError(f"long_fraction: must be in [0, 1], got {self.long_fraction}")
        if self.prefix_len < 0:
            raise ValueError(f"prefix_len: must be >= 0, got {self.prefix_len}")
        if self.kind == "sharegpt" and not self.dataset_path:
            raise ValueError("dataset_path: required for the sharegpt workload")


def build_workload(spec: WorkloadSpec, limits: ModelLimits) -> list[BenchRequest]:
    """The requests ``spec`` describes, sized to fit ``limits``."""
    spec.validate()
    rng = random.Random(spec.seed)
    if spec.kind == "random":
        requests = [_random_request(rng, limits, _jitter(rng, spec.input_len, spec.range_ratio), _jitter(rng, spec.output_len, spec.range_ratio)) for _ in range(spec.num_requests)]
    elif spec.kind == "mixed":
        requests = _mixed(spec, limits, rng)
    elif spec.kind == "prefix":
        requests = _prefix_sharing(spec, limits, rng)
    else:
        requests = load_sharegpt(Path(spec.dataset_path), spec, limits, rng)
    for request in requests:
        if request.prompt_token_ids is not None and request.prompt_len + request.max_tokens > limits.max_context_len:
            raise ValueError(
                f"input_len/output_len: a request of {request.prompt_len} + {request.max_tokens} tokens "
                f"exceeds the model's context of {limits.max_context_len}"
            )
    return requests


def random_token_ids(rng: random.Random, limits: ModelLimits, length: int) -> list[int]:
    """``length`` ids drawn uniformly from the vocabulary, never an EOS id."""
    eos = set(limits.eos_token_ids)
    ids = []
    while len(ids) < length:
        token = rng.randrange(limits.vocab_size)
        if token not in eos:
            ids.append(token)
    return ids


def _jitter(rng: random.Random, length: int, ratio: float) -> int:
    if ratio == 0.0:
        return length
    # [floor(len (1 - r)), ceil(len (1 + r))], as vLLM's random dataset draws them.
    return max(1, rng.randint(math.floor(length * (1 - ratio)), math.ceil(length * (1 + ratio))))


def _random_request(rng: random.Random, limits: ModelLimits, input_len: int, output_len: int, tag: str = "") -> BenchRequest:
    return BenchRequest(max_tokens=output_len, prompt_token_ids=random_token_ids(rng, limits, input_len), tag=tag, prompt_len=input_len)


def _mixed(spec: WorkloadSpec, limits: ModelLimits, rng: random.Random) -> list[BenchRequest]:
    # The long ones are spread by a seeded shuffle, not drawn independently: every run of a
    # given size has exactly round(n * long_fraction) of them, so two clusters compare fairly.
    num_long = round(spec.num_requests * spec.long_fraction)
    kinds = ["long"] * num_long + ["short"] * (spec.num_requests - num_long)
    rng.shuffle(kinds)
    requests = []
    for kind in kinds:
        base = spec.long_input_len if kind == "long" else spec.input_len
        requests.append(_random_request(rng, limits, _jitter(rng, base, spec.range_ratio), _jitter(rng, spec.output_len, spec.range_ratio), kind))
    return requests


def _prefix_sharing(spec: WorkloadSpec, limits: ModelLimits, rng: random.Random) -> list[BenchRequest]:
    prefixes = [random_token_ids(rng, limits, spec.prefix_len) for _ in range(spec.num_prefixes)]
    requests = []
    for _ in range(spec.num_requests):
        group = rng.randrange(spec.num_prefixes)
        suffix = random_token_ids(rng, limits, _jitter(rng, spec.input_len, spec.range_ratio))
        prompt = prefixes[group] + suffix
        requests.append(BenchRequest(max_tokens=_jitter(rng, spec.output_len, spec.range_ratio), prompt_token_ids=prompt, tag=f"prefix-{group}", prompt_len=len(prompt)))
    return requests


_SHAREGPT_MAX_PROMPT, _SHAREGPT_MAX_TOTAL = 1024, 2048  # vLLM's is_valid_sequence bounds


def load_sharegpt(path: Path, spec: WorkloadSpec, limits: ModelLimits, rng: random.Random) -> list[BenchRequest]:
    """First-turn prompts of a ShareGPT file; the reply's length (or ``output_len``) is the output.

    Without a tokenizer, lengths are estimated: a prompt at one token per UTF-8 byte (an upper
    bound for byte-level BPE, so a kept prompt always fits the context) and a reply at four
    bytes per token.
    """
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"dataset_path: cannot read {path} as JSON ({exc})") from exc
    if not isinstance(entries, list):
        raise ValueError(f"dataset_path: {path} must hold a JSON list of conversations")
    count = _token_counter(spec.tokenizer_path)
    pairs = _first_turns(entries)
    rng.shuffle(pairs)
    requests = []
    for prompt, reply in pairs:
        size = len(prompt.encode("utf-8"))
        prompt_len = count(prompt) if count else size + 1
        # vLLM's caps are on tokens: without a tokenizer, judged at four bytes a token (the
        # upper bound above would drop three quarters of what vLLM keeps).
        likely_len = prompt_len if count else -(-size // 4)
        output_len = spec.output_len if spec.fixed_output_len else (count(reply) if count else -(-len(reply.encode("utf-8")) // 4))
        # Too short says nothing about serving; as vLLM's bench serve keeps them (a prompt of at
        # most 1,024 tokens, 2,048 with the reply), and what the router would refuse.
        if (prompt_len < 4 or (output_len < 4 and not spec.fixed_output_len) or likely_len > _SHAREGPT_MAX_PROMPT
                or likely_len + output_len > _SHAREGPT_MAX_TOTAL or prompt_len + output_len > limits.max_context_len):
            continue
        requests.append(BenchRequest(max_tokens=output_len, prompt_text=prompt, tag="sharegpt", prompt_len=prompt_len))
        if len(requests) == spec.num_requests:
            break
    if not requests:
        raise ValueError(f"dataset_path: no usable conversation in {path}")
    return requests


def _first_turns(entries: list) -> list[tuple[str, str]]:
    """(prompt, reply) of every conversation that has both; malformed entries are skipped."""
    pairs = []
    for entry in entries:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if isinstance(first, dict) and isinstance(second, dict) and isinstance(first.get("value"), str) and isinstance(second.get("value"), str):
            pairs.append((first["value"], second["value"]))
    return pairs


def _token_counter(tokenizer_path: str | None):
    if not tokenizer_path:
        return None
    from tokenizers import Tokenizer

    path = Path(tokenizer_path)
    if path.is_dir():
        path = path / "tokenizer.json"
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises a bare Exception (a missing or malformed file)
        raise ValueError(f"tokenizer: cannot load {path} ({exc})") from None
    return lambda text: len(tokenizer.encode(text).ids)
