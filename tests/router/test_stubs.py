"""The committed gRPC stubs are exactly what the committed .proto files generate, and import cleanly."""

from __future__ import annotations

import importlib.metadata

import pytest

from router.api import generate_stubs

pytest.importorskip("grpc_tools")


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    written = generate_stubs.generate(tmp_path)
    fresh = {p.relative_to(tmp_path): p.read_bytes() for p in written}
    committed_dir = generate_stubs.REPO_ROOT / generate_stubs.PACKAGE_PREFIX
    committed = {
        p.relative_to(generate_stubs.REPO_ROOT): p.read_bytes() for p in generate_stubs.generated_files(committed_dir)
    }
    hint = (
        "run `python -m router.api.generate_stubs` and commit the result "
        f"(grpcio-tools {importlib.metadata.version('grpcio-tools')}, "
        f"protobuf {importlib.metadata.version('protobuf')})"
    )
    assert sorted(fresh) == sorted(committed), f"stub files differ: {hint}"
    stale = [str(path) for path in fresh if fresh[path] != committed[path]]
    assert not stale, f"stale stubs {stale}: {hint}"


def test_stubs_import_as_a_package_and_expose_the_api():
    from router.api.pdserve.v1 import generation_pb2, generation_pb2_grpc

    services = generation_pb2.DESCRIPTOR.services_by_name
    assert set(services["Generation"].methods_by_name) == {"Generate", "GetModelInfo", "GetClusterStatus"}
    assert set(services["Admin"].methods_by_name) == {"ScalePool", "DrainWorker"}
    assert services["Generation"].methods_by_name["Generate"].server_streaming
    assert generation_pb2.DESCRIPTOR.package == "pdserve.v1"
    assert hasattr(generation_pb2_grpc, "add_GenerationServicer_to_server")
    assert hasattr(generation_pb2_grpc, "add_AdminServicer_to_server")
