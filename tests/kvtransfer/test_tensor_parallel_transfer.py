"""KV transfer between workers of different tensor-parallel sizes: every writer rank's heads
land straight in the reader rank(s) holding them, byte for byte, over real NIXL (and the Ray
fallback), for (P, D) in {1, 2} x {1, 2}, split and replicated heads, plain and quantized caches.

Each case runs in a Ray worker process, as the real workers do: NIXL's libraries are never
loaded into the test process (beside grpc_tools' protobuf they crash its later imports)."""

from __future__ import annotations

import dataclasses
import re
import time

import pytest
import ray
import torch

from kvtransfer import KVAgent, KVCompat, KVTransferConfig
from kvtransfer.backends import BackendOptions, make_transport
from kvtransfer.errors import IncompatiblePeerError
from kvtransfer.layout import KVRegion
from kvtransfer.sharded_transport import RankTransport
from kvtransfer.sharding import KVShard, descriptors_per_block, plan_legs
from tests.kvtransfer.conftest import TEST_POLICY

NUM_BLOCKS = 24


def shards(num_kv_heads: int, tp_size: int) -> list[KVShard]:
    """The engine's rule (engine.parallel.shard): split, or replicate where there are fewer heads."""
    if num_kv_heads >= tp_size:
        per = num_kv_heads // tp_size
        return [KVShard(tp_size, r, r * per, per) for r in range(tp_size)]
    return [KVShard(tp_size, r, r // (tp_size // num_kv_heads), 1) for r in range(tp_size)]


class Worker:
    """A worker's ranks in this process: per-rank KV tensors, rank 0's agent driving them all."""

    def __init__(self, name: str, compat: KVCompat, tp_size: int, backend: str, nixl_mode: str = "prepped"):
        self.compat = compat
        self.shards = shards(compat.num_kv_heads, tp_size)
        self.tensors = [self._tensor(shard) for shard in self.shards]

        def open_ranks(base: str) -> list[RankTransport]:
            opened = []
            for shard, tensor in zip(self.shards[1:], self.tensors[1:]):
                region = KVRegion.from_tensor(tensor)
                options = BackendOptions(f"{base}/r{shard.rank}", tensor, region, nixl_mode=nixl_mode)
                opened.append(RankTransport(shard, region, make_transport(backend, options), options.transport_name))
            return opened

        config = KVTransferConfig(backend=backend, lease=TEST_POLICY, nixl_mode=nixl_mode)
        self.agent = KVAgent(name, self.tensors[0], compat, config, shard=self.shards[0], open_ranks=open_ranks)

    def _tensor(self, shard: KVShard) -> torch.Tensor:
        if self.compat.block_scales:
            return torch.zeros((NUM_BLOCKS, shard.num_heads * self.compat.bytes_per_head), dtype=torch.uint8)
        return torch.zeros((NUM_BLOCKS, *self.compat.block_shape(shard.num_heads)), dtype=getattr(torch, self.compat.dtype))

    def heads_bytes(self, block_ids: list[int]) -> torch.Tensor:
        """[blocks, num_kv_heads, bytes_per_head]: every head of these blocks, from its first holder."""
        per_head = self.compat.bytes_per_head
        out = torch.zeros((len(block_ids), self.compat.num_kv_heads, per_head), dtype=torch.uint8)
        for shard, tensor in reversed(list(zip(self.shards, self.tensors))):
            raw = tensor.view(NUM_BLOCKS, -1).view(torch.uint8).view(NUM_BLOCKS, shard.num_heads, per_head)
            out[:, shard.head_start : shard.head_end] = raw[block_ids]
        return out

    def fill(self, seed: int) -> None:
        """Random bytes per head; a replicated head holds the same bytes on every rank."""
        truth = torch.randint(0, 256, (NUM_BLOCKS, self.compat.num_kv_heads, self.compat.bytes_per_head), dtype=torch.uint8,
                              generator=torch.Generator().manual_seed(seed))
        for shard, tensor in zip(self.shards, self.tensors):
            raw = tensor.view(NUM_BLOCKS, -1).view(torch.uint8).view(NUM_BLOCKS, shard.num_heads, -1)
            raw.copy_(truth[:, shard.head_start : shard.head_end])

    def close(self) -> None:
        self.agent.close()


def _transfer(writer: Worker, reader: Worker, src: list[int], dst: list[int], req_id: str) -> None:
    dest = reader.agent.reserve(req_id, dst, lease_s=20.0)
    # Two pushes, like two prefill chunks; the second seals the request.
    half = len(src) // 2
    writer.agent.push(req_id, dest, src[:half], dst[:half], half)
    writer.agent.push(req_id, dest, src[half:], dst[half:], len(dst))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        writer.agent.poll_sends()
        events = reader.agent.poll_receives()
        assert not events.failed, events.failed
        if req_id in events.ready:
            assert reader.agent.complete(req_id) == dst
            return
        time.sleep(0.001)
    raise AssertionError(f"{req_id}: not ready in time")


CASES = [(p, d) for p in (1, 2) for d in (1, 2)]


@ray.remote(num_cpus=1)
def _every_pair(backend: str, compat: KVCompat, nixl_mode: str = "prepped") -> list[str]:
    """Each (P, D) pair's transfer; the problems found (none: every head where it belongs)."""
    torch.set_num_threads(1)
    problems = []
    for p, d in CASES:
        writer = Worker(f"P{p}{d}", compat, p, backend, nixl_mode)
        reader = Worker(f"D{p}{d}", compat, d, backend, nixl_mode)
        try:
            writer.agent.connect(reader.agent.handshake_offer())
            writer.fill(seed=p * 10 + d)
            src, dst = [3, 4, 5, 9, 10, 17], [0, 1, 2, 20, 21, 7]
            _transfer(writer, reader, src, dst, f"req-{p}{d}")
            if not torch.equal(reader.heads_bytes(dst), writer.heads_bytes(src)):
                problems.append(f"({p},{d}): heads differ from the writer's")
            for shard, tensor in zip(reader.shards, reader.tensors):
                untouched = [b for b in range(NUM_BLOCKS) if b not in dst]
                if tensor.view(NUM_BLOCKS, -1)[untouched].any():
                    problems.append(f"({p},{d}) rank {shard.rank} got bytes outside the reservation")
        finally:
            writer.close()
            reader.close()
    return problems


# Over NIXL every head layout (and, in NIXL's descriptors-per-push mode, one: a piece of a
# block on one side is the whole block on the other, and both lists must be as long); over Ray
# (the fallback transport, whose mailboxes are processes of their own: seconds per pair on a
# 2-core host) the one that takes head slices and scales.
@pytest.mark.parametrize(
    "backend,num_kv_heads,block_scales,nixl_mode",
    [("nixl", 4, False, "prepped"), ("nixl", 1, False, "prepped"), ("nixl", 2, True, "prepped"), ("nixl", 4, False, "dynamic"), ("ray", 2, True, "prepped")],
)
def test_every_tp_pair_moves_each_head_into_the_rank_that_holds_it(ray_session, backend, num_kv_heads, block_scales, nixl_mode):
    dtype = "int8" if block_scales else "bfloat16"
    compat = KVCompat("tp/model", dtype, num_layers=2, num_kv_heads=num_kv_heads, head_dim=8, block_size=4, block_scales=block_scales)
    assert ray.get(_every_pair.remote(backend, compat, nixl_mode)) == []


def test_descriptors_per_block_for_each_tp_pair():
    compat = KVCompat("tp/model", "bfloat16", num_layers=2, num_kv_heads=4, head_dim=8, block_size=4)
    per_block = {}
    for p, d in CASES:
        legs = plan_legs(shards(4, p), shards(4, d), 4, compat.bytes_per_head)
        per_block[(p, d)] = (len(legs), descriptors_per_block(legs, run_length=1), descriptors_per_block(legs, run_length=8))
        assert sum(leg.num_bytes for leg in legs) == compat.bytes_per_block  # every head once
    # (legs, descriptors per block alone, per block inside a run of 8 adjacent blocks)
    assert per_block == {(1, 1): (1, 1, 1 / 8), (1, 2): (2, 2, 2), (2, 1): (2, 2, 2), (2, 2): (2, 2, 2 / 8)}


@ray.remote(num_cpus=1)
def _write_costs() -> list[tuple[int, int]]:
    compat = KVCompat("tp/model", "bfloat16", num_layers=2, num_kv_heads=4, head_dim=8, block_size=4)
    writer, whole, split = Worker("Pc", compat, 1, "nixl"), Worker("Dc1", compat, 1, "nixl"), Worker("Dc2", compat, 2, "nixl")
    try:
        costs = []
        for reader, req_id in ((whole, "a"), (split, "b")):
            writer.agent.connect(reader.agent.handshake_offer())
            dest = reader.agent.reserve(req_id, [0, 1, 2, 3])
            costs.append(writer.agent.write_cost(dest, [4, 5, 6, 7], [0, 1, 2, 3]))
        return costs
    finally:
        for worker in (writer, whole, split):
            worker.close()


def test_write_cost_counts_every_rank_and_each_piece(ray_session):
    compat = KVCompat("tp/model", "bfloat16", num_layers=2, num_kv_heads=4, head_dim=8, block_size=4)
    # Four adjacent blocks into one reader rank: one run; into two ranks: one piece per block per rank.
    assert ray.get(_write_costs.remote()) == [(4 * compat.bytes_per_block, 1), (4 * compat.bytes_per_block, 8)]


@ray.remote(num_cpus=1)
def _refusal() -> str:
    compat = KVCompat("tp/model", "bfloat16", num_layers=2, num_kv_heads=4, head_dim=8, block_size=4)
    writer, reader = Worker("Pbad", compat, 2, "nixl"), Worker("Dbad", compat, 2, "nixl")
    try:
        offer = reader.agent.handshake_offer()
        # A reader whose ranks leave heads 2 and 3 to nobody (a broken or foreign peer).
        broken = dataclasses.replace(offer, shards=[KVShard(2, 0, 0, 2), KVShard(2, 1, 0, 2)])
        try:
            writer.agent.connect(broken)
        except IncompatiblePeerError as exc:
            refusal = str(exc)
        else:
            refusal = ""
        writer.agent.connect(offer)  # the real one still connects
        return refusal
    finally:
        writer.close()
        reader.close()


def test_a_pair_that_cannot_be_mapped_is_refused_naming_both_shapes(ray_session):
    refusal = ray.get(_refusal.remote())
    assert re.search(r"writer TP 2 \(rank 0: heads \[0, 2\), rank 1: heads \[2, 4\)\).*reader TP 2 .*heads \[2, 3\] are held by no rank", refusal), refusal
