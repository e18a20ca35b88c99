"""Hosts on one machine, for the multi-node tests and the node-kill benchmark: network
namespaces with their own addresses, joined through veth pairs to a bridge, each running its
own Ray node.

Everything crosses a real interface ("eth-pd" inside each namespace), never loopback: Ray's
control traffic, gRPC, and the KV bytes UCX sends over TCP. ``NetnsCluster`` creates the
namespaces, starts a Ray head in the first and a worker node in each other, and removes it
all again; it needs root and the ``ip`` tool (``missing_requirement`` says what is absent).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time

DEVICE = "eth-pd"  # the interface inside every namespace


def missing_requirement() -> str | None:
    """Why namespaces cannot be made here, or None (it makes and removes one to find out: root in
    a container without CAP_NET_ADMIN cannot)."""
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"pd-probe-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _namespace_env(**extra: str) -> dict[str, str]:
    """The environment of a process started in a namespace: Ray's token auth (its default for
    local clusters), without the test session's loopback confinement of UCX."""
    env = {**os.environ, "RAY_AUTH_MODE": "token", **extra}
    env.pop("UCX_NET_DEVICES", None)
    return env


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class NetnsCluster:
    """``num_nodes`` namespaced hosts at 10.<subnet>.0.1.. on one bridge, each a Ray node."""

    def __init__(self, num_nodes: int, resources: list[dict[str, float]], num_cpus: int = 2):
        self.tag = secrets.token_hex(3)
        self.subnet = 100 + secrets.randbelow(100)
        self.hub = f"pd{self.tag}-hub"
        self.names = [f"pd{self.tag}-{i}" for i in range(num_nodes)]
        self.addresses = [f"10.{self.subnet}.0.{i + 1}" for i in range(num_nodes)]
        self.resources = resources
        self.num_cpus = num_cpus
        self.head_port = 6390
        self._created: list[str] = []
        self.ray_processes: dict[str, subprocess.Popen] = {}

    @property
    def head_address(self) -> str:
        return f"{self.addresses[0]}:{self.head_port}"

    def __enter__(self) -> "NetnsCluster":
        try:
            self._make_network()
            self._start_ray()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _make_network(self) -> None:
        _ip("netns", "add", self.hub)
        self._created.append(self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for index, (name, address) in enumerate(zip(self.names, self.addresses)):
            _ip("netns", "add", name)
            self._created.append(name)
            _ip("link", "add", f"vh{index}", "netns", self.hub, "type", "veth", "peer", "name", DEVICE, "netns", name)
            _ip("-n", self.hub, "link", "set", f"vh{index}", "master", "br0", "up")
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", DEVICE)
            _ip("-n", name, "link", "set", DEVICE, "up")
            _ip("-n", name, "link", "set", "lo", "up")

    def _start_ray(self) -> None:
        # A dead node is noticed within about 3 s (Ray's default is about 15 s). No idle workers
        # started ahead of a driver's first task, and no log monitors: the drivers run with
        # log_to_driver=False (the logs stay in each node's session directory), and on two
        # cores these processes cost a node seconds of CPU while its neighbours start.
        env = _namespace_env(
            RAY_health_check_period_ms="1000", RAY_health_check_failure_threshold="3", RAY_prestart_worker_first_driver="0"
        )
        ray_cli = [
            sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats", f"--num-cpus={self.num_cpus}",
            "--include-log-monitor=false",
        ]
        for index, (name, address) in enumerate(zip(self.names, self.addresses)):
            role = ["--head", f"--port={self.head_port}", "--include-dashboard=false"] if index == 0 else [f"--address={self.head_address}"]
            # Each node its own temporary directory: raylets started together would otherwise
            # race for the same socket names.
            command = [
                "ip", "netns", "exec", name, *ray_cli, *role, f"--node-ip-address={address}",
                f"--temp-dir=/tmp/ray-{name}", f"--resources={json.dumps(self.resources[index])}",
            ]
            self.ray_processes[name] = subprocess.Popen(
                command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env
            )
            if index == 0:
                self._wait_for_head()
        self.wait_for_nodes(len(self.names))

    def _wait_for_head(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            probe = subprocess.run(
                ["ip", "netns", "exec", self.names[0], sys.executable, "-c",
                 f"import socket; socket.create_connection(('{self.addresses[0]}', {self.head_port}), timeout=1)"],
                capture_output=True,
            )
            if probe.returncode == 0:
                return
            time.sleep(0.5)
        raise AssertionError("the Ray head did not come up")

    def wait_for_nodes(self, count: int, timeout_s: float = 90) -> None:
        # One driver that polls, not one per poll: joining as a driver costs seconds of CPU.
        script = (
            "import ray, sys, time; ray.init(address=sys.argv[1], log_to_driver=False); "
            "deadline = time.monotonic() + float(sys.argv[3])\n"
            "while sum(1 for n in ray.nodes() if n['Alive']) < int(sys.argv[2]) and time.monotonic() < deadline: time.sleep(0.1)\n"
            "print(sum(1 for n in ray.nodes() if n['Alive']))"
        )
        alive = self.run(0, [sys.executable, "-c", script, self.head_address, str(count), str(timeout_s)], check=False).stdout.strip().splitlines()
        if not (alive and alive[-1].isdigit() and int(alive[-1]) >= count):
            raise AssertionError(f"fewer than {count} Ray nodes came up ({alive[-1:] or 'no answer'})")

    def run(self, node: int, command: list[str], check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        env = _namespace_env(**kwargs.pop("env", {}))
        return subprocess.run(["ip", "netns", "exec", self.names[node], *command], check=check, capture_output=True, text=True, env=env, **kwargs)

    def popen(self, node: int, command: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.names[node], *command], env=_namespace_env(), **kwargs)

    def device_bytes(self, node: int) -> tuple[int, int]:
        """(sent, received) bytes of the node's interface so far."""
        out = subprocess.run(["ip", "-s", "-j", "-n", self.names[node], "link", "show", "dev", DEVICE], check=True, capture_output=True, text=True)
        stats = json.loads(out.stdout)[0]["stats64"]
        return stats["tx"]["bytes"], stats["rx"]["bytes"]

    def kill_node(self, node: int) -> int:
        """Kill every process of a node (its raylet and every worker on it); return how many."""
        pids = [int(p) for p in subprocess.run(["ip", "netns", "pids", self.names[node]], capture_output=True, text=True).stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(pids)

    def close(self) -> None:
        for name in self.names:
            if name in self._created:
                self.kill_node(self.names.index(name))
        for process in self.ray_processes.values():
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for name in reversed(self._created):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._created.clear()
        for name in self.names:
            shutil.rmtree(f"/tmp/ray-{name}", ignore_errors=True)
