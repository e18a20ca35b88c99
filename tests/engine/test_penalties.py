"""The penalties kept up to date between steps give, step after step, exactly what counting each
row's whole history gives: requests joining and leaving, a resumed request, draft rows, a
finished request's row taken by a new one."""

from __future__ import annotations

import gc
import random
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from engine import SamplingParams
from engine.penalties import PenaltyHistory
from engine.sequence import Sequence
from engine.speculation import DraftRow

VOCAB = 300


def _reference(logits: torch.Tensor, rows: list) -> torch.Tensor:
    """vLLM's formulas, row by row over the whole vocabulary, from each row's token lists."""
    out = logits.clone()
    for i, row in enumerate(rows):
        params = row.params
        tokens = list(row.token_ids)
        num_output = row.num_output_tokens + params.num_resumed_tokens
        output = Counter(tokens[len(tokens) - num_output :] if num_output else [])
        values = out[i]
        if params.repetition_penalty != 1.0:
            seen = torch.zeros(VOCAB, dtype=torch.bool)
            seen[list(set(tokens))] = True
            repeated = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
            values = torch.where(seen, repeated, values)
        f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731  (the logits' arithmetic)
        for token, count in output.items():
            values[token] = values[token] - f32(params.frequency_penalty) * f32(count) - f32(params.presence_penalty)
        out[i] = values
    return out


def _sequence(name: str, rng: random.Random, prompt_len: int, resumed: int = 0, **penalties) -> Sequence:
    params = SamplingParams(temperature=0.7, max_tokens=100, num_resumed_tokens=resumed, **penalties)
    return Sequence(name, [rng.randrange(VOCAB) for _ in range(prompt_len)], prompt_len, params)


@pytest.mark.parametrize("whole_rows", [False, True], ids=["pairs", "whole rows"])
def test_kept_counts_equal_a_recount_of_every_rows_history_step_after_step(whole_rows):
    rng = random.Random(0)
    history = PenaltyHistory(whole_rows=whole_rows)
    running = [
        _sequence("rep", rng, 40, repetition_penalty=1.3),
        _sequence("freq", rng, 25, frequency_penalty=0.5),
        _sequence("pres", rng, 10, presence_penalty=-0.8),
        _sequence("all", rng, 60, repetition_penalty=0.7, frequency_penalty=0.25, presence_penalty=0.4),
        _sequence("none", rng, 12),
        _sequence("resumed", rng, 30, resumed=6, frequency_penalty=1.0, repetition_penalty=1.1),
    ]
    checked = 0
    for step in range(12):
        if step == 5:  # one ends (its row is given back) and two arrive, one taking that row
            running = [s for s in running if s.req_id != "freq"]
            gc.collect()
            running.append(_sequence("late", rng, 33, repetition_penalty=2.0, presence_penalty=0.3))
            running.append(_sequence("later", rng, 5, frequency_penalty=0.9))
        rows: list = list(running)
        if step % 4 == 3:  # a speculative step: rows at drafts, each seeing the drafts before it
            drafts = [rng.randrange(VOCAB) for _ in range(3)]
            rows += [DraftRow(running[3], drafts[:i]) for i in range(1, 4)]
            rows += [DraftRow(running[1], drafts[:2])]
        logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(step)) * 3
        got = history.apply(logits, rows)
        assert torch.equal(got, _reference(logits, rows)), f"step {step}"
        assert not torch.equal(got, logits)
        checked += 1
        for seq in running:  # the step's tokens, often ones the history already holds
            seq.token_ids.append(rng.choice(seq.token_ids) if rng.random() < 0.5 else rng.randrange(VOCAB))
    assert checked == 12
    rows_in_use = {entry.row for entry in history._counted.values()}
    assert len(rows_in_use) == len(history._counted) <= history.seen.shape[0] <= 8, "the ended request's row was reused"


def test_rows_without_penalties_come_back_untouched_and_uncounted():
    rng = random.Random(1)
    history = PenaltyHistory()
    plain = [_sequence("a", rng, 20), _sequence("b", rng, 20, frequency_penalty=0.5)]  # b: no output yet
    logits = torch.randn(2, VOCAB)
    assert history.apply(logits, plain) is logits
    assert history.seen is None


def test_a_penalty_kernel_that_fails_leaves_the_torch_ops_with_the_history_whole(monkeypatch):
    """Where the fused kernel (engine.triton_penalties) fails to build or launch, the penalties
    come from the torch ops, that step and after, and the token of the step in flight that the
    kernel was to count is counted all the same."""
    import engine.penalties
    from engine.model_runner import PendingSamples

    launches = []

    def failing(*args, **kwargs):
        launches.append(1)
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(engine.penalties, "_triton_penalties", lambda: SimpleNamespace(apply_penalties=failing))
    rng = random.Random(3)
    fused, reference = PenaltyHistory(whole_rows=True, fused=True), PenaltyHistory(whole_rows=True, fused=False)
    seqs = [_sequence("a", rng, 20, repetition_penalty=1.3, frequency_penalty=0.5), _sequence("b", rng, 9, presence_penalty=0.4)]
    for seq in seqs:
        seq.token_ids.append(rng.randrange(VOCAB))
        seq.num_pending_tokens = 1
    for step in range(2):
        logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(step))
        pending = PendingSamples(torch.tensor([rng.randrange(VOCAB) for _ in seqs]), {id(s): r for r, s in enumerate(seqs)})
        assert torch.equal(fused.apply(logits, seqs, pending), reference.apply(logits, seqs, pending))
        assert torch.equal(fused.output_counts, reference.output_counts) and torch.equal(fused.seen, reference.seen)
        for seq, token in zip(seqs, pending.token_ids.tolist()):
            seq.token_ids.append(token)
    assert launches == [1] and fused.fused is False
