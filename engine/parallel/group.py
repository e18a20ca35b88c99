"""The collectives a tensor-parallel model needs, over one torch.distributed process group.

One group per worker: its ranks are that worker's processes (gloo on CPU, NCCL on CUDA).
Rank 0 is the worker itself, where the scheduler and the sampler run; it broadcasts each
step's inputs, every rank computes its shard, and rank 0 gathers the logits. A group of one
(``SINGLE``) makes every collective a no-op, so the model code has one path. On a CPU the
layers' all-reduces go through shared memory (``engine.parallel.shm``): the ranks share a node.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# A rank waits in a broadcast for the next step however long the worker idles: the group's
# timeout bounds idleness, not work, so it is long. A rank that dies is seen at once (its
# sockets close); a hung one by the worker's own hang check.
IDLE_TIMEOUT = datetime.timedelta(days=7)
# Each rank other than 0 sets this key in rank 0's store as it reaches the group. Until every
# one has, rank 0 waits and asks its launcher whether a rank failed on the way (an import, its
# device, its actor): joining at once, it waited the group's timeout for a rank that never came.
ARRIVED_KEY = "pdserve/rank_arrived/{rank}"
ARRIVAL_POLL_S = 0.05
# A step that raised on one rank raised on every rank (the same inputs meet the same error at the
# same point, so the ranks are still in step and rank 0 reruns the batch per request), or on some
# only (an out-of-memory error on one): those wait in the step's next collective for good. Each
# rank whose step raised counts itself under this key in rank 0's store, and waits this long for
# all to have: ranks in step fail within one layer's work of each other.
STEP_FAILED_KEY = "pdserve/step_failed/{step}"
STEP_AGREEMENT_TIMEOUT_S = 5.0


class RankFailedError(RuntimeError):
    """A collective failed: another rank of this worker died or its group broke.

    Never a request's fault: the worker as a whole is lost (every rank is replaced).
    """


@dataclass(slots=True, frozen=True)
class GroupAddress:
    """Where the ranks of one worker meet: rank 0's node, a free port there."""

    host: str
    port: int
    world_size: int
    backend: str  # "gloo" or "nccl"

    @property
    def init_method(self) -> str:
        return f"tcp://{self.host}:{self.port}"


def listen(world_size: int, device: str, host: str = "127.0.0.1") -> tuple[GroupAddress, dist.TCPStore]:
    """Rank 0's meeting place on this node for ``world_size`` ranks (a worker's ranks share a
    node): its store, already listening on a port the OS chose, and that address for the others.

    The store is bound before the address is handed out: choosing a free port and binding it
    later leaves a window in which another process (Ray opens connections all the time) can take
    the port, and the group would fail to form."""
    store = dist.TCPStore(host, 0, world_size, is_master=True, timeout=IDLE_TIMEOUT, wait_for_workers=False)
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    return GroupAddress(host, store.port, world_size, backend), store


@dataclass(slots=True)
class CollectiveTimes:
    """Seconds this rank spent in each kind of collective (waiting for the others included)."""

    all_reduce_s: float = 0.0
    gather_s: float = 0.0
    broadcast_s: float = 0.0
    num_all_reduces: int = 0


class TPGroup:
    """A worker's ranks as one torch.distributed group; ``rank`` is this process's."""

    def __init__(self, rank: int, world_size: int, group: Any = None, shared_memory: Any = None, store: dist.Store | None = None):
        self.rank = rank
        self.world_size = world_size
        self._group = group
        self._shm = shared_memory  # engine.parallel.shm.SharedMemoryAllReduce, on CPU
        self._store = store  # rank 0's, where ranks agree on a failed step (``run_step``)
        self._num_broadcasts = 0  # the same count on every rank: it names a step
        self._last_failed_key: str | None = None
        self._left = False  # aborted: every later step fails at once (RankFailedError)
        # Rank 0 has gathered the current step's logits: every rank is past the step's last
        # collective (an error after it is rank 0's own work, the others are in step).
        self._gathered = False
        self.times = CollectiveTimes()  # for the benchmarks: what the collectives cost a step

    @classmethod
    def join(cls, address: GroupAddress, rank: int, store: dist.Store | None = None,
             check_ranks: Callable[[], None] | None = None) -> "TPGroup":
        """Join (blocking until every rank has) the group at ``address`` as ``rank``: rank 0 with
        the ``store`` it listens with (``listen``), the others by connecting to it.
        ``check_ranks`` (rank 0): raises, naming the rank, if one failed before it came."""
        if store is None:
            if rank == 0:
                raise ValueError("rank 0 joins with the store it listens with (engine.parallel.group.listen)")
            store = dist.TCPStore(address.host, address.port, address.world_size, is_master=False, timeout=IDLE_TIMEOUT)
        if rank > 0:
            store.set(ARRIVED_KEY.format(rank=rank), "1")
        elif check_ranks is not None:
            arrived = [ARRIVED_KEY.format(rank=r) for r in range(1, address.world_size)]
            while not store.check(arrived):
                check_ranks()
                time.sleep(ARRIVAL_POLL_S)
        dist.init_process_group(address.backend, store=store, world_size=address.world_size, rank=rank, timeout=IDLE_TIMEOUT)
        shared_memory = None
        if address.backend == "gloo":
            from engine.parallel.shm import SharedMemoryAllReduce

            shared_memory = SharedMemoryAllReduce(rank, address.world_size, f"{address.host}-{address.port}")
        logger.info("rank %d of %d joined %s (%s)", rank, address.world_size, address.init_method, address.backend)
        return cls(rank, address.world_size, dist.group.WORLD, shared_memory, store)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it."""
        if self.world_size > 1:
            started = time.perf_counter()
            try:
                if self._shm is None or not self._shm.all_reduce(tensor):
                    dist.all_reduce(tensor, group=self._group)
            except RuntimeError as exc:
                raise self._broken("all-reduce", exc) from exc
            self.times.all_reduce_s += time.perf_counter() - started
            self.times.num_all_reduces += 1
        return tensor

    def gather_to_first(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``tensor`` concatenated along the last dimension on rank 0 (None elsewhere)."""
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)] if self.is_first else None
        started = time.perf_counter()
        try:
            dist.gather(tensor, parts, dst=0, group=self._group)
        except RuntimeError as exc:
            raise self._broken("gather", exc) from exc
        self.times.gather_s += time.perf_counter() - started
        self._gathered = True
        return torch.cat(parts, dim=-1) if self.is_first else None

    def broadcast_from_first(self, message: Any = None) -> Any:
        """Rank 0's ``message`` on every rank (pickled; the others pass nothing)."""
        if self.world_size == 1:
            return message
        if self._left:
            raise RankFailedError(f"rank {self.rank} left its group (it broke)")
        box = [message]
        started = time.perf_counter()
        try:
            dist.broadcast_object_list(box, src=0, group=self._group)
        except RuntimeError as exc:
            raise self._broken("broadcast", exc) from exc
        self._num_broadcasts += 1
        self._gathered = False
        if self.is_first:  # the other ranks wait here between steps: idle, not cost
            self.times.broadcast_s += time.perf_counter() - started
        return box[0]

    def run_step(self, compute: Callable[[], Any]) -> Any:
        """This rank's part of the step rank 0 last broadcast: ``compute()``. If it raises, the
        error is raised as it is once every rank's step raised too (the ranks are in step: the
        error is the step's own, a request's to answer for); if one rank's did not within
        ``STEP_AGREEMENT_TIMEOUT_S``, the ranks are out of step for good: this rank aborts the
        group, so the others stop waiting for it now, and raises ``RankFailedError``."""
        try:
            return compute()
        except RankFailedError:
            raise
        except Exception as exc:
            if self.world_size == 1 or self._gathered or self._failed_alike():
                # (Past the gather the other ranks are done with the step: rank 0's own work
                # after it, joining and converting the logits, raised alone and in step.)
                raise
            self.abort()
            raise RankFailedError(f"a step failed on rank {self.rank} alone ({type(exc).__name__}: {exc}); the ranks are out of step") from exc

    def _failed_alike(self) -> bool:
        """Count this rank's failure of the current step; True once every rank's is counted."""
        if self._store is None:
            return False  # nowhere to agree (a group built without join's store): out of step
        key = STEP_FAILED_KEY.format(step=self._num_broadcasts)
        deadline = time.monotonic() + STEP_AGREEMENT_TIMEOUT_S
        try:
            failed = self._store.add(key, 1)
            while failed < self.world_size:
                if time.monotonic() > deadline:
                    return False
                time.sleep(ARRIVAL_POLL_S / 5)
                failed = self._store.add(key, 0)
            if self.is_first and self._last_failed_key is not None:
                # Every rank is past that step (they all reached this one): its count is done with.
                self._store.delete_key(self._last_failed_key)
        except RuntimeError:  # the store is rank 0's: it is gone
            return False
        self._last_failed_key = key
        return True

    def _broken(self, collective: str, exc: Exception) -> RankFailedError:
        """A collective failed: another rank is gone, or left. So does this one (``abort``), so
        that no rank still waits for it (a group of more than two)."""
        self.abort()
        return RankFailedError(f"{collective} failed on rank {self.rank}: {exc}")

    def abort(self) -> None:
        """Leave the group for good, so that the other ranks' collectives fail now rather than
        wait for this one (the shared memory's flags, then the process group's sockets)."""
        if self._left:
            return
        self._left = True
        if self._shm is not None:
            self._shm.abort()
        self.close()

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        if self.world_size > 1 and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a broken group cannot always be torn down cleanly
                logger.debug("destroying the process group failed", exc_info=True)


SINGLE = TPGroup(0, 1)
