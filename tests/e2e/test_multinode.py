"""Many machines, on one: three Ray nodes in network namespaces joined by veth pairs, so that
Ray, gRPC and the KV bytes cross a real interface, never loopback. The router runs on the head
node, the prefill and decode actors spread over the two worker nodes. Then a whole worker node
dies (its raylet and every worker on it) under a burst.

The driver (``tests/e2e/multinode_driver.py``) runs inside the head node's namespace; this
test builds the hosts, computes the expected tokens with transformers, reads the interfaces'
byte counters and kills the node.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoints import hf_greedy, random_prompts
from tests.e2e.multinode_driver import MARK
from cluster.netns import NetnsCluster, missing_requirement

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
MAX_TOKENS = 8
BURST_TOKENS = 160


@pytest.fixture(scope="module")
def run(e2e_model, tmp_path_factory):
    """The whole scenario, once: what the driver reported in each phase, and the interfaces' bytes."""
    missing = missing_requirement()
    if missing is not None:
        pytest.skip(f"no network namespaces here: {missing}")
    prompts = random_prompts([200, 150, 260, 90], e2e_model.vocab_size, seed=71)
    burst = random_prompts([120, 60, 180, 40, 150, 80, 100, 70], e2e_model.vocab_size, seed=72)
    plan_path = tmp_path_factory.mktemp("multinode") / "plan.json"
    with NetnsCluster(3, resources=[{}, {"pd_worker": 3}, {"pd_worker": 3}]) as cluster:
        plan = {
            "ray_address": cluster.head_address, "router_host": cluster.addresses[0], "model": str(e2e_model.path),
            "prompts": prompts, "max_tokens": MAX_TOKENS, "burst": burst, "burst_tokens": BURST_TOKENS,
        }
        plan_path.write_text(json.dumps(plan))
        before = {i: cluster.device_bytes(i) for i in (1, 2)}
        driver = cluster.popen(0, [sys.executable, "-m", "tests.e2e.multinode_driver", str(plan_path)], cwd=REPO,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        reports, killed_processes = {}, 0
        try:
            for line in driver.stdout:
                if not line.startswith(MARK):
                    continue
                message = json.loads(line[len(MARK):])
                if "kill" in message:
                    node = cluster.addresses.index(message["kill"])
                    killed_processes = cluster.kill_node(node)
                    driver.stdin.write("killed\n")
                    driver.stdin.flush()
                    continue
                reports[message["phase"]] = message
                if message["phase"] == "serve":
                    after_serving = {i: cluster.device_bytes(i) for i in (1, 2)}
        finally:
            driver.wait(120)
        assert driver.returncode == 0, "the driver failed (its stderr is in the test output)"
    yield {
        "prompts": prompts, "burst": burst, "reports": reports, "addresses": cluster.addresses,
        "bytes": {i: (after_serving[i][0] - before[i][0], after_serving[i][1] - before[i][1]) for i in (1, 2)},
        "killed_processes": killed_processes,
    }


def test_pools_on_other_hosts_serve_exact_greedy_output_and_kv_crosses_the_interface(run, e2e_model):
    serve = run["reports"]["serve"]
    assert serve["tokens"] == [hf_greedy(e2e_model.hf_model, p, MAX_TOKENS) for p in run["prompts"]]
    ips = serve["worker_ips"]
    addresses = run["addresses"]
    assert set(ips.values()) <= set(addresses[1:]), f"the pools run on the worker nodes only: {ips}"
    assert len(set(ips.values())) == 2, f"the pools spread over both worker nodes: {ips}"
    prefill_node = addresses.index(ips["prefill-0"])
    remote = [w for w, ip in ips.items() if w.startswith("decode-") and ip != ips["prefill-0"]]
    assert remote, f"a decode actor on the other node: {ips}"
    # The transport of each pair is exported: TCP on the namespaces' interface.
    paths = {(p["decode_worker_id"], p["name"]): p for p in serve["paths"] if p["prefill_worker_id"] == "prefill-0"}
    sent_remote = sum(p["value"] for (peer, name), p in paths.items() if peer in remote and name.endswith("path_bytes_total"))
    for (peer, name), p in paths.items():
        assert (p["transport"], p["device"]) == ("tcp", "eth-pd" if peer in remote else "lo"), p
    assert sent_remote > 0, "some prompts were prefilled for the decode actor on the other node"
    routed_remote = sum(b for b, d in zip(serve["kv_bytes"], serve["decode_workers"]) if d in remote)
    assert sent_remote == routed_remote, "the per-pair counters add up to what the requests report"
    sent_on_device, _ = run["bytes"][prefill_node]
    assert sent_on_device >= sent_remote, f"{sent_remote} KV bytes to the other node, {sent_on_device} left the prefill node's interface"


def test_a_node_dying_under_a_burst_loses_nothing_and_the_pools_come_back_on_the_other_nodes(run, e2e_model):
    report = run["reports"]["node-kill"]
    assert run["killed_processes"] >= 3, "the raylet and the workers on that node were killed"
    assert report["in_flight_at_kill"] > 0
    expected = [hf_greedy(e2e_model.hf_model, p, BURST_TOKENS) for p in run["burst"]]
    assert [r.get("tokens", r.get("error")) for r in report["results"]] == expected, "every stream finished, exactly"
    assert report["killed"] not in report["worker_ips"].values()
    assert sorted(w for w in report["worker_ips"] if report["worker_ips"][w] != "gone").count("prefill-0") <= 1
    decode_now = [w for w in report["worker_ips"] if w.startswith("decode-")]
    assert len(decode_now) == 2 and report["replaced"] >= 1, report
    assert set(report["blocks_used"].values()) == {0}, f"blocks left in use: {report['blocks_used']}"
