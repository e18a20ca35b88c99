"""Host values to a device, and device values to the host, without waiting for the stream.

``torch.tensor(values, device="cuda")`` and ``tensor.to("cuda")`` copy from pageable memory and
then synchronize the stream: the host waits for every kernel queued before the copy. Run one step
at a time that costs a few microseconds; with overlapped steps (engine.overlap) it would make the
host wait for the step in flight and undo the overlap. Here a CUDA copy goes through pinned
memory with ``non_blocking``: torch's pinned allocator keeps the buffer until the copy has run.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(values: list | np.ndarray | torch.Tensor, dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """``values`` as a ``dtype`` tensor on ``device`` (on a CPU, without a copy where it can)."""
    if isinstance(values, np.ndarray):
        host = torch.from_numpy(np.ascontiguousarray(values))
    elif isinstance(values, torch.Tensor):
        host = values
    else:
        host = torch.tensor(values, dtype=dtype)
    host = host.to(dtype)
    if torch.device(device).type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def to_host(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A host copy of a CUDA ``tensor`` into pinned memory, started without waiting: valid once the
    stream has reached it (an event recorded after it says when). Anything else is returned as is."""
    if tensor is None or tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)
