"""Distributed split-fuse: whether a prompt is prefilled by a pipeline of prefill actors, and how.

Every prefill actor holds the whole model, so any of them can compute any range of layers. For
each prompt the router decides here how many stages to use (one: the ordinary path) from its
length, the prefill actors' queues and the configuration, and cuts the layers into
contiguous ranges of balanced cost. A pipeline pays for itself only when the prompt is long
enough that its chunks keep every stage busy: with ``k`` stages and ``c`` chunks, its compute
takes about ``(c + k - 1) / (k c)`` of one actor's, so short prompts stay on one actor.

Measured (``pdserve bench-scenario split-fuse``, 135M shape, float32, two prefill actors of one
thread on a 2-core host): an 8k prompt's TTFT pipelined over 2 is 0.61-0.63x of one actor's, a
1k prompt's 0.73x; two independent 8k prefills at once each run 15% slower than one alone here
(shared cores and memory), which bounds what two stages can gain.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from router.pool import WorkerRecord


class PipelineMode(str, enum.Enum):
    AUTO = "auto"  # long prompts over the prefill actors that bring their first token soonest
    ALWAYS = "always"  # every remote prompt over every routable prefill actor (for tests)
    OFF = "off"  # one prefill actor per prompt


@dataclass(slots=True)
class PipelinePlan:
    """The prefill actors of the stages, in order, the layers each stage computes, and the
    chunks. With ``decode_stage`` the request's decode actor computes the last stage (the last
    range of ``layers``), straight into its reservation."""

    workers: list[WorkerRecord]
    layers: list[range]
    chunk_tokens: int
    decode_stage: bool = False

    @property
    def num_stages(self) -> int:
        return len(self.layers)


def decode_may_be_a_stage(mode: PipelineMode, decode: WorkerRecord) -> bool:
    """Whether ``decode`` (the request's decode actor) may compute the last stage of its prompt:
    ``auto`` while it has no other request (its core idle: the start of a burst, a lone long
    prompt), ``always`` whenever (for tests), ``off`` never. Its stage's chunks take turns with
    its decode steps, so a busy decode actor would slow every stream it decodes."""
    if mode is PipelineMode.OFF:
        return False
    return mode is PipelineMode.ALWAYS or decode.num_assigned == 0


def num_stages(
    mode: PipelineMode, num_tokens: int, loads: Sequence[int], num_extra: int, max_stages: int | None, tokens_per_stage: int, num_layers: int,
    max_chunk_tokens: int = 512, block_size: int = 16,
) -> int:
    """How many stages a prompt of ``num_tokens`` (to compute) gets; 1: no pipeline. ``loads``:
    the prompt tokens queued on each routable prefill actor, ascending (the first stages go to
    the least loaded); ``num_extra``: idle stages beyond them (the decode actor's, last).

    ``auto`` picks the count whose first token comes soonest: on one actor, the least loaded
    queue and then the whole prompt; over ``k`` stages, the longest queue among the ``k`` least
    loaded (a stage's chunks wait behind its actor's work; an actor serves its stages oldest
    first, so a pipeline behind another one follows it stage by stage) and then the prompt's
    pipelined share (``pipelined_share``). So a long prompt that arrives while a pipeline holds
    every actor is pipelined behind it instead of going whole onto one of them, where its steps
    would take turns with that stage's chunks and hold the pipeline's other stages up. Every
    stage gets at least ``tokens_per_stage`` of the prompt."""
    if mode is PipelineMode.OFF or num_layers < 2:
        return 1
    limit = num_layers if max_stages is None else min(max_stages, num_layers)
    limit = min(limit, len(loads) + num_extra)
    if mode is PipelineMode.ALWAYS:
        return max(1, limit)
    best, soonest = 1, (loads[0] if loads else 0) + num_tokens
    for stages in range(2, min(limit, num_tokens // tokens_per_stage) + 1):
        # The last prefill stage's queue (``num_extra`` is 0 or 1: every pipeline keeps a prefill stage).
        ready = loads[stages - num_extra - 1] + num_tokens * pipelined_share(num_tokens, stages, max_chunk_tokens, block_size)
        if ready < soonest:
            best, soonest = stages, ready
    return best


def pipelined_share(num_tokens: int, num_stages: int, max_chunk_tokens: int, block_size: int) -> float:
    """The part of one actor's time a prompt takes over ``num_stages`` stages: with ``c``
    chunks, ``(c + k - 1) / (k c)`` (each stage computes ``1/k`` of every chunk; filling and
    draining the pipeline adds ``k - 1`` chunk turns)."""
    chunks = -(-num_tokens // chunk_tokens(num_tokens, num_stages, max_chunk_tokens, block_size))
    return (chunks + num_stages - 1) / (num_stages * chunks)


def balanced_layers(layer_costs: Sequence[float], num_stages: int) -> list[range]:
    """Cut the layers into ``num_stages`` contiguous ranges whose largest cost is the smallest
    possible (a stage's step time is the pipeline's beat): a binary search over the bound, each
    tested by filling stages greedily."""
    num_layers = len(layer_costs)
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"num_stages: {num_stages} is outside [1, {num_layers}] (the model's layers)")

    def cuts_within(bound: float) -> list[int] | None:
        cuts, total = [], 0.0
        for index, cost in enumerate(layer_costs):
            # Leave at least one layer for each stage still to come.
            must_cut = num_layers - index == num_stages - 1 - len(cuts)
            if index > 0 and (total + cost > bound or must_cut) and len(cuts) < num_stages - 1:
                cuts.append(index)
                total = 0.0
            total += cost
            if total > bound:
                return None
        return cuts if len(cuts) == num_stages - 1 else None

    low, high = max(layer_costs), sum(layer_costs)
    best = cuts_within(high)
    for _ in range(60):
        middle = (low + high) / 2
        found = cuts_within(middle)
        if found is not None:
            best, high = found, middle
        else:
            low = middle
    bounds = [0, *best, num_layers]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def chunk_tokens(num_tokens: int, num_stages: int, max_chunk_tokens: int, block_size: int) -> int:
    """The chunks a prompt flows through its stages in. A pipeline's fill and drain cost about one
    chunk, and small chunks compute less efficiently: about two chunks per stage, in whole blocks,
    at most ``max_chunk_tokens`` (a 1,024-token prompt over 2 stages took 992 / 946 / 923 / 1,022 ms
    in chunks of 64 / 128 / 256 / 512 here; an 8k prompt the same in 256 or 512)."""
    per_chunk = -(-num_tokens // (2 * num_stages))
    per_chunk = -(-per_chunk // block_size) * block_size
    return max(1, min(max_chunk_tokens, max(block_size, per_chunk)))


def plan_pipeline(
    mode: PipelineMode,
    num_tokens: int,
    candidates: Sequence[WorkerRecord],
    max_stages: int | None,
    tokens_per_stage: int,
    layer_costs: Sequence[float],
    max_chunk_tokens: int = 512,
    block_size: int = 16,
    decode: WorkerRecord | None = None,
) -> PipelinePlan | None:
    """The pipeline for a prompt of ``num_tokens`` over ``candidates`` (routable prefill actors)
    and ``decode`` (the request's decode actor, if it may compute the last stage: it counts as
    one more idle stage), or None for the ordinary path. The least loaded first; a pipeline has
    at least one prefill stage; ``num_stages`` says how many."""
    ordered = sorted(candidates, key=lambda w: (w.num_assigned_prompt_tokens, w.worker_id))
    extra = 1 if decode is not None else 0
    stages = num_stages(
        mode, num_tokens, [w.num_assigned_prompt_tokens for w in ordered], extra, max_stages, tokens_per_stage, len(layer_costs),
        max_chunk_tokens, block_size,
    )
    if stages < 2:  # also with no candidates: ``num_stages`` keeps a prefill stage in every pipeline
        return None
    return PipelinePlan(
        ordered[: stages - extra], balanced_layers(layer_costs, stages), chunk_tokens(num_tokens, stages, max_chunk_tokens, block_size),
        decode_stage=decode is not None,
    )


def stage_starts(cached_tokens: Sequence[int]) -> list[int]:
    """Where each stage computes from, given how many prompt tokens each stage's cache holds (of
    its layers; the decode stage's: every layer). A stage needs the previous one's activations
    from its own start on, so no stage may start after a later one: each starts at the fewest
    any stage from it on holds (a later stage holding more skips the activations it has)."""
    starts = list(cached_tokens)
    for index in range(len(starts) - 2, -1, -1):
        starts[index] = min(starts[index], starts[index + 1])
    return starts
