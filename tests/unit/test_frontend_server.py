"""The real frontend (grpc.aio + ZeroMQ) against a scripted scheduler, on loopback."""

from __future__ import annotations

import argparse
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from radixserve.v1 import generation_pb2 as pb
from radixserve.v1 import generation_pb2_grpc
from services.common import transport
from services.frontend.client import add_generate_args, run_generate
from services.frontend.tokenizer import Tokenizer

try:
    from tests.fake_scheduler import (
        EOS_ID,
        SCRIPT_TEXT,
        FakeScheduler,
        FrontendThread,
        build_tokenizer,
        frontend_config,
    )
except ImportError:
    from fake_scheduler import (
        EOS_ID,
        SCRIPT_TEXT,
        FakeScheduler,
        FrontendThread,
        build_tokenizer,
        frontend_config,
    )

SERVICE = "radixserve.v1.Generation"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer(str(model_dir))


@pytest.fixture(scope="module")
def fake(tok):
    f = FakeScheduler(tok.encode(SCRIPT_TEXT), tok.vocab_size).start()
    yield f
    f.stop()


@pytest.fixture(scope="module")
def frontend(model_dir, fake):
    fe = FrontendThread(frontend_config(model_dir, [fake])).start()
    yield fe
    fe.stop()


@pytest.fixture(scope="module")
def channel(frontend):
    with grpc.insecure_channel(frontend.grpc_target) as ch:
        _wait_serving(ch)
        yield ch


@pytest.fixture
def stub(channel):
    return generation_pb2_grpc.GenerationStub(channel)


def _health(ch, service: str = SERVICE):
    return (
        health_pb2_grpc.HealthStub(ch)
        .Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        .status
    )


def _wait_serving(ch, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _health(ch) != health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() < deadline, "frontend never became SERVING"
        time.sleep(0.05)


def _generate(stub, **kw) -> list[pb.GenerateResponse]:
    return list(stub.Generate(pb.GenerateRequest(**kw), timeout=20))


def _wait_for(pred, timeout_s: float = 2.0) -> float:
    """Seconds until pred() held (fails after timeout_s)."""
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout_s, "condition not reached in time"
        time.sleep(0.005)
    return time.monotonic() - t0


# ---- streaming -----------------------------------------------------------------------


def test_streams_tokens_and_text_until_length(stub, fake, tok):
    prompt = "hello world"
    out = _generate(stub, text=prompt, sampling=pb.SamplingParams(max_tokens=10))
    ids = [t for r in out for t in r.token_ids]
    assert ids == fake.script[:10]
    assert "".join(r.text for r in out) == tok.decode(fake.script[:10])
    last = out[-1]
    assert [r.finish_reason for r in out[:-1]] == [""] * (len(out) - 1)
    assert last.finish_reason == "length" and last.completion_tokens == 10
    n_prompt = len(tok.encode(prompt))
    assert (last.prompt_tokens, last.cached_tokens) == (n_prompt, n_prompt // 2)
    assert last.timings.decode_time == pytest.approx(0.003) and last.timings.total_time > 0
    assert len({r.request_id for r in out}) == 1 and out[0].request_id


def test_utf8_never_split_and_eos_finish(stub, fake, tok):
    out = _generate(stub, text="hi", request_id="utf8-1")
    assert "".join(r.text for r in out) == SCRIPT_TEXT
    assert all("\ufffd" not in r.text for r in out)
    assert any(r.token_ids and not r.text for r in out)  # held back half characters
    assert out[-1].finish_reason == "stop" and out[-1].matched_stop == "</s>"
    assert out[-1].token_ids == [EOS_ID] and all(r.request_id == "utf8-1" for r in out)
    sent = fake.requests[-1]
    assert sent.rid == "utf8-1" and list(sent.eos_token_ids) == [EOS_ID] and sent.arrival_time > 0


def test_stop_string_cuts_text_and_aborts_scheduler(stub, fake, tok):
    prompt = "hello there world"
    out = _generate(
        stub, text=prompt, request_id="stop-1", sampling=pb.SamplingParams(stop=["STOP", "zzz"])
    )
    assert "".join(r.text for r in out) == SCRIPT_TEXT[: SCRIPT_TEXT.index("STOP")]
    last = out[-1]
    assert last.finish_reason == "stop" and last.matched_stop == "STOP"
    # Totals come from the scheduler's closing delta; completion counts what was streamed.
    n_prompt = len(tok.encode(prompt))
    assert (last.prompt_tokens, last.cached_tokens) == (n_prompt, n_prompt // 2)
    assert last.completion_tokens == sum(len(r.token_ids) for r in out)
    assert last.timings.decode_time == pytest.approx(0.003)
    _wait_for(lambda: any(a.rid == "stop-1" for a, _ in fake.aborts))


def test_several_tokens_per_delta_stop_where_one_per_delta_would(stub, fake):
    """Speculative decoding streams several tokens per delta: a stop string matched in the
    middle of one keeps nothing after it (tokens, logprobs, counts), as one per delta."""
    sp = pb.SamplingParams(stop=["STOP"], logprobs=True)
    one = _generate(stub, text="hello there", request_id="one-1", sampling=sp)
    many = _generate(
        stub, text="hello there", request_id="many-1", sampling=sp, cache_salt="multi:4"
    )
    assert any(len(r.token_ids) > 1 for r in many)

    def seen(out):
        ids = [t for r in out for t in r.token_ids]
        lps = [lp.token_id for r in out for lp in r.logprobs]
        return "".join(r.text for r in out), ids, lps, out[-1].completion_tokens

    assert seen(many) == seen(one)
    assert seen(one)[0] == SCRIPT_TEXT[: SCRIPT_TEXT.index("STOP")]
    assert seen(one)[1] == seen(one)[2] and seen(one)[3] == len(seen(one)[1])


def test_chat_and_input_ids_reach_scheduler_tokenized(stub, fake, tok):
    msgs = pb.ChatMessages(
        messages=[
            pb.ChatMessage(role="system", content="be brief"),
            pb.ChatMessage(role="user", content="hi"),
        ]
    )
    _generate(
        stub,
        messages=msgs,
        sampling=pb.SamplingParams(max_tokens=2, temperature=0, seed=7),
        priority=3,
        cache_salt="s",
    )
    sent = fake.requests[-1]
    assert list(transport.unpack_i32(sent.input_ids)) == tok.encode_chat(
        [("system", "be brief"), ("user", "hi")]
    )
    assert (
        sent.sampling.temperature == 0
        and sent.sampling.seed == 7
        and sent.priority == 3
        and sent.cache_salt == "s"
    )
    _generate(stub, input_ids=pb.InputIds(ids=[5, 6, 7]), sampling=pb.SamplingParams(max_tokens=1))
    assert list(transport.unpack_i32(fake.requests[-1].input_ids)) == [5, 6, 7]


def test_logprobs_are_relayed(stub):
    out = _generate(
        stub, text="hi", sampling=pb.SamplingParams(max_tokens=3, logprobs=True, top_logprobs=1)
    )
    lps = [lp for r in out for lp in r.logprobs]
    assert [lp.token_id for lp in lps] == [t for r in out for t in r.token_ids]
    assert all(lp.logprob == pytest.approx(-0.5) and len(lp.top) == 1 for lp in lps)


# ---- errors --------------------------------------------------------------------------


BAD = [
    (dict(text=""), "text"),
    (dict(), "input"),
    (dict(text="hi", sampling=pb.SamplingParams(max_tokens=-1)), "sampling.max_tokens"),
    (
        dict(text="hi", sampling=pb.SamplingParams(prompt_logprobs=True, prompt_logprobs_start=99)),
        "sampling.prompt_logprobs_start",
    ),
    (dict(text="hi", sampling=pb.SamplingParams(max_tokens=300)), "max_model_len 256"),
    (dict(text="hi", sampling=pb.SamplingParams(temperature=-1)), "sampling.temperature"),
    (dict(text="hi", sampling=pb.SamplingParams(top_p=0)), "sampling.top_p"),
    (dict(text="hi", sampling=pb.SamplingParams(top_k=-2)), "sampling.top_k"),
    (dict(text="hi", sampling=pb.SamplingParams(min_p=2)), "sampling.min_p"),
    (
        dict(text="hi", sampling=pb.SamplingParams(repetition_penalty=3)),
        "sampling.repetition_penalty",
    ),
    (
        dict(text="hi", sampling=pb.SamplingParams(frequency_penalty=5)),
        "sampling.frequency_penalty",
    ),
    (dict(text="hi", sampling=pb.SamplingParams(presence_penalty=-5)), "sampling.presence_penalty"),
    (dict(text="hi", sampling=pb.SamplingParams(top_logprobs=50)), "sampling.top_logprobs"),
    (dict(text="hi", sampling=pb.SamplingParams(stop=[""])), "sampling.stop[0]"),
    (dict(text="hi", sampling=pb.SamplingParams(stop=["a"] * 17)), "at most 16"),
    (dict(input_ids=pb.InputIds(ids=[1, 999])), "input_ids.ids[1]"),
    (dict(input_ids=pb.InputIds(ids=list(range(5, 261)))), "max_model_len"),
    (
        dict(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="wizard", content="x")])),
        "messages[0].role",
    ),
]


@pytest.mark.parametrize(("kw", "named"), BAD)
def test_bad_input_is_invalid_argument_and_server_keeps_serving(stub, fake, kw, named):
    n_sent = len(fake.requests)
    with pytest.raises(grpc.RpcError) as e:
        _generate(stub, **kw)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in e.value.details()
    assert len(fake.requests) == n_sent  # nothing reached the scheduler
    assert (
        _generate(stub, text="ok", sampling=pb.SamplingParams(max_tokens=1))[-1].finish_reason
        == "length"
    )


def test_scheduler_error_code_becomes_grpc_status(stub):
    with pytest.raises(grpc.RpcError) as e:
        _generate(stub, text="hi", cache_salt="error:RESOURCE_EXHAUSTED")
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert e.value.details() == "fake refusal: no room"
    assert ("retry-after", "2") in tuple(e.value.trailing_metadata() or ())  # overloaded


def test_cancel_aborts_at_scheduler_promptly(stub, fake):
    call = stub.Generate(pb.GenerateRequest(text="hi", request_id="cancel-1", cache_salt="slow"))
    assert next(call).token_ids and next(call).token_ids
    t_cancel = time.monotonic()
    call.cancel()
    _wait_for(lambda: any(a.rid == "cancel-1" for a, _ in fake.aborts))
    t_abort = next(t for a, t in fake.aborts if a.rid == "cancel-1")
    assert t_abort - t_cancel < 0.5


def test_duplicate_request_id_in_flight_is_refused(stub, fake):
    call = stub.Generate(pb.GenerateRequest(text="hi", request_id="dup-1", cache_salt="slow"))
    next(call)
    with pytest.raises(grpc.RpcError) as e:
        _generate(stub, text="hi", request_id="dup-1")
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "dup-1" in e.value.details()
    call.cancel()
    _wait_for(lambda: any(a.rid == "dup-1" for a, _ in fake.aborts))


# ---- small RPCs ----------------------------------------------------------------------


def test_health_and_reflection(channel):
    assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
    assert _health(channel, "") == health_pb2.HealthCheckResponse.SERVING
    req = reflection_pb2.ServerReflectionRequest(list_services="")
    resp = next(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter([req])))
    names = {s.name for s in resp.list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health"} <= names


def test_get_model_info(stub, tok):
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    assert (info.model_id, info.max_model_len, info.vocab_size) == ("tiny", 256, tok.vocab_size)
    assert (info.page_size, info.max_total_num_tokens, info.num_engines) == (1, 4096, 1)
    assert info.architecture == "LlamaForCausalLM"


def test_tokenize(stub, tok):
    resp = stub.Tokenize(pb.TokenizeRequest(text="hello world"), timeout=5)
    assert list(resp.ids) == tok.encode("hello world") and len(resp.tokens) == len(resp.ids)
    with pytest.raises(grpc.RpcError) as e:
        stub.Tokenize(pb.TokenizeRequest(text=""), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_flush_cache_relays_success_and_refusal(stub, fake):
    before = fake.flushes
    assert stub.FlushCache(pb.FlushCacheRequest(), timeout=5) == pb.FlushCacheResponse(
        flushed=True, message="Cache flushed."
    )
    assert fake.flushes == before + 1
    fake.flush_refusal = "2 requests running"
    try:
        resp = stub.FlushCache(pb.FlushCacheRequest(), timeout=5)
    finally:
        fake.flush_refusal = ""
    assert not resp.flushed and "2 requests running" in resp.message


def test_generate_cli_streams_to_stdout(frontend, fake, tok, capsys):
    parser = argparse.ArgumentParser()
    add_generate_args(parser)
    ns = parser.parse_args(
        [
            "hi",
            "--target",
            frontend.grpc_target,
            "--max-tokens",
            "24",
            "--show-stats",
            "--seed",
            "1",
        ]
    )
    assert run_generate(ns) == 0
    out = capsys.readouterr()
    assert out.out == tok.decode(fake.script[:24]) + "\n"
    assert "finish_reason=length" in out.err and "completion_tokens=24" in out.err
    bad = parser.parse_args(["hi", "--target", frontend.grpc_target, "--max-tokens=-1"])
    assert run_generate(bad) == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err


# ---- engines that start late, several engines -----------------------------------------


def test_not_serving_until_engines_answer(model_dir, tok):
    late = FakeScheduler(tok.encode(SCRIPT_TEXT), tok.vocab_size)
    fe = FrontendThread(frontend_config(model_dir, [late])).start()
    try:
        with grpc.insecure_channel(fe.grpc_target) as ch:
            assert _health(ch) == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as e:
                _generate(generation_pb2_grpc.GenerationStub(ch), text="hi")
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            late.start()
            _wait_serving(ch)
            out = _generate(
                generation_pb2_grpc.GenerationStub(ch),
                text="hi",
                sampling=pb.SamplingParams(max_tokens=2),
            )
            assert out[-1].finish_reason == "length"
    finally:
        fe.stop()
        late.stop()


def test_routes_across_engines_and_flush_needs_all(model_dir, tok):
    fakes = [FakeScheduler(tok.encode(SCRIPT_TEXT), tok.vocab_size).start() for _ in range(2)]
    fe = FrontendThread(frontend_config(model_dir, fakes)).start()
    try:
        with grpc.insecure_channel(fe.grpc_target) as ch:
            _wait_serving(ch)
            stub = generation_pb2_grpc.GenerationStub(ch)
            assert stub.GetModelInfo(pb.GetModelInfoRequest()).num_engines == 2
            shared = list(range(10, 42))
            for i in range(4):  # same first 32 tokens: one engine gets them all
                _generate(
                    stub,
                    input_ids=pb.InputIds(ids=shared + [i + 50]),
                    sampling=pb.SamplingParams(max_tokens=1),
                )
            assert sorted(len(f.requests) for f in fakes) == [0, 4]
            for i in range(30):
                _generate(
                    stub,
                    input_ids=pb.InputIds(ids=[i + 50, 7]),
                    sampling=pb.SamplingParams(max_tokens=1),
                )
            assert min(len(f.requests) for f in fakes) > 0  # different prefixes spread out
            fakes[1].flush_refusal = "busy"
            resp = stub.FlushCache(pb.FlushCacheRequest())
            assert not resp.flushed and "engine 1: busy" in resp.message
    finally:
        fe.stop()
        for f in fakes:
            f.stop()


def test_main_logs_listening_line_and_exits_on_sigterm(model_dir):
    import signal
    import subprocess
    import sys

    code = (
        "import sys; from services.common.config import FrontendConfig; "
        "from services.frontend.main import main; "
        f"main(FrontendConfig(model_path={str(model_dir)!r}, port=0, http_port=0, "
        "scheduler_addrs=['ipc:///tmp/radixserve/nobody.sock'], "
        "scheduler_control_addrs=['127.0.0.1:1']))"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "frontend: gRPC on" in line:
                break
        assert any(
            "frontend: gRPC on 127.0.0.1:" in s and ", HTTP on 127.0.0.1:" in s for s in lines
        ), lines
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_engine_going_away_fails_its_requests(model_dir, tok, monkeypatch):
    from services.frontend import engine_pool

    monkeypatch.setattr(engine_pool, "HEALTH_INTERVAL_S", 0.1)
    fake = FakeScheduler(tok.encode(SCRIPT_TEXT), tok.vocab_size).start()
    fe = FrontendThread(frontend_config(model_dir, [fake])).start()
    try:
        with grpc.insecure_channel(fe.grpc_target) as ch:
            _wait_serving(ch)
            call = generation_pb2_grpc.GenerationStub(ch).Generate(
                pb.GenerateRequest(text="hi", cache_salt="slow"), timeout=10
            )
            next(call)
            fake.stop()
            with pytest.raises(grpc.RpcError) as e:
                list(call)
            assert (
                e.value.code() == grpc.StatusCode.UNAVAILABLE
                and "engine 0 is not answering" in e.value.details()
            )
            assert _health(ch) == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        fe.stop()


def test_sigterm_drains_running_streams_and_refuses_new_ones(model_dir, tok):
    """stop(): NOT_SERVING and no new calls at once, while a running stream (3 s here, longer
    than the old 2 s cut) still ends normally within --shutdown-grace-period."""
    import asyncio

    slow = FakeScheduler(tok.encode(SCRIPT_TEXT), tok.vocab_size, step_s=0.15).start()
    fe = FrontendThread(frontend_config(model_dir, [slow])).start()
    channel = grpc.insecure_channel(fe.grpc_target)
    stub = generation_pb2_grpc.GenerationStub(channel)
    try:
        deadline = time.monotonic() + 10
        health = health_pb2_grpc.HealthStub(channel)
        while health.Check(health_pb2.HealthCheckRequest(service=SERVICE)).status != 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        stream = stub.Generate(
            pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=200)), timeout=30
        )
        first = next(stream)
        assert first.token_ids
        stopping = asyncio.run_coroutine_threadsafe(fe.server.stop(10.0), fe.loop)
        time.sleep(0.3)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(pb.GenerateRequest(text="late"), timeout=5))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        rest = list(stream)
        assert rest[-1].finish_reason in ("stop", "length")
        stopping.result(20)
    finally:
        channel.close()
        fe.loop.call_soon_threadsafe(fe.loop.stop)
        slow.stop()
