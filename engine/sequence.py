"""One request's token state inside an engine: tokens, progress, blocks, status."""

from __future__ import annotations

import enum
import json
import time
from dataclasses import dataclass, field

import torch

from engine.sampling_params import SamplingParams, TokenLogprob


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued; nothing of it is computed (or it was preempted)
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # blocks reserved, a peer is writing its KV
    RUNNING = "running"  # holds blocks and is scheduled every step
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    LENGTH = "length"  # max_tokens or the model's context reached
    STOP = "stop"  # a stop token id (stop strings are the router's)
    EOS = "eos"
    ABORT = "abort"
    ERROR = "error"


def sampled_token_to_json(token_id: int, logprob: TokenLogprob | None) -> str:
    """A sampled token (and its log-probabilities) as text, to travel with another message."""
    body: dict = {"id": token_id}
    if logprob is not None:
        body["lp"] = [logprob.logprob, logprob.rank, logprob.top]
    return json.dumps(body, separators=(",", ":"))


def sampled_token_from_json(text: str) -> tuple[int, TokenLogprob | None]:
    body = json.loads(text)
    token_id = int(body["id"])
    if "lp" not in body:
        return token_id, None
    value, rank, top = body["lp"]
    return token_id, TokenLogprob(token_id, float(value), int(rank), [(int(t), float(v)) for t, v in top])


@dataclass(slots=True, eq=False, weakref_slot=True)  # identity: two requests are never "equal"; weakly referable (engine.penalties)
class Sequence:
    """Prompt plus generated tokens, and how far the KV cache has caught up with them.

    ``token_ids`` holds prompt then output; ``num_computed_tokens`` of them have KV in the
    cache. A sequence needs a forward pass over ``token_ids[num_computed_tokens:]``; when
    that reaches the end, the step samples its next token.
    """

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_order: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    # Grows in place (extend) only; any other change assigns a new list: the model runner's
    # copy of it (engine.attention.block_tables) sees changes by the list's identity and length.
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # ``params.prompt_logprobs``: entry i is prompt token i + 1's (the first token has none),
    # filled as the prompt's chunks are computed.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    num_cached_tokens: int | None = None  # prompt tokens whose KV came from a prefix cache
    # Seeds the chain of its blocks' prefix-cache hashes: b"" for blocks holding every layer; a
    # pipeline stage's name for blocks holding only that stage's layers (never found by others).
    hash_salt: bytes = b""
    # Its LoRA adapter's slot in the model (engine.lora), kept for its whole life even if the
    # adapter is unloaded or replaced meanwhile; -1: the base model.
    adapter_slot: int = -1
    first_token_time: float | None = None
    # Speculative decoding (engine.speculation): the proposer's state for this sequence, and
    # what its decode steps proposed and accepted.
    draft_state: object | None = None
    draft_window: object | None = None  # engine.speculation.DraftWindow: how many drafts it gets next
    num_decode_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    # Structured outputs (engine.grammar.SequenceGrammar): what the next token of its answer may be.
    grammar: object | None = None
    # A reasoning model's thinking (engine.thinking.ThinkingState): where the output is in it.
    thinking: object | None = None
    # Tokens sampled on the device whose ids the host has not read yet (overlapped steps,
    # engine.overlap): they come after ``token_ids``, and a step may already compute them.
    num_pending_tokens: int = 0

    def append_token(self, token_id: int, logprob: TokenLogprob | None = None) -> None:
        """Add a sampled token (its thinking, if any, advances; its grammar, if any, consumes
        an answer's token)."""
        self.token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        answer = self.thinking.accept(token_id) if self.thinking is not None else True
        if self.grammar is not None and answer:
            self.grammar.accept(token_id)

    @property
    def num_tokens(self) -> int:
        """Every token the sequence has, the pending ones included."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        """Output tokens the host has read (pending ones excluded)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens - self.num_computed_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asks for its prompt's log-probabilities and some are not computed yet: its prompt is
        computed here in full (no prefix cache), with logits at every position."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    def prompt_logprob_positions(self, start: int, num_tokens: int) -> range:
        """The positions among ``start .. start + num_tokens`` whose logits give prompt
        log-probabilities still missing (position p's logits score prompt token p + 1)."""
        if not self.needs_prompt_logprobs:
            return range(0)
        return range(max(start, len(self.prompt_logprobs)), min(start + num_tokens, self.num_prompt_tokens - 1))

    @property
    def is_decoding(self) -> bool:
        """Past its prompt, with one token (the last sampled) to compute."""
        return self.num_uncomputed_tokens == 1 and self.num_computed_tokens >= self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def queue_key(self) -> tuple[int, int, int]:
        """Higher priority first, then first come first served."""
        return (1, -self.priority, self.arrival_order)

    def aged_queue_key(self, now: float, max_wait_s: float) -> tuple[int, int, int]:
        """``queue_key``, except that a sequence waiting ``max_wait_s`` or longer since it arrived
        goes ahead of every priority (oldest first): a low priority delays, never starves."""
        if now - self.arrival_time >= max_wait_s:
            return (0, 0, self.arrival_order)
        return (1, -self.priority, self.arrival_order)
