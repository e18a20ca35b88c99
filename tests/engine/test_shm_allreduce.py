"""The CPU ranks' shared-memory all-reduce: the sum every rank gets, bit for bit the same on
each, over real gloo-formed groups of processes; big tensors fall back to gloo; a rank that
never arrives is reported as a lost rank, not waited for forever. The groups meet as a worker's
do: rank 0 listens first and hands its address out, holding the port from then on."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from engine.parallel.group import RankFailedError, TPGroup, listen
from engine.parallel.shm import SLOT_BYTES


def _meet(rank: int, world: int, addresses, results) -> TPGroup:
    """Rank 0 listens (and checks nobody else can take its port now), then hands the address
    to the others, who join it."""
    torch.set_num_threads(1)
    if rank > 0:
        return TPGroup.join(addresses.get(timeout=60), rank)
    address, store = listen(world, "cpu")
    with socket.socket() as other:
        try:
            other.bind((address.host, address.port))
            results["port taken by another"] = True
        except OSError:
            results["port taken by another"] = False
    for _ in range(world - 1):
        addresses.put(address)
    return TPGroup.join(address, 0, store)


def _run(target, world: int, *shared) -> None:
    context = mp.get_context("spawn")
    processes = [context.Process(target=target, args=(rank, world, *shared)) for rank in range(world)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(120)
        assert process.exitcode == 0


def _sums(rank: int, world: int, addresses, results) -> None:
    group = _meet(rank, world, addresses, results)
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
    manager = mp.get_context("spawn").Manager()
    results, addresses = manager.dict(), manager.Queue()
    _run(_sums, world, addresses, results)
    assert results.pop("port taken by another") is False
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


def _abandoned(rank: int, world: int, addresses, results, errors) -> None:
    import os
    import time

    group = _meet(rank, world, addresses, results)
    group._shm.arrival_timeout_s = 1.0
    if rank == 1:
        # Never reaches the all-reduce, and ends as a dead rank does: at once, no teardown (its
        # group's threads torn down at interpreter exit aborted the process now and then).
        time.sleep(2.0)
        os._exit(0)
    try:
        group.all_reduce(torch.ones(16))
    except RankFailedError as exc:
        errors.append(str(exc))
    os._exit(0)  # as a worker ends on a lost rank (workers/base.py), not through the group's teardown


def test_a_rank_that_never_arrives_is_a_lost_rank():
    manager = mp.get_context("spawn").Manager()
    errors = manager.list()
    _run(_abandoned, 2, manager.Queue(), manager.dict(), errors)
    assert len(errors) == 1 and "did not reach the all-reduce within 1s" in errors[0]


def _one_aborts(rank: int, world: int, addresses, results, size: int) -> None:
    import time

    group = _meet(rank, world, addresses, results)
    if rank == world - 1:
        time.sleep(0.5)  # the others are waiting in the all-reduce by now
        group.abort()  # as a rank whose step failed there alone (TPGroup.run_step)
        return
    started = time.monotonic()
    try:
        group.all_reduce(torch.ones(size))
    except RankFailedError as exc:
        results[rank] = (time.monotonic() - started, str(exc))


@pytest.mark.parametrize("size", [16, SLOT_BYTES // 4 + 1], ids=["shared memory", "gloo"])
def test_a_rank_that_aborts_ends_every_other_ranks_wait_at_once(size):
    """The others waited out the arrival timeout (60 s) on shared memory; now the aborting rank's
    flags (or, over gloo, its closed sockets) end their all-reduces within seconds, each with
    RankFailedError."""
    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    _run(_one_aborts, 3, manager.Queue(), results, size)
    for rank in (0, 1):
        waited, error = results[rank]
        assert waited < 10, (rank, waited, error)


def test_a_rank_failing_during_setup_leaves_nothing_in_dev_shm(monkeypatch):
    """Rank 0 made the segment and another rank failed (its barrier raised): the file was left in
    /dev/shm, and a later worker given the same port could not start (O_EXCL)."""
    import os

    from engine import native_kernels
    from engine.parallel import shm

    if native_kernels.kernel() is None:
        pytest.skip("no native kernel library here: gloo does the all-reduce")

    def lost(*args, **kwargs):
        raise RuntimeError("rank 1 is gone")

    monkeypatch.setattr(shm.dist, "all_reduce", lambda *args, **kwargs: None)
    monkeypatch.setattr(shm.dist, "barrier", lost)
    tag = f"test-leak-{os.getpid()}"
    with pytest.raises(RuntimeError, match="rank 1 is gone"):
        shm.SharedMemoryAllReduce(0, 2, tag)
    assert not os.path.exists(f"/dev/shm/pdserve-tp-{tag}")
