"""Draft-model speculation: a small model of the same vocabulary guesses the next tokens.

A decoding sequence's life with a draft model: the draft keeps its own KV cache, a second
tensor with the draft's shape whose blocks are the target's block ids (the target's block
manager owns them; the draft only writes where the target's block table points). Each step,
before the target runs, the draft catches up on the sequence's tokens it has not seen (the
whole prompt after admission or preemption, else the tokens emitted last step), which yields
its guess for the next token, then guesses ``room - 1`` more one token at a time; every guess
is a batched forward over all speculating sequences. Greedy requests get the draft's argmax;
sampled ones a draw from the draft's distribution ``q`` (the request's temperature and filters
applied to the draft's logits), which the sampler needs to accept with min(1, p/q).

The draft's progress lives on the sequence (``DraftProgress``); it restarts from zero whenever
the sequence's blocks were taken away (preemption) or it was admitted anew, so the draft never
reads KV it did not write for this very sequence.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention import CacheGeometry, SeqSlice, select_backend
from engine.attention.block_tables import BlockTables
from engine.config import EngineConfig, ModelConfig
from engine.errors import ModelLoadError
from engine.kv_cache import KVCache
from engine.loader import load_model
from engine.sampler import Sampler
from engine.sequence import Sequence
from engine.speculation import DraftRow, Proposal, Proposer

logger = logging.getLogger(__name__)

_DRAFT_SALT = 0x6472  # seeded draws of the draft differ from the target's at the same position


@dataclass(slots=True)
class DraftProgress:
    """How far the draft's KV covers one sequence."""

    num_computed_tokens: int = 0
    num_preemptions: int = 0  # the sequence's count when this progress began: a new one resets it


def draft_bytes_per_block(draft_model: str | Path, engine_config: EngineConfig, dtype: torch.dtype) -> int:
    """KV bytes the draft needs per block id, to size the two caches together."""
    draft_config = ModelConfig.from_model_dir(Path(draft_model))
    return KVCache.bytes_per_block_of(draft_config, engine_config.block_size, dtype, engine_config.kv_cache_dtype)


class DraftModelProposer(Proposer):
    """Runs the draft model inside the engine that verifies its guesses."""

    def __init__(
        self, draft_model: str | Path, engine_config: EngineConfig, num_blocks: int, target_vocab_size: int, dtype: torch.dtype,
        eos_token_ids: list[int] = (),
    ):
        loaded = load_model(
            draft_model, dtype=str(dtype).removeprefix("torch."), device=engine_config.device,
            max_positions=engine_config.max_model_len, prepack_linear=engine_config.prepack_linear,
        )
        if loaded.config.vocab_size != target_vocab_size:
            raise ModelLoadError(
                f"speculative.draft_model: {draft_model} has a vocabulary of {loaded.config.vocab_size} tokens, "
                f"the target model {target_vocab_size}: a draft must share the target's tokenizer"
            )
        self.model = loaded.model
        self.config = loaded.config
        # Its rotary table covers the target's context, but past its own it was never trained:
        # guesses there would be noise, verified for nothing.
        self.max_positions = min(engine_config.max_model_len or loaded.config.max_position_embeddings, loaded.config.max_position_embeddings)
        self.device = engine_config.device
        self.kv_cache = KVCache(loaded.config, dataclasses.replace(engine_config, num_kv_blocks=num_blocks), loaded.dtype)
        self.block_size = self.kv_cache.block_size
        self.attention = select_backend(
            engine_config.attention_backend, CacheGeometry.of(loaded.config, self.kv_cache, loaded.dtype, engine_config.device)
        )
        self.block_tables = BlockTables()
        # The target's end tokens: a request short of its min_tokens may not end, and a draft
        # that guesses an end there only wastes its row (the target's p has none).
        self.sampler = Sampler(engine_config.seed, list(eos_token_ids))

    def propose(self, seqs: list[Sequence], rooms: list[int]) -> list[Proposal]:
        """Up to ``rooms[i]`` guesses for ``seqs[i]``; blocks for them must be allocated already."""
        proposals = [Proposal([]) for _ in seqs]
        live = list(range(len(seqs)))
        # The first forward: every sequence's unseen tokens, ending with its last one.
        inputs = []
        for i in live:
            seq = seqs[i]
            progress = seq.draft_state
            if not isinstance(progress, DraftProgress) or progress.num_preemptions != seq.num_preemptions:
                progress = seq.draft_state = DraftProgress(0, seq.num_preemptions)
            inputs.append((i, seq.token_ids[progress.num_computed_tokens :], progress.num_computed_tokens))
        try:
            for step in range(max(rooms)):
                logits = self._forward(seqs, inputs, first=step == 0)
                for (i, tokens, context), row in zip(inputs, logits):
                    seqs[i].draft_state.num_computed_tokens = context + len(tokens)
                    self._choose(seqs[i], proposals[i], row)
                live = [i for i in live if len(proposals[i].token_ids) < rooms[i]]
                if not live:
                    break
                inputs = [(i, proposals[i].token_ids[-1:], seqs[i].num_tokens + step) for i in live]
        except BaseException:
            # No guess of a failed proposal is verified (``after_verify`` never runs for it): the
            # draft's KV is valid up to the sequence's own tokens only, not the guesses fed after.
            for seq in seqs:
                if isinstance(seq.draft_state, DraftProgress):
                    seq.draft_state.num_computed_tokens = min(seq.draft_state.num_computed_tokens, seq.num_tokens)
            raise
        return proposals

    def after_verify(self, seq: Sequence) -> None:
        """The draft's KV is valid up to the last accepted guess it was fed (its last guess never is)."""
        progress = seq.draft_state
        if isinstance(progress, DraftProgress):
            # Fed: the sequence's tokens, then its guesses but the last. Valid: what was fed and
            # is still the sequence's (tokens emitted past a rejection differ from the guesses).
            progress.num_computed_tokens = min(progress.num_computed_tokens, seq.num_tokens - 1)

    def _forward(self, seqs: list[Sequence], inputs: list[tuple[int, list[int], int]], first: bool) -> torch.Tensor:
        """One batched draft forward; logits at each input's last token, in input order (``first``:
        the step's first, over every speculating sequence)."""
        # Single tokens first: the decode kernel's rows come before prefill chunks.
        ordered = sorted(range(len(inputs)), key=lambda k: len(inputs[k][1]) != 1)
        rows, updates = self.block_tables.sync([(seqs[inputs[k][0]], seqs[inputs[k][0]].block_table) for k in ordered], release_absent=first)
        self.block_tables.apply(updates)
        input_ids: list[int] = []
        positions: list[int] = []
        last_rows: list[int] = []
        slices: list[SeqSlice] = []
        for k, row in zip(ordered, rows):
            _, tokens, context = inputs[k]
            input_ids.extend(tokens)
            positions.extend(range(context, context + len(tokens)))
            last_rows.append(len(input_ids) - 1)
            slices.append(SeqSlice(row, context, len(tokens), decode=len(tokens) == 1))
        meta = self.attention.build(slices, self.block_tables.array)
        logits = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            self.kv_cache,
            meta,
            torch.tensor(last_rows, dtype=torch.long, device=self.device),
        ).cpu()
        back = torch.empty(len(ordered), dtype=torch.long)
        back[torch.tensor(ordered)] = torch.arange(len(ordered))
        return logits[back]

    def _choose(self, seq: Sequence, proposal: Proposal, logits: torch.Tensor) -> None:
        """The draft's next guess for ``seq`` after what it has guessed so far."""
        row = DraftRow(seq, proposal.token_ids) if proposal.token_ids else seq
        if seq.params.greedy:
            proposal.token_ids.append(int(logits.argmax()))
            return
        probs = self.sampler.probabilities(logits.unsqueeze(0), [row])[0]
        # The draw's generator is the request's, on the CPU (keyed by seed and position): on a GPU
        # torch.multinomial refuses a CPU generator for device probabilities.
        token = int(torch.multinomial(probs.cpu(), 1, generator=self.sampler.draw_generator(row, _DRAFT_SALT)))
        proposal.token_ids.append(token)
        if proposal.probs is None:
            proposal.probs = []
        proposal.probs.append(probs)
