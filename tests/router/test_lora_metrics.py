"""vLLM's lora_requests_info, per worker: which adapters its requests go through, as of when."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from prometheus_client import generate_latest

from engine.stats import EngineStats
from router.metrics import Metrics
from router.pool import Role


def _router(engine: EngineStats | None, waiting_for_room: int = 0, awaiting_kv: int = 0):
    record = SimpleNamespace(worker_id="decode-0", role=Role.DECODE)
    status = None if engine is None else SimpleNamespace(engine=engine, epoch="e1", transfer_paths=[], num_awaiting_kv=awaiting_kv)

    async def reports(max_age_s):
        return {"decode-0": SimpleNamespace(status=status)}

    return SimpleNamespace(
        pool=SimpleNamespace(workers={"decode-0": record}), status_monitor=SimpleNamespace(reports=reports),
        dispatcher=SimpleNamespace(num_queued=0, capacity=SimpleNamespace(num_waiting=waiting_for_room)),
    )


def _lora_lines(metrics: Metrics) -> list[str]:
    return [line for line in generate_latest(metrics.registry).decode().splitlines() if line.startswith("pdserve:lora_requests_info{")]


def test_each_worker_shows_its_running_and_waiting_adapters_and_only_its_latest():
    metrics = Metrics("tiny")
    stats = EngineStats(1, 2, 0, 10, 20, 0, num_lora_adapters=3, running_lora_adapters=["chat", "sql"], waiting_lora_adapters=["sql"])
    before = time.time()
    asyncio.run(metrics.refresh(_router(stats)))
    (line,) = _lora_lines(metrics)
    assert 'max_lora="3"' in line and 'running_lora_adapters="chat,sql"' in line and 'waiting_lora_adapters="sql"' in line
    assert 'worker_id="decode-0"' in line and float(line.rsplit(" ", 1)[1]) >= before
    stats.running_lora_adapters, stats.waiting_lora_adapters = [], []
    asyncio.run(metrics.refresh(_router(stats)))
    (line,) = _lora_lines(metrics)  # the earlier label set is gone
    assert 'running_lora_adapters=""' in line and 'waiting_lora_adapters=""' in line


def test_a_worker_without_adapters_has_no_series():
    metrics = Metrics("tiny")
    asyncio.run(metrics.refresh(_router(EngineStats(0, 0, 0, 10, 10, 0))))
    assert _lora_lines(metrics) == []


def test_a_worker_that_left_takes_its_tokens_per_step_and_transfer_paths_with_it():
    """Under an autoscaler's churn a retired prefill worker's last tokens per step and its
    transfer paths' series were exported for good (and their running totals kept)."""
    from kvtransfer.path import PathStats

    metrics = Metrics("tiny")
    record = SimpleNamespace(worker_id="prefill-0", role=Role.PREFILL)
    status = SimpleNamespace(engine=EngineStats(0, 0, 0, 10, 10, 0, num_steps=4, num_scheduled_tokens=400), epoch="e1",
                             transfer_paths=[PathStats("decode-0", "nixl", "cpu", num_bytes=4096, num_writes=2)])
    workers = {"prefill-0": record}

    async def reports(max_age_s):
        return {w: SimpleNamespace(status=status) for w in workers}

    router = SimpleNamespace(pool=SimpleNamespace(workers=workers), status_monitor=SimpleNamespace(reports=reports),
                             dispatcher=SimpleNamespace(num_queued=0, capacity=SimpleNamespace(num_waiting=0)))
    asyncio.run(metrics.refresh(router))
    labels = {"model_name": "tiny", "worker_id": "prefill-0"}
    assert metrics.registry.get_sample_value("pdserve:prefill_tokens_per_step", labels) == 100.0
    path = {"model_name": "tiny", "prefill_worker_id": "prefill-0", "decode_worker_id": "decode-0", "transport": "nixl", "device": "cpu"}
    assert metrics.registry.get_sample_value("pdserve:kv_transfer_path_bytes_total", path) == 4096
    workers.clear()
    asyncio.run(metrics.refresh(router))
    assert metrics.registry.get_sample_value("pdserve:prefill_tokens_per_step", labels) is None
    assert metrics.registry.get_sample_value("pdserve:kv_transfer_path_bytes_total", path) is None
    assert not metrics._last_totals and not metrics._last_steps


def test_a_following_router_exports_its_own_queue_not_the_workers_series():
    """Router replicas follow the managing router's pools: each exporting every worker's series
    counted each worker's steps and KV once per router in a sum over the scrape targets."""
    metrics = Metrics("tiny")
    asyncio.run(metrics.refresh(_router(EngineStats(1, 2, 0, 10, 20, 0)), pools=False))
    text = generate_latest(metrics.registry).decode()
    assert "pdserve:num_requests_waiting{" in text
    assert 'worker_id="decode-0"' not in text


def test_waiting_requests_are_those_queued_not_those_being_computed():
    """vLLM's num_requests_waiting is its scheduler's waiting queue, what autoscalers scale out
    on. It counted every request without a first token, prefills and KV transfers under way
    included, so it stayed above 0 with no queue at all. Now: those waiting for decode room at
    the router and those in the workers' queues."""
    metrics = Metrics("tiny")

    def waiting(router) -> float:
        asyncio.run(metrics.refresh(router))
        return metrics.registry.get_sample_value("pdserve:num_requests_waiting", {"model_name": "tiny"})

    # A request a prefill actor computes is awaited by its decode reservation: not waiting.
    assert waiting(_router(EngineStats(3, 2, 0, 10, 20, 0), waiting_for_room=2, awaiting_kv=4)) == 5
    assert waiting(_router(None)) == 3, "a worker too busy to answer in time dropped its queue from the count"
    assert waiting(_router(EngineStats(0, 4, 0, 10, 20, 0))) == 0
