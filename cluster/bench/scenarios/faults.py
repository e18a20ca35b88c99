"""Scenario: faults under load. Kill a prefill actor, a decode actor, then the controller
(with the router it hosts) while Poisson traffic runs; count what clients lost.

The deployment runs as ``pdserve up`` runs it: a controller actor hosting the router, durable
workers (1 prefill, 2 decode), Ray restarting the controller when it dies. The client rides
out a router restart as a robust client does (``wait_for_ready``: a call waits for the router
to listen again instead of failing at connect). Every request is greedy on one of a few
prompts, whose uninterrupted outputs are taken first, so every stream can be checked token
by token.

With ``--node-kill`` the cluster is three Ray nodes in network namespaces on this machine
(``cluster/netns.py``: their own addresses, joined by veth pairs, KV over UCX's TCP transport
on their interfaces): the controller on the head node, 1 prefill and 2 decode actors spread
over the two worker nodes, and at ``--kill-node-at`` the worker node holding the busiest decode
actor dies whole (its raylet and every worker on it). Recovery: until both pools are back at
their sizes, on the surviving node. The run itself happens inside the head node's namespace
(``run_inside``, in a process started there); the KV bytes each node's interface carried are read from outside.

Reported, per fault: when it happened, what was killed, the recovery time (until the pool
is back at its size with every worker ready, or for the controller, until the new router
answers with every worker adopted), and the TTFT and end-to-end p99 of requests sent in the
``--window-s`` after it over the p99 before the first fault. Over the run: requests lost
(failed, or ended by a FINISH_REASON_ERROR message) apart from the streams that were in flight
through the killed router, tokens duplicated or missing against the reference, and KV blocks
still held once the traffic has ended and the leases have had time to run out.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import socket
import time
from dataclasses import asdict, dataclass

from cluster.bench import plots
from cluster.bench.arrivals import phased_offsets
from cluster.bench.client import BenchClient, ClientConfig, RequestRecord
from cluster.bench.metrics import SLO, distribution, e2e_ms, ttft_ms
from cluster.bench.report import result_document, run_to_dict, write_json
from cluster.bench.runner import run_load
from cluster.bench.scenarios.common import ScenarioOutcome, engine_config, flags_of, fmt, ray_running, ratio, scenario_model
from cluster.bench.workloads import BenchRequest, random_token_ids
from router.api.pdserve.v1 import generation_pb2 as pb
from router.config import Disaggregation, RouterConfig

NAME = "faults"
SUMMARY = "under Poisson load, kill a prefill actor, a decode actor and the controller/router: requests lost, tokens wrong, blocks leaked, recovery"
DEFAULT_DTYPE = "float32"

ROUTER_LEASE_S = 5.0  # the workers drop a dead router's requests after this much silence
KV_LEASE_S = 20.0  # above the KV write timeout (10 s), as it must be
RECOVERY_LIMIT_S = 180.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rate", type=float, default=1.0, help="requests/s (Poisson)")
    parser.add_argument("--duration-s", type=float, default=120.0, help="seconds of traffic")
    parser.add_argument("--kill-prefill-at", type=float, default=30.0, help="seconds into the traffic (the 25 s before are the baseline)")
    parser.add_argument("--kill-decode-at", type=float, default=60.0)
    parser.add_argument("--kill-router-at", type=float, default=90.0)
    parser.add_argument("--window-s", type=float, default=15.0, help="requests sent this long after a fault count as its impact")
    parser.add_argument("--input-len", type=int, default=96)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=12, help="distinct prompts (each has a reference output)")
    parser.add_argument("--node-kill", action="store_true", help="instead: three namespaced nodes, and a whole worker node killed (needs root and ip)")
    parser.add_argument("--kill-node-at", type=float, default=40.0, help="--node-kill: seconds into the traffic")


@dataclass(slots=True)
class Fault:
    kind: str  # prefill, decode, router
    victim: str
    at_s: float
    recovered_s: float | None = None  # seconds from the kill until recovered; None: not within the limit


def run(args: argparse.Namespace) -> ScenarioOutcome:
    if args.node_kill:
        return _run_node_kill(args)
    with scenario_model(args.model, args.dtype, args.seed) as model_dir, ray_running():
        # A fixed port: the restarted controller's router listens where the old one did.
        spec = _spec(model_dir, args, RouterConfig(port=_free_port()))
        records, faults, references, leaked = _under_controller(spec, args, _inject)
    return _report(args, records, faults, references, leaked)


def _spec(model_dir, args: argparse.Namespace, router: RouterConfig, pool_resources: dict | None = None, transfer=None):
    """The deployment every variant runs: durable workers (1 prefill, 2 decode), Admin off, every
    prompt through a prefill actor, short leases so that a dead router's requests go soon."""
    from cluster.pools import DeploymentSpec, PoolSpec

    engine = engine_config(args.dtype, 512, 256, seed=args.seed)
    router.admin_port, router.disaggregation = None, Disaggregation.ALWAYS
    router.router_lease_s, router.kv_lease_s = ROUTER_LEASE_S, KV_LEASE_S
    spec = DeploymentSpec(
        model_path=model_dir,
        prefill=PoolSpec(1, engine, num_cpus=0, resources=dict(pool_resources or {})),
        decode=PoolSpec(2, engine, num_cpus=0, resources=dict(pool_resources or {})),
        router=router,
        name=f"faults-bench-{int(time.time())}",
        durable_workers=True,
        health_interval_s=0.5,
    )
    if transfer is not None:
        spec.transfer = transfer
    return spec


def _under_controller(spec, args: argparse.Namespace, inject):
    """Host ``spec`` as ``pdserve up`` does (a controller actor), drive it while ``inject`` kills."""
    import ray

    from cluster.controller import create_controller

    controller = create_controller(spec, None, "127.0.0.1", detached=False)
    try:
        info = ray.get(controller.start.remote())
        return asyncio.run(_drive(info.router_address, controller, spec, args, inject))
    finally:
        try:
            ray.get(controller.stop.remote(), timeout=60)
        finally:
            ray.kill(controller)


async def _drive(address: str, controller, spec, args: argparse.Namespace, inject):
    config = ClientConfig(address=address, timeout_s=300.0, request_id_prefix="faults", wait_for_ready=True)
    async with BenchClient(config) as client:
        limits = await client.model_limits()
        rng = random.Random(args.seed)
        prompts = [random_token_ids(rng, limits, args.input_len) for _ in range(args.num_prompts)]
        # References: each prompt's output with nothing failing (greedy float32 output does not
        # depend on what shares a batch).
        reference_run = await client.run([BenchRequest(args.output_len, p, tag=str(i), prompt_len=len(p)) for i, p in enumerate(prompts)], [0.0] * len(prompts))
        if not all(r.ok for r in reference_run.records):
            raise RuntimeError("the reference run failed before any fault: " + next(r.error for r in reference_run.records if not r.ok))
        references = {r.tag: r.token_ids for r in reference_run.records}
        offsets = phased_offsets([(args.duration_s, args.rate)], seed=args.seed)
        requests = [BenchRequest(args.output_len, prompts[i % len(prompts)], tag=str(i % len(prompts)), prompt_len=args.input_len) for i in range(len(offsets))]
        client.config.request_id_prefix = "faults-load"
        load = asyncio.create_task(run_load(client, requests, offsets, SLO(), NAME, not args.no_progress))
        await asyncio.sleep(0)  # the run starts its clock first: fault times count from the traffic's start
        faults = await inject(client, controller, spec, args)
        output = await load
        leaked = await _blocks_left(client, settle_s=ROUTER_LEASE_S + KV_LEASE_S + 10)
    return output.records, faults, references, leaked


async def _inject(client: BenchClient, controller, spec, args: argparse.Namespace) -> list[Fault]:
    import ray

    from cluster.pools import WORKER_NAMESPACE

    faults = []
    for at_s, kind in sorted([(args.kill_prefill_at, "prefill"), (args.kill_decode_at, "decode"), (args.kill_router_at, "router")]):
        await asyncio.sleep(max(0.0, at_s - client.now_s()))
        if kind == "router":
            victim = "controller (router)"
            # As if its process died: Ray restarts it, and the new one adopts the workers.
            await asyncio.to_thread(ray.kill, controller, no_restart=False)
        else:
            workers = await _status(client)
            role = pb.WORKER_ROLE_PREFILL if kind == "prefill" else pb.WORKER_ROLE_DECODE
            ready = [w for w in workers or [] if w.role == role and w.state == pb.WORKER_STATE_READY]
            if not ready:
                faults.append(Fault(kind, "none ready", client.now_s()))
                continue
            victim = max(ready, key=lambda w: w.num_running_seqs).worker_id  # the busiest: a kill that costs something
            handle = await asyncio.to_thread(ray.get_actor, f"{spec.name}/{victim}", WORKER_NAMESPACE)
            await asyncio.to_thread(ray.kill, handle, no_restart=True)
        fault = Fault(kind, victim, client.now_s())
        fault.recovered_s = await _wait_recovered(client, spec, fault)
        faults.append(fault)
    return faults


async def _wait_recovered(client: BenchClient, spec, fault: Fault, gone=None) -> float | None:
    """Seconds from the kill until every pool is back at its size with every worker ready
    (and, with ``gone``, none of the workers it names is left)."""
    want = {pb.WORKER_ROLE_PREFILL: spec.prefill.replicas, pb.WORKER_ROLE_DECODE: spec.decode.replicas}
    gone = gone or {fault.victim}
    deadline = time.monotonic() + RECOVERY_LIMIT_S
    while time.monotonic() < deadline:
        workers = await _status(client)
        if workers is not None and not gone & {w.worker_id for w in workers if w.state != pb.WORKER_STATE_DEAD}:
            ready = {role: sum(1 for w in workers if w.role == role and w.state == pb.WORKER_STATE_READY) for role in want}
            if all(ready[role] >= count for role, count in want.items()):
                return client.now_s() - fault.at_s
        await asyncio.sleep(0.2)
    return None


async def _status(client: BenchClient):
    try:
        return (await client.stub.GetClusterStatus(pb.GetClusterStatusRequest(), timeout=2.0)).workers
    except Exception:
        return None  # the router is down (restarting)


async def _blocks_left(client: BenchClient, settle_s: float) -> int:
    """KV blocks still in use once traffic has ended, after the leases had time to run out."""
    deadline = time.monotonic() + settle_s
    used = -1
    while time.monotonic() < deadline:
        workers = await _status(client)
        if workers is not None:
            used = sum(w.num_kv_blocks_used for w in workers)
            if used == 0:
                return 0
        await asyncio.sleep(0.5)
    return used


def _classify(records: list[RequestRecord], references: dict[str, list[int]], router_kill_s: float | None) -> dict:
    counts = dict(correct=0, lost=0, in_flight_at_router_death=0, wrong=0, tokens_duplicated=0, tokens_missing=0, tokens_changed=0)
    for r in records:
        if not r.ok:
            through_dead_router = router_kill_s is not None and r.send_s <= router_kill_s <= r.end_s
            counts["in_flight_at_router_death" if through_dead_router else "lost"] += 1
            continue
        want = references[r.tag]
        got = r.token_ids
        if got == want:
            counts["correct"] += 1
            continue
        counts["wrong"] += 1
        counts["tokens_duplicated"] += max(0, len(got) - len(want))
        counts["tokens_missing"] += max(0, len(want) - len(got))
        counts["tokens_changed"] += sum(1 for a, b in zip(got, want) if a != b)
    return counts


def _impact(records: list[RequestRecord], faults: list[Fault], window_s: float) -> dict:
    first = min((f.at_s for f in faults), default=None)
    before = [r for r in records if r.ok and first is not None and 5.0 <= r.send_s < first]
    base_ttft = distribution([ttft_ms(r) for r in before]).p99
    base_e2e = distribution([e2e_ms(r) for r in before]).p99
    impact = {"before_first_fault": {"num_requests": len(before), "ttft_p99_ms": base_ttft, "e2e_p99_ms": base_e2e}}
    for f in faults:
        window = [r for r in records if r.ok and f.at_s <= r.send_s < f.at_s + window_s]
        ttft = distribution([ttft_ms(r) for r in window]).p99
        e2e = distribution([e2e_ms(r) for r in window]).p99
        impact[f.kind] = {
            "num_requests": len(window), "ttft_p99_ms": ttft, "e2e_p99_ms": e2e,
            "ttft_p99_over_before": ratio(ttft, base_ttft), "e2e_p99_over_before": ratio(e2e, base_e2e),
        }
    return impact


def _report(args, records, faults, references, leaked) -> ScenarioOutcome:
    router_kill = next((f.at_s for f in faults if f.kind == "router"), None)
    counts = _classify(records, references, router_kill)
    impact = _impact(records, faults, args.window_s)
    out = args.out
    events = [(f.at_s, f"kill {f.victim}") for f in faults] + [(f.at_s + f.recovered_s, f"{f.kind} recovered") for f in faults if f.recovered_s is not None]
    paths = [plots.plot_latency_over_time(records, out / "latency_over_time.png", events, [(0.0, args.rate), (args.duration_s, args.rate)], title="faults under Poisson load")]
    from cluster.bench.metrics import compute_metrics

    duration = max((r.end_s for r in records), default=0.0)
    metrics = compute_metrics(records, duration)
    body = {
        "faults": [asdict(f) for f in faults], "counts": counts, "kv_blocks_leaked": leaked, "impact": impact,
        "runs": {NAME: run_to_dict(metrics, records)}, "plots": [str(p) for p in paths],
    }
    json_path = write_json(out / "scenario.json", result_document(f"scenario:{NAME}", {"scenario": NAME, **flags_of(args)}, body))
    lines = [
        f"{len(records)} requests: {counts['correct']} correct, {counts['lost']} lost, {counts['wrong']} with wrong tokens "
        f"({counts['tokens_duplicated']} duplicated, {counts['tokens_missing']} missing, {counts['tokens_changed']} changed), "
        f"{counts['in_flight_at_router_death']} in flight through the killed router; KV blocks leaked: {leaked}",
    ]
    for f in faults:
        fi = impact.get(f.kind, {})
        lines.append(
            f"kill {f.victim} at {f.at_s:.1f}s: recovered in {fmt(f.recovered_s, 's')}; requests sent in the next {args.window_s:g}s: "
            f"TTFT p99 {fmt(fi.get('ttft_p99_ms'), ' ms', 0)} ({fmt(fi.get('ttft_p99_over_before'), 'x', 2)} of before), "
            f"E2E p99 {fmt(fi.get('e2e_p99_ms'), ' ms', 0)} ({fmt(fi.get('e2e_p99_over_before'), 'x', 2)})"
        )
    ok = counts["lost"] == 0 and counts["wrong"] == 0 and leaked == 0 and all(f.recovered_s is not None for f in faults)
    return ScenarioOutcome(NAME, lines, json_path, {"lost": counts["lost"], "wrong": counts["wrong"], "leaked": leaked}, ok=ok)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- a whole node dies (--node-kill) ----------------------------------------------------------


def _run_node_kill(args: argparse.Namespace) -> ScenarioOutcome:
    """Build the namespaced nodes, run the scenario inside the head node's namespace, and add
    what each node's interface carried."""
    import json
    import sys
    import tempfile
    from pathlib import Path

    from cluster.netns import NetnsCluster, missing_requirement

    missing = missing_requirement()
    if missing is not None:
        raise ValueError(f"--node-kill: {missing}")
    with scenario_model(args.model, args.dtype, args.seed) as model_dir, tempfile.TemporaryDirectory() as tmp:
        with NetnsCluster(3, resources=[{}, {"pd_worker": 4}, {"pd_worker": 4}]) as cluster:
            plan = {
                "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if not callable(v)},
                "model": str(model_dir), "ray_address": cluster.head_address, "router_host": cluster.addresses[0],
                "namespaces": cluster.names, "addresses": cluster.addresses, "result": str(Path(tmp) / "outcome.json"),
            }
            plan_path = Path(tmp) / "plan.json"
            plan_path.write_text(json.dumps(plan))
            before = {i: cluster.device_bytes(i) for i in (1, 2)}
            repo = Path(__file__).resolve().parents[3]
            run_inside = "import sys; from cluster.bench.scenarios.faults import run_inside; run_inside(sys.argv[1])"
            inside = cluster.popen(0, [sys.executable, "-c", run_inside, str(plan_path)], cwd=str(repo))
            inside.wait()
            after = {i: cluster.device_bytes(i) for i in (1, 2)}
        if inside.returncode != 0 or not Path(plan["result"]).is_file():
            raise RuntimeError("the node-kill run inside the head node's namespace failed (its output is above)")
        outcome = json.loads(Path(plan["result"]).read_text())
    interface = {cluster.addresses[i]: {"sent_bytes": after[i][0] - before[i][0], "received_bytes": after[i][1] - before[i][1]} for i in (1, 2)}
    doc = json.loads(Path(outcome["json_path"]).read_text())
    doc["interface_bytes"] = interface
    Path(outcome["json_path"]).write_text(json.dumps(doc, indent=2))
    carried = ", ".join(f"{ip} sent {v['sent_bytes'] / 2**20:.1f} MiB, received {v['received_bytes'] / 2**20:.1f} MiB" for ip, v in interface.items())
    lines = [*outcome["lines"], f"bytes through each worker node's interface: {carried}"]
    return ScenarioOutcome(NAME, lines, Path(outcome["json_path"]), outcome["ratios"], ok=outcome["ok"])


def run_inside(plan_path: str) -> None:
    """The node-kill run, in the head node's namespace: a controller with its pools on the worker
    nodes, Poisson traffic, one worker node killed."""
    import json
    from pathlib import Path

    import ray

    from cluster.netns import DEVICE
    from kvtransfer.agent import KVTransferConfig

    plan = json.loads(Path(plan_path).read_text())
    args = argparse.Namespace(**plan["args"])
    args.out = Path(args.out)
    args.model = plan["model"]
    ray.init(address=plan["ray_address"], log_to_driver=False)
    router = RouterConfig(host=plan["router_host"], port=_free_port(), http_port=None)
    spec = _spec(Path(plan["model"]), args, router, pool_resources={"pd_worker": 1},
                 transfer=KVTransferConfig(network_devices=DEVICE, transports="tcp"))
    spec.health_timeout_s = 3.0

    async def kill_node(client, controller, spec, args):
        return await _inject_node_kill(client, spec, args, plan)

    records, faults, references, leaked = _under_controller(spec, args, kill_node)
    outcome = _report(args, records, faults, references, leaked)
    Path(plan["result"]).write_text(json.dumps({"lines": outcome.lines, "json_path": str(outcome.json_path), "ratios": outcome.ratios, "ok": outcome.ok}))


async def _inject_node_kill(client: BenchClient, spec, args: argparse.Namespace, plan: dict) -> list[Fault]:
    import os
    import signal
    import subprocess

    import ray

    await asyncio.sleep(max(0.0, args.kill_node_at - client.now_s()))
    workers = await _status(client) or []
    ips = {n["NodeID"][:8]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    where = {w.worker_id: ips.get(w.node.rsplit(":", 1)[-1], "") for w in workers}
    decodes = [w for w in workers if w.role == pb.WORKER_ROLE_DECODE and w.state == pb.WORKER_STATE_READY]
    busiest = max(decodes, key=lambda w: w.num_running_seqs)
    target = where[busiest.worker_id]
    doomed = {w for w, ip in where.items() if ip == target}
    namespace = plan["namespaces"][plan["addresses"].index(target)]
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    fault = Fault("node", f"node {target} ({', '.join(sorted(doomed))}; {len(pids)} processes)", client.now_s())
    fault.recovered_s = await _wait_recovered(client, spec, fault, gone=doomed)
    return [fault]

