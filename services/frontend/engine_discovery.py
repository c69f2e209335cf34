"""Where the engine replicas are: a fixed list, or the A records of a DNS name, re-resolved.

Under Kubernetes the engines are a StatefulSet behind a headless Service: its DNS name
resolves to one A record per engine pod (every pod, ready or not, because the Service
publishes not-ready addresses: a frontend may connect while an engine still loads its model,
and health probes decide when it gets requests). Re-resolving that name every few seconds
follows `kubectl scale` without any access to the Kubernetes API.

Why DNS rather than watching pods with a Role (as SGLang's router and production-stack's
router do): the frontend needs no ServiceAccount token, no RBAC objects and no client
library; pods keep `automountServiceAccountToken: false`; it works the same with the plain
system resolver outside Kubernetes; and a few seconds of delay before a new engine gets
traffic is nothing next to the minutes an engine takes to load a model. What DNS cannot say
(an engine that is up but not answering) the frontend's own health probes find out.

A resolver is anything with ``async resolve() -> list[Endpoint] | None`` (None: the lookup
failed, keep the engines we have) and an ``interval_s`` (None: resolve once). Tests point
DnsResolver at a stub DNS server on loopback (``nameserver``).
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
    """One engine replica: its scheduler's ZeroMQ address and gRPC control address.

    ``name`` identifies the replica to routing and logs (the pod IP, or the list index).
    ``control_addr`` may be empty: nothing to probe, the engine is trusted to be up.
    """

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
    """Every address a DNS name resolves to, each an engine on the same two ports.

    ``nameserver`` ("host:port", or "host" for port 53) asks that server directly; empty
    uses the system resolver (resolv.conf search domains, /etc/hosts), as a pod does.
    """

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
    """DNS discovery when a name is given, else the fixed list."""
    if dns_name:
        return DnsResolver(dns_name, zmq_port, control_port, interval_s, nameserver)
    return StaticResolver(scheduler_addrs, control_addrs)
