"""TLS end to end: one `radixserve serve` with mutual TLS on its public gRPC and HTTP ports
and TLS on the control gRPC (scheduler and worker, dialed by serve and the frontend)."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.server_util import Server, greedy
from tests.tls_util import make_pki

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def server(pki):
    ca = pki.ca.read_bytes()
    creds = grpc.ssl_channel_credentials(
        ca, pki.client_key.read_bytes(), pki.client_cert.read_bytes()
    )
    cert = ("--ssl-certfile", str(pki.server_cert), "--ssl-keyfile", str(pki.server_key))
    control = ("--control-ssl-certfile", str(pki.server_cert),
               "--control-ssl-keyfile", str(pki.server_key),
               "--control-ssl-ca-certs", str(pki.ca))  # fmt: skip
    flags = (*cert, "--ssl-ca-certs", str(pki.ca), *control, "--max-total-tokens", "4096")
    with Server(*flags, credentials=creds) as s:
        yield s


def _check(channel: grpc.Channel) -> None:
    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)


def _complete(url: str, ctx: ssl.SSLContext | None) -> dict:
    body = json.dumps({"prompt": "Beautiful is better", "max_tokens": 4, "temperature": 0})
    req = urllib.request.Request(
        url + "/v1/completions", body.encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60, context=ctx) as r:
        return json.load(r)


def _client_ctx(pki, with_cert: bool) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    if with_cert:
        ctx.load_cert_chain(pki.client_cert, pki.client_key)
    return ctx


def test_grpc_generate_over_mutual_tls(server):
    # Generate reaches the scheduler too: the frontend dialed its control port over TLS.
    ids, _, last = server.generate(text="Beautiful is better", sampling=greedy(4))
    assert len(ids) == 4 and last.finish_reason


def test_grpc_without_client_certificate_or_tls_is_refused(server, pki):
    no_cert = grpc.ssl_channel_credentials(pki.ca.read_bytes())
    for channel in (grpc.secure_channel(server.addr, no_cert), grpc.insecure_channel(server.addr)):
        with channel, pytest.raises(grpc.RpcError) as e:
            _check(channel)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_https_completion_with_client_certificate(server, pki):
    done = _complete(f"https://127.0.0.1:{server.http_port}", _client_ctx(pki, True))
    assert done["usage"]["completion_tokens"] == 4


def test_https_without_client_certificate_and_plain_http_fail(server, pki):
    url = f"127.0.0.1:{server.http_port}"
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        _complete(f"https://{url}", _client_ctx(pki, False))
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        _complete(f"http://{url}", None)
