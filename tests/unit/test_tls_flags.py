"""TLS flags: their checks before anything binds, and the gRPC credentials they make."""

from __future__ import annotations

import subprocess
import sys
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.cli.serve import _control_tls
from services.common.config import FrontendConfig, SchedulerConfig, WorkerConfig
from services.common.grpc_util import SERVER_OPTIONS, add_health_and_reflection, bind
from services.common.tls import ClientTls, server_credentials
from tests.tls_util import make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_bad_tls_files_name_their_flag(pki, tmp_path):
    cert, key = str(pki.server_cert), str(pki.server_key)
    cases = [
        (FrontendConfig, {"ssl_certfile": cert}, "--ssl-certfile and --ssl-keyfile"),
        (FrontendConfig, {"ssl_certfile": cert, "ssl_keyfile": "/nope"}, "--ssl-keyfile: cannot"),
        (FrontendConfig, {"ssl_ca_certs": str(pki.ca)}, "--ssl-ca-certs (client certificates)"),
        (FrontendConfig, {"control_ssl_ca_certs": key}, "--control-ssl-ca-certs: not a PEM"),
        (FrontendConfig, {"ssl_certfile": cert, "ssl_keyfile": str(pki.client_key)}, "not a PEM"),
        (SchedulerConfig, {"control_ssl_keyfile": key}, "--control-ssl-certfile and"),
        (WorkerConfig, {"control_ssl_certfile": "/nope", "control_ssl_keyfile": key}, "cannot"),
    ]
    for cls, kw, why in cases:
        with pytest.raises(ValueError, match=why.replace("(", r"\(").replace(")", r"\)")):
            cls(**kw)


def test_an_unreadable_file_stops_the_frontend_with_status_2(pki):
    cmd = [sys.executable, "-m", "services.cli", "frontend", "--ssl-certfile", "/nope/cert.pem",
           "--ssl-keyfile", str(pki.server_key)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "radixserve frontend: --ssl-certfile: cannot read /nope/cert.pem"
    ]


def test_serve_needs_the_control_ca_with_a_control_certificate(pki):
    sched = SchedulerConfig(
        control_ssl_certfile=str(pki.server_cert), control_ssl_keyfile=str(pki.server_key)
    )
    with pytest.raises(ValueError, match="--control-ssl-ca-certs"):
        _control_tls(sched, FrontendConfig())
    assert _control_tls(sched, FrontendConfig(control_ssl_ca_certs=str(pki.ca))) is not None
    assert _control_tls(SchedulerConfig(), FrontendConfig()) is None


def _health(channel: grpc.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_tls_grpc_server_without_client_certificates(pki):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=SERVER_OPTIONS)
    add_health_and_reflection(server, [])
    creds = server_credentials(str(pki.server_cert), str(pki.server_key))
    port = bind(server, "127.0.0.1", 0, "test", creds)
    server.start()
    try:
        addr = f"127.0.0.1:{port}"
        tls = ClientTls.of(str(pki.ca))
        assert tls is not None
        with grpc.secure_channel(addr, tls.credentials) as ch:
            assert _health(ch) == health_pb2.HealthCheckResponse.SERVING
        # The certificate checked for a name of its own (the engines are dialed by IP).
        named = ClientTls.of(str(pki.ca), "localhost")
        assert named is not None
        with grpc.secure_channel(addr, named.credentials, options=list(named.options)) as ch:
            assert _health(ch) == health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(addr) as ch, pytest.raises(grpc.RpcError):
            _health(ch)
    finally:
        server.stop(None)
