"""Speculative decoding: cheap guesses of a sequence's next tokens, verified in one forward.

A decoding sequence's life with speculation: each step the scheduler asks the proposer for up
to ``num_speculative_tokens`` draft tokens; the step computes the sequence's last token and the
drafts together, each as its own decode row over the paged cache (so every row is the exact
computation plain decoding would do at that position); the sampler then emits the target's
token at each row and keeps going while that token equals the draft. A step thus emits between
one token (every draft rejected) and ``1 + drafts`` (every draft accepted, plus the target's own
token after the last). Greedy output is the same token for token as without speculation (with
an unquantized cache: an int8/fp8 block's scale covers the rows one step writes, so a row
written beside drafts, or beside rejected ones, rounds differently); sampled output keeps the
target's distribution (``engine.sampler`` accepts a draft with the target's probability of it
and otherwise draws from the rest).

The n-gram proposer (prompt lookup) needs no draft model: it finds the latest earlier place
where the sequence's last ``n`` tokens occurred (longest ``n`` first) and proposes the tokens
that followed there. It pays where text repeats itself: code, edits, extraction.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.sequence import Sequence

SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(slots=True)
class SpeculativeConfig:
    """How a decoding engine speculates (None in ``EngineConfig.speculative``: it does not)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4  # drafts proposed per sequence per step, at most
    prompt_lookup_max: int = 4  # ngram: the longest suffix looked up
    prompt_lookup_min: int = 1  # ngram: the shortest
    draft_model: str | None = None  # draft_model: the draft's checkpoint directory (same tokenizer)
    # Each sequence's draft count follows how its drafts fare (DraftWindow); False (default, as
    # vLLM): always num_speculative_tokens. Measured (bench-scenario speculation, built-in model,
    # batch 1/8/32): n-gram 1.75/1.43/1.43x plain fixed, 1.10/1.08/1.36x adaptive; a draft
    # accepting 4-9% 0.73/0.60/0.55x fixed, 0.72/0.66/0.83x adaptive.
    adaptive: bool = False

    def validate(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative.method: must be one of {list(SPECULATIVE_METHODS)}, got {self.method!r}")
        if self.method == "draft_model":
            if not self.draft_model:
                raise ValueError("speculative.draft_model: method draft_model needs the draft's model directory")
            if not (Path(self.draft_model) / "config.json").is_file():
                raise ValueError(f"speculative.draft_model: {self.draft_model} is not a model directory (no config.json)")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(f"speculative.num_speculative_tokens: must be an integer >= 1, got {self.num_speculative_tokens!r}")
        if not isinstance(self.prompt_lookup_min, int) or self.prompt_lookup_min < 1:
            raise ValueError(f"speculative.prompt_lookup_min: must be an integer >= 1, got {self.prompt_lookup_min!r}")
        if not isinstance(self.prompt_lookup_max, int) or self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(
                f"speculative.prompt_lookup_max: must be an integer >= prompt_lookup_min ({self.prompt_lookup_min}), "
                f"got {self.prompt_lookup_max!r}"
            )


@dataclass(slots=True)
class NgramIndex:
    """One sequence's n-grams, each mapped to the latest place it starts with a token after it.

    Kept on the sequence and extended as tokens arrive, so a step's lookup costs a few dict
    probes however long the sequence is."""

    sizes: range
    latest_start: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    num_indexed: dict[int, int] = field(default_factory=dict)  # per size: starts indexed so far

    def extend(self, token_ids: list[int]) -> None:
        """Index every n-gram that has a token after it in ``token_ids``."""
        for n in self.sizes:
            table = self.latest_start.setdefault(n, {})
            start = self.num_indexed.get(n, 0)
            last = len(token_ids) - n  # exclusive: the n-gram at ``last`` has nothing after it yet
            for i in range(start, last):
                table[tuple(token_ids[i : i + n])] = i
            self.num_indexed[n] = max(start, last)

    def lookup(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """The tokens that followed the latest earlier match of the longest matching suffix."""
        for n in reversed(self.sizes):
            if n >= len(token_ids):
                continue
            start = self.latest_start.get(n, {}).get(tuple(token_ids[-n:]))
            if start is not None:
                return token_ids[start + n : start + n + max_tokens]
        return []


@dataclass(slots=True)
class DraftWindow:
    """How many drafts one sequence gets next step, from how its last ones fared.

    A draft row costs a decode row whether it is accepted or not, and the rows after a rejected
    draft are wasted. So the window grows by one after a step that accepted every draft, shrinks
    to one past the last accepted draft after a rejection, and after a step that accepted none,
    drafting pauses for a number of steps that doubles with each such step in a row (0, 1, 3, 7,
    then 15): a sequence whose drafts keep failing costs (almost) no rows, and is retried now
    and then, since text changes character."""

    limit: int
    size: int = 0  # 0: not set yet, the limit
    pause: int = 0  # steps left without drafts
    misses: int = 0  # steps in a row that accepted no draft

    def room(self) -> int:
        """Drafts for this step (taking one step of a pause)."""
        if self.pause > 0:
            self.pause -= 1
            return 0
        return self.size or self.limit

    def update(self, num_drafts: int, num_accepted: int) -> None:
        if num_accepted == num_drafts:
            self.size, self.misses, self.pause = min(self.limit, num_drafts + 1), 0, 0
        elif num_accepted > 0:
            self.size, self.misses, self.pause = num_accepted + 1, 0, 0
        else:
            self.misses += 1
            self.size = 1
            self.pause = min(16, 2 ** (self.misses - 1)) - 1


@dataclass(slots=True)
class Proposal:
    """Draft tokens for one sequence, and per token the distribution it was drawn from
    (``probs`` None: proposed with certainty, as a lookup or a greedy draft does)."""

    token_ids: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] | None = None


class Proposer(ABC):
    """What the scheduler asks for drafts (engine.draft_model's proposer is the other kind)."""

    # The positions the proposer can read (a draft model's context; None: any). A sequence
    # whose drafts would go past them gets fewer, or none (as vLLM skips such sequences).
    max_positions: int | None = None

    @abstractmethod
    def propose(self, seqs: list[Sequence], rooms: list[int]) -> list[Proposal]:
        """At most ``rooms[i]`` drafts to follow ``seqs[i]``; the blocks for them are allocated."""

    def after_verify(self, seq: Sequence) -> None:
        """``seq``'s drafts were verified and its new tokens appended."""


class NgramProposer(Proposer):
    """Prompt-lookup drafts from the sequence's own tokens (prompt and output)."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.sizes = range(config.prompt_lookup_min, config.prompt_lookup_max + 1)

    def propose(self, seqs: list[Sequence], rooms: list[int]) -> list[Proposal]:
        return [Proposal(self.lookup(seq, room)) for seq, room in zip(seqs, rooms)]

    def lookup(self, seq: Sequence, max_tokens: int) -> list[int]:
        """At most ``max_tokens`` draft tokens to follow ``seq.token_ids`` (maybe none)."""
        if max_tokens <= 0:
            return []
        index = seq.draft_state
        if not isinstance(index, NgramIndex):
            index = seq.draft_state = NgramIndex(self.sizes)
        index.extend(seq.token_ids)
        return index.lookup(seq.token_ids, max_tokens)


@dataclass(slots=True)
class DraftRow:
    """A sequence as seen by the sampler at a draft's row: its tokens plus the drafts before it.

    Quacks like ``Sequence`` for what the sampler reads (params, generator, tokens so far)."""

    seq: Sequence
    drafts_before: list[int]

    @property
    def params(self):
        return self.seq.params

    @property
    def generator(self):
        return self.seq.generator

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids + self.drafts_before

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + len(self.drafts_before)

    @property
    def thinking(self):
        """Its thinking's state after the drafts before it (engine.thinking), or None."""
        return None if self.seq.thinking is None else self.seq.thinking.after(self.drafts_before)

    @property
    def num_pending_tokens(self) -> int:
        return self.seq.num_pending_tokens
