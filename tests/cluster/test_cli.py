"""The pdserve CLI as a user types it, in subprocesses, on local Ray clusters."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from cluster.cli import _stop_pid, process_alive
from tests.checkpoints import hf_greedy

PDSERVE = [sys.executable, "-m", "cluster.cli"]


def _run(*args: str, state_file: Path, timeout: float = 180, check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [*PDSERVE, "--state-file", str(state_file), *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **env} if env else None,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"pdserve {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


@pytest.mark.e2e
def test_up_generate_status_scale_survive_a_controller_crash_down_detached(e2e_model, tmp_path):
    state = tmp_path / "state.json"
    # Fixed ports, as in production: the restarted controller listens on them again.
    port, admin_port = _free_port(), _free_port()
    up = _run("up", "--detach", "--model", str(e2e_model.path), "--port", str(port), "--admin-port", str(admin_port),
              "--metrics-port", "0", "--http-port", "0",
              "--prefill-cpus", "0.5", "--decode-cpus", "0.5", "--disaggregation", "always", state_file=state)
    try:
        assert "pdserve serving on 127.0.0.1:" in up.stdout
        recorded = json.loads(state.read_text())
        assert recorded["router_address"] in up.stdout
        # Another `up` on its ports is told of the deployment, not of a port clash.
        again = _run("up", "--detach", "--port", str(port), state_file=state, check=False)
        assert again.returncode == 2 and "run `pdserve down` first" in again.stderr

        prompt = "The quick brown fox"
        generated = _run("generate", prompt, "--max-tokens", "10", "--ignore-eos", state_file=state)
        tokenizer = AutoTokenizer.from_pretrained(e2e_model.path)
        ids = tokenizer(prompt)["input_ids"]
        expected = tokenizer.decode(hf_greedy(e2e_model.hf_model, ids, 10), skip_special_tokens=True)
        assert generated.stdout == prompt + expected + "\n"
        # The same through the OpenAI API whose address `up` printed.
        assert f"OpenAI API on http://{recorded['http_address']}/v1" in up.stdout
        body = json.dumps({"prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}).encode()
        request = urllib.request.Request(f"http://{recorded['http_address']}/v1/completions", data=body, method="POST")
        with urllib.request.urlopen(request, timeout=60) as response:
            assert json.loads(response.read())["choices"][0]["text"] == expected

        table = _run("status", state_file=state).stdout.splitlines()
        assert table[0].split() == ["WORKER", "ROLE", "STATE", "QUEUE", "KV", "USED", "RUNNING", "EPOCH", "NODE", "RANKS"]
        rows = {line.split()[0]: line.split() for line in table[1:]}
        assert set(rows) == {"prefill-0", "decode-0"}
        assert rows["prefill-0"][1:3] == ["prefill", "ready"] and rows["decode-0"][1:3] == ["decode", "ready"]
        assert rows["prefill-0"][-1] == rows["decode-0"][-1] == "1"  # one tensor-parallel rank each

        assert _run("scale", "--decode", "2", state_file=state).stdout.strip() == "decode: 1 -> 2"
        rows = [line.split() for line in _run("status", state_file=state).stdout.splitlines()[1:]]
        assert sorted(r[0] for r in rows) == ["decode-0", "decode-1", "prefill-0"]
        epochs = {r[0]: r[6] for r in rows}

        # The controller's process dies: Ray restarts it, the new one adopts every worker.
        (controller,) = _processes_named("ray::Controller", session=recorded["ray_head_pid"])
        os.kill(controller, signal.SIGKILL)
        deadline = time.monotonic() + 150
        while True:
            status = _run("status", state_file=state, check=False)
            if status.returncode == 0 and process_alive(controller) is False:
                break
            assert time.monotonic() < deadline, status.stderr
            time.sleep(0.5)
        rows = [line.split() for line in status.stdout.splitlines()[1:]]
        assert {r[0]: r[6] for r in rows} == epochs, "the same workers (same epochs), none launched anew"
        assert _run("generate", prompt, "--max-tokens", "10", "--ignore-eos", state_file=state).stdout == prompt + expected + "\n"
    finally:
        down = _run("down", state_file=state, check=False)
    assert down.returncode == 0 and "pdserve stopped" in down.stdout
    assert not state.exists()
    assert not process_alive(recorded["ray_head_pid"]), "the Ray head that `up --detach` started is gone too"
    assert not _processes_named("gcs_server", session=recorded["ray_head_pid"]), "and every process of it"


def test_version():
    from importlib.metadata import version

    assert _run("--version", state_file=Path("unused")).stdout.strip() == f"pdserve {version('pdserve')}"


def test_commands_that_talk_to_a_deployment_start_without_torch():
    """`status`, `scale`, `down`, `--version`: parsing their command line imports no torch (the
    benchmark scenarios' flags did, ~3 s of every call on a 2-core host); `bench-scenario`
    still gets its scenarios' flags."""
    probe = ("import sys; from cluster.cli import build_parser; "
             "build_parser(scenarios=False).parse_args(['status']); print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip() == "False"
    from cluster.cli import build_parser

    assert build_parser(scenarios=True).parse_args(["bench-scenario", "disaggregation"]).scenario == "disaggregation"


# One error from the file and one from a flag: each case is a process start (4 s of CPU here);
# the other kinds of error are read in-process (tests/cluster/test_config.py).
@pytest.mark.parametrize(
    "config_text, flags, message",
    [
        ("decode:\n  replicas: -1\n", [], "decode.replicas"),
        ("", ["--block-size", "0"], "block_size"),
    ],
)
def test_config_errors_name_the_field_and_start_nothing(tmp_path, config_text, flags, message):
    config = tmp_path / "pdserve.yaml"
    config.write_text(config_text)
    started = time.monotonic()
    result = _run("up", "--config", str(config), *flags, state_file=tmp_path / "state.json", check=False, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr
    assert time.monotonic() - started < 30, "refused before starting Ray"
    assert "pdserve serving" not in result.stdout


def test_a_taken_port_fails_up_with_the_field_named_and_leaves_nothing_running(e2e_model, tmp_path):
    state = tmp_path / "state.json"
    # Every process `up` starts inherits this tag: what is left of them is found by it, whatever
    # else (another test process's Ray) runs on the machine.
    tag = f"test-{os.getpid()}-{time.monotonic_ns()}"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        result = _run("up", "--detach", "--model", str(e2e_model.path), "--port", "0", "--admin-port", str(port),
                      "--metrics-port", "0", "--http-port", "0", "--prefill", "0", "--decode-cpus", "0.5",
                      state_file=state, check=False, env={_TAG_ENV: tag})
        elapsed = time.monotonic() - started
    assert result.returncode == 1
    message = result.stderr.strip().splitlines()
    assert message == [f"pdserve up: router.admin_port: cannot listen on 127.0.0.1:{port} (the port is in use, or the host is not "
                       "an address of this machine); give another port, or 0 for any free one"]
    assert elapsed < 20, "refused before a Ray head, the controller or a worker started"
    assert not state.exists()
    assert _processes_tagged(tag) == [], "no process of `up` (a Ray head, a worker) left behind"


def test_up_on_this_machine_refuses_workers_it_has_no_room_for_and_leaves_nothing_running(e2e_model, tmp_path):
    """GPUs on a machine without any (or more than it has): refused once its Ray is up, naming
    the fields, where the workers waited startup_timeout_s (300 s) for room that never comes."""
    import torch

    state = tmp_path / "state.json"
    tag = f"test-{os.getpid()}-{time.monotonic_ns()}"
    gpus = torch.cuda.device_count() + 1
    started = time.monotonic()
    result = _run("up", "--detach", "--model", str(e2e_model.path), "--port", "0", "--admin-port", "0", "--metrics-port", "0",
                  "--http-port", "0", "--prefill", "0", "--decode", str(gpus), "--decode-gpus", "1", "--decode-cpus", "0.5",
                  state_file=state, check=False, env={_TAG_ENV: tag})
    elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"pdserve up: decode.num_gpus = 1 for {gpus} workers need {gpus} GPU, this machine's Ray has {gpus - 1}; "
        "lower them, or start with --address to join a cluster that has them"
    ]
    assert elapsed < 60, "refused once Ray was up, before any worker waited"
    assert not state.exists()
    assert _processes_tagged(tag) == [], "the Ray head `up` started is stopped"


def test_a_port_taken_after_up_looked_fails_the_router_with_the_field_named(e2e_model):
    """The router's own bind (a port taken between ``up``'s look and the router's start) names
    the field the same way."""
    from cluster.deployment import DeploymentSpec, PoolSpec
    from router.config import RouterConfig
    from tests.serving import HostedRouter, engine_config

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        spec = DeploymentSpec(model_path=e2e_model.path, prefill=PoolSpec(0, engine_config()), decode=PoolSpec(1, engine_config()),
                              router=RouterConfig(port=0, http_port=None, admin_port=port))
        with pytest.raises(OSError, match=rf"^router\.admin_port: cannot listen on 127\.0\.0\.1:{port} \(the port is in use"):
            HostedRouter(spec)


def test_up_finds_a_taken_port_on_an_ipv6_host_and_names_it_with_brackets(tmp_path):
    from cluster.cli import _port_taken
    from cluster.config import load_config

    try:
        taken = socket.socket(socket.AF_INET6)
        taken.bind(("::1", 0))
    except OSError:
        pytest.skip("this machine has no IPv6 loopback")
    with taken:
        taken.listen()
        port = taken.getsockname()[1]
        config = tmp_path / "pdserve.yaml"
        config.write_text(f"router: {{host: '[::1]', port: {port}, admin_port: 0, http_port: 0, metrics_port: null}}\n")
        assert _port_taken(load_config(config, {})) == (
            f"router.port: cannot listen on [::1]:{port} (the port is in use, or the host is not an address of this machine); "
            "give another port, or 0 for any free one"
        )
    # Free again: a bracketed host is bound without its brackets (the lookup of "[::1]" failed,
    # which read as a taken port).
    config.write_text(f"router: {{host: '[::1]', port: {port}, admin_port: 0, http_port: 0, metrics_port: null}}\n")
    assert _port_taken(load_config(config, {})) is None


@pytest.mark.e2e
def test_prefill_and_decode_on_different_nodes_of_a_two_node_cluster(e2e_model, tmp_path):
    """Two raylets on this machine, each with a resource that pins one pool to it."""
    head_port = _free_port()
    nodes = []
    state = tmp_path / "state.json"
    ray_cli = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats", "--num-cpus=2"]
    # Both raylets use Ray's token auth (its default for local clusters); the worker node
    # must be told, or the head refuses it.
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    try:
        nodes.append(subprocess.Popen([*ray_cli, "--head", f"--port={head_port}", "--node-ip-address=127.0.0.1",
                                       "--include-dashboard=false", '--resources={"prefill_node": 4}'],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env))
        _wait_for_port(head_port)
        nodes.append(subprocess.Popen([*ray_cli, f"--address=127.0.0.1:{head_port}", "--node-ip-address=127.0.0.1",
                                       '--resources={"decode_node": 4}'],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env))
        config = tmp_path / "two_nodes.yaml"
        config.write_text(
            f"model: {e2e_model.path}\n"
            "router: {port: 0, admin_port: 0, metrics_port: null, http_port: null, disaggregation: always}\n"
            "prefill: {replicas: 1, num_cpus: 0.5, resources: {prefill_node: 1}}\n"
            "decode: {replicas: 1, num_cpus: 0.5, resources: {decode_node: 1}}\n"
        )
        # Actors wait for the second node's resource if it is still registering.
        up = _run("up", "--detach", "--config", str(config), "--address", f"127.0.0.1:{head_port}", state_file=state, check=False)
        assert up.returncode == 0, up.stderr
        rows = {line.split()[0]: line.split() for line in _run("status", state_file=state).stdout.splitlines()[1:]}
        assert rows["prefill-0"][7] != rows["decode-0"][7], "prefill and decode run on different Ray nodes"
        generated = _run("generate", "The quick brown fox", "--max-tokens", "8", "--ignore-eos", state_file=state)
        tokenizer = AutoTokenizer.from_pretrained(e2e_model.path)
        ids = tokenizer("The quick brown fox")["input_ids"]
        expected = tokenizer.decode(hf_greedy(e2e_model.hf_model, ids, 8), skip_special_tokens=True)
        assert generated.stdout == "The quick brown fox" + expected + "\n"
    finally:
        _run("down", state_file=state, check=False)
        for node in reversed(nodes):  # stopped as `pdserve down` stops the head it started
            _stop_pid(node.pid)
            node.wait(timeout=60)


def _processes_named(name: str, session: int | None = None) -> list[int]:
    """Pids of the running processes called ``name`` in the process session ``session`` (None:
    in any). A zombie is not one: it has ended, and waits only for its parent to collect it."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        if comm == name[:15] and fields[0] != "Z" and session in (None, int(fields[3])):
            found.append(int(entry.name))
    return found


_TAG_ENV = "PDSERVE_TEST_TAG"


def _processes_tagged(tag: str) -> list[int]:
    """Pids of the live processes whose environment carries ``PDSERVE_TEST_TAG=tag``."""
    wanted = f"{_TAG_ENV}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environment = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if wanted in environment and process_alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_port(port: int, timeout_s: float = 60) -> None:
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"nothing listens on {port}")


def test_generate_refuses_a_model_directory_without_a_tokenizer_before_starting_anything(e2e_model, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((e2e_model.path / "config.json").read_text())
    result = _run("generate", "hello", "--model", str(model), state_file=tmp_path / "none.json", check=False, timeout=60)
    assert result.returncode == 2 and "no tokenizer.json" in result.stderr


def test_generate_chat_refuses_a_model_without_a_chat_template_before_starting_anything(tmp_path):
    """The built-in model has none: a whole local deployment started, then the request failed
    advising /v1/completions (an HTTP route, to a gRPC client)."""
    result = _run("generate", "--chat", "hello", state_file=tmp_path / "none.json", check=False, timeout=60)
    assert result.returncode == 2 and "has no chat template" in result.stderr and "leave --chat out" in result.stderr


def test_generate_refuses_a_model_the_engine_does_not_serve_before_starting_anything(e2e_model, tmp_path):
    """A checkpoint of an architecture the engine refuses started a local deployment whose
    workers failed, with their traceback."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(e2e_model.path, model)
    config = json.loads((model / "config.json").read_text())
    config.update(architectures=["GPTBigCodeForCausalLM"], model_type="gpt_bigcode")
    (model / "config.json").write_text(json.dumps(config))
    result = _run("generate", "hello", "--model", str(model), state_file=tmp_path / "none.json", check=False, timeout=60)
    assert result.returncode == 2 and "GPTBigCode" in result.stderr and "Traceback" not in result.stderr


def test_a_detached_head_whose_port_was_taken_meanwhile_starts_on_another(monkeypatch, capsys):
    """`up --detach` picks a free port for its Ray head, which binds it a moment later; a port
    another process took in between makes that head exit, and the next one comes up elsewhere.
    (A fake `ray start` here: a real one takes about 40 s to give up on a taken port; the real
    head is started by the detached test above.)"""
    from cluster import cli

    first, second = cli._free_port(), cli._free_port()
    ports = iter([first, second])
    monkeypatch.setattr(cli, "_free_port", lambda: next(ports))
    heads = []

    class FakeHead:  # the first exits at once (its port taken); the second listens on its port
        def __init__(self, argv, **kwargs):
            self.pid = 1000 + len(heads)
            self.port = int(next(a for a in argv if a.startswith("--port=")).split("=")[1])
            self.listener = None
            if heads:
                self.listener = socket.socket()
                self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                self.listener.bind(("127.0.0.1", self.port))
                self.listener.listen()
            heads.append(self)

        def poll(self):
            return None if self.listener is not None else 1

    monkeypatch.setattr(cli.subprocess, "Popen", FakeHead)
    try:
        assert cli._start_ray_head() == (1001, f"127.0.0.1:{second}")
    finally:
        for head in heads:
            if head.listener is not None:
                head.listener.close()
    assert [h.port for h in heads] == [first, second]
    assert f"ray start --head on port {first} exited (attempt 1 of 3)" in capsys.readouterr().err


def test_down_removes_a_record_whose_deployment_is_gone_and_stops_a_foreground_up(tmp_path):
    """A foreground `up` killed (SIGKILL, its terminal closed) or a detached deployment whose
    machine rebooted left its record behind: `down` refused it ("give --address") or failed
    with a traceback, and kept it, and `up --detach` refused to start while it stayed. A record
    whose process is gone is now removed; a foreground `up` that runs is asked to stop."""
    from cluster.cli import main

    finished = subprocess.Popen(["true"])
    finished.wait()
    state = tmp_path / "state.json"
    for record in ({"router_address": "127.0.0.1:1", "ray_address": None, "ray_head_pid": None, "up_pid": finished.pid},
                   {"router_address": "127.0.0.1:1", "ray_address": "127.0.0.1:6390", "ray_head_pid": finished.pid}):
        state.write_text(json.dumps(record))
        assert main(["--state-file", str(state), "down"]) == 0
        assert not state.exists()
    # A number the record names may be another process's after a reboot (here this test's own):
    # its start time tells, and it is left alone.
    state.write_text(json.dumps({"router_address": "127.0.0.1:1", "ray_address": None, "up_pid": os.getpid(), "up_start": 1}))
    assert main(["--state-file", str(state), "down"]) == 0 and not state.exists()
    serving = subprocess.Popen(["sleep", "60"])  # stands for the foreground `up`: it stops on SIGTERM
    try:
        state.write_text(json.dumps({"router_address": "127.0.0.1:1", "ray_address": None, "ray_head_pid": None, "up_pid": serving.pid}))
        assert main(["--state-file", str(state), "down"]) == 0
        assert serving.wait(5) == -signal.SIGTERM
    finally:
        serving.kill()


@pytest.mark.parametrize("argv, flag", [
    (["scale", "--decode", "-1"], "--decode"),
    (["generate", "x", "--max-tokens", "-1"], "--max-tokens"),
    (["generate", "x", "--top-k", "9999999999"], "--top-k"),
    (["simulate", "--profile", "p", "--workload", "w", "--prefill", "1", "--decode", "1", "--window-s", "0"], "--window-s"),
    (["plan", "--profile", "p", "--workload", "w", "--prefill-cost", "-1"], "--prefill-cost"),
])
def test_out_of_range_numbers_are_refused_naming_the_flag(argv, flag, capsys):
    """They were a protobuf ValueError's traceback (scale, generate), a ZeroDivisionError
    (simulate), or a plan at a negative cost."""
    from cluster.cli import build_parser

    with pytest.raises(SystemExit) as exited:
        build_parser(scenarios=False).parse_args(argv)
    assert exited.value.code == 2 and f"argument {flag}: must be" in capsys.readouterr().err


def test_generate_says_why_a_stream_ended_without_its_answer_and_exits_non_zero(capsys):
    """A stream the cluster ended (decode restarts used up, a drain) printed the text so far
    and exited 0, its reason shown only with --timing."""
    import argparse
    from concurrent import futures

    import grpc

    from cluster.cli import _stream
    from router.api.pdserve.v1 import generation_pb2 as pb
    from router.api.pdserve.v1 import generation_pb2_grpc as pb_grpc

    class CutShort(pb_grpc.GenerationServicer):
        def Generate(self, request, context):
            yield pb.GenerateResponse(text=" par")
            yield pb.GenerateResponse(finish_reason=pb.FINISH_REASON_ERROR, finish_detail="decode restarts used up")

    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_GenerationServicer_to_server(CutShort(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        args = argparse.Namespace(prompt="hello", max_tokens=None, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=None,
                                  repetition_penalty=1.0, stop=[], ignore_eos=False, lora_name="", chat=False, system=None, timing=False)
        assert _stream(args, f"127.0.0.1:{port}") == 1
    finally:
        server.stop(None)
    out, err = capsys.readouterr()
    assert out == "hello par\n" and "ended with error: decode restarts used up" in err
