"""Moving KV blocks between prefill and decode actors (NIXL by default, Ray as fallback).

Workers hold one ``KVAgent`` each; see ``kvtransfer.agent`` for the calls and their order.
The names below load on first use: the router imports ``kvtransfer.messages`` only.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "FreedBlocks": "kvtransfer.messages",
    "HandshakeOffer": "kvtransfer.handshake",
    "KVAgent": "kvtransfer.agent",
    "KVCompat": "kvtransfer.layout",
    "KVDestination": "kvtransfer.messages",
    "KVRegion": "kvtransfer.layout",
    "KVTransferConfig": "kvtransfer.agent",
    "LeasePolicy": "kvtransfer.leases",
    "PeerRef": "kvtransfer.messages",
    "QuiesceReport": "kvtransfer.messages",
    "ReceiveEvents": "kvtransfer.messages",
    "SendEvent": "kvtransfer.messages",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtransfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
