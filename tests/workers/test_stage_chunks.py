"""A pipeline stage's activations handed on over Ray (``workers.pipeline.StageChunk``): host
arrays on the way, tensors of the receiving engine's dtype and device on arrival, bit for bit,
less the tokens the next stage holds cached."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.model import StageActivations
from workers.pipeline import StageChunk

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_a_chunk_crosses_as_host_arrays_and_arrives_exact_on_the_engines_device(device, dtype, with_residual):
    hidden = torch.randn(9, 16, dtype=dtype, device=device)
    residual = torch.randn_like(hidden) if with_residual else None
    chunk = StageChunk.of("req", 3, 32, StageActivations(hidden, residual), skip=4)
    assert (chunk.start, chunk.num_tokens) == (36, 5)
    assert isinstance(chunk.hidden, np.ndarray) and (chunk.residual is None) == (not with_residual)
    # Arrays from Ray's object store are read-only: the engine's copy must be writable.
    chunk.hidden.flags.writeable = False
    back = chunk.activations(device)
    assert back.hidden.device.type == device and back.hidden.dtype == dtype and torch.equal(back.hidden, hidden[4:])
    back.hidden.add_(1)  # the layers update activations in place
    if with_residual:
        assert torch.equal(back.residual, residual[4:])
    else:
        assert back.residual is None
