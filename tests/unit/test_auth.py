"""The API key on the public surface (issue 15): every HTTP route and gRPC method of the
real frontend needs it, health probes excepted; admin routes take the admin key; keys are
compared in constant time; the client sends it. Also the control token interceptor on a
synchronous grpc.server, and what the frontend does with bytes that are not a request."""

from __future__ import annotations

import dataclasses
import hmac
from concurrent import futures

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from radixserve.client import Client
from radixserve.v1 import generation_pb2 as pb
from radixserve.v1 import generation_pb2_grpc
from services.common import bearer
from services.common.bearer import BearerInterceptor, MethodKeys, bearer_matches
from services.common.config import FrontendConfig, add_dataclass_args, from_args, to_argv
from services.frontend.auth import HEALTH_PATHS, ApiKeys
from services.frontend.tokenizer import Tokenizer

try:
    from tests.fake_scheduler import FakeScheduler, FrontendThread, build_tokenizer, frontend_config
except ImportError:
    from fake_scheduler import FakeScheduler, FrontendThread, build_tokenizer, frontend_config

KEY, ADMIN = "sk-test-key", "sk-admin-key"
SERVICE = "radixserve.v1.Generation"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def fake(model_dir):
    tok = Tokenizer(str(model_dir))
    f = FakeScheduler(tok.encode("hello world"), tok.vocab_size).start()
    yield f
    f.stop()


@pytest.fixture(scope="module")
def frontend(model_dir, fake):
    cfg = dataclasses.replace(
        frontend_config(model_dir, [fake], http=True), api_key=KEY, admin_api_key=ADMIN
    )
    fe = FrontendThread(cfg).start().wait_ready()
    yield fe
    fe.stop()


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _routes(base: str) -> list[tuple[str, str]]:
    """Every route the app has (from its OpenAPI document), plus FastAPI's own pages."""
    spec = httpx.get(base + "/openapi.json", headers=_auth(KEY)).json()
    routes = [(m.upper(), path) for path, ops in spec["paths"].items() for m in ops]
    return routes + [("GET", "/docs"), ("GET", "/redoc"), ("GET", "/openapi.json")]


def _assert_401(resp: httpx.Response, words: str) -> None:
    assert resp.status_code == 401, (resp.request.url, resp.text)
    error = resp.json()["error"]
    assert error["code"] == "invalid_api_key" and words in error["message"]
    assert error["type"] == "invalid_request_error"
    assert resp.headers["www-authenticate"] == "Bearer"
    assert KEY not in resp.text and ADMIN not in resp.text


def test_every_http_route_refuses_a_missing_or_wrong_key(frontend):
    routes = _routes(frontend.http_base)
    paths = {p for _, p in routes}
    assert {"/v1/completions", "/v1/chat/completions", "/flush_cache", "/metrics"} <= paths
    with httpx.Client(base_url=frontend.http_base) as http:
        for method, path in routes:
            if path in HEALTH_PATHS:  # the probes (/health, /livez) are open by design
                continue
            _assert_401(http.request(method, path, json={}), "missing API key")
            _assert_401(http.request(method, path, json={}, headers=_auth("nope")), "invalid")
            basic = {"Authorization": f"Basic {KEY}"}
            _assert_401(http.request(method, path, json={}, headers=basic), "invalid")


def test_the_right_key_opens_every_route_and_health_needs_none(frontend):
    with httpx.Client(base_url=frontend.http_base) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/livez").status_code == 200
        assert http.get("/healthz").status_code != 401  # no such route: 404, not 401
        for path in ("/v1/models", "/metrics", "/docs", "/redoc", "/openapi.json"):
            assert http.get(path, headers=_auth(KEY)).status_code == 200, path
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
        done = http.post("/v1/completions", json=body, headers=_auth(KEY))
        assert done.status_code == 200, done.text


def test_admin_routes_take_the_admin_key_only(frontend):
    with httpx.Client(base_url=frontend.http_base) as http:
        _assert_401(http.post("/flush_cache", headers=_auth(KEY)), "invalid")
        assert http.post("/flush_cache", headers=_auth(ADMIN)).status_code in (200, 400)
        abort = {"json": {"rid": "nobody"}}  # SGLang's: it can abort anyone's requests
        _assert_401(http.post("/abort_request", headers=_auth(KEY), **abort), "invalid")
        assert http.post("/abort_request", headers=_auth(ADMIN), **abort).status_code == 200
        # and the admin key is no key for the other routes
        _assert_401(http.get("/v1/models", headers=_auth(ADMIN)), "invalid")


def test_key_for_path_rules():
    keys = ApiKeys(KEY, "", metrics_auth=False)
    assert keys.key_for_path("/metrics") == ""  # --no-metrics-auth
    assert keys.key_for_path("/flush_cache") == KEY  # no admin key: the API key
    assert keys.key_for_path("/readyz") == "" and keys.key_for_path("/generate") == KEY
    assert keys.key_for_path("/health/") == KEY  # only the listed probe paths are open
    assert ApiKeys(KEY).key_for_path("/metrics") == KEY
    assert not ApiKeys().enabled and KEY not in repr(ApiKeys(KEY, ADMIN))


def test_keys_are_compared_in_constant_time_on_bytes(monkeypatch):
    seen: list[tuple[object, object]] = []
    real = hmac.compare_digest

    def spy(a, b):
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(bearer.hmac, "compare_digest", spy)
    assert bearer_matches(b"Bearer " + KEY.encode(), KEY)
    assert bearer_matches(f"bearer {KEY}", KEY)
    assert not bearer_matches(f"Bearer {KEY}x", KEY)
    assert not bearer_matches("Bearer é", KEY)  # non-ASCII header: no exception
    assert not bearer_matches(None, KEY) and not bearer_matches(KEY, KEY)
    assert len(seen) == 4 and all(isinstance(a, bytes) and isinstance(b, bytes) for a, b in seen)


# ---- gRPC ---------------------------------------------------------------------------


def _calls(ch: grpc.Channel, metadata):
    stub = generation_pb2_grpc.GenerationStub(ch)
    gen = pb.GenerateRequest(text="hello", sampling=pb.SamplingParams(max_tokens=2))
    return {
        "Generate": lambda: list(stub.Generate(gen, metadata=metadata, timeout=10)),
        "Tokenize": lambda: stub.Tokenize(pb.TokenizeRequest(text="hi"), metadata=metadata),
        "GetModelInfo": lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata),
        "FlushCache": lambda: stub.FlushCache(pb.FlushCacheRequest(), metadata=metadata),
        "reflection": lambda: list(
            reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                metadata=metadata,
            )
        ),
    }


@pytest.mark.parametrize("key", [None, "nope"])
def test_every_rpc_refuses_a_missing_or_wrong_key(frontend, key):
    metadata = [("authorization", f"Bearer {key}")] if key else None
    with grpc.insecure_channel(frontend.grpc_target) as ch:
        for name, call in _calls(ch, metadata).items():
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            words = "missing API key" if key is None else "invalid API key"
            assert words in err.value.details() and "nope" not in err.value.details()


def test_health_needs_no_key_and_the_right_key_works(frontend):
    with grpc.insecure_channel(frontend.grpc_target) as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=SERVICE), timeout=5
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        calls = _calls(ch, [("authorization", f"Bearer {KEY}")])
        assert calls["GetModelInfo"]().model_id == "tiny"
        assert calls["Generate"]()[-1].finish_reason
        assert calls["reflection"]()
        with pytest.raises(grpc.RpcError) as err:  # admin RPC: the API key is not enough
            calls["FlushCache"]()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert _calls(ch, [("authorization", f"Bearer {ADMIN}")])["FlushCache"]()


def test_the_client_sends_its_key_or_the_environment_one(frontend, monkeypatch):
    with Client(frontend.grpc_target, api_key=KEY, timeout=10) as c:
        assert c.model_info().model_id == "tiny"
    monkeypatch.setenv("RADIXSERVE_API_KEY", KEY)
    with Client(frontend.grpc_target, timeout=10) as c:
        assert c.model_info().model_id == "tiny"
    monkeypatch.delenv("RADIXSERVE_API_KEY")
    with Client(frontend.grpc_target, timeout=10) as c, pytest.raises(Exception) as err:
        c.model_info()
    assert "API key" in str(err.value)


def test_invalid_utf8_is_invalid_argument_naming_the_request(frontend):
    """Raw bytes through a generic call: a string field with bytes that are not UTF-8."""
    good = pb.GenerateRequest(text="AB").SerializeToString()
    bad = good.replace(b"AB", b"\xff\xfe")
    metadata = [("authorization", f"Bearer {KEY}")]
    with grpc.insecure_channel(frontend.grpc_target) as ch:
        generate = ch.unary_stream(
            f"/{SERVICE}/Generate", request_serializer=lambda b: b, response_deserializer=None
        )
        tokenize = ch.unary_unary(
            f"/{SERVICE}/Tokenize", request_serializer=lambda b: b, response_deserializer=None
        )
        tok_bad = pb.TokenizeRequest(text="AB").SerializeToString().replace(b"AB", b"\xc3(")
        for what, call in (
            ("Generate", lambda: list(generate(bad, metadata=metadata, timeout=10))),
            ("Tokenize", lambda: tokenize(tok_bad, metadata=metadata, timeout=10)),
        ):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, what
            details = err.value.details()
            assert f"{SERVICE}/{what}" in details and "UTF-8" in details
            assert "Error" not in details.split(":")[0]  # no Python exception name up front
        # the same bytes, well-formed, still work through the same path
        assert list(generate(good, metadata=metadata, timeout=10))


# ---- the control token on a synchronous server ----------------------------------------


def test_control_token_interceptor_on_a_threaded_server():
    from services.common.grpc_util import SERVER_OPTIONS, add_health_and_reflection

    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2),
        options=SERVER_OPTIONS,
        interceptors=[BearerInterceptor(MethodKeys("tok"))],
    )
    add_health_and_reflection(server, ["x.Y"])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            check = health_pb2_grpc.HealthStub(ch).Check
            assert check(health_pb2.HealthCheckRequest(), timeout=5).status == 1  # exempt
            info = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo
            req = [reflection_pb2.ServerReflectionRequest(list_services="")]
            with pytest.raises(grpc.RpcError) as err:
                list(info(iter(req), timeout=5))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert list(info(iter(req), timeout=5, metadata=[("authorization", "Bearer tok")]))
    finally:
        server.stop(None)


# ---- the key never in argv, --help or repr ---------------------------------------------


def test_keys_come_from_env_stay_out_of_argv_help_and_repr(monkeypatch, capsys):
    import argparse

    monkeypatch.setenv("RADIXSERVE_API_KEY", "sk-from-env")
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_dataclass_args(parser, FrontendConfig)
    assert "sk-from-env" not in parser.format_help()
    cfg = from_args(FrontendConfig, parser.parse_args([]))
    assert cfg.api_key == "sk-from-env"  # env when no flag
    assert from_args(FrontendConfig, parser.parse_args(["--api-key", "flag"])).api_key == "flag"
    assert "sk-from-env" not in repr(cfg) and "sk-from-env" not in " ".join(to_argv(cfg))


def test_no_metrics_auth_opens_metrics_only_and_streams_pass_through():
    """The middleware alone around a tiny ASGI app: --no-metrics-auth opens /metrics and
    nothing else; an authorised streamed answer arrives chunk by chunk, untouched."""
    import asyncio

    from services.frontend.auth import ApiKeyAuth

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for part in (b"a", b"b", b"c"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async def run() -> None:
        guarded = ApiKeyAuth(app, ApiKeys(KEY, metrics_auth=False))
        transport = httpx.ASGITransport(app=guarded)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            assert (await http.get("/metrics")).status_code == 200
            assert (await http.get("/v1/models")).status_code == 401
            async with http.stream("GET", "/v1/x", headers=_auth(KEY)) as resp:
                assert resp.status_code == 200
                assert b"".join([c async for c in resp.aiter_raw()]) == b"abc"

    asyncio.run(run())
