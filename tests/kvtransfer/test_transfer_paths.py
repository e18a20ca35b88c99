"""Which way a pair's KV goes (kvtransfer.path), and what the writer counts on that path."""

from __future__ import annotations

import time

import torch

from kvtransfer.agent import KVAgent, KVTransferConfig
from kvtransfer.layout import KVCompat
from kvtransfer.path import describe_path, host_id, local_device_toward


def test_a_peer_on_this_host_is_shared_memory_unless_ucx_tls_rules_it_out():
    assert str(describe_path("nixl", host_id(), "127.0.0.1", ucx_tls=None, ucx_devices="lo")) == "shm"
    assert str(describe_path("nixl", host_id(), "127.0.0.1", ucx_tls="tcp", ucx_devices="lo")) == "tcp/lo"
    assert describe_path("nixl", host_id(), "127.0.0.1", ucx_tls="sm,self").transport == "shm"


def test_a_peer_on_another_host_goes_through_the_device_that_routes_to_it():
    path = describe_path("nixl", "another-host/boot", "127.0.0.1", ucx_tls=None, ucx_devices="lo")
    assert (path.transport, path.device, path.same_host) == ("tcp", "lo", False)
    assert local_device_toward("127.0.0.1") == "lo"
    assert describe_path("ray", "another-host/boot", "127.0.0.1").transport == "ray"


def _paths_after_a_push(transports: str | None) -> dict:
    compat = KVCompat("m", "float32", 2, 1, 4, 8)
    config = KVTransferConfig(network_devices="lo", transports=transports)
    sender = KVAgent("P-path", torch.randn(16, *compat.block_shape()), compat, config, address="127.0.0.1")
    receiver = KVAgent("D-path", torch.zeros(16, *compat.block_shape()), compat, config, address="127.0.0.1")
    try:
        sender.connect(receiver.handshake_offer())
        destination = receiver.reserve("r", [3, 4, 5])
        num_bytes, _ = sender.write_cost(destination, [1, 2, 3], [3, 4, 5])
        sender.push("r", destination, [1, 2, 3], [3, 4, 5], 3)
        deadline = time.monotonic() + 10
        while not any(e.finished for e in sender.poll_sends()) and time.monotonic() < deadline:
            receiver.poll_receives()
            time.sleep(0.005)
        (stats,) = sender.path_stats()
        return {"stats": stats, "expected_bytes": num_bytes}
    finally:
        sender.close()
        receiver.close()


def test_the_writer_counts_bytes_writes_and_time_per_peer_and_path(ray_session):
    # In a worker process: NIXL's native libraries must not share the test process with
    # grpc_tools' protoc extension; and UCX_TLS is read once per process.
    result = ray_session.get(ray_session.remote(_paths_after_a_push).remote("tcp"))
    stats = result["stats"]
    assert (stats.peer, stats.transport, stats.device) == ("D-path", "tcp", "lo")
    assert stats.num_writes == 1 and stats.num_failures == 0
    assert stats.num_bytes == result["expected_bytes"] == 3 * 2 * 1 * 2 * 4 * 8 * 4
    assert 0 < stats.write_seconds < 10
