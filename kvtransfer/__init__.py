"""Moving KV blocks between prefill and decode actors (NIXL by default, Ray as fallback).

Workers hold one ``KVAgent`` each; see ``kvtransfer.agent`` for the calls and their order.
"""

from kvtransfer.agent import KVAgent, KVTransferConfig
from kvtransfer.handshake import HandshakeOffer
from kvtransfer.layout import KVCompat, KVRegion
from kvtransfer.leases import LeasePolicy
from kvtransfer.messages import FreedBlocks, KVDestination, PeerRef, QuiesceReport, ReceiveEvents, SendEvent

__all__ = [
    "FreedBlocks",
    "HandshakeOffer",
    "KVAgent",
    "KVCompat",
    "KVDestination",
    "KVRegion",
    "KVTransferConfig",
    "LeasePolicy",
    "PeerRef",
    "QuiesceReport",
    "ReceiveEvents",
    "SendEvent",
]
