"""A snapshot of an engine's load, for the worker status reports the router balances on."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class WorkerState(str, enum.Enum):
    """Lifecycle of whatever runs an engine, as the router sees it."""

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"  # finishes what it has, takes nothing new
    UNHEALTHY = "unhealthy"
    DEAD = "dead"


@dataclass(slots=True)
class EngineStats:
    num_waiting: int  # requests queued, not yet holding blocks
    num_running: int  # sequences in the batch
    num_queued_prefill_tokens: int  # prompt tokens not yet computed, queued or running
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int
    num_steps: int = 0  # since the engine started
    num_scheduled_tokens: int = 0  # prompt and decode tokens computed, since the engine started
    num_prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache, since the start
    num_prefix_hit_tokens: int = 0  # of those, tokens the cache held
    num_cached_free_blocks: int = 0  # free blocks still holding a cached prefix block
    num_draft_tokens: int = 0  # speculative tokens proposed, since the start
    num_accepted_draft_tokens: int = 0  # of those, tokens the model confirmed
    step_seconds: float = 0.0  # wall time inside steps (schedule, run, read the tokens), since the start
    # LoRA adapters (engine.lora): how many versions the engine holds, and the names its
    # computing and its waiting requests go through (vLLM's lora_requests_info).
    num_lora_adapters: int = 0
    running_lora_adapters: list[str] = field(default_factory=list)
    waiting_lora_adapters: list[str] = field(default_factory=list)

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks


def engine_stats(engine) -> EngineStats:
    """Read the load of an ``LLMEngine`` (call on the engine's own thread)."""
    scheduler = engine.scheduler
    computing = scheduler.computing()
    queued = sum(s.num_uncomputed_tokens for s in scheduler.waiting)
    queued += sum(s.num_uncomputed_tokens for s in computing if s.num_computed_tokens < s.num_prompt_tokens)
    return EngineStats(
        num_waiting=len(scheduler.waiting),
        num_running=len(computing),
        num_queued_prefill_tokens=queued,
        num_free_blocks=engine.allocator.num_free,
        num_total_blocks=engine.allocator.num_blocks,
        num_preemptions=scheduler.num_preemptions,
        num_steps=engine.num_steps,
        num_scheduled_tokens=engine.num_scheduled_tokens,
        num_prefix_query_tokens=scheduler.num_prefix_query_tokens,
        num_prefix_hit_tokens=scheduler.num_prefix_hit_tokens,
        num_cached_free_blocks=engine.allocator.num_cached_free,
        num_draft_tokens=scheduler.num_draft_tokens,
        num_accepted_draft_tokens=scheduler.num_accepted_draft_tokens,
        step_seconds=engine.step_seconds,
        num_lora_adapters=len(engine.adapters.slots),
        running_lora_adapters=sorted({s.params.lora_name for s in computing if s.params.lora_name is not None}),
        waiting_lora_adapters=sorted({s.params.lora_name for s in scheduler.waiting if s.params.lora_name is not None}),
    )
