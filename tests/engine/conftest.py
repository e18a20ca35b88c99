"""Engine test fixtures: one random-weight checkpoint per architecture, built once."""

from __future__ import annotations

import pytest
import torch

from tests.checkpoints import ARCHITECTURES, build_checkpoint

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """arch -> (checkpoint dir, float32 transformers model). Llama is saved sharded."""
    built = {}
    for arch in ARCHITECTURES:
        path = tmp_path_factory.mktemp(f"ckpt_{arch}")
        shard = "100KB" if arch == "llama" else None
        built[arch] = (path, build_checkpoint(arch, path, max_shard_size=shard))
    return built


@pytest.fixture(params=ARCHITECTURES)
def arch_checkpoint(request, checkpoints):
    return checkpoints[request.param]
