"""A tensor-parallel worker's ranks 1..tp-1 as Ray actors, and rank 0's handles on them.

A worker of tensor_parallel_size tp is tp processes on one node: the worker actor itself
(rank 0: scheduler, block manager, sampler, KV agent) and tp - 1 ``RankActor``s, placed in the
bundles of the worker's placement group (``cluster.pools``: STRICT_PACK, one bundle per rank,
one GPU each on GPUs). A rank actor's life:

1. Created by rank 0's ``RayRankLauncher`` when the engine starts; it builds its ``ShardRank``
   (engine: joins the group, loads its slices, allocates its KV shard) on a thread of its own,
   which then serves rank 0's step broadcasts until told to stop.
2. Rank 0's KV agent opens the rank's transport (``open_transport``: its own NIXL agent over
   its own KV shard) and drives it through ``RemoteRankTransport``: writes, their completion,
   notifications and landing run on the actor's event loop, beside the computing thread.
3. It dies with rank 0 (Ray ends an actor whose owner died), and rank 0 dies with it: a
   collective that fails ends rank 0's process (``workers.base``), and rank 0's health check
   watches every rank (``check_alive``). Either way the whole worker is replaced.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import threading
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine.config import EngineConfig
from engine.parallel.group import GroupAddress
from kvtransfer.agent import KVTransferConfig
from kvtransfer.backends import make_transport
from kvtransfer.descriptors import BlockRuns
from kvtransfer.layout import KVRegion
from kvtransfer.sharded_transport import RankTransport, rank_transport_name
from kvtransfer.sharding import KVShard
from kvtransfer.transport import BlockPiece, Incoming, Transport, XferState

logger = logging.getLogger(__name__)

RANK_CALL_TIMEOUT_S = 60.0  # a rank that does not answer a setup call within this is taken for dead
POLL_INTERVAL_S = 0.0005  # how often a rank checks its writes and notifications while someone waits
RELEASED_EARLY_KEPT = 4096  # write ids cancelled before they arrived (or after they were over), at most


def node_name() -> str:
    """Host plus Ray node: two raylets on one host are still two nodes."""
    return f"{socket.gethostname()}:{ray.get_runtime_context().get_node_id()[:8]}" if ray.is_initialized() else socket.gethostname()


class RankActor:
    """Rank ``rank`` (> 0) of a tensor-parallel worker: hosted by Ray as an async actor."""

    def __init__(self, model_path: str, config: EngineConfig, address: GroupAddress, rank: int):
        self.rank = rank
        self.node = node_name()
        self._built = threading.Event()
        self._error: BaseException | None = None
        self.shard_rank = None
        # Built and served on one thread: torch's CPU kernels run slower on a thread other
        # than the one that set the model up (engine.engine_thread).
        self._thread = threading.Thread(target=self._serve, args=(model_path, config, address), name=f"tp-rank-{rank}", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._error is not None:
            raise self._error
        self._transport: Transport | None = None
        self._writes: dict[int, Any] = {}
        self._released_early: set[int] = set()

    def _serve(self, model_path: str, config: EngineConfig, address: GroupAddress) -> None:
        from engine.parallel.rank import ShardRank

        try:
            self.shard_rank = ShardRank(model_path, config, address, self.rank)
        except BaseException as exc:
            self._error = exc
            self._built.set()
            return
        self._built.set()
        try:
            self.shard_rank.serve()
        except BaseException:
            logger.exception("rank %d: its group broke; the worker is replaced", self.rank)

    async def info(self) -> tuple[int, str]:
        return self.rank, self.node

    async def watch(self) -> None:
        """Never returns while the rank lives: rank 0 holds this call's ref, which fails when the rank dies."""
        while self._thread.is_alive():
            await asyncio.sleep(1.0)
        raise RuntimeError(f"rank {self.rank}: its serving thread ended")

    # -- the rank's transport, driven by rank 0's KV agent ---------------------------------

    async def open_transport(self, base_name: str, config: KVTransferConfig) -> tuple[KVShard, KVRegion, bytes, str, bool]:
        shard = self.shard_rank.runner.model.shard
        tensor = self.shard_rank.kv_cache.tensor
        region = KVRegion.from_tensor(tensor)
        options = config.backend_options(rank_transport_name(base_name, self.rank), tensor, region)
        self._transport = make_transport(config.backend, options)
        kv_shard = KVShard(shard.tp_size, self.rank, shard.kv_head_start, shard.num_kv_heads)
        return kv_shard, region, self._transport.metadata(), self._transport.kind, self._transport.receiver_lands

    async def add_peer(self, transport_name: str, metadata: bytes, region: KVRegion) -> None:
        self._transport.add_peer(transport_name, metadata, region)

    async def remove_peer(self, transport_name: str) -> None:
        self._transport.remove_peer(transport_name)

    async def write(self, write_id: int, transport_name: str, runs: BlockRuns, notif: bytes, piece: BlockPiece | None) -> str:
        """Post a write and return its final state ("DONE" or "ERR") once it has one."""
        if write_id in self._released_early:
            # Cancelled before it reached this actor (an async actor's calls may run out of
            # order): rank 0 counted it over, and its blocks may be another request's now.
            self._released_early.discard(write_id)
            return XferState.FAILED.value
        try:
            handle = self._transport.post_write(transport_name, runs, notif, piece)
        except Exception as exc:
            logger.warning("rank %d: posting a write to %s failed: %s", self.rank, transport_name, exc)
            return XferState.FAILED.value
        self._writes[write_id] = handle
        try:
            while True:
                if write_id not in self._writes:
                    return XferState.FAILED.value  # cancelled (``release``): its handle is freed, never checked again
                state = self._transport.check(handle)
                if state is not XferState.IN_PROGRESS:
                    del self._writes[write_id]
                    self._transport.release(handle)
                    return state.value
                await asyncio.sleep(POLL_INTERVAL_S)
        finally:
            self._writes.pop(write_id, None)

    async def release(self, write_id: int) -> bool:
        """Cancel a write; False while it cannot be stopped (it is still polled, and may be
        released again: rank 0 keeps counting it in flight)."""
        handle = self._writes.get(write_id)
        if handle is None:
            # Over, or not arrived yet: if it arrives, it is not posted. (An id kept for a write
            # that was over stays until the bound drops it.)
            self._released_early.add(write_id)
            if len(self._released_early) > RELEASED_EARLY_KEPT:
                self._released_early.discard(min(self._released_early))
            return True
        if not self._transport.release(handle):
            return False
        del self._writes[write_id]
        return True

    async def incoming(self, wait_s: float) -> list[tuple[str, bytes, list]]:
        """Notifications that arrived, waiting up to ``wait_s`` for the first (payload refs nested)."""
        deadline = asyncio.get_running_loop().time() + wait_s
        while True:
            arrived = self._transport.get_incoming() if self._transport is not None else []
            if arrived or asyncio.get_running_loop().time() >= deadline:
                return [(i.sender, i.message, [i.payload]) for i in arrived]
            await asyncio.sleep(POLL_INTERVAL_S)

    async def land(self, sender: str, message: bytes, payload: list, dst_spans: list[tuple[int, int]], piece: BlockPiece | None) -> None:
        self._transport.land(Incoming(sender, message, payload[0]), dst_spans, piece)

    async def close_transport(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None


class RemoteRankTransport(Transport):
    """Rank 0's handle on another rank's transport: the same interface, over Ray calls."""

    def __init__(self, actor, name: str, metadata: bytes, kind: str, receiver_lands: bool):
        self._actor = actor
        self.name = name
        self._metadata = metadata
        self.kind = kind
        self.receiver_lands = receiver_lands
        self._ids = itertools.count()
        self._pending_incoming = None

    def metadata(self) -> bytes:
        return self._metadata

    def add_peer(self, transport_name: str, metadata: bytes, region: KVRegion) -> None:
        ray.get(self._actor.add_peer.remote(transport_name, metadata, region), timeout=RANK_CALL_TIMEOUT_S)

    def remove_peer(self, transport_name: str) -> None:
        try:
            ray.get(self._actor.remove_peer.remote(transport_name), timeout=RANK_CALL_TIMEOUT_S)
        except Exception:
            logger.warning("rank %s could not remove peer %s", self.name, transport_name, exc_info=True)

    def post_write(self, transport_name: str, runs: BlockRuns, notif: bytes, piece: BlockPiece | None = None) -> Any:
        write_id = next(self._ids)
        return write_id, self._actor.write.remote(write_id, transport_name, runs, notif, piece)

    def check(self, handle: Any) -> XferState:
        _, ref = handle
        ready, _ = ray.wait([ref], timeout=0, fetch_local=True)
        if not ready:
            return XferState.IN_PROGRESS
        try:
            return XferState(ray.get(ref))
        except Exception:
            logger.warning("rank %s: a write's state is unknown (rank gone?)", self.name, exc_info=True)
            return XferState.FAILED

    def release(self, handle: Any) -> bool:
        write_id, ref = handle
        ready, _ = ray.wait([ref], timeout=0)
        if ready:
            return True
        try:
            return bool(ray.get(self._actor.release.remote(write_id), timeout=RANK_CALL_TIMEOUT_S))
        except Exception:
            return False

    def get_incoming(self) -> list[Incoming]:
        if self._pending_incoming is None:
            self._pending_incoming = self._actor.incoming.remote(1.0)
        ready, _ = ray.wait([self._pending_incoming], timeout=0)
        if not ready:
            return []
        ref, self._pending_incoming = self._pending_incoming, None
        try:
            arrived = ray.get(ref)
        except Exception:
            logger.warning("rank %s: notifications lost (rank gone?)", self.name, exc_info=True)
            return []
        return [Incoming(sender, message, (sender, message, payload)) for sender, message, payload in arrived]

    def land(self, incoming: Incoming, dst_spans, piece: BlockPiece | None = None) -> None:
        sender, message, payload = incoming.payload
        ray.get(self._actor.land.remote(sender, message, payload, list(dst_spans), piece), timeout=RANK_CALL_TIMEOUT_S)

    def close(self) -> None:
        try:
            ray.get(self._actor.close_transport.remote(), timeout=RANK_CALL_TIMEOUT_S)
        except Exception:
            logger.debug("rank %s: closing its transport failed (gone?)", self.name, exc_info=True)


class RayRankLauncher:
    """Starts ranks 1..tp-1 as ``RankActor``s beside rank 0 (in its placement group, if it has
    one: the bundles after rank 0's), each with rank 0's own CPUs and GPUs."""

    def __init__(self) -> None:
        self.actors: list = []
        self._watches: list = []
        context = ray.get_runtime_context()
        assigned = context.get_assigned_resources()
        self._num_cpus = assigned.get("CPU", 0.0)
        self._num_gpus = assigned.get("GPU", 0.0)

    def start(self, model_path: Path, config: EngineConfig, address: GroupAddress) -> None:
        group = ray.util.get_current_placement_group()
        cls = ray.remote(RankActor)
        for rank in range(1, address.world_size):
            options: dict[str, Any] = dict(num_cpus=self._num_cpus, num_gpus=self._num_gpus, max_restarts=0, max_concurrency=1000)
            if group is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)
            self.actors.append(cls.options(**options).remote(str(model_path), config, address, rank))
        self._watches = [actor.watch.remote() for actor in self.actors]

    def stop(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        self.actors.clear()

    def check_alive(self) -> None:
        """Raise RuntimeError naming the first rank that died."""
        done, _ = ray.wait(self._watches, timeout=0, num_returns=len(self._watches)) if self._watches else ([], [])
        for ref in done:
            rank = self._watches.index(ref) + 1
            try:
                ray.get(ref)
            except Exception as exc:
                # Where its constructor raised, Ray's message ends with the rank's own traceback,
                # whose last line names the error: the message's end is kept.
                raise RuntimeError(f"tensor-parallel rank {rank} died: {type(exc).__name__}: ...{str(exc)[-500:]}") from None
            raise RuntimeError(f"tensor-parallel rank {rank} stopped")

    def nodes(self) -> list[str]:
        """Each rank's node, ranks 1.. in order."""
        return [node for _, node in ray.get([actor.info.remote() for actor in self.actors], timeout=RANK_CALL_TIMEOUT_S)]

    def open_transports(self, base_name: str, config: KVTransferConfig) -> list[RankTransport]:
        """Each rank's transport over its KV shard, named ``<base_name>/r<rank>``, as proxies."""
        opened = ray.get([actor.open_transport.remote(base_name, config) for actor in self.actors], timeout=RANK_CALL_TIMEOUT_S)
        transports = []
        for actor, (shard, region, metadata, kind, lands) in zip(self.actors, opened):
            name = rank_transport_name(base_name, shard.rank)
            transports.append(RankTransport(shard, region, RemoteRankTransport(actor, name, metadata, kind, lands), name))
        return transports
