"""Which way a pair's KV bytes go, and what went that way.

The peers' trackers show one failure above most others: KV silently crossing TCP where the
operator expected RDMA (a device name missing from UCX_NET_DEVICES, a transport left out of
UCX_TLS, a container without the RDMA devices). NIXL does not say which UCX transport it
picked, so at handshake the writer works it out the way UCX chooses, from what both sides
say of themselves: two agents on one host (same host id: network namespaces on one kernel
count as one host) use shared memory unless UCX_TLS rules it out; otherwise the bytes leave
through the local device that routes to the peer's address: RDMA when that device is one
(or UCX may use the host's RDMA devices and UCX_TLS allows them), else TCP. The writer logs
the path once per peer, warns when TCP is chosen on a host that has RDMA devices, and counts
bytes, writes, failures and write time per peer and path (``PathStats``, exported by the
router as ``pdserve:kv_transfer_*``).
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

_SHM_TRANSPORTS = ("sm", "shm", "posix", "sysv", "cma", "knem", "xpmem")
_RDMA_TRANSPORTS = ("rc", "ud", "dc", "ib", "rc_v", "rc_x", "ud_v", "ud_x", "dc_x", "rc_mlx5", "ud_mlx5", "dc_mlx5")
_SIOCGIFADDR = 0x8915


@dataclass(slots=True)
class TransferPath:
    """How KV bytes go to one peer."""

    transport: str  # "shm", "rdma", "tcp", or "ray" (the object store, not UCX)
    device: str = ""  # the local device toward the peer ("" for shared memory and Ray)
    same_host: bool = False

    def __str__(self) -> str:
        return f"{self.transport}/{self.device}" if self.device else self.transport


@dataclass(slots=True)
class PathStats:
    """What one writer sent one peer (since the writer started), and which way."""

    peer: str  # the peer worker's name
    transport: str
    device: str
    num_bytes: int = 0
    num_writes: int = 0  # writes that completed
    num_failures: int = 0  # writes that failed or timed out (each retry counts)
    write_seconds: float = 0.0  # post-to-completion time of the completed writes, summed


def host_id() -> str:
    """This host: its name and boot, as UCX tells hosts apart (namespaces share both)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def describe_path(backend: str, peer_host_id: str, peer_address: str, ucx_tls: str | None = None, ucx_devices: str | None = None) -> TransferPath:
    """The path a write to a peer at ``peer_address`` on host ``peer_host_id`` takes from here."""
    if backend != "nixl":
        return TransferPath(backend)
    tls = _names(ucx_tls if ucx_tls is not None else os.environ.get("UCX_TLS"))
    same_host = bool(peer_host_id) and peer_host_id == host_id()
    if same_host and _allows(tls, _SHM_TRANSPORTS):
        return TransferPath("shm", same_host=True)
    device = local_device_toward(peer_address) if peer_address else ""
    rdma = rdma_devices()
    devices = _names(ucx_devices if ucx_devices is not None else os.environ.get("UCX_NET_DEVICES"))
    rdma_allowed = [d for d in rdma if devices is None or any(n.split(":")[0] == d for n in devices)]
    if rdma_allowed and _allows(tls, _RDMA_TRANSPORTS):
        return TransferPath("rdma", rdma_allowed[0], same_host)
    return TransferPath("tcp", device, same_host)


def log_path(peer: str, path: TransferPath) -> None:
    """Say once which way KV goes to ``peer``; warn when it is TCP on a host with RDMA devices."""
    settings = f"UCX_TLS={os.environ.get('UCX_TLS', 'all')}, UCX_NET_DEVICES={os.environ.get('UCX_NET_DEVICES', 'all')}"
    logger.info("KV to %s goes over %s (%s)", peer, path, settings)
    rdma = rdma_devices()
    if path.transport == "tcp" and rdma:
        logger.warning(
            "KV to %s goes over TCP (%s) although this host has RDMA devices %s: add them to UCX_NET_DEVICES "
            "(transfer_network_devices) and let UCX_TLS (transfer_transports) include rc/ud/dc", peer, path.device, rdma,
        )


def rdma_devices() -> list[str]:
    """This host's RDMA devices (mlx5_0, ...), as the kernel lists them."""
    root = Path("/sys/class/infiniband")
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def local_device_toward(address: str) -> str:
    """The local network device whose address this host sends from to reach ``address``."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))  # no packet is sent: this only picks the route
            local_ip = probe.getsockname()[0]
    except OSError:
        return ""
    if local_ip == address:
        return "lo"  # the peer is on this node: the kernel loops it back
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == local_ip:
            return name
    return ""


def _ipv4_of(device: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", device[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def _names(setting: str | None) -> list[str] | None:
    """A UCX list setting's names; None for unset, "all", or an exclusion ("^name,...": taken as all)."""
    if setting is None or setting.strip() in ("", "all") or setting.startswith("^"):
        return None
    return [name.strip() for name in setting.split(",") if name.strip()]


def _allows(tls: list[str] | None, family: tuple[str, ...]) -> bool:
    return tls is None or any(name in family or name.split("_")[0] in family for name in tls)
