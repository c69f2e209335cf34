"""`radixserve serve` never gives a child a port the command line already names.

The ports named with --port / --http-port are bound only later, by the frontend, so the
kernel may hand one of them out again for the worker's or the scheduler's free port; the
worker then failed to start with "Address already in use" (seen in CI)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from services.cli import serve
from services.cli.main import build_parser


class _FakeSocket:
    """socket.socket whose bind(0) hands out the next port of a script."""

    ports: Iterator[int]

    def __init__(self, *args: object) -> None:
        self.port = 0

    def __enter__(self) -> _FakeSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def bind(self, addr: tuple[str, int]) -> None:
        self.port = next(self.ports)

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)


@pytest.fixture
def scripted_ports(monkeypatch):
    def script(*ports: int) -> None:
        _FakeSocket.ports = iter(ports)
        monkeypatch.setattr(serve.socket, "socket", _FakeSocket)

    return script


def test_a_named_port_handed_out_again_is_skipped(scripted_ports):
    ns = build_parser().parse_args(["serve", "--port", "40000", "--http-port", "40001"])
    # The kernel offers the frontend's two ports first, then the worker's twice.
    scripted_ports(40000, 40001, 40002, 40002, 40003)
    worker, sched, front = serve.plan(ns)
    assert worker.worker_grpc_port == 40002
    assert sched.control_port == 40003
    assert {front.port, front.http_port}.isdisjoint({40002, 40003})


def test_metrics_block_is_avoided_too(scripted_ports):
    ns = build_parser().parse_args(["serve", "--port", "40000", "--metrics-port", "40100"])
    scripted_ports(40101, 40102, 40000, 40200, 40100, 40201)
    worker, sched, _ = serve.plan(ns)
    assert (worker.worker_grpc_port, sched.control_port) == (40200, 40201)


def test_free_port_binds_a_real_socket():
    port = serve.free_port("127.0.0.1", frozenset({1}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # it was free
