"""A pool ends at the size it was scaled to even when a dead worker's replacement is still
starting: the replacement counts (scaling up launches only what is missing, scaling down
retires ready workers in its place) and a surplus left when it lands is retired. Checked
without Ray: the pool manager's launch and removal are replaced by ones that only keep the
router's pool of records."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from cluster.deployment import DeploymentSpec, PoolSpec
from cluster.pools import PoolManager
from router.pool import Role, WorkerPool, WorkerRecord
from engine.stats import WorkerState
from tests.serving import engine_config


def _manager(tmp_path, decode_replicas: int) -> tuple[PoolManager, list[asyncio.Event]]:
    """A pool manager whose launches wait for the test's go (one event each, in launch order)."""
    (tmp_path / "config.json").write_text("{}")
    spec = DeploymentSpec(model_path=str(tmp_path), prefill=PoolSpec(0, engine_config()), decode=PoolSpec(decode_replicas, engine_config()))
    router = SimpleNamespace(pool=WorkerPool(), worker_died=lambda record: None)

    async def drain(record):
        record.state = WorkerState.DRAINING

    router.drain = drain
    manager = PoolManager(spec, router)
    gates: list[asyncio.Event] = []
    names = iter(range(100))

    async def launch(role, num_starting=1):
        gate = asyncio.Event()
        gates.append(gate)
        await gate.wait()
        record = WorkerRecord(f"{role.value}-{next(names)}", role, handle=None)
        router.pool.add(record)
        return record

    async def idle(record):
        return True

    async def nothing():
        return None

    manager._launch, manager._worker_idle, manager.refresh_readiness = launch, idle, nothing
    manager._remove = lambda record: router.pool.remove(record.worker_id)
    return manager, gates


def _ready(manager: PoolManager) -> list[str]:
    return sorted(w.worker_id for w in manager.router.pool.of_role(Role.DECODE) if w.state is WorkerState.READY)


async def _settle(gates: list[asyncio.Event]) -> None:
    for _ in range(20):
        for gate in gates:
            gate.set()
        await asyncio.sleep(0.01)


async def _one_of_two_decode_workers_replaced(tmp_path) -> tuple[PoolManager, list[asyncio.Event]]:
    """A pool of two decode workers, one of which died: its replacement starts (and waits)."""
    manager, gates = _manager(tmp_path, 2)
    pool = manager.router.pool
    for name in ("decode-a", "decode-b"):
        pool.add(WorkerRecord(name, Role.DECODE, handle=None))
    manager._on_unhealthy(pool.workers["decode-b"], "health check timed out")
    await asyncio.sleep(0)
    return manager, gates


@pytest.mark.parametrize("replicas", [3, 2, 1, 0])
def test_scaling_while_a_replacement_starts_ends_at_the_size_asked(tmp_path, replicas):
    async def scenario():
        manager, gates = await _one_of_two_decode_workers_replaced(tmp_path)
        assert manager._num_launching[Role.DECODE] == 1
        scaling = asyncio.create_task(manager.scale(Role.DECODE, replicas))
        await _settle(gates)
        await asyncio.wait_for(scaling, 5)
        await _settle(gates)  # the replacement landed; a surplus is retired
        return _ready(manager)

    ready = asyncio.run(scenario())
    assert len(ready) == replicas, ready


def test_a_worker_that_dies_while_the_pool_drains_a_slow_worker_is_replaced_at_once(tmp_path):
    """Shrinking a pool drains the worker it retires, which may take up to drain_timeout_s (a
    long generation); a worker that dies meanwhile is replaced then, not after the drain (the
    pool was one short, or had no decode worker at all, for up to ten minutes)."""
    async def scenario():
        manager, gates = _manager(tmp_path, 3)
        pool = manager.router.pool
        for name in ("decode-a", "decode-b", "decode-c"):
            pool.add(WorkerRecord(name, Role.DECODE, handle=None))
        busy = asyncio.Event()

        async def idle(record):
            return busy.is_set()

        manager._worker_idle = idle
        scaling = asyncio.create_task(manager.scale(Role.DECODE, 2))
        await asyncio.sleep(0.05)
        (draining,) = [w.worker_id for w in pool.of_role(Role.DECODE) if w.state is WorkerState.DRAINING]
        survivor = next(w for w in _ready(manager))
        manager._on_unhealthy(pool.workers[survivor], "died")
        await _settle(gates)
        replaced = _ready(manager)
        assert not scaling.done()
        busy.set()
        await asyncio.wait_for(scaling, 5)
        return draining, survivor, replaced, _ready(manager)

    draining, survivor, replaced, final = asyncio.run(scenario())
    assert len(replaced) == 2 and survivor not in replaced and draining not in replaced
    assert final == replaced


def test_a_worker_adopted_mid_drain_is_not_routed_to_nor_counted_and_its_retirement_finishes(tmp_path):
    """A controller that died while retiring a worker restarts and adopts it: the worker refuses
    new work (it is draining), so the router must not pick it, the pool must not count it, and
    the new manager finishes retiring it (it stayed, READY to the router, refusing every pick)."""
    from router.core import Router

    class _Call:
        def __init__(self, value):
            self.value = value

        def remote(self, *args):
            async def answer():
                return self.value
            return answer()

    def handle(state):
        return SimpleNamespace(ping=_Call("e1"), handshake_offer=_Call(None), status=_Call(SimpleNamespace(node="n1", state=state)))

    async def scenario():
        manager, _ = _manager(tmp_path, 1)
        router = manager.router
        host = SimpleNamespace(
            pool=router.pool, model_info=SimpleNamespace(lora_adapters={}), config=SimpleNamespace(allow_runtime_lora_updating=False)
        )
        for worker_id, state in (("decode-0", WorkerState.READY), ("decode-1", WorkerState.DRAINING)):
            await Router.add_worker(host, Role.DECODE, worker_id, handle(state), adopted=True)
            manager._adopted(Role.DECODE, worker_id)
        states = {w.worker_id: w.state for w in router.pool.of_role(Role.DECODE)}
        await asyncio.sleep(0.05)
        return states, _ready(manager), sorted(router.pool.workers)

    states, ready, left = asyncio.run(scenario())
    assert states == {"decode-0": WorkerState.READY, "decode-1": WorkerState.DRAINING}
    assert ready == ["decode-0"] and left == ["decode-0"]  # the draining one was retired


def test_a_restarted_manager_whose_launch_fails_serves_with_what_it_adopted(tmp_path, monkeypatch):
    """A restarted controller adopts the workers still running and launches what its pool lacks;
    a launch that fails then (its GPU taken, a node gone) must not leave it not ready for good,
    with no health loop, its adopted workers unused: it serves, and the health loop retries."""
    import cluster.pools as pools_module

    async def scenario():
        manager, _ = _manager(tmp_path, 2)
        manager.spec.durable_workers = True
        router = manager.router

        async def adopt():
            router.pool.add(WorkerRecord("decode-0", Role.DECODE, handle=None))
            return {Role.PREFILL: 0, Role.DECODE: 1}

        async def refuse(role, num_starting=1):
            raise TimeoutError("no GPU free")

        async def nodes_fine(*args, **kwargs):
            return None

        async def health_loop():
            await asyncio.sleep(3600)

        monkeypatch.setattr(pools_module, "check_nodes", nodes_fine)
        manager._adopt, manager._launch, manager._health_loop = adopt, refuse, health_loop
        await asyncio.wait_for(manager.start(), 5)
        started = (manager._started, manager._health_task is not None, manager.desired[Role.DECODE])
        manager._health_task.cancel()
        return started

    assert asyncio.run(scenario()) == (True, True, 2)


def test_stopping_releases_an_adopted_workers_placement_group(tmp_path, monkeypatch):
    """A tensor-parallel worker's placement group is detached with it (durable workers); after a
    controller restart the new manager did not create it, and ``down`` left it holding its GPUs."""
    import cluster.pools as pools_module

    removed, killed = [], []
    monkeypatch.setattr(pools_module.ray, "kill", killed.append)
    monkeypatch.setattr(pools_module.ray.util, "get_placement_group", lambda name: f"group {name}")
    monkeypatch.setattr(pools_module, "remove_placement_group", removed.append)

    async def scenario():
        manager, _ = _manager(tmp_path, 1)
        manager.spec.durable_workers = True
        manager.handles["decode-3"] = "handle of decode-3"  # adopted: no group of its own recorded
        await manager.stop()
        return manager._name_prefix()

    prefix = asyncio.run(scenario())
    assert killed == ["handle of decode-3"] and removed == [f"group {prefix}decode-3"]


def test_down_without_a_controller_stops_the_durable_workers_it_left(monkeypatch):
    """A foreground `up` killed with its process (SIGHUP, SIGKILL) takes its controller along,
    while its durable workers and their placement groups live on: `down` finds and stops them
    (it only stopped the router replicas and the responses board, and said nothing was running)."""
    import cluster.pools as pools_module

    named = [{"name": n, "namespace": ns} for n, ns in (
        ("pdserve/decode-0", "pdserve"), ("pdserve/prefill-2", "pdserve"), ("pdserve/router-1", "pdserve"),
        ("other/decode-0", "pdserve"), ("pdserve/decode-9", "elsewhere"),
    )]
    killed, removed = [], []

    def group(name):
        if name != "pdserve/decode-0":
            raise ValueError(name)  # a worker of one rank has none
        return f"group {name}"

    monkeypatch.setattr(pools_module.ray.util, "list_named_actors", lambda all_namespaces: named)
    monkeypatch.setattr(pools_module.ray, "get_actor", lambda name, namespace: f"actor {name}")
    monkeypatch.setattr(pools_module.ray, "kill", lambda actor, no_restart: killed.append(actor))
    monkeypatch.setattr(pools_module.ray.util, "get_placement_group", group)
    monkeypatch.setattr(pools_module, "remove_placement_group", removed.append)
    assert pools_module.stop_leftover_workers("pdserve") == ["pdserve/decode-0", "pdserve/prefill-2"]
    assert killed == ["actor pdserve/decode-0", "actor pdserve/prefill-2"] and removed == ["group pdserve/decode-0"]


@pytest.mark.parametrize("recorded, expected", [(None, 2), (1, 1), (3, 3), (0, 0)])
def test_a_restarted_manager_resumes_the_sizes_its_predecessor_set(tmp_path, monkeypatch, recorded, expected):
    """A controller restarted by Ray adopts the running workers; the pools' sizes are the ones the
    dead controller last set (recorded in Ray's key-value store), not ``max(spec, adopted)``: a
    pool scaled down is trimmed back to its size (the predecessor died before its drains began),
    and one short of a worker that died with the controller is refilled. Without a record (a new
    deployment) what runs is kept, as before."""
    import cluster.pools as pools_module

    store: dict[str, dict] = {}
    if recorded is not None:
        store["pdserve"] = {Role.PREFILL: 0, Role.DECODE: recorded}
    monkeypatch.setattr(pools_module.desired_sizes, "load", lambda name: store.get(name))
    monkeypatch.setattr(pools_module.desired_sizes, "save", lambda name, sizes: store.__setitem__(name, dict(sizes)))

    async def nodes_fine(*args, **kwargs):
        return None

    monkeypatch.setattr(pools_module, "check_nodes", nodes_fine)

    async def scenario():
        manager, gates = _manager(tmp_path, 1)
        manager.spec.durable_workers = True
        router = manager.router

        async def adopt():
            for name in ("decode-a", "decode-b"):
                router.pool.add(WorkerRecord(name, Role.DECODE, handle=None))
            return {Role.PREFILL: 0, Role.DECODE: 2}

        async def health_loop():
            await asyncio.sleep(3600)

        manager._adopt, manager._health_loop = adopt, health_loop
        starting = asyncio.create_task(manager.start())
        await _settle(gates)
        await asyncio.wait_for(starting, 5)
        await _settle(gates)  # a surplus' retirement finishes
        manager._health_task.cancel()
        manager._size_records.shutdown(wait=True)  # the records are written on a thread of their own
        return len(_ready(manager)), store["pdserve"][Role.DECODE]

    assert asyncio.run(scenario()) == (expected, expected)


def test_a_scale_is_recorded_for_a_restarted_controller(tmp_path, monkeypatch):
    import cluster.pools as pools_module

    saved = []
    monkeypatch.setattr(pools_module.desired_sizes, "save", lambda name, sizes: saved.append((name, sizes[Role.DECODE])))

    async def scenario():
        manager, gates = _manager(tmp_path, 1)
        manager.spec.durable_workers = True
        manager.router.pool.add(WorkerRecord("decode-0", Role.DECODE, handle=None))
        scaling = asyncio.create_task(manager.scale(Role.DECODE, 3))
        await _settle(gates)
        await asyncio.wait_for(scaling, 5)
        await manager.retire(manager.router.pool.workers["decode-0"])  # a retirement shrinks the pool by one
        manager._size_records.shutdown(wait=True)  # the records are written on a thread of their own

    asyncio.run(scenario())
    assert saved == [("pdserve", 3), ("pdserve", 2)]


def test_recorded_sizes_live_in_rays_key_value_store(ray_session):
    """The record outlives every actor (it is in the GCS); `down` and a new `up` forget it."""
    from cluster import desired_sizes

    name = f"sizes-test-{time.monotonic_ns()}"
    assert desired_sizes.load(name) is None
    desired_sizes.save(name, {Role.PREFILL: 2, Role.DECODE: 5})
    assert desired_sizes.load(name) == {Role.PREFILL: 2, Role.DECODE: 5}
    desired_sizes.forget(name)
    assert desired_sizes.load(name) is None


def test_a_following_router_stops_routing_to_a_worker_the_controller_drains():
    """Router replicas follow the controller's pools: a worker the controller begins draining
    (scaling down) refuses new work, and a replica kept routing every request to it first. Its
    status report says it drains; the follower's health round takes it out of routing."""
    from cluster.pool_follower import PoolFollower
    from router.status_monitor import StatusMonitor

    class _Status:
        def __init__(self, state):
            self.state = state

        def remote(self):
            async def answer():
                return SimpleNamespace(state=self.state)
            return answer()

    async def scenario():
        pool = WorkerPool()
        router = SimpleNamespace(pool=pool, status_monitor=StatusMonitor(pool, timeout_s=1.0))
        for worker_id, state in (("decode-0", WorkerState.READY), ("decode-1", WorkerState.DRAINING)):
            pool.add(WorkerRecord(worker_id, Role.DECODE, handle=SimpleNamespace(status=_Status(state))))
        before = sorted(w.worker_id for w in pool.routable(Role.DECODE))
        await PoolFollower("pdserve", router)._follow_drains()
        return before, sorted(w.worker_id for w in pool.routable(Role.DECODE))

    assert asyncio.run(scenario()) == (["decode-0", "decode-1"], ["decode-0"])


def test_draining_a_worker_by_hand_launches_no_replacement(tmp_path):
    """DrainWorker: the pool's size drops before the worker drains. It dropped only after the
    drain call returned, and a health round in between found the pool a worker short and launched
    one (a model load), which was then trimmed again when it landed."""
    from router.admin import AdminOperations
    from router.api.pdserve.v1 import generation_pb2 as pb

    async def scenario():
        manager, _ = _manager(tmp_path, 2)
        router = manager.router
        for name in ("decode-a", "decode-b"):
            router.pool.add(WorkerRecord(name, Role.DECODE, handle=None))

        async def drain(record):
            record.state = WorkerState.DRAINING
            await asyncio.sleep(0.01)  # the worker's drain call
            manager._reconcile()  # a health round meanwhile

        router.drain, router.pool_manager, router.background_tasks = drain, manager, set()
        reply = await AdminOperations(router).drain_worker(pb.DrainWorkerRequest(worker_id="decode-a"))
        await asyncio.sleep(0.05)
        return reply.state, manager._num_launching[Role.DECODE], manager.desired[Role.DECODE], _ready(manager)

    assert asyncio.run(scenario()) == (pb.WORKER_STATE_DRAINING, 0, 1, ["decode-b"])


def test_a_stopped_manager_records_nothing_after_forgetting(tmp_path, monkeypatch):
    """`down` forgets the deployment's sizes; a retirement ending while the manager stops must
    not write them back (the next `up` would start from them), and stopping twice is harmless."""
    import cluster.pools as pools_module

    calls = []
    monkeypatch.setattr(pools_module.desired_sizes, "save", lambda name, sizes: calls.append("save"))
    monkeypatch.setattr(pools_module.desired_sizes, "forget", lambda name: calls.append("forget"))

    async def scenario():
        manager, _ = _manager(tmp_path, 1)
        manager.spec.durable_workers = True
        manager._set_desired(Role.DECODE, 2)
        await manager.stop()
        manager._set_desired(Role.DECODE, 1)  # a retirement that ended after the stop
        await manager.stop()

    asyncio.run(scenario())
    assert calls == ["save", "forget"]


def test_a_routers_health_rounds_go_on_after_one_fails():
    """A round's adoption lists the deployment's workers through Ray's control store; one failed
    call (the store briefly away) ended a router replica's health loop for good: it never again
    checked a worker, adopted a replacement or became ready again."""
    from cluster.pool_follower import PoolFollower

    async def scenario():
        follower = PoolFollower("pdserve", SimpleNamespace(pool=WorkerPool()), health_interval_s=0.01)
        rounds = []

        async def adopt():
            rounds.append(len(rounds))
            if len(rounds) == 1:
                raise ConnectionError("the GCS is unreachable")
            return {}

        async def follow_drains():
            pass

        async def refresh_readiness():
            pass

        follower._adopt, follower._follow_drains, follower.refresh_readiness = adopt, follow_drains, refresh_readiness
        task = asyncio.create_task(follower._health_loop())
        for _ in range(200):
            if len(rounds) >= 3:
                break
            await asyncio.sleep(0.01)
        alive = not task.done()
        task.cancel()
        return alive, len(rounds)

    alive, rounds = asyncio.run(scenario())
    assert alive and rounds >= 3


def test_a_draining_worker_slow_to_report_is_not_taken_for_idle(tmp_path):
    """A worker answers its status between engine steps; one that did not answer within the
    timeout (a long prefill step) was taken for idle, and killed with its requests running."""
    from router.status_monitor import LoadReport

    manager, _ = _manager(tmp_path, 1)
    record = WorkerRecord("decode-0", Role.DECODE, handle=None)
    reports = {
        "late": LoadReport("decode-0", 0.0, problem="no status within 10s"),
        "gone": LoadReport("decode-0", 0.0, gone=True, problem="ActorDiedError"),
        "busy": LoadReport("decode-0", 0.0, status=SimpleNamespace(num_active_requests=3, engine=None)),
        "idle": LoadReport("decode-0", 0.0, status=SimpleNamespace(num_active_requests=0, engine=None)),
    }

    def idle(kind):
        async def report(record, max_age_s):
            return reports[kind]

        manager.router.status_monitor = SimpleNamespace(report=report)
        return asyncio.run(PoolManager._worker_idle(manager, record))

    assert {kind: idle(kind) for kind in reports} == {"late": False, "gone": True, "busy": False, "idle": True}


def test_adopting_a_worker_that_stops_answering_is_bounded(monkeypatch):
    """A worker that answered its ping and then hung: adopting it waited for its status for good,
    and the health round with it (no other worker was checked again)."""
    import router.core
    from router.core import Router

    monkeypatch.setattr(router.core, "ADD_WORKER_TIMEOUT_S", 0.2)

    class _Hangs:
        def remote(self, *args):
            return asyncio.Event().wait()

    class _Answers:
        def remote(self, *args):
            async def answer():
                return "e1"
            return answer()

    handle = SimpleNamespace(ping=_Answers(), handshake_offer=_Hangs(), status=_Hangs())
    host = SimpleNamespace(pool=WorkerPool(), model_info=SimpleNamespace(lora_adapters={}),
                           config=SimpleNamespace(allow_runtime_lora_updating=False))

    async def scenario():
        adding = asyncio.create_task(Router.add_worker(host, Role.DECODE, "decode-0", handle))
        await asyncio.sleep(2.0)  # ten times the bound
        ended = adding.done()
        adding.cancel()
        return ended and isinstance(adding.exception(), asyncio.TimeoutError)

    assert asyncio.run(scenario()), "adopting a hung worker waited for good"
    assert not host.pool.workers


def test_the_autoscaler_counts_a_replacement_still_starting_and_drains_no_ready_worker_for_it(tmp_path):
    """A decode worker died and its replacement loads for minutes. The autoscaler saw one worker
    fewer, and a tick that grew the prefill pool applied decode's size as it saw it: the scale,
    which counts the replacement, drained a ready worker in its place."""
    from cluster.autoscaler import apply_sizes, observed_sizes

    async def scenario():
        manager, gates = await _one_of_two_decode_workers_replaced(tmp_path)
        prefill, decode = observed_sizes(manager)
        assert decode == 2
        applying = asyncio.create_task(apply_sizes(manager, prefill, decode))
        await asyncio.sleep(0.01)
        assert _ready(manager) == ["decode-a"]  # nothing drained meanwhile
        await _settle(gates)
        await asyncio.wait_for(applying, 5)
        await _settle(gates)
        return _ready(manager)

    assert len(asyncio.run(scenario())) == 2
