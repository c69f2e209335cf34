"""Host:port strings with IPv6 literals (pod IPs may be IPv6): ZeroMQ and gRPC need such a
host in brackets, or its colons read as the port's."""

from __future__ import annotations

import ipaddress


def bracket(host: str) -> str:
    """``host`` for an address: an IPv6 literal bracketed, anything else unchanged."""
    if ":" not in host or host.startswith("["):
        return host
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return host
    return f"[{host}]"


def host_port(host: str, port: int | str) -> str:
    """``host:port`` (gRPC's form), IPv6 bracketed."""
    return f"{bracket(host)}:{port}"


def tcp_addr(host: str, port: int | str) -> str:
    """A ZeroMQ tcp:// address (``port`` may be ``*``: any free port)."""
    return f"tcp://{host_port(host, port)}"


def zmq_endpoint(addr: str) -> str:
    """A tcp:// ``addr`` with its IPv6 host bracketed (flags built from ``$(POD_IP)`` can't)."""
    scheme, sep, rest = addr.partition("://")
    if scheme != "tcp" or not sep:
        return addr
    host, colon, port = rest.rpartition(":")
    return tcp_addr(host, port) if colon else addr
