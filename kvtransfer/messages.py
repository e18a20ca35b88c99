"""Typed messages that cross process boundaries, and the events the agent reports.

Who sends what:
- ``KVDestination``: decode side -> router -> prefill side (a Ray call the workers make).
- ``TransferNotif``: prefill side -> decode side, riding on each write's NIXL notification.
- ``QuiesceReport``: prefill side -> decode side (Ray call), confirming no write in flight.
- ``SendEvent`` / ``ReceiveEvents``: what ``poll_sends`` / ``poll_receives`` return locally.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from kvtransfer.errors import KVTransferError, RequestTransferError

NOTIF_MAGIC = b"pdkv1:"


@dataclass(slots=True, frozen=True)
class PeerRef:
    """One incarnation of a worker's agent: its stable name and the epoch of this start."""

    name: str
    epoch: str

    def __str__(self) -> str:
        return f"{self.name}@{self.epoch}"


@dataclass(slots=True)
class KVDestination:
    """Blocks a decode worker reserved for one request, and the lease on them.

    ``lease_deadline`` is wall-clock seconds (``time.time()``): the writer posts nothing
    that could still be running after it, and the reserver frees without confirmation
    only after it plus a grace period. ``token`` tells two reservations of one req_id apart.
    """

    req_id: str
    peer: PeerRef
    block_ids: list[int]
    lease_deadline: float
    token: int
    # The reserver already holds the request's first blocks (a prefix cache): ``block_ids``
    # stand for its blocks from this index on, and only those are written.
    num_cached_blocks: int = 0

    @property
    def num_blocks(self) -> int:
        """The request's blocks the destination covers, the held ones included."""
        return self.num_cached_blocks + len(self.block_ids)


@dataclass(slots=True)
class TransferNotif:
    """Sent with a write: which request, which blocks landed, how many are now valid, and a payload."""

    req_id: str
    token: int
    seq: int
    num_valid_blocks: int
    dst_spans: list[tuple[int, int]]
    payload: str = ""  # opaque to kvtransfer: what the writer wants the reader to get with the blocks

    def encode(self) -> bytes:
        body = {"r": self.req_id, "t": self.token, "s": self.seq, "v": self.num_valid_blocks, "d": self.dst_spans}
        if self.payload:
            body["p"] = self.payload
        return NOTIF_MAGIC + json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> TransferNotif:
        """Parse a notification; raise KVTransferError on anything that is not ours."""
        if not raw.startswith(NOTIF_MAGIC):
            raise KVTransferError(f"not a kvtransfer notification: {raw[:32]!r}")
        try:
            body = json.loads(raw[len(NOTIF_MAGIC) :])
            return cls(
                req_id=str(body["r"]),
                token=int(body["t"]),
                seq=int(body["s"]),
                num_valid_blocks=int(body["v"]),
                dst_spans=[(int(s), int(n)) for s, n in body["d"]],
                payload=str(body.get("p", "")),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise KVTransferError(f"malformed kvtransfer notification: {e}") from e


@dataclass(slots=True)
class QuiesceReport:
    """The writer's answer to a cancel: ``quiesced`` once no write for ``req_id`` is in flight."""

    req_id: str
    writer: PeerRef
    quiesced: bool
    num_in_flight: int


@dataclass(slots=True)
class SendEvent:
    """A write finished (``error`` None) or a request failed (``error`` set) on the sending side."""

    req_id: str
    peer: str
    seq: int
    num_valid_blocks: int
    error: RequestTransferError | None = None
    finished: bool = False  # the request's last write completed; its send state is gone
    # The reservation written into: an event of an earlier attempt of the same request (its
    # decode actor died, and the request was placed again) must not touch the new attempt.
    token: int | None = None
    seen_at: float = 0.0  # time.perf_counter() when the transfer pump saw it (0: not through a pump)


@dataclass(slots=True)
class FreedBlocks:
    """Blocks the receiver gave back without being asked this call (lease expiry)."""

    req_id: str
    block_ids: list[int]
    reason: str


@dataclass(slots=True)
class ReceiveEvents:
    """What one ``poll_receives`` observed, in order of arrival per request."""

    progress: list[tuple[str, int]] = field(default_factory=list)  # (req_id, num_valid_blocks)
    ready: list[str] = field(default_factory=list)
    failed: list[RequestTransferError] = field(default_factory=list)
    freed: list[FreedBlocks] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.progress or self.ready or self.failed or self.freed)


@dataclass(slots=True)
class ActivationSlots:
    """Where one request's previous stage writes its chunks: the n-th chunk it sends goes into
    ``addresses[n]`` of agent ``agent_name`` (hidden rows at the address, residual rows
    ``slot_tokens`` rows after)."""

    agent_name: str
    metadata: bytes  # the agent's NIXL metadata: the sender loads it once
    addresses: list[int]
    slot_tokens: int
    row_bytes: int  # one token's hidden vector
    device_id: int
    mem_type: str  # "DRAM" or "VRAM"
