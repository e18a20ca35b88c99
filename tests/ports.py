"""Ports for the servers tests start themselves (a Ray head, a gloo rendezvous, a stand-in HTTP
server), chosen below the kernel's ephemeral range.

A port found by binding port 0 is an ephemeral one, and once the probe closes the kernel may hand
it to the next process that binds port 0: a Ray instance starting in the other test process
(its GCS binds port 0) took the port a two-node test had just picked for its head, and its
driver then reached the head's GCS instead of its own (CI: "InvalidAuthToken"; 106 tests of
that process failed to start Ray). No process binding port 0 is given a port below the range."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_LOWEST = 20_000


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def unused_port() -> int:
    """A loopback TCP port nothing listens on now, outside the ephemeral range."""
    high = max(_LOWEST + 1_000, _ephemeral_start())
    pick = random.SystemRandom()
    for _ in range(500):
        port = pick.randrange(_LOWEST, high)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{_LOWEST}, {high})")
