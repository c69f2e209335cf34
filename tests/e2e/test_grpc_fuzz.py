"""Fuzzes the gRPC services of one real server with requests built from the protos (issue 41).

Every public RPC and the scheduler's control service get hypothesis-drawn bodies through a
generic channel method (bytes in, bytes out): well-formed messages with extreme values, and
bodies cut short, padded with garbage, carrying unknown fields, or random. Whatever comes
back must be a status the API documents, never UNKNOWN or INTERNAL (a handler that raised),
and no detail may quote a Python traceback. Afterwards the server still answers a greedy
Generate and, idle, holds no KV beyond its cache.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import NamedTuple

import grpc
import pytest
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixserve.internal.v1 import engine_pb2
from radixserve.v1 import generation_pb2 as pb
from services.common.curve import InternalKeys, generate_keys
from tests.proto_strategies import messages, mutated, wire_bytes
from tests.server_util import Server, free_port, greedy

pytestmark = pytest.mark.slow

S = grpc.StatusCode
PUBLIC = "/radixserve.v1.Generation/"
CONTROL = "/radixserve.internal.v1.SchedulerControl/"
# What a request may be answered with; UNKNOWN and INTERNAL mean a handler raised.
EXPECTED = {
    S.OK,
    S.INVALID_ARGUMENT,
    S.OUT_OF_RANGE,
    S.RESOURCE_EXHAUSTED,
    S.FAILED_PRECONDITION,
    S.NOT_FOUND,
    S.ALREADY_EXISTS,  # a request_id drawn twice while the first is still running
    S.UNIMPLEMENTED,
}
REFUSED = {S.UNAUTHENTICATED, S.PERMISSION_DENIED}
WRONG_TOKENS = [None, "Bearer wrong", "Bearer ", "bearer", "Basic dXNlcjpwdw==", "Bearer  x"]
# The long run (docs/benchmarks.md, "Generated attacks"): RADIXSERVE_FUZZ_SCALE=20 pytest ...
SCALE = max(1, int(os.environ.get("RADIXSERVE_FUZZ_SCALE", "1")))
FUZZ = settings(
    max_examples=100 * SCALE,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
CHAT = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])
# Valid requests that mutated() changes a few fields of: most of what messages() draws is
# refused by the first check it meets, these get through to the engine.
GENERATE_BASES = [
    pb.GenerateRequest(text="Hello there", sampling=greedy(4)),
    pb.GenerateRequest(
        input_ids=pb.InputIds(ids=[5, 6, 7]),
        sampling=pb.SamplingParams(
            max_tokens=4, top_k=5, logprobs=True, top_logprobs=2, stop=["x"]
        ),
    ),
    pb.GenerateRequest(messages=CHAT, sampling=greedy(4, regex="[a-z]+"), n=2),
]
PUBLIC_UNARY = [
    ("Tokenize", pb.TokenizeRequest(messages=CHAT)),
    ("GetModelInfo", pb.GetModelInfoRequest()),
    ("FlushCache", pb.FlushCacheRequest()),
    ("NoSuchMethod", pb.GetModelInfoRequest()),
]


def _bodies(base: Message) -> st.SearchStrategy[bytes]:
    """Raw bodies for ``base``'s type, and ``base`` with a few fields changed."""
    changed = mutated(base).map(lambda m: m.SerializeToString())
    return wire_bytes(type(base)) | changed


class Control(NamedTuple):
    channel: grpc.Channel
    token: str  # the authorization header that admits a caller


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> InternalKeys:
    folder = str(tmp_path_factory.mktemp("keys"))
    generate_keys(folder)
    return InternalKeys(folder)


@pytest.fixture(scope="module")
def control_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def server(keys, control_port) -> Iterator[Server]:
    flags = (f"--control-port={control_port}", f"--internal-keys-dir={keys.folder}")
    with Server(*flags, "--max-total-tokens=4096") as s:
        yield s


@pytest.fixture(scope="module")
def control(server, keys, control_port) -> Iterator[Control]:
    with grpc.insecure_channel(f"127.0.0.1:{control_port}") as channel:
        yield Control(channel, f"Bearer {keys.control_token()}")


def _check(err: grpc.RpcError, allowed: set[grpc.StatusCode]) -> None:
    code, details = err.code(), err.details() or ""
    assert code in allowed, f"{code}: {details}"
    for trace in ("Traceback", 'File "', "Exception calling application", "Exception iterating"):
        assert trace not in details, details


def _unary(
    channel: grpc.Channel,
    method: str,
    body: bytes,
    token: str | None = None,
    allowed: set[grpc.StatusCode] = EXPECTED,
) -> bytes | None:
    """One call with serializers None: ``body`` goes out as is, the answer comes back raw."""
    metadata = [("authorization", token)] if token is not None else None
    try:
        return channel.unary_unary(method)(body, timeout=30, metadata=metadata)
    except grpc.RpcError as e:
        _check(e, allowed)
        return None


def _generate(server: Server, body: bytes, keep: int = 3) -> None:
    """A raw Generate read to its end, or cancelled after ``keep`` messages."""
    call = server.channel.unary_stream(PUBLIC + "Generate")(body, timeout=60)
    try:
        for i, _ in enumerate(call):
            if i + 1 >= keep:
                call.cancel()
                return
    except grpc.RpcError as e:
        _check(e, EXPECTED)


@settings(FUZZ, max_examples=300 * SCALE)
@given(st.sampled_from(GENERATE_BASES).flatmap(mutated) | messages(pb.GenerateRequest))
def test_generate_messages(server, request):
    _generate(server, request.SerializeToString())


@FUZZ
@given(body=wire_bytes(pb.GenerateRequest))
def test_generate_bytes(server, body):
    _generate(server, body)


@FUZZ
@given(st.data())
def test_public_unary_rpcs(server, data):
    name, base = data.draw(st.sampled_from(PUBLIC_UNARY))
    _unary(server.channel, PUBLIC + name, data.draw(_bodies(base)))


CONTROL_RPCS = [
    ("GetStats", engine_pb2.StatsRequest),
    ("CacheSnapshot", engine_pb2.CacheSnapshotRequest),
    ("FlushCache", engine_pb2.FlushRequest),
]


@FUZZ
@given(st.data())
def test_control_with_the_token(control, data):
    name, cls = data.draw(st.sampled_from(CONTROL_RPCS))
    _unary(control.channel, CONTROL + name, data.draw(wire_bytes(cls)), control.token)


@settings(FUZZ, max_examples=30 * SCALE)
@given(st.data())
def test_control_without_the_token_is_refused(control, data):
    name, cls = data.draw(st.sampled_from(CONTROL_RPCS))
    token = data.draw(st.sampled_from(WRONG_TOKENS))
    body = data.draw(wire_bytes(cls))
    assert _unary(control.channel, CONTROL + name, body, token, REFUSED) is None


def test_the_server_still_serves_and_its_pool_is_whole(server, control):
    ids, _, last = server.generate(text="Beautiful is better than", sampling=greedy(8))
    assert ids and last.finish_reason, server.output()
    stats = _control_stats(control)
    deadline = time.monotonic() + 10
    while stats.num_running_reqs or stats.num_queue_reqs:
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)
        stats = _control_stats(control)
    assert stats.used_tokens == 0 and stats.protected_tokens == 0, stats
    assert stats.available_tokens + stats.evictable_tokens == stats.max_total_num_tokens, stats
    assert server.proc.poll() is None
    assert "Traceback" not in server.output(), server.output()[-4000:]


def _control_stats(control: Control) -> engine_pb2.SchedulerStats:
    raw = _unary(control.channel, CONTROL + "GetStats", b"", control.token)
    assert raw is not None
    return engine_pb2.SchedulerStats.FromString(raw)
