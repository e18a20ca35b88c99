"""Prefill and decode pair on one node when that is as good: a prefill actor on another node
than the request's decode actor pays the measured cost of crossing nodes, and loses ties."""

from __future__ import annotations

import pytest

from router.pool import Role, WorkerRecord
from router.prefix_index import PrefixIndex
from router.routing import KVAware, LeastLoaded, RouteQuery
from router.transfer_costs import TransferCosts


def _prefill(worker_id: str, node: str, queued: int, rate: float | None = 1000.0) -> WorkerRecord:
    record = WorkerRecord(worker_id, Role.PREFILL, handle=None, node=node)
    record.num_assigned_prompt_tokens = queued
    record.prefill_rate.per_second = rate
    return record


@pytest.mark.parametrize("selector", [LeastLoaded(), KVAware(PrefixIndex(16))], ids=["least_loaded", "kv_aware"])
def test_among_equally_loaded_prefill_actors_the_one_on_the_decode_actors_node_wins(selector):
    far, near = _prefill("prefill-0", "node-a", 100), _prefill("prefill-1", "node-b", 100)
    query = RouteQuery(64, near_node="node-b")
    assert selector.choose(Role.PREFILL, [far, near], query) is near
    assert selector.choose(Role.PREFILL, [near, far], RouteQuery(64, near_node="node-a")) is far


@pytest.mark.parametrize("selector", [LeastLoaded(), KVAware(PrefixIndex(16))], ids=["least_loaded", "kv_aware"])
def test_a_busier_near_actor_wins_until_its_queue_outweighs_the_measured_cost_of_crossing(selector):
    costs = TransferCosts()
    assert costs.cross_node_extra_s() == 0.0, "unmeasured: no extra cost, only the tie-break"
    for _ in range(5):
        costs.observe(same_node=True, exposed_transfer_ms=5.0)
        costs.observe(same_node=False, exposed_transfer_ms=205.0)
    assert costs.cross_node_extra_s() == pytest.approx(0.2)
    # At 1000 prompt tokens/s, crossing costs 200 tokens of queue.
    query = RouteQuery(64, near_node="node-b", cross_node_s=costs.cross_node_extra_s())
    far = _prefill("prefill-0", "node-a", 0)
    assert selector.choose(Role.PREFILL, [far, _prefill("prefill-1", "node-b", 150)], query).node == "node-b"
    assert selector.choose(Role.PREFILL, [far, _prefill("prefill-1", "node-b", 250)], query).node == "node-a"


def test_without_a_node_on_either_side_nothing_changes():
    a, b = _prefill("prefill-0", "", 10), _prefill("prefill-1", "node-b", 20)
    assert LeastLoaded().choose(Role.PREFILL, [b, a], RouteQuery(8, near_node="node-b", cross_node_s=10.0)) is a
    assert LeastLoaded().choose(Role.PREFILL, [b, a], RouteQuery(8)) is a
