"""--max-concurrent-requests-per-key: the counter, its ASGI door, and the real frontend over a
scripted scheduler (HTTP and gRPC sharing one count per key)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import grpc
import httpx
import pytest

from radixserve.v1 import generation_pb2 as pb
from radixserve.v1 import generation_pb2_grpc
from services.common.config import FrontendConfig
from services.frontend.key_limits import (
    FLAG,
    KeyBusy,
    KeyConcurrency,
    KeyConcurrencyLimit,
    bearer_token,
    metadata_token,
)
from services.frontend.tokenizer import Tokenizer

try:
    from tests.fake_scheduler import FakeScheduler, FrontendThread, build_tokenizer
    from tests.fake_scheduler import frontend_config as make_config
except ImportError:
    from fake_scheduler import FakeScheduler, FrontendThread, build_tokenizer
    from fake_scheduler import frontend_config as make_config

LIMIT = 2


def _wait_for(pred, timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


# ---- the counter ---------------------------------------------------------------------


def test_bearer_token_parsing():
    assert bearer_token(b"Bearer sk-1") == b"sk-1"
    assert bearer_token("bearer  sk-2 ") == b"sk-2"
    assert bearer_token(None) == bearer_token(b"") == bearer_token(b"Basic x") == b""
    assert metadata_token([("x", "y"), ("authorization", "Bearer g")]) == b"g"
    assert metadata_token(None) == b""


def test_limit_per_key_and_release_on_every_ending():
    refused: list[int] = []
    limits = KeyConcurrency(LIMIT, on_refused=lambda: refused.append(1))
    with limits.hold(b"a"), limits.hold(b"a"):
        assert limits.in_flight(b"a") == LIMIT
        with pytest.raises(KeyBusy, match=FLAG):
            with limits.hold(b"a"):
                pass
        with limits.hold(b"b"):  # another key is unaffected
            assert limits.in_flight(b"b") == 1
        assert limits.in_flight(b"a") == LIMIT  # a refusal takes no slot
    assert limits.in_flight(b"a") == 0 and refused == [1]
    with pytest.raises(RuntimeError), limits.hold(b"a"):  # a failure releases too
        raise RuntimeError
    with pytest.raises(asyncio.CancelledError), limits.hold(b"a"):  # and a cancel
        raise asyncio.CancelledError
    assert limits.in_flight(b"a") == 0 and not limits._held  # no empty entries are kept


def test_zero_is_off():
    limits = KeyConcurrency(0)
    with limits.hold(b"a"), limits.hold(b"a"), limits.hold(b"a"):
        assert limits.in_flight(b"a") == 0


def test_asgi_door_limits_generating_posts_only():
    gate = asyncio.Event()

    async def app(scope, receive, send):
        if scope["path"] == "/v1/completions":
            await gate.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def run() -> None:
        limits = KeyConcurrency(1)
        transport = httpx.ASGITransport(app=KeyConcurrencyLimit(app, limits))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            auth = {"authorization": "Bearer k"}
            held = asyncio.create_task(http.post("/v1/completions", headers=auth))
            while not limits.in_flight(b"k"):
                await asyncio.sleep(0.001)
            refused = await http.post("/v1/completions", headers=auth)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            error = refused.json()["error"]
            assert FLAG in error["message"] and error["type"] == "invalid_request_error"
            assert (await http.post("/generate", headers=auth)).status_code == 429
            assert (await http.get("/v1/models", headers=auth)).status_code == 200
            assert (await http.post("/tokenize", headers=auth)).status_code == 200
            gate.set()
            assert (await held).status_code == 200
            assert limits.in_flight(b"k") == 0

    asyncio.run(run())


def test_flag_bounds():
    assert FrontendConfig().max_concurrent_requests_per_key == 0
    with pytest.raises(ValueError):
        FrontendConfig(max_concurrent_requests_per_key=-1)


# ---- the real frontend: HTTP and gRPC share each key's count ----------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = build_tokenizer(tmp_path_factory.mktemp("model"))
    tok = Tokenizer(str(path))
    fake = FakeScheduler(tok.encode("hello there"), tok.vocab_size).start()
    cfg = dataclasses.replace(
        make_config(path, [fake], http=True), max_concurrent_requests_per_key=LIMIT
    )
    fe = FrontendThread(cfg).start().wait_ready()
    yield fe
    fe.stop()
    fake.stop()


def _key(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


SLOW = {"model": "tiny", "prompt": "hi", "stream": True, "cache_salt": "slow"}  # never ends
QUICK = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


def test_one_more_than_the_limit_is_refused_and_other_keys_pass(served):
    base, limits = served.http_base, served.server.key_limits

    async def run() -> None:
        async with httpx.AsyncClient(base_url=base, timeout=10) as http:

            async def open_stream() -> httpx.Response:
                req = http.build_request("POST", "/v1/completions", json=SLOW, headers=_key("a"))
                return await http.send(req, stream=True)

            # N+1 at once with one key: exactly one refused, at once.
            answers = await asyncio.gather(*(open_stream() for _ in range(LIMIT + 1)))
            codes = sorted(r.status_code for r in answers)
            assert codes == [200] * LIMIT + [429]
            refused = next(r for r in answers if r.status_code == 429)
            await refused.aread()
            assert refused.headers["retry-after"] == "1"
            assert FLAG in refused.json()["error"]["message"]
            # Another key is unaffected; so is the key with no token.
            assert (await http.post("/v1/completions", json=QUICK, headers=_key("b"))).is_success
            assert (await http.post("/v1/completions", json=QUICK)).is_success
            # gRPC counts against the same key.
            with grpc.insecure_channel(served.grpc_target) as ch:
                stub = generation_pb2_grpc.GenerationStub(ch)
                with pytest.raises(grpc.RpcError) as e:
                    req = pb.GenerateRequest(text="hi")
                    list(stub.Generate(req, metadata=tuple(_key("a").items()), timeout=5))
                assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert FLAG in (e.value.details() or "")
            # Cancelled streams (the client goes away) give their slots back.
            for r in answers:
                await r.aclose()
        _wait_for(lambda: limits.in_flight(b"a") == 0)

    asyncio.run(run())
    metrics = httpx.get(base + "/metrics").text
    assert 'frontend_refused_requests_total{model_name="tiny",reason="key_concurrency"} 2.0' in (
        metrics
    )


def test_cancelled_grpc_stream_releases_its_slot(served):
    limits = served.server.key_limits
    with grpc.insecure_channel(served.grpc_target) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        meta = tuple(_key("c").items())
        calls = [
            stub.Generate(pb.GenerateRequest(text="hi", cache_salt="slow"), metadata=meta)
            for _ in range(LIMIT)
        ]
        for call in calls:
            next(call)
        assert limits.in_flight(b"c") == LIMIT
        # HTTP counts against the same key.
        r = httpx.post(served.http_base + "/v1/completions", json=QUICK, headers=_key("c"))
        assert r.status_code == 429
        for call in calls:
            call.cancel()
        _wait_for(lambda: limits.in_flight(b"c") == 0)
        done = list(stub.Generate(pb.GenerateRequest(text="hi"), metadata=meta, timeout=10))
        assert done[-1].finish_reason
    assert limits.in_flight(b"c") == 0
