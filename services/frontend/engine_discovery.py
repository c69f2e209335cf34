"""Where the engine replicas are: a fixed list, or the A records of a DNS name, re-resolved.

Under Kubernetes a headless Service's name resolves to every engine pod, ready or not;
re-resolving it follows `kubectl scale` without the Kubernetes API (why: docs/kubernetes.md).
A resolver's ``resolve()`` returns None when the lookup failed (keep the engines we have);
``interval_s`` None means resolve once.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass
from typing import Protocol

from services.common.hostport import host_port, tcp_addr

log = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Endpoint:
    """One engine replica: its scheduler's ZeroMQ address and gRPC control address (empty:
    nothing to probe, the engine is trusted to be up). ``name``: the pod IP or list index."""

    name: str
    zmq_addr: str
    control_addr: str


class Resolver(Protocol):
    interval_s: float | None

    async def resolve(self) -> list[Endpoint] | None: ...


class StaticResolver:
    """The addresses given on the command line (``radixserve serve``, tests, fixed setups)."""

    interval_s: float | None = None

    def __init__(self, zmq_addrs: list[str], control_addrs: list[str]) -> None:
        if not zmq_addrs:
            raise ValueError("no engine to talk to: give --scheduler-addrs or --engine-dns-name")
        if control_addrs and len(control_addrs) != len(zmq_addrs):
            raise ValueError("--scheduler-control-addrs must list one address per scheduler")
        controls = control_addrs or [""] * len(zmq_addrs)
        self._endpoints = [
            Endpoint(str(i), z, c) for i, (z, c) in enumerate(zip(zmq_addrs, controls, strict=True))
        ]

    async def resolve(self) -> list[Endpoint] | None:
        return list(self._endpoints)


class DnsResolver:
    """Every address a DNS name resolves to, each an engine on the same two ports;
    ``nameserver`` ("host[:port]") asks that server directly, empty the system resolver."""

    def __init__(
        self,
        name: str,
        zmq_port: int,
        control_port: int,
        interval_s: float = 5.0,
        nameserver: str = "",
    ) -> None:
        self.name = name
        self.zmq_port, self.control_port = zmq_port, control_port
        self.interval_s: float | None = interval_s
        self.nameserver = nameserver

    async def resolve(self) -> list[Endpoint] | None:
        try:
            ips = await (self._ask_server() if self.nameserver else self._ask_system())
        except Exception as e:  # a lookup that failed says nothing about the engines
            log.warning("resolving %s failed: %r; keeping the engines known so far", self.name, e)
            return None
        return [self._endpoint(ip) for ip in sorted(ips)]

    def _endpoint(self, ip: str) -> Endpoint:
        return Endpoint(ip, tcp_addr(ip, self.zmq_port), host_port(ip, self.control_port))

    async def _ask_system(self) -> set[str]:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(LOOKUP_TIMEOUT_S):
                infos = await loop.getaddrinfo(self.name, None, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            if e.errno == socket.EAI_NONAME:  # the name exists no more: no engine at all
                return set()
            raise
        return {str(info[4][0]) for info in infos}

    async def _ask_server(self) -> set[str]:
        import dns.asyncresolver  # only this mode needs it
        import dns.resolver

        host, _, port = self.nameserver.partition(":")
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = [host]
        resolver.port = int(port or 53)
        try:
            answer = await resolver.resolve(self.name, "A", lifetime=LOOKUP_TIMEOUT_S)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return set()
        return {rr.address for rr in answer}


def make_resolver(
    scheduler_addrs: list[str],
    control_addrs: list[str],
    dns_name: str,
    zmq_port: int,
    control_port: int,
    interval_s: float,
    nameserver: str,
) -> Resolver:
    if dns_name:
        return DnsResolver(dns_name, zmq_port, control_port, interval_s, nameserver)
    return StaticResolver(scheduler_addrs, control_addrs)
