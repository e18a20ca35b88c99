"""Pipeline stages writing their own layers of every block into one reservation (issue 27):
each stage is a writer of its own, moves only its layers of each head (and their scales in a
quantized cache), and the reservation is ready only once every stage landed every block. Over
real NIXL and the Ray fallback, between workers of equal and different tensor-parallel sizes.

As in test_tensor_parallel_transfer, each case runs in a Ray worker process."""

from __future__ import annotations

import time

import pytest
import ray
import torch

from kvtransfer import KVCompat
from tests.kvtransfer.test_tensor_parallel_transfer import NUM_BLOCKS, Worker

# (stages' layer ranges, writer TP, reader TP)
CASES = [
    ([range(0, 2), range(2, 3)], 1, 1),
    ([range(0, 1), range(1, 2), range(2, 3)], 1, 1),
    ([range(0, 1), range(1, 3)], 2, 1),
    ([range(0, 2), range(2, 3)], 1, 2),
]


def _layer_mask(compat: KVCompat, layers: range) -> torch.Tensor:
    """Which bytes of a head's share of a block belong to ``layers``."""
    mask = torch.zeros(compat.bytes_per_head, dtype=torch.bool)
    for offset, length in compat.layer_runs_in_head(layers):
        mask[offset : offset + length] = True
    return mask


@ray.remote(num_cpus=1)
def _stages_into_one_reservation(backend: str, compat: KVCompat) -> list[str]:
    torch.set_num_threads(1)
    problems = []
    for case, (stage_layers, p, d) in enumerate(CASES):
        stages = [Worker(f"S{case}-{i}", compat, p, backend) for i in range(len(stage_layers))]
        reader = Worker(f"R{case}", compat, d, backend)
        try:
            for i, stage in enumerate(stages):
                stage.agent.connect(reader.agent.handshake_offer())
                stage.fill(seed=case * 10 + i)  # each stage's cache holds different bytes everywhere
            src, dst = [3, 4, 5, 9, 10, 17], [0, 1, 2, 20, 21, 7]
            req_id = f"req-{case}"
            dest = reader.agent.reserve(req_id, dst, lease_s=20.0, num_writers=len(stages))
            half = len(src) // 2
            for i, (stage, layers) in enumerate(zip(stages, stage_layers)):
                stage.agent.push(req_id, dest, src[:half], dst[:half], half, layers=layers)
            # Every stage but the last has sealed: not ready while one stage's blocks are missing.
            for stage, layers in zip(stages[:-1], stage_layers[:-1]):
                stage.agent.push(req_id, dest, src[half:], dst[half:], len(dst), layers=layers)
            ready = _drain(stages, reader, req_id, seconds=0.5)
            if ready:
                problems.append(f"case {case}: ready before the last stage wrote its second half")
            stages[-1].agent.push(req_id, dest, src[half:], dst[half:], len(dst), "first-token", layers=stage_layers[-1])
            if not _drain(stages, reader, req_id, seconds=10):
                problems.append(f"case {case}: never ready")
                continue
            if reader.agent.payload(req_id) != "first-token":
                problems.append(f"case {case}: payload {reader.agent.payload(req_id)!r}")
            reader.agent.complete(req_id)
            got = reader.heads_bytes(dst)
            expected = torch.zeros_like(got)
            for stage, layers in zip(stages, stage_layers):
                mask = _layer_mask(compat, layers)
                expected[:, :, mask] = stage.heads_bytes(src)[:, :, mask]
            if not torch.equal(got, expected):
                problems.append(f"case {case}: a layer's bytes are not its stage's")
            for shard, tensor in zip(reader.shards, reader.tensors):
                untouched = [b for b in range(NUM_BLOCKS) if b not in dst]
                if tensor.view(NUM_BLOCKS, -1)[untouched].any():
                    problems.append(f"case {case} rank {shard.rank}: bytes outside the reservation")
            # What one stage's push costs: its layers of every head, one descriptor per head run per block.
            cost = stages[0].agent.write_cost(dest, src, dst, stage_layers[0])
            per_head = sum(n for _, n in compat.layer_runs_in_head(stage_layers[0]))
            if cost[0] != len(src) * compat.num_kv_heads * per_head:
                problems.append(f"case {case}: write cost {cost}")
        finally:
            for worker in (*stages, reader):
                worker.close()
    return problems


def _drain(stages: list[Worker], reader: Worker, req_id: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for stage in stages:
            for event in stage.agent.poll_sends():
                assert event.error is None, event.error
        events = reader.agent.poll_receives()
        assert not events.failed, events.failed
        if req_id in events.ready:
            return True
        time.sleep(0.001)
    return False


# Over Ray (the fallback transport: seconds of mailbox processes) the case with block scales only.
@pytest.mark.parametrize("backend,block_scales", [("nixl", False), ("nixl", True), ("ray", True)])
def test_each_stage_lands_its_layers_and_the_reservation_waits_for_all(ray_session, backend, block_scales):
    dtype = "int8" if block_scales else "bfloat16"
    compat = KVCompat("pp/model", dtype, num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, block_scales=block_scales)
    assert ray.get(_stages_into_one_reservation.remote(backend, compat)) == []


def test_layer_runs_of_a_head_tile_it():
    for scales in (False, True):
        compat = KVCompat("pp/model", "int8" if scales else "float32", num_layers=5, num_kv_heads=2, head_dim=8, block_size=4, block_scales=scales)
        covered = torch.zeros(compat.bytes_per_head, dtype=torch.int32)
        for layers in (range(0, 2), range(2, 3), range(3, 5)):
            for offset, length in compat.layer_runs_in_head(layers):
                covered[offset : offset + length] += 1
        assert bool((covered == 1).all())
    with pytest.raises(Exception, match="layers: range\\(3, 7\\)"):
        compat.layer_runs_in_head(range(3, 7))
