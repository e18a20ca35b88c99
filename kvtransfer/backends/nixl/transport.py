"""NIXL (UCX) transport: one agent, one registration of the KV tensor, one-sided WRITEs.

Setup: the agent registers the whole KV tensor once (DRAM on CPU, VRAM on GPU) and, in
the default ``prepped`` mode, prepares a per-block descriptor list for itself and, on
``add_peer``, one for the peer's region. A push then only names block indices
(``make_prepped_xfer``, a few microseconds) and NIXL merges adjacent indices back into
one descriptor per run. The ``dynamic`` mode builds one descriptor per merged run and
calls ``initialize_xfer`` on every push instead; the benchmark compares the two.

A write of one piece of each block (a KV head range, between workers of different tensor-
parallel sizes) uses lists prepared for that piece, once per (offset, length) on each side:
one descriptor per block, since pieces of adjacent blocks are not adjacent.

The UCX progress thread is off by default: it busy-polls a whole core per agent, and
on CPU the write is driven by post and by our polls anyway. Turn it on for GPUs/RDMA
where the writer computes for long stretches without polling.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtransfer.backends.nixl import api as nixl_api
from kvtransfer.descriptors import BlockRuns, block_byte_descs
from kvtransfer.errors import BackendUnavailableError, TransportError
from kvtransfer.layout import KVRegion
from kvtransfer.transport import BlockPiece, Incoming, Transport, XferState

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_STATES = {"DONE": XferState.DONE, "PROC": XferState.IN_PROGRESS}


def _as_transport_error(what: str, peer: str, exc: Exception) -> TransportError:
    # The bindings' exceptions all derive from Exception directly; the class name is the status.
    lost = type(exc).__name__ == "nixlRemoteDisconnectError"
    return TransportError(f"{what} to {peer} failed: {type(exc).__name__}: {exc}", peer_lost=lost)


@dataclass(slots=True)
class _NixlPeer:
    region: KVRegion
    prepped: Any  # nixl_prepped_dlist_handle, or None in dynamic mode
    pieces: dict = field(default_factory=dict)  # (offset, num_bytes) -> prepped list of that piece of every block


class NixlTransport(Transport):
    kind = "nixl"
    receiver_lands = False

    def __init__(
        self,
        transport_name: str,
        kv_cache: torch.Tensor,
        region: KVRegion,
        mode: str = "prepped",
        merge: bool = True,
        progress_thread: bool = False,
        network_devices: str | None = None,
        transports: str | None = None,
    ) -> None:
        try:
            api = nixl_api.load()
            nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config
        except ImportError as e:
            raise BackendUnavailableError(f"nixl is not importable here: {e}") from e
        if mode not in ("prepped", "dynamic"):
            raise ValueError(f"nixl_mode: must be 'prepped' or 'dynamic', got {mode!r}")
        self.name = transport_name
        self._mode = mode
        self._merge = merge
        self._region = region
        self._kv_cache = kv_cache  # registered memory must outlive the agent
        if network_devices is not None:
            # UCX reads it when the agent creates its context: the one agent of this process.
            os.environ["UCX_NET_DEVICES"] = network_devices
        if transports is not None:
            os.environ["UCX_TLS"] = transports
        config = nixl_agent_config(enable_prog_thread=progress_thread, enable_listen_thread=False, backends=["UCX"])
        self._agent = nixl_agent(transport_name, config)
        if "UCX" not in self._agent.backends:
            raise BackendUnavailableError("nixl: the UCX backend could not be created")
        self._reg = self._agent.register_memory(kv_cache)
        self._local_prepped = None
        self._local_pieces: dict[tuple[int, int], Any] = {}
        if mode == "prepped":
            self._local_prepped = self._agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", block_byte_descs(region), region.nixl_mem_type
            )
        self._peers: dict[str, _NixlPeer] = {}
        logger.info(
            "nixl agent %s registered %d blocks x %d bytes (%s, mode=%s)",
            transport_name, region.num_blocks, region.bytes_per_block, region.nixl_mem_type, mode,
        )

    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    def add_peer(self, transport_name: str, metadata: bytes, region: KVRegion) -> None:
        if transport_name in self._peers:
            return
        try:
            loaded = self._agent.add_remote_agent(metadata)
        except Exception as e:
            raise _as_transport_error("loading metadata", transport_name, e) from e
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != transport_name:
            self._agent.remove_remote_agent(loaded)
            raise TransportError(f"metadata names agent {loaded}, expected {transport_name}")
        prepped = None
        if self._mode == "prepped":
            prepped = self._agent.prep_xfer_dlist(transport_name, block_byte_descs(region), region.nixl_mem_type)
        self._peers[transport_name] = _NixlPeer(region=region, prepped=prepped)

    def remove_peer(self, transport_name: str) -> None:
        peer = self._peers.pop(transport_name, None)
        if peer is None:
            return
        try:
            for handle in peer.pieces.values():
                handle.release()
            if peer.prepped is not None:
                peer.prepped.release()
            self._agent.remove_remote_agent(transport_name)
        except Exception:
            logger.warning("removing nixl peer %s failed", transport_name, exc_info=True)

    def _prepped_lists(self, transport_name: str, peer: _NixlPeer, piece: BlockPiece | None) -> tuple[Any, Any]:
        """The (local, remote) prepared lists a write of ``piece`` (None: whole blocks) indexes."""
        if piece is None:
            return self._local_prepped, peer.prepped
        local_key = (piece.src_offset, piece.num_bytes)
        if local_key not in self._local_pieces:
            descs = block_byte_descs(self._region, piece.src_offset, piece.num_bytes)
            self._local_pieces[local_key] = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, self._region.nixl_mem_type)
        remote_key = (piece.dst_offset, piece.num_bytes)
        if remote_key not in peer.pieces:
            descs = block_byte_descs(peer.region, piece.dst_offset, piece.num_bytes)
            peer.pieces[remote_key] = self._agent.prep_xfer_dlist(transport_name, descs, peer.region.nixl_mem_type)
        return self._local_pieces[local_key], peer.pieces[remote_key]

    def post_write(self, transport_name: str, runs: BlockRuns, notif: bytes, piece: BlockPiece | None = None) -> Any:
        peer = self._peers.get(transport_name)
        if peer is None:
            raise TransportError(f"no nixl peer {transport_name}", peer_lost=True)
        if piece is not None and piece.num_bytes == self._region.bytes_per_block == peer.region.bytes_per_block:
            piece = None  # the whole block on both sides: runs of adjacent blocks merge
        try:
            if self._mode == "prepped":
                src, dst = runs.expand()
                local, remote = self._prepped_lists(transport_name, peer, piece)
                handle = self._agent.make_prepped_xfer(
                    "WRITE", local, src, remote, dst, notif, skip_desc_merge=not self._merge
                )
            else:
                mem = self._region.nixl_mem_type
                src_off, dst_off, num = (0, 0, None) if piece is None else (piece.src_offset, piece.dst_offset, piece.num_bytes)
                src_descs = self._agent.get_xfer_descs(runs.byte_descs(self._region, "src", src_off, num), mem)
                dst_descs = self._agent.get_xfer_descs(runs.byte_descs(peer.region, "dst", dst_off, num), peer.region.nixl_mem_type)
                handle = self._agent.initialize_xfer("WRITE", src_descs, dst_descs, transport_name, notif)
        except Exception as e:
            raise _as_transport_error("preparing a write", transport_name, e) from e
        try:
            state = self._agent.transfer(handle)
        except Exception as e:
            self.release(handle)
            raise _as_transport_error("posting a write", transport_name, e) from e
        if state == "ERR":
            self.release(handle)
            raise TransportError(f"posting a write to {transport_name} returned ERR")
        return handle

    def check(self, handle: Any) -> XferState:
        try:
            return _STATES.get(self._agent.check_xfer_state(handle), XferState.FAILED)
        except Exception:
            logger.warning("nixl check_xfer_state raised; treating the write as failed", exc_info=True)
            return XferState.FAILED

    def release(self, handle: Any) -> bool:
        try:
            handle.release()
            return True
        except Exception:
            # NIXL could not cancel a running write; the caller keeps counting it in flight.
            logger.warning("nixl could not release (cancel) a write handle", exc_info=True)
            return False

    def get_incoming(self) -> list[Incoming]:
        notifs = self._agent.get_new_notifs()
        return [
            Incoming(sender=sender.decode() if isinstance(sender, bytes) else str(sender), message=bytes(msg))
            for sender, msgs in notifs.items()
            for msg in msgs
        ]

    def close(self) -> None:
        for name in list(self._peers):
            self.remove_peer(name)
        try:
            for handle in self._local_pieces.values():
                handle.release()
            self._local_pieces.clear()
            if self._local_prepped is not None:
                self._local_prepped.release()
            self._agent.deregister_memory(self._reg)
        except Exception:
            logger.warning("closing nixl agent %s failed", self.name, exc_info=True)


def create(options) -> NixlTransport:
    """The registry's constructor (``kvtransfer.backends.make_transport``)."""
    return NixlTransport(
        options.transport_name,
        options.kv_cache,
        options.region,
        mode=options.nixl_mode,
        merge=options.merge_descriptors,
        progress_thread=options.progress_thread,
        network_devices=options.network_devices,
        transports=options.transports,
    )
