"""Creating, health-checking, scaling and draining the prefill and decode actor pools.

A worker's life here: ``_launch`` creates the actor (one GPU each where there are GPUs,
else the configured CPUs), waits until its model is loaded and hands it to the router.
The router's readiness (health SERVING, Generate calls let through) follows: set once every
worker asked for at start-up is up, cleared whenever no decode actor is left to route to.
The health loop pings every worker; one that is dead or does not answer within the
timeout is removed from routing at once, killed if still there, and replaced by a new
actor (a new epoch, so peers handshake afresh). Scaling down drains: the router stops
sending the worker new requests, the worker finishes what it has, and only when neither
the router nor the worker holds a request is the actor removed. No request fails because
of scaling.

Durable workers (``DeploymentSpec.durable_workers``, what ``pdserve up`` uses) are detached,
named actors ("<deployment name>/<worker id>" in Ray namespace "pdserve"): they outlive the
controller. A pool manager starting under the same deployment name adopts the live ones
instead of launching new ones, so a restarted controller or router keeps every worker (and a
restarted controller the pools' sizes, ``cluster/desired_sizes.py``); the
requests the old router had on them are dropped by the workers once that router falls silent
(``RouterConfig.router_lease_s``). A router that does not manage the pools follows them
(``cluster/pool_follower.py``): it adopts, routes and health-checks, and never launches,
drains or kills.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from cluster import desired_sizes
from cluster.kv_memory import KVMemoryPolicy, KVSizedDecodeWorker, KVSizedPrefillWorker
from decode_workers.worker import DecodeWorker
from engine.config import EngineConfig
from engine.default_model_path import DEFAULT_MODEL_PATH
from engine.stats import WorkerState
from kvtransfer.agent import KVTransferConfig
from prefill_workers.worker import PrefillWorker
from router.config import Disaggregation, RouterConfig
from router.errors import FailedPreconditionError, UnavailableError
from cluster.node_check import check_nodes
from cluster.pool_follower import WORKER_NAMESPACE, PoolFollower, durable_worker_names
from router.pool import Role, WorkerRecord, within
from router.pool_control import PoolHost
from workers.adapter_files import AdapterFiles

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PoolSpec:
    """How the actors of one pool are created."""

    replicas: int = 1
    engine: EngineConfig = field(default_factory=EngineConfig)
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)
    spread: bool = True
    # Set: each actor sizes its KV cache from its own node's memory (the engine's
    # kv_cache_bytes / num_kv_blocks are replaced); None: the engine config's size is used.
    kv_memory: KVMemoryPolicy | None = None


@dataclass(slots=True)
class DeploymentSpec:
    model_path: Path = DEFAULT_MODEL_PATH
    # A Hugging Face id (org/name[@revision]) the model came from: each worker resolves it in
    # its own node's cache, where the snapshot's path may differ from this node's model_path.
    model_source: str | None = None
    prefill: PoolSpec = field(default_factory=lambda: PoolSpec(engine=EngineConfig(max_num_batched_tokens=512, long_prefill_chunk=512)))
    decode: PoolSpec = field(default_factory=lambda: PoolSpec(engine=EngineConfig(max_num_batched_tokens=512, long_prefill_chunk=256)))
    router: RouterConfig = field(default_factory=RouterConfig)
    transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    startup_timeout_s: float = 300.0
    health_interval_s: float = 1.0
    health_timeout_s: float = 10.0
    drain_timeout_s: float = 600.0
    name: str = "pdserve"  # names durable workers; one deployment per name in a Ray cluster
    durable_workers: bool = False
    # Routers serving the deployment: the managing one plus replicas following the pools
    # (cluster/router_replica.py; they find the workers by name, so they need durable ones).
    router_replicas: int = 1
    autoscaler: Any = None  # cluster.autoscaler.AutoscalerConfig; None: the pools keep the sizes they are given

    def pool(self, role: Role) -> PoolSpec:
        return self.prefill if role is Role.PREFILL else self.decode

    @property
    def served_model_name(self) -> str:
        """What the OpenAI API and the metrics call the model."""
        return (self.router.served_model_names or [Path(self.model_path).name])[0]

    def validate(self) -> None:
        """Raise ValueError, naming the field, for settings that cannot work together."""
        self.router.validate()
        if self.router_replicas < 1:
            raise ValueError(f"router.replicas: must be >= 1, got {self.router_replicas}")
        if self.router_replicas > 1 and not self.durable_workers:
            raise ValueError("router.replicas: replicas find the workers by name: durable_workers must be on (pdserve up turns it on)")
        write_timeout_s = self.transfer.lease.write_timeout_s
        if self.router.kv_lease_s <= write_timeout_s:
            raise ValueError(
                f"router.kv_lease_s: {self.router.kv_lease_s:g}s must exceed the KV write timeout ({write_timeout_s:g}s): "
                "a write posted near the end of a lease could outlive it"
            )


# After a failed launch, how long the health loop waits before it launches for that pool again:
# short at first (a replacement sent to a node that died, before Ray has noticed, fails within
# seconds, and the next one lands elsewhere), doubling with each failure in a row up to the cap
# (a pool that cannot fit anywhere is not relaunched in a tight loop); a launch that works resets it.
LAUNCH_RETRY_FIRST_PAUSE_S = 1.0
LAUNCH_RETRY_MAX_PAUSE_S = 16.0


class PoolManager(PoolFollower):
    """Owns the actors of both pools; runs on the router's event loop."""

    manage = True

    def __init__(self, spec: DeploymentSpec, router: PoolHost, metrics=None):
        spec.validate()
        super().__init__(spec.name, router, spec.health_interval_s, spec.health_timeout_s, metrics)
        self.spec = spec
        # Tensor-parallel workers: the placement group packing each one's ranks onto one node.
        self.placement_groups: dict[str, object] = {}
        self._next_index = {Role.PREFILL: 0, Role.DECODE: 0}
        self._scale_locks = {Role.PREFILL: asyncio.Lock(), Role.DECODE: asyncio.Lock()}
        self._retiring: set[str] = set()
        self._replacements: set[asyncio.Task] = set()
        self._trims: set[asyncio.Task] = set()  # retirements of a surplus (``_trim``), held until done
        self.num_replaced = 0
        # Workers being launched: their role and the node each was sent to (counted when placing the next).
        self._placing: dict[str, tuple[Role, str]] = {}
        self.autoscaler = None  # cluster.autoscaler.Autoscaler, when the spec enables one
        # Reconciliation: the health loop launches what each pool lacks of its desired size
        # (a dead worker's replacement, or one whose launch failed, retried after a pause).
        self.desired = {Role.PREFILL: spec.prefill.replicas, Role.DECODE: spec.decode.replicas}
        self._num_launching = {Role.PREFILL: 0, Role.DECODE: 0}
        self._launch_retry_at = {Role.PREFILL: 0.0, Role.DECODE: 0.0}
        self._launch_failures_in_a_row = {Role.PREFILL: 0, Role.DECODE: 0}
        self._adapter_files: dict[str, ray.ObjectRef] | None = None  # configured adapter directory -> its files
        self._adopted_ids: list[str] = []  # workers found running (durable) as this manager started
        # Writes of the desired sizes to Ray's GCS (cluster/desired_sizes.py), one at a time, in order.
        self._size_records = ThreadPoolExecutor(1, thread_name_prefix="desired-sizes")
        self._sizes_forgotten = False  # set as the manager stops: nothing is recorded after

    async def _shipped_adapters(self, pool: PoolSpec) -> dict[str, ray.ObjectRef]:
        """The pool's configured LoRA adapters, name -> their files (once, into Ray's object
        store): as a worker adopted at start runs them, else as read here. A worker writes them
        out on its own node, which needs no copy of the directories, and starts with these very
        versions whenever it starts (workers.adapter_files). A path that is no directory here (a
        Hugging Face id) is left to each worker to resolve."""
        if self._adapter_files is None:
            configured = {name: path for each in (self.spec.prefill, self.spec.decode) for name, path in each.engine.lora_adapters.items()}
            found = await self._running_adapter_files(configured)
            missing = {path for path in configured.values() if path not in found}
            read = await asyncio.to_thread(lambda: {path: AdapterFiles.read(path) for path in missing})
            found.update({path: files for path, files in read.items() if files is not None})
            self._adapter_files = {path: ray.put(files) for path, files in found.items()}
        return {name: self._adapter_files[path] for name, path in pool.engine.lora_adapters.items() if path in self._adapter_files}

    async def _running_adapter_files(self, configured: dict[str, str]) -> dict[str, AdapterFiles]:
        """directory -> files of the configured adapters as a worker adopted at start (one that
        outlived the manager before) runs them: new workers start with those versions, whatever
        the directories hold by now (else the router would refuse them as inconsistent)."""
        for worker_id in self._adopted_ids:
            handle = self.handles.get(worker_id)
            if handle is None:
                continue
            try:
                versions = await within(handle.lora_adapter_versions.remote(), self.health_timeout_s)
            except Exception as exc:  # gone or hung since: another adopted one may answer
                logger.warning("%s did not give its LoRA adapters' files (%r)", worker_id, exc)
                continue
            return {configured[name]: files for name, (_, _, files) in versions.items() if name in configured and files is not None}
        return {}

    async def start(self) -> None:
        roles = (Role.PREFILL, Role.DECODE)
        if self.spec.durable_workers:
            adopted = await self._adopt()
        else:
            adopted = dict.fromkeys(roles, 0)
            self._first_adoption.set()  # nothing to adopt: no worker outlives its manager
        recorded = desired_sizes.load(self.spec.name) if self.spec.durable_workers else None
        for role in roles:
            # A restarted controller resumes the sizes its predecessor last set (a pool scaled
            # down stays down); without a record, what an earlier manager left running is kept.
            self._set_desired(role, recorded[role] if recorded is not None else max(self.desired[role], adopted[role]))
        missing = {role: max(0, self.desired[role] - adopted[role]) for role in roles}
        if any(missing.values()):
            # On a cluster of several nodes, a node that lacks the code, a library or the model
            # is named now rather than found through a worker that died there.
            pools = [self.spec.pool(role) for role in roles if missing[role]]
            try:
                await check_nodes(
                    self.spec.model_source or str(self.spec.model_path), self.spec.transfer.backend, self.spec.startup_timeout_s,
                    can_host=lambda resources: any(_fits(resources, pool) for pool in pools),
                )
            except Exception as exc:
                if not any(adopted.values()):
                    raise
                logger.warning("the nodes' check failed (%s); serving with the adopted workers, the health loop launches the rest", exc)
                missing = dict.fromkeys(roles, 0)
        # CPU actors share their node's host memory; each GPU actor has its own GPU.
        num_starting = sum(missing[r] for r in missing if self.spec.pool(r).num_gpus == 0) or 1
        launches = [self._launch(role, num_starting) for role in roles for _ in range(missing[role])]
        if not any(adopted.values()):
            await asyncio.gather(*launches)  # a first start fails at once, naming what did not start
        else:
            # A restarted manager serves with the workers it adopted: a launch that fails now is
            # retried by the health loop, as a dead worker's replacement would be (raising here
            # left it not ready for good, with no health loop, its adopted workers unused).
            for error in await asyncio.gather(*launches, return_exceptions=True):
                if isinstance(error, BaseException):
                    logger.warning("a worker launched beside the adopted ones did not start (%s); the health loop launches it again",
                                   _start_failure(error, self.spec.startup_timeout_s))
        self._started = True
        for role in roles:
            self._trim(role)  # adopted beyond the recorded size: the predecessor died before its drains began
        await self.refresh_readiness()
        self._health_task = asyncio.create_task(self._health_loop())
        if self.spec.autoscaler is not None:
            from cluster.autoscaler import Autoscaler, apply_sizes, observed_sizes
            from cluster.planning.simulator import PipelineSettings

            self.autoscaler = Autoscaler.from_config(
                self.spec.autoscaler, self.router.traffic.snapshot, lambda: observed_sizes(self), lambda p, d: apply_sizes(self, p, d),
                pipeline=PipelineSettings.of(self.spec.router), aggregated=self.spec.router.disaggregation is Disaggregation.NEVER,
            )
            self.autoscaler.start()

    async def stop(self) -> None:
        if self.autoscaler is not None:
            await self.autoscaler.stop()
        for task in (*self._replacements, *self._trims):
            task.cancel()
        for handle in self.handles.values():
            ray.kill(handle)
        # Every worker's group: an adopted tensor-parallel worker's is found by its name (this
        # manager did not create it), else it kept its GPUs reserved after ``down``.
        for worker_id in {*self.placement_groups, *self.handles}:
            self._release_placement(worker_id)
        if self.spec.durable_workers and not self._sizes_forgotten:
            # After any save still queued, and no save after it (a retirement ending meanwhile):
            # the deployment ends, the next `up` starts from its configuration.
            self._sizes_forgotten = True
            self._size_records.submit(desired_sizes.forget, self.spec.name)
        await asyncio.to_thread(self._size_records.shutdown, True)
        await super().stop()

    def _set_desired(self, role: Role, replicas: int) -> None:
        """Change a pool's desired size; a durable deployment records it for a restarted controller
        (on a thread of its own, in order: a GCS that does not answer must not stall the router)."""
        self.desired[role] = replicas
        if self.spec.durable_workers and not self._sizes_forgotten:
            self._size_records.submit(desired_sizes.save, self.spec.name, dict(self.desired))

    def _adopted(self, role: Role, worker_id: str) -> None:
        """New workers of ``role`` get ids after an adopted one's (ids are never reused); one
        found draining (an earlier manager was retiring it) is retired."""
        self._adopted_ids.append(worker_id)
        record = self.router.pool.workers[worker_id]
        if record.state is WorkerState.DRAINING:
            self._retire_later(record)
        try:
            index = int(worker_id.rsplit("-", 1)[1])
        except (IndexError, ValueError):
            return
        self._next_index[role] = max(self._next_index[role], index + 1)

    # -- creating -------------------------------------------------------------------------

    async def _launch(self, role: Role, num_starting: int = 1) -> WorkerRecord:
        """Create one actor; ``num_starting`` actors (this one included) start at the same time.

        A tensor-parallel worker first gets a placement group of one bundle per rank, packed
        on one node (STRICT_PACK: its ranks meet on loopback and share the node's memory); the
        worker actor takes bundle 0 and starts its other ranks in the rest (``workers.ranks``).
        """
        pool = self.spec.pool(role)
        worker_id = f"{role.value}-{self._next_index[role]}"
        self._next_index[role] += 1
        options = dict(num_cpus=pool.num_cpus, num_gpus=pool.num_gpus, max_restarts=0, max_concurrency=1000)
        if self.spec.durable_workers:
            options.update(name=f"{self._name_prefix()}{worker_id}", namespace=WORKER_NAMESPACE, lifetime="detached")
        if pool.resources:
            options["resources"] = dict(pool.resources)
        tp_size = pool.engine.tensor_parallel_size
        node_id = await self._pick_node(role, pool) if pool.spread and tp_size == 1 else None
        if node_id is not None:
            # Soft: where that node has no room left, Ray places it elsewhere.
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=True)
            self._placing[worker_id] = (role, node_id)
        elif pool.spread and not pool.resources:
            options["scheduling_strategy"] = "SPREAD"
        if tp_size > 1:
            group = await self._place(worker_id, pool, tp_size)
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
        args = [worker_id, self.spec.model_source or str(self.spec.model_path), pool.engine, self.spec.transfer]
        if pool.kv_memory is not None:
            cls = KVSizedPrefillWorker if role is Role.PREFILL else KVSizedDecodeWorker
            # On CPU every rank's cache shares the node's memory.
            sharing = _num_sharing(pool, num_starting) * (tp_size if pool.num_gpus == 0 else 1)
            args.append(replace(pool.kv_memory, num_sharing=sharing))
        else:
            cls = PrefillWorker if role is Role.PREFILL else DecodeWorker
        try:
            handle = ray.remote(cls).options(**options).remote(*args, adapter_files=await self._shipped_adapters(pool))
        except BaseException:
            self._release_placement(worker_id)
            raise
        self.handles[worker_id] = handle
        try:
            await within(handle.ping.remote(), self.spec.startup_timeout_s)
            record = await self.router.add_worker(role, worker_id, handle)
        except BaseException:
            self.handles.pop(worker_id, None)
            ray.kill(handle)
            self._release_placement(worker_id)
            raise
        finally:
            self._placing.pop(worker_id, None)
        logger.info("%s is up", worker_id)
        await self.refresh_readiness()
        return record

    async def _pick_node(self, role: Role, pool: PoolSpec) -> str | None:
        """The node for a new worker of ``role``, on a cluster of several: among the live nodes
        whose resources fit it, the one with the fewest workers of its pool (a node that dies
        takes as few of a pool's workers as can be), then the most of the other pool (prefill
        and decode pair on one node), then the fewest workers. None: one node, or none fits."""
        nodes = [n for n in await asyncio.to_thread(ray.nodes) if n.get("Alive") and _fits(n.get("Resources", {}), pool)]
        if len(nodes) < 2:
            return None
        where = [(w.role, w.node.rsplit(":", 1)[-1]) for w in self.router.pool.workers.values() if w.state is not WorkerState.DEAD]
        where += [(r, n[:8]) for r, n in self._placing.values()]

        def load(node) -> tuple[int, int, int]:
            short = node["NodeID"][:8]
            mine = sum(1 for r, n in where if n == short and r is role)
            theirs = sum(1 for r, n in where if n == short and r is not role)
            return mine, -theirs, mine + theirs

        return min(nodes, key=lambda n: (load(n), n["NodeID"]))["NodeID"]

    async def _place(self, worker_id: str, pool: PoolSpec, tp_size: int):
        """A ready placement group of ``tp_size`` bundles on one node for ``worker_id``."""
        # Ray refuses empty bundles: a pool of CPU-less actors still asks a sliver of a CPU.
        bundle = {"CPU": pool.num_cpus or 0.01, **({"GPU": pool.num_gpus} if pool.num_gpus else {}), **pool.resources}
        lifetime = "detached" if self.spec.durable_workers else None
        group = placement_group([dict(bundle) for _ in range(tp_size)], strategy="STRICT_PACK",
                                name=f"{self._name_prefix()}{worker_id}", lifetime=lifetime)
        self.placement_groups[worker_id] = group
        try:
            await within(group.ready(), self.spec.startup_timeout_s)
        except BaseException:
            self._release_placement(worker_id)
            raise
        return group

    def _release_placement(self, worker_id: str) -> None:
        group = self.placement_groups.pop(worker_id, None)
        if group is None and self.spec.durable_workers:
            group = _named_group(f"{self._name_prefix()}{worker_id}")  # an adopted worker's
        if group is not None:
            _remove_group(group, worker_id)

    # -- scaling --------------------------------------------------------------------------

    async def check_resources(self, role: Role, replicas: int) -> None:
        """Raise FailedPreconditionError, naming the resource, if growing ``role`` to ``replicas``
        needs more than the cluster has free (instead of waiting for actors that never start)."""
        adding = replicas - self.size(role) - self._num_launching[role]
        if adding <= 0:
            return
        available = await asyncio.to_thread(ray.available_resources)
        for resource, needed in worker_resources(self.spec.pool(role), adding).items():
            if available.get(resource, 0.0) + 1e-9 < needed:
                raise FailedPreconditionError(
                    f"replicas: {adding} more {role.value} workers need {needed:g} {resource}, the cluster has "
                    f"{available.get(resource, 0.0):g} free"
                )

    def num_coming(self, role: Role) -> int:
        """The pool's routable workers and the replacements of dead ones still starting: what it
        holds once they land (what ``scale`` counts from)."""
        return self.size(role) + self._num_launching[role]

    async def scale(self, role: Role, replicas: int) -> int:
        """Grow or shrink a pool to ``replicas`` routable workers; return the previous size."""
        draining: list[asyncio.Task] = []
        async with self._scale_locks[role]:
            previous = self.size(role)
            # Replacements of dead workers still starting count: they join the pool (else the
            # pool would end above ``replicas``, and nothing shrinks it back).
            coming = self.num_coming(role)
            self._set_desired(role, replicas)
            if replicas > coming:
                launches = await asyncio.gather(*(self._launch(role, replicas - coming) for _ in range(replicas - coming)),
                                                return_exceptions=True)
                failed = [error for error in launches if isinstance(error, BaseException)]
                if failed:
                    # The pool keeps its desired size: the health loop launches what it lacks again.
                    raise UnavailableError(
                        f"replicas: {len(failed)} of {replicas - coming} new {role.value} workers did not start "
                        f"({_start_failure(failed[0], self.spec.startup_timeout_s)}); the pool keeps trying to reach {replicas}"
                    ) from failed[0]
            elif replicas < coming:
                ready = [w for w in self.router.pool.of_role(role) if w.state is WorkerState.READY]
                draining = [asyncio.create_task(self.retire(w, shrink=False)) for w in _least_assigned(ready, coming - replicas)]
                await asyncio.sleep(0)  # each is draining (no longer counted) before the lock is let go
            logger.info("%s pool: %d -> %d workers", role.value, previous, replicas)
        # The drains run without the lock (up to drain_timeout_s): meanwhile a worker that dies
        # is replaced, and the pool may be scaled again.
        await asyncio.gather(*draining)
        self._trim(role)  # a replacement that landed while the pool shrank
        return previous

    async def retire(self, record: WorkerRecord, shrink: bool = True) -> None:
        """Drain a worker, then remove it once nothing of any request is left on it.

        ``shrink``: the pool's desired size drops by one, so it is not replaced (``scale`` sets
        the size itself and passes False).
        """
        if shrink and record.worker_id not in self._retiring:
            self._set_desired(record.role, max(0, self.desired[record.role] - 1))
        self._retiring.add(record.worker_id)
        try:
            await self.router.drain(record)
            deadline = time.monotonic() + self.spec.drain_timeout_s
            while time.monotonic() < deadline and record.state is not WorkerState.DEAD:
                if not record.req_ids and await self._worker_idle(record):
                    break
                await asyncio.sleep(0.05)
            else:
                if record.state is not WorkerState.DEAD:
                    logger.warning("%s did not drain within %.0fs; removing it anyway", record.worker_id, self.spec.drain_timeout_s)
            self._remove(record)
            await self.refresh_readiness()
        finally:
            self._retiring.discard(record.worker_id)

    async def _worker_idle(self, record: WorkerRecord) -> bool:
        report = await self.router.status_monitor.report(record, max_age_s=0.0)
        status = report.status
        if status is None:
            # Gone: nothing left to wait for. No answer in time is no sign of idleness (a long
            # step delays it): the drain waits on, bounded by drain_timeout_s, and the health
            # check replaces a worker that hangs.
            return report.gone
        engine = status.engine
        if record.role is Role.PREFILL:
            return engine.num_waiting == 0 and engine.num_running == 0 and status.num_transfers_in_flight == 0
        return status.num_active_requests == 0

    def _remove(self, record: WorkerRecord) -> None:
        self.router.pool.remove(record.worker_id)
        handle = self.handles.pop(record.worker_id, None)
        if handle is not None:
            ray.kill(handle)  # its other ranks die with it (Ray ends the actors an actor owns)
        self._release_placement(record.worker_id)
        if record.role is Role.DECODE:
            # Every prefill agent forgets it as a NIXL peer: a replaced decode actor comes back
            # under a new name, and the old peer's agent and descriptors would stay forever.
            for prefill in self.router.pool.of_role(Role.PREFILL):
                if prefill.state is not WorkerState.DEAD:
                    prefill.handle.disconnect_peer.remote(record.worker_id, f"{record.worker_id} left the pool")

    # -- health ---------------------------------------------------------------------------

    async def _after_health_checks(self) -> None:
        self._reconcile()

    def _on_unhealthy(self, record: WorkerRecord, reason) -> None:
        self.router.worker_died(record)
        logger.warning("%s failed its health check (%r): replacing it", record.worker_id, reason)
        self._remove(record)
        if record.worker_id in self._retiring:
            return  # it was leaving anyway
        self.num_replaced += 1
        if self.metrics is not None:
            self.metrics.workers_replaced(record.role.value).inc()
        self._reconcile()

    def _reconcile(self) -> None:
        """Launch what each pool lacks of its desired size (not while it is being scaled)."""
        now = time.monotonic()
        for role in (Role.PREFILL, Role.DECODE):
            if self._scale_locks[role].locked() or now < self._launch_retry_at[role]:
                continue
            present = sum(1 for w in self.router.pool.of_role(role) if w.state in (WorkerState.READY, WorkerState.STARTING))
            for _ in range(self.desired[role] - present - self._num_launching[role]):
                self._num_launching[role] += 1
                task = asyncio.create_task(self._launch(role))
                self._replacements.add(task)
                task.add_done_callback(functools.partial(self._replacement_done, role))

    def _trim(self, role: Role) -> None:
        """Retire what a pool has beyond its desired size: a replacement that landed after the
        pool was scaled below what it counted on."""
        if self._scale_locks[role].locked():
            return  # the scale in progress sizes the pool itself
        ready = [w for w in self.router.pool.of_role(role) if w.state is WorkerState.READY and w.worker_id not in self._retiring]
        surplus = len(ready) + self._num_launching[role] - self.desired[role]
        for victim in _least_assigned(ready, surplus):
            self._retiring.add(victim.worker_id)  # counted out at once: the next trim does not pick it again
            self._retire_later(victim)

    def _retire_later(self, record: WorkerRecord) -> None:
        """Retire ``record`` in a task of its own (the pool's size already leaves it out)."""
        task = asyncio.create_task(self.retire(record, shrink=False))
        self._trims.add(task)
        task.add_done_callback(self._trims.discard)

    def _replacement_done(self, role: Role, task: asyncio.Task) -> None:
        self._replacements.discard(task)
        self._num_launching[role] -= 1
        if task.cancelled():
            return
        if task.exception() is None:
            self._launch_failures_in_a_row[role] = 0
            self._trim(role)
            return
        # Retried by the health loop after a pause, until the pool is back at its size.
        failures = self._launch_failures_in_a_row[role]
        self._launch_failures_in_a_row[role] = failures + 1
        pause_s = min(LAUNCH_RETRY_MAX_PAUSE_S, LAUNCH_RETRY_FIRST_PAUSE_S * 2**failures)
        self._launch_retry_at[role] = time.monotonic() + pause_s
        logger.warning("launching a %s worker failed (retrying in %.0fs): %r", role.value, pause_s, task.exception())


def stop_leftover_workers(deployment_name: str) -> list[str]:
    """Kill the deployment's durable workers that no controller stopped (its process was killed,
    or its stop timed out) and remove their placement groups; return their names."""
    names = durable_worker_names(deployment_name)
    desired_sizes.forget(deployment_name)
    for name in names:
        with contextlib.suppress(ValueError):  # gone since it was listed
            ray.kill(ray.get_actor(name, namespace=WORKER_NAMESPACE), no_restart=True)
        group = _named_group(name)  # a tensor-parallel worker's is named after it
        if group is not None:
            _remove_group(group, name)
    return names


def _named_group(name: str):
    """The placement group called ``name``; None where there is none (a worker of one rank)."""
    try:
        return ray.util.get_placement_group(name)
    except Exception:
        return None


def _remove_group(group, worker_id: str) -> None:
    try:
        remove_placement_group(group)
    except Exception:
        logger.warning("removing the placement group of %s failed", worker_id, exc_info=True)


def _least_assigned(records: list[WorkerRecord], count: int) -> list[WorkerRecord]:
    """The ``count`` workers with the fewest requests: the cheapest to drain."""
    return sorted(records, key=lambda w: (w.num_assigned, w.worker_id))[: max(0, count)]


def worker_resources(pool: PoolSpec, count: int) -> dict[str, float]:
    """What ``count`` of ``pool``'s workers take from Ray, all their ranks together (the resources
    they ask for, by name; none of zero)."""
    ranks = pool.engine.tensor_parallel_size
    wanted = {"CPU": pool.num_cpus, "GPU": pool.num_gpus, **pool.resources}
    return {name: amount * ranks * count for name, amount in wanted.items() if amount > 0 and count > 0}


def start_shortfall(spec: DeploymentSpec, available: dict[str, float]) -> str | None:
    """Why ``spec``'s first workers cannot all start with ``available`` (Ray's free resources),
    naming the config field; None if they can. For a cluster that cannot grow (one started for
    this deployment): there the workers would wait ``startup_timeout_s`` for room that never comes."""
    needed: dict[str, float] = {}
    asked_by: dict[str, list[str]] = {}
    for role in (Role.PREFILL, Role.DECODE):
        pool = spec.pool(role)
        ranks = pool.engine.tensor_parallel_size
        for resource, amount in worker_resources(pool, pool.replicas).items():
            needed[resource] = needed.get(resource, 0.0) + amount
            field = {"CPU": "num_cpus", "GPU": "num_gpus"}.get(resource, f"resources.{resource}")
            times = f"{pool.replicas} workers x {ranks} ranks" if ranks > 1 else f"{pool.replicas} workers"
            asked_by.setdefault(resource, []).append(f"{role.value}.{field} = {amount / pool.replicas / ranks:g} for {times}")
    for resource, amount in needed.items():
        if available.get(resource, 0.0) + 1e-9 < amount:
            return (f"{' + '.join(asked_by[resource])} need {amount:g} {resource}, this machine's Ray has "
                    f"{available.get(resource, 0.0):g}; lower them, or start with --address to join a cluster that has them")
    return None


def _fits(resources: dict[str, float], pool: PoolSpec) -> bool:
    """Whether a node with these resources (totals) can hold one of ``pool``'s actors."""
    wanted = {"CPU": pool.num_cpus, "GPU": pool.num_gpus, **pool.resources}
    return all(resources.get(name, 0.0) + 1e-9 >= amount for name, amount in wanted.items() if amount > 0)


def _num_sharing(pool: PoolSpec, num_starting: int) -> int:
    """How many actors may measure the same memory at once: of one GPU, or of one node's host."""
    if pool.num_gpus > 0:
        return max(1, math.floor(1 / pool.num_gpus)) if pool.num_gpus < 1 else 1
    if pool.resources or not pool.spread:
        return num_starting  # placement unknown: assume they all land on one node
    num_nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
    return max(1, math.ceil(num_starting / max(1, num_nodes)))


def _start_failure(error: BaseException, timeout_s: float) -> str:
    """Why a worker did not start, in a line: the error its creation raised (the last line of
    Ray's report, which carries the remote traceback), or the startup timeout."""
    if isinstance(error, (asyncio.TimeoutError, TimeoutError)):
        return f"not ready within startup_timeout_s = {timeout_s:g} s"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return (lines[-1] if lines else type(error).__name__)[:300]
