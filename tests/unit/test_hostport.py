"""IPv6 pod IPs in internal addresses (issue 41): ZeroMQ and gRPC need an IPv6 literal in
brackets (``tcp://[fd00::1]:30100``), or its colons read as the port's."""

from __future__ import annotations

import socket

import pytest
import zmq

from services.common import transport
from services.common.hostport import bracket, host_port, tcp_addr, zmq_endpoint
from services.frontend.engine_discovery import DnsResolver


@pytest.mark.parametrize(
    ("host", "want"),
    [
        ("fd00::1", "[fd00::1]"),
        ("::1", "[::1]"),
        ("fe80::1%eth0", "[fe80::1%eth0]"),
        ("[fd00::1]", "[fd00::1]"),  # already bracketed: as is
        ("10.0.0.7", "10.0.0.7"),
        ("engine-0.engines", "engine-0.engines"),
        ("*", "*"),
    ],
)
def test_only_an_ipv6_literal_is_bracketed(host, want):
    assert bracket(host) == want
    assert host_port(host, 30101) == f"{want}:30101"
    assert tcp_addr(host, 30100) == f"tcp://{want}:30100"


@pytest.mark.parametrize(
    ("addr", "want"),
    [
        ("tcp://fd00::1:30100", "tcp://[fd00::1]:30100"),  # the chart's tcp://$(POD_IP):30100
        ("tcp://::1:*", "tcp://[::1]:*"),
        ("tcp://[fd00::1]:30100", "tcp://[fd00::1]:30100"),
        ("tcp://10.0.0.7:30100", "tcp://10.0.0.7:30100"),
        ("tcp://*:30100", "tcp://*:30100"),
        ("ipc:///tmp/radixserve-0/worker.sock", "ipc:///tmp/radixserve-0/worker.sock"),
    ],
)
def test_a_zmq_address_gets_its_ipv6_host_bracketed(addr, want):
    assert zmq_endpoint(addr) == want


def test_dns_discovery_brackets_an_ipv6_engine():
    ep = DnsResolver("engines", 30100, 30101)._endpoint("fd00::1")
    assert (ep.zmq_addr, ep.control_addr) == ("tcp://[fd00::1]:30100", "[fd00::1]:30101")


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
def test_a_link_binds_and_connects_on_an_unbracketed_ipv6_address():
    ctx = zmq.Context()
    try:
        server = transport.router(ctx, "tcp://::1:*")
        port = server.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1]
        client = transport.dealer(ctx, f"tcp://::1:{port}")
        client.send(b"hello")
        assert server.poll(5000)
        assert server.recv_multipart()[1] == b"hello"
        client.close()
        server.close()
    finally:
        ctx.term()
