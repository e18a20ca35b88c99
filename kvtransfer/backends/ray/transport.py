"""Ray object-store transport: the fallback where NIXL is missing, and the benchmark baseline.

A write puts the source blocks into the object store and hands the reference, with the
notification, to a small mailbox actor the receiving agent owns (it dies with its
owner). The receiver drains its mailbox without blocking when it polls and copies the
bytes into its blocks itself, after checking that the reservation is still live, so a
late write for freed blocks is simply dropped. The writer's "done" means "delivered to
the mailbox"; the bytes land on the receiver's next poll.

This is the only kvtransfer module that imports ray. A write of one piece of each block (a
KV head range) carries just those bytes, and lands them at the piece's offset.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import ray

from kvtransfer.descriptors import BlockRuns
from kvtransfer.errors import BackendUnavailableError, TransportError
from kvtransfer.layout import KVRegion
from kvtransfer.transport import BlockPiece, Incoming, Transport, XferState

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
class _Mailbox:
    """Holds (sender, notification, payload ref) until the owning agent drains it."""

    def __init__(self) -> None:
        self._queue: list[tuple[str, bytes, Any]] = []

    def deliver(self, sender: str, message: bytes, payload: list) -> bool:
        # The ref arrives nested in a list so Ray passes it through instead of fetching it.
        self._queue.append((sender, message, payload[0]))
        return True

    def drain(self) -> list[tuple[str, bytes, Any]]:
        queue, self._queue = self._queue, []
        return queue

    def ready(self) -> bool:
        return True


class RayTransport(Transport):
    kind = "ray"
    receiver_lands = True

    def __init__(self, transport_name: str, kv_cache: torch.Tensor, region: KVRegion) -> None:
        import torch

        if not ray.is_initialized():
            raise BackendUnavailableError("the ray backend needs a connected Ray (inside an actor, or ray.init)")
        self.name = transport_name
        self._region = region
        self._blocks = kv_cache.reshape(-1).view(torch.uint8).view(region.num_blocks, region.bytes_per_block)
        # On CPU a numpy view avoids torch's dispatch per copy; CUDA goes through torch.
        self._blocks_np = self._blocks.numpy() if region.device_kind == "cpu" else None
        self._mailbox: Any = None
        self._draining: Any = None
        self._peers: dict[str, Any] = {}

    def metadata(self) -> bytes:
        if self._mailbox is None:
            self._mailbox = _Mailbox.remote()
            # An offer must be usable at once: wait until the mailbox process is up.
            ray.get(self._mailbox.ready.remote())
        return ray.cloudpickle.dumps(self._mailbox)

    def add_peer(self, transport_name: str, metadata: bytes, region: KVRegion) -> None:
        try:
            self._peers[transport_name] = ray.cloudpickle.loads(metadata)
        except Exception as e:
            raise TransportError(f"unusable ray metadata for {transport_name}: {e}") from e

    def remove_peer(self, transport_name: str) -> None:
        self._peers.pop(transport_name, None)

    def _gather(self, runs: BlockRuns, piece: BlockPiece | None) -> list[np.ndarray]:
        spans = zip(runs.src.tolist(), runs.count.tolist())
        columns = slice(None) if piece is None else slice(piece.src_offset, piece.src_offset + piece.num_bytes)
        if self._blocks_np is not None:
            return [np.ascontiguousarray(self._blocks_np[start : start + count, columns]) for start, count in spans]
        return [self._blocks[start : start + count, columns].cpu().numpy() for start, count in spans]

    def post_write(self, transport_name: str, runs: BlockRuns, notif: bytes, piece: BlockPiece | None = None) -> Any:
        mailbox = self._peers.get(transport_name)
        if mailbox is None:
            raise TransportError(f"no ray peer {transport_name}", peer_lost=True)
        try:
            payload = ray.put(self._gather(runs, piece))
            return mailbox.deliver.remote(self.name, notif, [payload])
        except Exception as e:
            raise TransportError(f"posting a write to {transport_name} failed: {e}", peer_lost=True) from e

    def check(self, handle: Any) -> XferState:
        ready, _ = ray.wait([handle], timeout=0, fetch_local=False)
        if not ready:
            return XferState.IN_PROGRESS
        try:
            ray.get(handle)
            return XferState.DONE
        except Exception:
            logger.warning("ray mailbox delivery failed", exc_info=True)
            return XferState.FAILED

    def release(self, handle: Any) -> bool:
        # Nothing to cancel: an undelivered payload is dropped by the receiver if unwanted.
        return True

    def get_incoming(self) -> list[Incoming]:
        if self._mailbox is None:
            return []
        if self._draining is None:
            self._draining = self._mailbox.drain.remote()
        ready, _ = ray.wait([self._draining], timeout=0)
        if not ready:
            return []
        items = ray.get(self._draining)
        self._draining = self._mailbox.drain.remote()
        return [Incoming(sender=sender, message=message, payload=ref) for sender, message, ref in items]

    def land(self, incoming: Incoming, dst_spans: Sequence[tuple[int, int]], piece: BlockPiece | None = None) -> None:
        import torch

        chunks = ray.get(incoming.payload)
        if len(chunks) != len(dst_spans):
            raise TransportError(
                f"payload from {incoming.sender} has {len(chunks)} runs, its notification {len(dst_spans)}"
            )
        columns = slice(None) if piece is None else slice(piece.dst_offset, piece.dst_offset + piece.num_bytes)
        for (start, count), chunk in zip(dst_spans, chunks):
            if self._blocks_np is not None:
                self._blocks_np[start : start + count, columns] = chunk
            else:
                self._blocks[start : start + count, columns].copy_(torch.from_numpy(np.array(chunk)))

    def close(self) -> None:
        if self._mailbox is not None:
            ray.kill(self._mailbox)
            self._mailbox = None


def create(options) -> RayTransport:
    """The registry's constructor (``kvtransfer.backends.make_transport``)."""
    return RayTransport(options.transport_name, options.kv_cache, options.region)
