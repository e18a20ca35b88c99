"""The CPU ranks' shared-memory all-reduce: the sum every rank gets, bit for bit the same on
each, over real gloo-formed groups of processes; big tensors fall back to gloo; a rank that
never arrives is reported as a lost rank, not waited for forever. Rank 0 holds the group's
port from the moment it hands the address out."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from engine.parallel.group import GroupAddress, RankFailedError, TPGroup, listen
from engine.parallel.shm import SLOT_BYTES


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _sums(rank: int, port: int, world: int, results) -> None:
    torch.set_num_threads(1)
    group = TPGroup.join(GroupAddress("127.0.0.1", port, world, "gloo"), rank)
    assert group._shm is not None and group._shm.available
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for size in (7, 576, 300_000):
            mine = (torch.randn(size, generator=torch.Generator().manual_seed(100 * rank + size)) * 3).to(dtype)
            summed = group.all_reduce(mine.clone())
            out[(str(dtype), size)] = summed
    big = torch.ones(SLOT_BYTES // 4 + 1) * (rank + 1)  # over a slot: gloo sums it
    out["big"] = group.all_reduce(big)
    results[rank] = out
    group.close()


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_the_same_sum_as_adding_the_ranks_in_order(world):
    context = mp.get_context("spawn")
    manager = context.Manager()
    results = manager.dict()
    port = _free_port()
    processes = [context.Process(target=_sums, args=(rank, port, world, results)) for rank in range(world)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(120)
        assert process.exitcode == 0
    for key in results[0]:
        if key == "big":
            assert torch.equal(results[0]["big"], torch.full_like(results[0]["big"], sum(range(1, world + 1))))
            continue
        dtype_name, size = key
        dtype = getattr(torch, dtype_name.removeprefix("torch."))
        parts = [(torch.randn(size, generator=torch.Generator().manual_seed(100 * r + size)) * 3).to(dtype) for r in range(world)]
        # Rank order, accumulated in float32, rounded once (bfloat16).
        expected = sum(p.float() for p in parts).to(dtype) if world > 1 else parts[0]
        for rank in range(world):
            assert torch.equal(results[rank][key], results[0][key]), "every rank holds the same bits"
        assert torch.equal(results[0][key], expected), key


def _abandoned(rank: int, port: int, errors) -> None:
    group = TPGroup.join(GroupAddress("127.0.0.1", port, 2, "gloo"), rank)
    group._shm.arrival_timeout_s = 1.0
    if rank == 1:
        return  # never reaches the all-reduce (as if it died)
    try:
        group.all_reduce(torch.ones(16))
    except RankFailedError as exc:
        errors.append(str(exc))


def test_a_rank_that_never_arrives_is_a_lost_rank():
    context = mp.get_context("spawn")
    manager = context.Manager()
    errors = manager.list()
    port = _free_port()
    processes = [context.Process(target=_abandoned, args=(rank, port, errors)) for rank in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(120)
    assert len(errors) == 1 and "did not reach the all-reduce within 1s" in errors[0]


def _meets(rank: int, addresses, results) -> None:
    torch.set_num_threads(1)
    if rank == 0:
        address, store = listen(2, "cpu")
        with socket.socket() as other:  # nobody else can take the port before the ranks meet
            try:
                other.bind((address.host, address.port))
                results["bound by another"] = True
            except OSError:
                results["bound by another"] = False
        addresses.put(address)
        group = TPGroup.join(address, 0, store)
    else:
        group = TPGroup.join(addresses.get(timeout=60), rank)
    results[rank] = group.all_reduce(torch.full((4,), float(rank + 1)))
    group.close()


def test_rank_zero_holds_the_groups_port_from_the_moment_it_hands_the_address_out():
    context = mp.get_context("spawn")
    manager = context.Manager()
    results, addresses = manager.dict(), manager.Queue()
    processes = [context.Process(target=_meets, args=(rank, addresses, results)) for rank in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(120)
        assert process.exitcode == 0
    assert results["bound by another"] is False
    assert torch.equal(results[0], torch.full((4,), 3.0)) and torch.equal(results[1], torch.full((4,), 3.0))
