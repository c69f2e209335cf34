"""A gRPC port already bound fails with a message naming it; it is never silently shared
(grpc's default SO_REUSEPORT let a second server take a share of the first one's clients)."""

from concurrent import futures

import grpc
import pytest

from services.common.grpc_util import SERVER_OPTIONS, bind


def _server() -> grpc.Server:
    return grpc.server(futures.ThreadPoolExecutor(max_workers=1), options=SERVER_OPTIONS)


def test_second_server_on_a_bound_port_fails_naming_it():
    first = _server()
    port = bind(first, "127.0.0.1", 0, "first")
    first.start()
    try:
        with pytest.raises(OSError, match=rf"second: cannot bind 127.0.0.1:{port}.*in use"):
            bind(_server(), "127.0.0.1", port, "second")
    finally:
        first.stop(0)


def test_free_port_binds():
    server = _server()
    assert bind(server, "127.0.0.1", 0, "any") > 0
    server.stop(0)
