"""Host:port strings that hold an IPv6 literal: pod IPs may be IPv6 (a dual-stack or
IPv6-only cluster), and both ZeroMQ (``tcp://[fd00::1]:30100``) and gRPC
(``[fd00::1]:30101``) need such a host in brackets, or its colons read as the port's."""

from __future__ import annotations

import ipaddress


def bracket(host: str) -> str:
    """``host`` as the host part of an address: an IPv6 literal in brackets; a name, an
    IPv4 literal, ``*`` or an already bracketed host unchanged."""
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
    """``addr`` with an unbracketed IPv6 host bracketed: a flag written from a pod's IP
    (the chart's ``tcp://$(POD_IP):30100``) cannot bracket it itself. Other addresses, and
    ones already bracketed, are returned unchanged."""
    scheme, sep, rest = addr.partition("://")
    if scheme != "tcp" or not sep:
        return addr
    host, colon, port = rest.rpartition(":")
    return tcp_addr(host, port) if colon else addr
