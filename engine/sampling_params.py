"""Per-request sampling parameters, validated where they enter the engine; the model's
defaults for them; the log-probabilities a request may ask for. Plain data, no torch: the
router imports this module."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import InvalidRequestError, ModelLoadError, read_json_file
from engine.structured_output import StructuredOutput
from engine.thinking import Thinking

# Integers that become 64-bit tensors or generator seeds (top_k, seed) stay within a signed
# 64-bit integer, as OpenAI's API and vLLM take them; the n choices of one request draw with
# seed + i, which stays within what torch.Generator takes.
MAX_INT64 = 2**63 - 1
MAX_SEED = MAX_INT64
MIN_SEED = -MAX_INT64 - 1  # vLLM takes negative seeds too (torch.Generator maps them into its range)


@dataclass(slots=True)
class SamplingParams:
    """How one request picks its next tokens and when it stops.

    temperature 0 means greedy. top_k 0 (or -1) disables top-k; top_p 1 and min_p 0
    disable those filters. ``seed`` makes a sampled request reproducible on its own,
    whatever else shares its batch. ``logprobs`` asks for the log-probability of each
    sampled token plus the top-``logprobs`` alternatives (0 = sampled token only,
    None = none); ``prompt_logprobs`` asks the same of every prompt token after the first (each
    token's log-probability given those before it, and that many alternatives: vLLM's field). ``min_tokens``: until this many tokens are out, EOS and ``stop_token_ids``
    cannot be drawn (their logits are masked) and do not end the request.

    The logit adjustments are vLLM's (engine.sampler applies them in vLLM's order):
    ``logit_bias`` adds to a token's logit; ``allowed_token_ids`` forbids every other token;
    ``bad_words_token_ids`` forbids each sequence's last token where the output ends with the
    rest of it; ``presence_penalty`` subtracts from the logit of every token the output holds,
    ``frequency_penalty`` that many times per occurrence. ``structured``: the grammar the
    output must match (engine.grammar).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    # Output tokens the request produced before it was resumed on this worker (a stream
    # migrated after its decode actor died): they end the prompt it is given here, and seeded
    # draws go on at their own positions. Set by the router, never by a client.
    num_resumed_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    structured: StructuredOutput | None = None
    # A reasoning model's thinking (engine.thinking): where it is in the output (the grammar
    # constrains the answer after it) and its token budget. Set by the router's reasoning parser.
    thinking: Thinking | None = None
    # The LoRA adapter (engine.lora) this request runs through, by name; None: the base model.
    lora_name: str | None = None
    # The version of it (engine.lora_loading.adapter_digest) every worker of the request computes with,
    # pinned by the router; None: the version the name serves where the sequence starts.
    lora_digest: str | None = None
    # vLLM's cache_salt: the prefix cache shares this request's blocks only with requests of the
    # same salt (engine.block_allocator.cache_hash_salt); None: with every unsalted request.
    cache_salt: str | None = None

    MAX_LOGPROBS = 20
    MAX_CACHE_SALT_CHARS = 256  # it travels with every message of the request (vLLM suggests 43: 256 bits in base64)
    MAX_PENALTY = 2.0  # presence and frequency, as OpenAI bounds them
    MAX_LOGIT_BIAS = 100.0

    def resumed(self, num_generated: int) -> "SamplingParams":
        """These parameters for the rest of a request that already produced ``num_generated`` tokens."""
        return dataclasses.replace(
            self,
            max_tokens=self.max_tokens - num_generated,
            min_tokens=max(0, self.min_tokens - num_generated),
            num_resumed_tokens=self.num_resumed_tokens + num_generated,
            prompt_logprobs=None,  # the client has them: the first part of the request reported them
        )

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequestError naming the first bad field."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_finite_number(self.temperature) or self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or not -1 <= self.top_k <= MAX_INT64:
            raise InvalidRequestError("top_k", f"must be -1, 0 (disabled) or a positive integer up to {MAX_INT64}, got {self.top_k!r}")
        if not _is_finite_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_finite_number(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if not _is_finite_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidRequestError(
                "repetition_penalty", f"must be a finite number > 0, got {self.repetition_penalty!r}"
            )
        if self.seed is not None and (not isinstance(self.seed, int) or not MIN_SEED <= self.seed <= MAX_SEED):
            raise InvalidRequestError("seed", f"must be a 64-bit signed integer, in [{MIN_SEED}, {MAX_SEED}], got {self.seed!r}")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not (0 <= self.logprobs <= self.MAX_LOGPROBS)
        ):
            raise InvalidRequestError("logprobs", f"must be in [0, {self.MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or not (0 <= self.prompt_logprobs <= self.MAX_LOGPROBS)
        ):
            raise InvalidRequestError("prompt_logprobs", f"must be in [0, {self.MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if not isinstance(self.num_resumed_tokens, int) or self.num_resumed_tokens < 0:
            raise InvalidRequestError("num_resumed_tokens", f"must be an integer >= 0, got {self.num_resumed_tokens!r}")
        _check_token_ids("stop_token_ids", self.stop_token_ids, vocab_size)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_finite_number(value) or abs(value) > self.MAX_PENALTY:
                raise InvalidRequestError(name, f"must be a number in [-{self.MAX_PENALTY}, {self.MAX_PENALTY}], got {value!r}")
        if not isinstance(self.logit_bias, dict):
            raise InvalidRequestError("logit_bias", "must map token ids to numbers")
        _check_token_ids("logit_bias", list(self.logit_bias), vocab_size)
        for token_id, bias in self.logit_bias.items():
            if not _is_finite_number(bias) or abs(bias) > self.MAX_LOGIT_BIAS:
                raise InvalidRequestError(f"logit_bias.{token_id}", f"must be a number in [-100, 100], got {bias!r}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise InvalidRequestError("allowed_token_ids", "must not be empty (leave it unset to allow every token)")
            _check_token_ids("allowed_token_ids", self.allowed_token_ids, vocab_size)
        for index, word in enumerate(self.bad_words_token_ids):
            if not isinstance(word, list) or not word:
                raise InvalidRequestError(f"bad_words_token_ids[{index}]", "must be a non-empty list of token ids")
            _check_token_ids(f"bad_words_token_ids[{index}]", word, vocab_size)
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not 0 < len(self.cache_salt) <= self.MAX_CACHE_SALT_CHARS):
            raise InvalidRequestError("cache_salt", f"must be a string of 1-{self.MAX_CACHE_SALT_CHARS} characters or unset, got {str(self.cache_salt)[:40]!r}")
        if self.lora_name is not None and (not isinstance(self.lora_name, str) or not self.lora_name):
            raise InvalidRequestError("lora_name", f"must be a non-empty adapter name or None, got {self.lora_name!r}")
        if self.thinking is not None:
            if not isinstance(self.thinking, Thinking):
                raise InvalidRequestError("thinking", f"must be a Thinking, got {type(self.thinking).__name__}")
            budget = self.thinking.budget
            if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
                raise InvalidRequestError("thinking_token_budget", f"must be an integer >= 0, got {budget!r}")
            _check_token_ids("thinking", [t for t in (self.thinking.opener, self.thinking.closer) if t is not None], vocab_size)
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise InvalidRequestError("structured", f"must be a StructuredOutput, got {type(self.structured).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check_token_ids(name: str, token_ids: list, vocab_size: int | None) -> None:
    for token_id in token_ids:
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
            raise InvalidRequestError(name, f"contains {token_id!r}, not a token id of this model")


def _is_finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and abs(value) != float("inf")


@dataclass(slots=True)
class TokenLogprob:
    """Log-probability of a sampled token and the top alternatives at its position."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True, frozen=True)
class SamplingDefaults:
    """What ``generation_config.json`` sets for fields a request leaves unset (as vLLM takes
    them): None where the file is silent."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # its max_new_tokens

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> "SamplingDefaults":
        path = Path(model_dir) / "generation_config.json"
        if not path.is_file():
            return cls()
        raw = read_json_file(path)

        def number(key: str, kind: type):
            value = raw.get(key)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ModelLoadError(f"{path}: {key} must be a number, got {value!r}")
            return kind(value)

        return cls(
            temperature=number("temperature", float),
            top_p=number("top_p", float),
            top_k=number("top_k", int),
            min_p=number("min_p", float),
            repetition_penalty=number("repetition_penalty", float),
            max_tokens=number("max_new_tokens", int),
        )
