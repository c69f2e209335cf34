"""A DNS server on loopback that answers A queries from a dict the test changes at will.

It stands in for the cluster DNS (CoreDNS) answering for the engines' headless Service: the
frontend's DnsResolver is pointed at it with --engine-dns-server. Unknown names get NXDOMAIN,
as CoreDNS answers for a Service with no endpoints.
"""

from __future__ import annotations

import socket
import threading

import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset


class DnsStub:
    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set(self, name: str, ips: list[str]) -> None:
        with self._lock:
            self.records[name.rstrip(".").lower()] = list(ips)

    def start(self) -> DnsStub:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                data, peer = self._sock.recvfrom(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            self._sock.sendto(self._answer(dns.message.from_wire(data)).to_wire(), peer)

    def _answer(self, query: dns.message.Message) -> dns.message.Message:
        reply = dns.message.make_response(query)
        reply.flags |= dns.flags.AA
        question = query.question[0]
        name = question.name.to_text().rstrip(".").lower()
        with self._lock:
            ips = self.records.get(name)
        if not ips:
            reply.set_rcode(dns.rcode.NXDOMAIN)
        elif question.rdtype == dns.rdatatype.A:
            reply.answer.append(dns.rrset.from_text_list(question.name, 1, "IN", "A", ips))
        return reply
