"""Who may call the router: bearer tokens, TLS, Admin on its own loopback port, loopback-only
listeners in local mode, and a configuration that refuses to expose the API unauthenticated."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.config import ConfigError, load_config
from cluster.pools import DeploymentSpec, PoolSpec
from router.api.pdserve.v1 import generation_pb2 as pb
from router.api.pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.config import RouterConfig
from router.metrics import Metrics
from router.security import AUTH_TOKEN_ENV, client_channel
from tests.serving import HostedRouter, engine_config

TOKEN = "s3cret-token-for-tests"


def _hosted(e2e_model, **router_fields) -> HostedRouter:
    """A router with no workers: enough to see who gets past its door."""
    spec = DeploymentSpec(
        model_path=e2e_model.path,
        prefill=PoolSpec(0, engine_config(), num_cpus=0.5),
        decode=PoolSpec(0, engine_config(), num_cpus=0.5),
        router=RouterConfig(**router_fields),
    )
    return HostedRouter(spec)


def _code(call) -> grpc.StatusCode | None:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    return None


def _model_info(channel) -> object:
    return pb_grpc.GenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=5)


def _scale(channel) -> object:
    return pb_grpc.AdminStub(channel).ScalePool(pb.ScalePoolRequest(role=pb.WORKER_ROLE_PREFILL, replicas=1), timeout=5)


def test_with_a_token_every_generation_and_admin_call_needs_it_and_health_stays_open(e2e_model):
    hosted = _hosted(e2e_model, auth_token=TOKEN)
    try:
        with grpc.insecure_channel(hosted.address) as anonymous, grpc.insecure_channel(hosted.admin_address) as anonymous_admin:
            assert _code(lambda: _model_info(anonymous)) == grpc.StatusCode.UNAUTHENTICATED
            request = pb.GenerateRequest(prompt_token_ids=[5, 6])
            assert _code(lambda: list(pb_grpc.GenerationStub(anonymous).Generate(request, timeout=5))) == grpc.StatusCode.UNAUTHENTICATED
            assert _code(lambda: _scale(anonymous_admin)) == grpc.StatusCode.UNAUTHENTICATED
            health = health_pb2_grpc.HealthStub(anonymous).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING  # open to probes: no worker yet
        with client_channel(hosted.address, "wrong-token") as wrong:
            assert _code(lambda: _model_info(wrong)) == grpc.StatusCode.UNAUTHENTICATED
        with client_channel(hosted.address, TOKEN) as good, client_channel(hosted.admin_address, TOKEN) as good_admin:
            assert _model_info(good).vocab_size == e2e_model.vocab_size
            # Past the door: the servicer answers (this router has no pool manager to scale).
            assert _code(lambda: _scale(good_admin)) == grpc.StatusCode.UNAVAILABLE
    finally:
        hosted.close()


def test_admin_listens_on_its_own_port_only_and_can_be_turned_off(e2e_model):
    hosted = _hosted(e2e_model)
    try:
        assert hosted.admin_address is not None and hosted.admin_address != hosted.address
        with grpc.insecure_channel(hosted.address) as channel:
            assert _code(lambda: _scale(channel)) == grpc.StatusCode.UNIMPLEMENTED, "no Admin on the Generate port"
        with grpc.insecure_channel(hosted.admin_address) as admin:
            assert _code(lambda: _scale(admin)) == grpc.StatusCode.UNAVAILABLE  # served: no pool manager here
    finally:
        hosted.close()
    off = _hosted(e2e_model, admin_port=None)
    try:
        assert off.admin_address is None and off.front_ends.admin_server is None
    finally:
        off.close()


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback")
def test_listeners_on_ipv6_hosts_serve_there_and_name_their_address_with_brackets(e2e_model):
    """An IPv6 host (``::1``, or written ``[::1]`` as in a URL) binds gRPC, Admin, the OpenAI API
    and /metrics: gRPC took ``::1:port`` for IPv4 0.1.0.0 and refused it, aiohttp and the
    metrics server refused the brackets."""
    hosted = _hosted(e2e_model, host="::1", admin_host="[::1]", http_host="[::1]")
    try:
        generate, admin = f"[::1]:{hosted.front_ends.port}", f"[::1]:{hosted.front_ends.admin_port}"
        with grpc.insecure_channel(generate) as channel, grpc.insecure_channel(admin) as admin_channel:
            assert _model_info(channel).vocab_size == e2e_model.vocab_size
            assert _code(lambda: _scale(admin_channel)) == grpc.StatusCode.UNAVAILABLE  # served: no pool manager here
        with grpc.insecure_channel(hosted.address) as ipv4:  # (127.0.0.1: nothing listens there)
            assert _code(lambda: _model_info(ipv4)) == grpc.StatusCode.UNAVAILABLE
        client = openai.OpenAI(base_url=f"http://[::1]:{hosted.http_port}/v1", api_key="unused", max_retries=0)
        assert [model.id for model in client.models.list()] == [e2e_model.path.name]
        with pytest.raises(OSError, match=rf"^router\.port: cannot listen on \[::1\]:{hosted.front_ends.port} \(the port is in use"):
            _hosted(e2e_model, host="::1", port=hosted.front_ends.port, admin_port=0)
    finally:
        hosted.close()
    metrics = Metrics("m")
    port = metrics.serve(0, "[::1]")
    assert 'model_name="m"' in urllib.request.urlopen(f"http://[::1]:{port}/metrics", timeout=10).read().decode()


def _self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    return cert, key


def test_with_a_certificate_the_listeners_speak_tls_only(e2e_model, tmp_path):
    cert, key = _self_signed_certificate(tmp_path)
    hosted = _hosted(e2e_model, tls_cert_file=cert, tls_key_file=key, auth_token=TOKEN)
    try:
        with client_channel(hosted.address, TOKEN, ca_file=cert) as secure:
            assert _model_info(secure).vocab_size == e2e_model.vocab_size
        with client_channel(hosted.admin_address, TOKEN, ca_file=cert) as secure_admin:
            assert _code(lambda: _scale(secure_admin)) == grpc.StatusCode.UNAVAILABLE
        with client_channel(hosted.address, TOKEN) as plaintext:
            assert _code(lambda: _model_info(plaintext)) == grpc.StatusCode.UNAVAILABLE, "no plaintext answer"
    finally:
        hosted.close()


@pytest.mark.parametrize(
    "router_section, message",
    [
        ("  host: 0.0.0.0\n", "router.host: 0.0.0.0 is reachable from other machines"),
        ("  admin_host: 0.0.0.0\n", "router.admin_host: 0.0.0.0 is reachable from other machines"),
        ("  tls_cert_file: /nonexistent/cert.pem\n  tls_key_file: /nonexistent/key.pem\n", "does not exist"),
        ("  tls_cert_file: /etc/hostname\n", "give both or neither"),
    ],
)
def test_config_refuses_an_exposed_router_without_a_token(tmp_path, monkeypatch, router_section, message):
    monkeypatch.delenv(AUTH_TOKEN_ENV, raising=False)
    path = tmp_path / "pdserve.yaml"
    path.write_text("router:\n" + router_section)
    with pytest.raises(ConfigError) as info:
        load_config(path, {})
    assert message in str(info.value)


def test_config_exposes_the_router_with_a_token_and_passes_it_to_the_router(tmp_path, monkeypatch):
    monkeypatch.delenv(AUTH_TOKEN_ENV, raising=False)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    path = tmp_path / "pdserve.yaml"
    path.write_text(f"router:\n  host: 0.0.0.0\n  auth_token_file: {token_file}\n")
    assert load_config(path, {}).to_spec().router.auth_token == TOKEN
    monkeypatch.setenv(AUTH_TOKEN_ENV, "from-the-environment")
    path.write_text("router:\n  host: 0.0.0.0\n")
    assert load_config(path, {}).to_spec().router.auth_token == "from-the-environment"
    assert TOKEN not in repr(load_config(path, {}).to_spec().router), "the token stays out of logs"


def _listening_sockets(root_pid: int) -> list[tuple[str, str]]:
    """(local address, process name) of every TCP listener held by ``root_pid`` or its descendants."""
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            names[int(entry.name)] = stat[stat.index("(") + 1 : stat.rindex(")")]
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
    pids, stack = set(), [root_pid]
    while stack:
        pid = stack.pop()
        pids.add(pid)
        stack.extend(children.get(pid, []))
    inode_owner: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in (Path("/proc") / str(pid) / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inode_owner[target[8:-1]] = pid
        except OSError:
            continue
    listeners = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inode_owner:  # LISTEN
                listeners.append((_address(fields[1].split(":")[0], width), names.get(inode_owner[fields[9]], "?")))
    return listeners


def _address(hex_ip: str, width: int) -> str:
    raw = bytes.fromhex(hex_ip)
    if width == 8:
        return ".".join(str(b) for b in raw[::-1])
    words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]  # each 32-bit word is little-endian
    flat = b"".join(words)
    if flat[:12] == b"\0" * 10 + b"\xff\xff":
        return ".".join(str(b) for b in flat[12:])  # IPv4-mapped
    return ":".join(flat[i : i + 2].hex() for i in range(0, 16, 2))


@pytest.mark.e2e
def test_up_in_the_foreground_listens_on_loopback_only_serves_and_stops_when_interrupted(e2e_model, tmp_path):
    """`pdserve up` without a Ray address, in the foreground: Ray's GCS, raylet, workers and agents,
    the router, Admin, metrics and NIXL's UCX in the actors all bind loopback (nothing listens on
    another interface); the address is printed once the router serves, it generates, and an
    interrupt stops everything and removes the state file; ``--log-level info`` reaches the
    workers, whose engines say what they run on. (One deployment for both: a start is
    the slow part.)"""
    from tests.cluster.test_cli import PDSERVE, _run

    state = tmp_path / "state.json"
    env = {k: v for k, v in os.environ.items() if k not in ("UCX_NET_DEVICES", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    process = subprocess.Popen(
        [*PDSERVE, "--log-level", "info", "--state-file", str(state), "up", "--model", str(e2e_model.path), "--port", "0",
         "--metrics-port", "0", "--http-port", "0", "--admin-port", "0", "--prefill", "1", "--decode-cpus", "0.5",
         "--prefill-cpus", "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
    )
    try:
        line = ""
        while not line.startswith("pdserve serving on "):  # Ray relays worker logs to stdout too
            line = process.stdout.readline()
            assert line or process.poll() is None, process.stderr.read()
        address = line.split()[3]
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING, "the address is printed only once the router serves"
        generated = _run("generate", "hello", "--address", address, "--max-tokens", "4", "--ignore-eos", state_file=state)
        assert generated.stdout.startswith("hello")
        listeners = _listening_sockets(process.pid)  # the agents started alongside the workers long before
        names = {name for _, name in listeners}
        assert {"gcs_server", "raylet"} <= names and any(n.startswith("ray::KVSized") for n in names), listeners
        exposed = [(a, n) for a, n in listeners if not (a.startswith("127.") or a == "0000:0000:0000:0000:0000:0000:0000:0001")]
        assert not exposed, f"listening beyond loopback: {exposed}"
    finally:
        os.killpg(process.pid, signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr[-3000:]
    assert not state.exists()
    # --log-level info reaches the workers: each says what its engine runs on.
    engines = [line for line in stderr.splitlines() if "engine ready:" in line]
    assert len(engines) == 2 and all("attention cpu, CUDA graphs off" in line for line in engines), stderr[-3000:]


def test_a_certificate_for_a_dns_name_is_checked_against_the_name_given(tmp_path):
    """A router with a certificate for a DNS name, reached by its IP (what `up` advertises): the
    check failed on the address, so `up`'s readiness probe never saw SERVING and tore the
    deployment down. router.tls_server_name (or $PDSERVE_TLS_SERVER_NAME) names what the
    certificate is checked against."""
    from concurrent import futures

    from grpc_health.v1 import health

    from cluster.cli import _wait_until_serving

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=router.example.test",
         "-addext", "subjectAltName=DNS:router.example.test", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())]))
    server.start()
    try:
        address = f"127.0.0.1:{port}"
        assert not _wait_until_serving(address, 1.0, cert)
        assert _wait_until_serving(address, 10.0, cert, "router.example.test")
        with client_channel(address, None, cert, "router.example.test") as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(None)
