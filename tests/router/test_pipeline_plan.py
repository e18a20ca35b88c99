"""The router's per-prompt pipeline decision (distributed split-fuse): how many stages a prompt
gets from its length, the prefill actors' queues and the configuration, and where the layers are cut."""

from __future__ import annotations

import pytest

from router.config import RouterConfig
from router.pipeline import PipelineMode, balanced_layers, decode_may_be_a_stage, plan_pipeline, stage_starts
from router.pool import Role, WorkerRecord

UNIFORM = [1.0] * 30


def _workers(*queued: int) -> list[WorkerRecord]:
    return [WorkerRecord(f"prefill-{i}", Role.PREFILL, handle=None, num_assigned_prompt_tokens=n) for i, n in enumerate(queued)]


def _stages(mode: PipelineMode, num_tokens: int, workers: list[WorkerRecord], max_stages: int | None = None) -> list[str]:
    plan = plan_pipeline(mode, num_tokens, workers, max_stages, 1024, UNIFORM)
    return [] if plan is None else [w.worker_id for w in plan.workers]


def test_auto_pipelines_long_prompts_where_their_first_token_comes_soonest():
    idle = _workers(0, 0, 0)
    assert _stages(PipelineMode.AUTO, 8000, idle) == ["prefill-0", "prefill-1", "prefill-2"]
    assert _stages(PipelineMode.AUTO, 8000, idle, max_stages=2) == ["prefill-0", "prefill-1"]
    # One stage per 1024 tokens: a 2,500-token prompt takes two; short prompts stay on one actor.
    assert _stages(PipelineMode.AUTO, 2500, idle) == ["prefill-0", "prefill-1"]
    assert _stages(PipelineMode.AUTO, 2000, idle) == []
    assert _stages(PipelineMode.AUTO, 64, idle) == []
    # A short prompt queued ahead delays a pipeline little; a long queue would hold the whole
    # pipeline behind it, so the busy actor is left out, or the prompt stays on the idle one.
    assert _stages(PipelineMode.AUTO, 8000, _workers(64, 0)) == ["prefill-1", "prefill-0"]
    assert _stages(PipelineMode.AUTO, 8000, _workers(4000, 0, 0)) == ["prefill-1", "prefill-2"]
    assert _stages(PipelineMode.AUTO, 8000, _workers(6000, 0)) == []
    # A long prompt that arrives while a pipeline holds every actor (each with its share queued)
    # is pipelined behind it, not put whole onto one of them.
    assert _stages(PipelineMode.AUTO, 4000, _workers(3000, 3000)) == ["prefill-0", "prefill-1"]
    assert _stages(PipelineMode.AUTO, 4000, _workers(3000, 3000, 3000)) == ["prefill-0", "prefill-1", "prefill-2"]


def test_chunks_are_about_two_per_stage_in_whole_blocks():
    plan = lambda n, workers=2: plan_pipeline(PipelineMode.ALWAYS, n, _workers(*[0] * workers), None, 1024, UNIFORM, 512, 16)
    assert plan(8000).chunk_tokens == 512  # at most the configured chunk
    assert plan(1024).chunk_tokens == 256
    assert plan(1000, workers=3).chunk_tokens == 176  # 167 rounded up to whole blocks
    assert plan(40).chunk_tokens == 16  # at least a block


def test_always_and_off():
    busy = _workers(300, 0)
    assert _stages(PipelineMode.ALWAYS, 40, busy) == ["prefill-1", "prefill-0"]  # least loaded first
    assert _stages(PipelineMode.ALWAYS, 40, _workers(0)) == []  # one actor: no pipeline
    assert _stages(PipelineMode.OFF, 8000, _workers(0, 0)) == []
    # Never more stages than layers.
    plan = plan_pipeline(PipelineMode.ALWAYS, 40, _workers(0, 0, 0), None, 1024, [1.0, 1.0])
    assert [len(r) for r in plan.layers] == [1, 1]


@pytest.mark.parametrize("costs,num_stages", [(UNIFORM, 2), (UNIFORM, 3), ([1.0] * 12, 5), ([5, 1, 1, 1, 1, 1], 2), ([1, 1, 1, 1, 9], 3), ([2.0] * 4, 4)])
def test_layers_are_cut_into_contiguous_ranges_of_the_least_largest_cost(costs, num_stages):
    ranges = balanced_layers(costs, num_stages)
    assert len(ranges) == num_stages and all(len(r) >= 1 for r in ranges)
    assert [i for r in ranges for i in r] == list(range(len(costs)))  # every layer once, in order
    largest = max(sum(costs[i] for i in r) for r in ranges)
    # Brute force over every way to cut: none has a smaller largest stage.
    import itertools

    best = min(
        max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, len(costs))))
        for cuts in itertools.combinations(range(1, len(costs)), num_stages - 1)
    )
    assert largest == pytest.approx(best)


def test_stage_count_is_refused_beyond_the_layers():
    with pytest.raises(ValueError, match="num_stages: 5 is outside \\[1, 4\\]"):
        balanced_layers([1.0] * 4, 5)


def test_config_names_a_bad_pipeline_field():
    for field, value, message in [
        ("max_pipeline_stages", 0, "max_pipeline_stages: must be >= 1 or unset, got 0"),
        ("pipeline_tokens_per_stage", 0, "pipeline_tokens_per_stage: must be >= 1, got 0"),
        ("pipeline_chunk_tokens", -5, "pipeline_chunk_tokens: must be >= 1, got -5"),
    ]:
        with pytest.raises(ValueError, match=message):
            RouterConfig(**{field: value}).validate()


def test_an_idle_decode_actor_is_the_last_stage():
    decode = WorkerRecord("decode-0", Role.DECODE, handle=None)
    # It counts as one more idle stage: with one prefill actor an 8k prompt gets two stages.
    plan = plan_pipeline(PipelineMode.AUTO, 8000, _workers(0), None, 1024, UNIFORM, decode=decode)
    assert [w.worker_id for w in plan.workers] == ["prefill-0"] and plan.decode_stage
    assert plan.num_stages == 2 and plan.layers == [range(0, 15), range(15, 30)]
    # The length still decides: one stage's worth of tokens is no pipeline.
    assert plan_pipeline(PipelineMode.AUTO, 1500, _workers(0), None, 1024, UNIFORM, decode=decode) is None
    # A pipeline keeps at least one prefill stage, and the stage limit counts the decode actor.
    assert plan_pipeline(PipelineMode.ALWAYS, 8000, [], None, 1024, UNIFORM, decode=decode) is None
    plan = plan_pipeline(PipelineMode.AUTO, 8000, _workers(0, 0, 0), 2, 1024, UNIFORM, decode=decode)
    assert [w.worker_id for w in plan.workers] == ["prefill-0"] and plan.decode_stage
    # Auto: only while it has no other request (its stage's chunks would slow its streams).
    assert decode_may_be_a_stage(PipelineMode.AUTO, decode)
    decode.num_assigned = 1
    assert not decode_may_be_a_stage(PipelineMode.AUTO, decode)
    assert decode_may_be_a_stage(PipelineMode.ALWAYS, decode) and not decode_may_be_a_stage(PipelineMode.OFF, decode)


def test_each_stage_starts_where_it_and_every_later_stage_hold_the_prompt():
    assert stage_starts([0, 0]) == [0, 0]
    # The decode actor holds 96 tokens of every layer: the prefill stage computes from 32 (what
    # it holds), and hands over activations only from 96.
    assert stage_starts([32, 96]) == [32, 96]
    # A later stage holding less pulls the earlier ones back (it needs their activations).
    assert stage_starts([96, 32]) == [32, 32]
    assert stage_starts([64, 128, 16, 48]) == [16, 16, 16, 48]
