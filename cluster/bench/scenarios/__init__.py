"""The benchmark scenarios: each launches the local clusters it compares and prints its ratio.

Every scenario module exposes ``NAME``, ``SUMMARY``, ``add_arguments(parser)`` and
``run(args) -> ScenarioOutcome``, and may set ``DEFAULT_DTYPE``; this registry is what
``pdserve bench-scenario`` lists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cluster.bench.scenarios import disaggregation, faults, hol_blocking, kv_transfer, prefix_cache, router_cost, scaling, simulator, speculation, split_fuse, tensor_parallel, vllm_compare
from cluster.bench.scenarios.common import ScenarioOutcome


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    summary: str
    add_arguments: Callable
    run: Callable[..., ScenarioOutcome]
    default_dtype: str = "bfloat16"


SCENARIOS: dict[str, Scenario] = {
    module.NAME: Scenario(module.NAME, module.SUMMARY, module.add_arguments, module.run, getattr(module, "DEFAULT_DTYPE", "bfloat16"))
    for module in (disaggregation, hol_blocking, scaling, kv_transfer, vllm_compare, faults, prefix_cache, speculation, simulator, tensor_parallel, split_fuse, router_cost)
}
