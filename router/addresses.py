"""Listener hosts as a config gives them (``127.0.0.1``, ``::1``, ``[::]``, ``0.0.0.0``, a
name) and the ``host:port`` text each library and client takes: gRPC parses ``::1:50051`` as
the IPv4 address 0.1.0.0 port 443 and refuses it, URLs need the brackets, sockets and aiohttp
refuse them."""

from __future__ import annotations

WILDCARD_HOSTS = ("", "0.0.0.0", "::")  # every address of the machine


def bare_host(host: str) -> str:
    """The host a socket binds: without the brackets an IPv6 literal may be written in."""
    host = host.strip()
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def host_port(host: str, port: int) -> str:
    """``host:port`` as gRPC targets, URLs and people read it: ``[::1]:50051`` for IPv6."""
    host = bare_host(host)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_wildcard(host: str) -> bool:
    return bare_host(host) in WILDCARD_HOSTS
