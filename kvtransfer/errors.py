"""Errors kvtransfer raises on purpose.

Two families matter to callers. Request-scoped errors (``RequestTransferError`` and
its subclasses) fail one request and name it and the peer; the actor and its other
requests go on. Peer-scoped errors (handshake refusals, a missing or stale handshake)
concern every request to that peer and say what the worker must do next.
"""

from __future__ import annotations


class KVTransferError(Exception):
    """Base class of every error kvtransfer raises on purpose."""


class LayoutError(KVTransferError, ValueError):
    """A KV tensor or layout description is unusable (wrong shape, dtype, not contiguous)."""


class InvalidBlocksError(KVTransferError, ValueError):
    """A block id list is invalid; ``field`` names the argument at fault."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem

    def __reduce__(self):  # errors cross Ray calls; rebuild from the constructor's arguments
        return (type(self), (self.field, self.problem))


class BlockInUseError(InvalidBlocksError):
    """A block is already reserved by another request that has not freed it."""


class UnknownRequestError(KVTransferError, KeyError):
    """A request id this side does not track (never reserved, or already handed back)."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class IncompatiblePeerError(KVTransferError):
    """A handshake was refused; ``differences`` lists each field that differs."""

    def __init__(self, peer: str, differences: list[str]) -> None:
        super().__init__(f"peer {peer} is incompatible: " + "; ".join(differences))
        self.peer = peer
        self.differences = differences

    def __reduce__(self):
        return (type(self), (self.peer, self.differences))


class HandshakeRequiredError(KVTransferError):
    """No handshake with this (peer, epoch) yet: fetch the peer's offer and ``connect`` it."""

    def __init__(self, peer: str, epoch: str, connected_epoch: str | None) -> None:
        have = f"connected epoch {connected_epoch}" if connected_epoch else "never connected"
        super().__init__(f"peer {peer} epoch {epoch} needs a handshake ({have})")
        self.peer = peer
        self.epoch = epoch
        self.connected_epoch = connected_epoch

    def __reduce__(self):
        return (type(self), (self.peer, self.epoch, self.connected_epoch))


class BackendUnavailableError(KVTransferError):
    """The requested transport backend cannot be created on this platform."""


class TransportError(KVTransferError):
    """A transport call failed; ``peer_lost`` says the peer is gone or unreachable."""

    def __init__(self, message: str, peer_lost: bool = False) -> None:
        super().__init__(message)
        self.peer_lost = peer_lost

    def __reduce__(self):
        return (type(self), (self.args[0], self.peer_lost))


class RequestTransferError(KVTransferError):
    """One request's transfer failed; only that request is affected."""

    def __init__(self, req_id: str, peer: str, problem: str) -> None:
        super().__init__(f"req {req_id} (peer {peer}): {problem}")
        self.req_id = req_id
        self.peer = peer
        self.problem = problem

    def __reduce__(self):
        return (type(self), (self.req_id, self.peer, self.problem))


class TransferFailedError(RequestTransferError):
    """The transport reported an error for one of the request's writes."""


class PeerLostError(RequestTransferError):
    """The peer died, restarted or became unreachable while the request was using it."""


class StaleEpochError(RequestTransferError):
    """The destination belongs to an earlier incarnation of the peer; never written."""


class TransferTimeoutError(RequestTransferError):
    """A write did not complete within the write timeout."""


class LeaseExpiredError(RequestTransferError):
    """The reservation's lease ran out (or would before a new write could finish)."""


class TransferCancelledError(RequestTransferError):
    """The request was cancelled (or already finished); no more writes are accepted for it."""
