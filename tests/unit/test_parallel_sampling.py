"""n samples of one prompt (GenerateRequest.n): the prompt prefilled once, then n requests on
the same engine; through gRPC, OpenAI's routes and SGLang's /generate, against the real
frontend and scripted schedulers on loopback."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import grpc
import httpx
import pytest

from radixserve.internal.v1 import engine_pb2
from radixserve.v1 import generation_pb2 as pb
from radixserve.v1 import generation_pb2_grpc
from services.frontend.parallel_sampling import interleave, prefill_request, sample_requests
from services.frontend.validation import ValidationError, validate_request, validate_samples

try:
    from tests.fake_scheduler import SCRIPT_TEXT, FakeScheduler, FrontendThread, frontend_config
    from tests.http_frontend import openai_frontend_fixtures
except ImportError:
    from fake_scheduler import SCRIPT_TEXT, FakeScheduler, FrontendThread, frontend_config
    from http_frontend import openai_frontend_fixtures

tok, fake, frontend, client = openai_frontend_fixtures()


# ---- the requests ---------------------------------------------------------------------


def _treq(**sampling) -> engine_pb2.TokenizedRequest:
    return engine_pb2.TokenizedRequest(
        rid="r",
        input_ids=b"\x05\x00\x00\x00",
        cache_salt="s",
        priority=3,
        sampling=engine_pb2.SamplingParams(**sampling),
    )


def test_sample_i_is_rid_i_with_seed_plus_i_wrapping_at_2_64():
    samples = sample_requests(_treq(seed=2**64 - 2, temperature=1.0, max_tokens=9), 3)
    assert [s.rid for s in samples] == ["r_0", "r_1", "r_2"]
    assert [s.sampling.seed for s in samples] == [2**64 - 2, 2**64 - 1, 0]
    assert all(s.sampling.max_tokens == 9 and s.cache_salt == "s" for s in samples)


def test_unseeded_samples_stay_unseeded():
    assert not any(s.sampling.HasField("seed") for s in sample_requests(_treq(), 2))


def test_the_prefill_keeps_what_decides_the_cache_and_samples_nothing():
    p = prefill_request(_treq(seed=4, logprobs=True, constraint=engine_pb2.Constraint(regex="a")))
    assert p.rid == "r_prefill" and p.cache_salt == "s" and p.priority == 3
    assert p.input_ids == b"\x05\x00\x00\x00"
    assert p.sampling == engine_pb2.SamplingParams(max_tokens=0)


@pytest.mark.parametrize("n, ok", [(0, True), (1, True), (128, True), (129, False), (-1, False)])
def test_n_is_bounded(n, ok):
    req = pb.GenerateRequest(text="x", n=n)
    if ok:
        validate_request(req, 100)
    else:
        with pytest.raises(ValidationError, match=r"n: must be in \[1, 128\]"):
            validate_request(req, 100)


def test_n_times_max_tokens_must_fit_the_pool():
    sp = pb.SamplingParams(max_tokens=100)
    validate_samples(8, 20, sp, 1000, 820)  # 20 + 8 * 100
    with pytest.raises(ValidationError, match="need 821 KV slots; the engine's pool holds 820"):
        validate_samples(8, 21, sp, 1000, 820)
    validate_samples(1, 21, sp, 1000, 10)  # one sample: the scheduler's check
    # max_tokens unset: the default, cut by the context.
    validate_samples(4, 10, pb.SamplingParams(), 50, 10 + 4 * 40)


# ---- interleaving ----------------------------------------------------------------------


async def _gen(name: str, steps: list[float], closed: list[str], fail: bool = False):
    try:
        for k, delay in enumerate(steps):
            await asyncio.sleep(delay)
            yield pb.GenerateResponse(text=f"{name}{k}")
        if fail:
            raise RuntimeError(f"{name} failed")
    finally:
        closed.append(name)


def test_interleave_yields_as_they_come_with_their_index():
    async def run():
        closed: list[str] = []
        a = _gen("a", [0.0, 0.03], closed)
        b = _gen("b", [0.01, 0.01], closed)
        return [(i, r.text) async for i, r in interleave([a, b])], closed

    got, closed = asyncio.run(run())
    assert got == [(0, "a0"), (1, "b0"), (1, "b1"), (0, "a1")]
    assert sorted(closed) == ["a", "b"]


def test_one_failure_closes_the_others_and_is_raised():
    async def run():
        closed: list[str] = []
        a = _gen("a", [0.0, 10.0], closed)
        b = _gen("b", [0.01], closed, fail=True)
        with pytest.raises(RuntimeError, match="b failed"):
            async for _ in interleave([a, b]):
                pass
        return closed

    assert sorted(asyncio.run(run())) == ["a", "b"]


def test_closing_early_closes_every_stream():
    async def run():
        closed: list[str] = []
        merged = interleave([_gen(x, [0.0, 10.0], closed) for x in "abc"])
        await merged.__anext__()
        await merged.aclose()
        return closed

    assert sorted(asyncio.run(run())) == ["a", "b", "c"]


# ---- through the frontend --------------------------------------------------------------


def _since(fake, k: int) -> list[engine_pb2.TokenizedRequest]:
    return list(fake.requests[k:])


def test_the_prompt_goes_first_alone_then_n_seeded_samples(client, fake, tok):
    k = len(fake.requests)
    res = client.completions.create(
        model="tiny",
        prompt="hello world",
        max_tokens=4,
        n=3,
        seed=7,
        extra_body={"request_id": "q"},
    )
    sent = _since(fake, k)
    assert [r.rid for r in sent] == ["q_prefill", "q_0", "q_1", "q_2"]
    assert sent[0].sampling.max_tokens == 0
    assert [r.sampling.seed for r in sent[1:]] == [7, 8, 9]
    assert len({r.input_ids for r in sent}) == 1
    assert [c.index for c in res.choices] == [0, 1, 2]
    assert all(c.text == tok[1].decode(tok[1].encode(SCRIPT_TEXT)[:4]) for c in res.choices)
    n_prompt = len(tok[1].encode("hello world"))
    # The prompt counted once (as OpenAI does), the completions summed.
    assert (res.usage.prompt_tokens, res.usage.completion_tokens) == (n_prompt, 12)
    assert res.usage.total_tokens == n_prompt + 12
    assert res.usage.prompt_tokens_details.cached_tokens == n_prompt // 2  # the prefill's


def test_chat_stream_of_n_carries_each_choices_index_and_usage_once(client):
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role]
    assert sorted(roles) == [0, 1]
    text = {0: "", 1: ""}
    finishes = []
    for c in chunks:
        for choice in c.choices:
            text[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes.append(choice.index)
    assert text[0] == text[1] and text[0]
    assert sorted(finishes) == [0, 1]
    usage = [c.usage for c in chunks if c.usage]
    assert len(usage) == 1 and chunks[-1].usage is not None and chunks[-1].choices == []
    assert usage[0].completion_tokens == 10


def test_best_of_returns_the_n_best_and_counts_every_sample(client, fake):
    k = len(fake.requests)
    res = client.completions.create(model="tiny", prompt="hello", max_tokens=3, n=1, best_of=3)
    sent = _since(fake, k)
    assert len(sent) == 4 and all(r.sampling.logprobs for r in sent[1:])  # ranked by them
    assert [c.index for c in res.choices] == [0]
    assert res.choices[0].logprobs is None  # not asked for
    assert res.usage.completion_tokens == 9


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"n": 0}, "n", "n must be at least 1"),
        ({"n": 129}, "n", "n: must be in [1, 128]"),
        ({"n": 100, "max_tokens": 100}, "n", "KV slots; the engine's pool holds 4096"),
        ({"n": 2, "best_of": 1}, "best_of", "best_of must be >= n (2)"),
        ({"best_of": 129}, "best_of", "best_of must be at most 128"),
        ({"best_of": 2, "stream": True}, "best_of", "cannot be streamed"),
    ],
)
def test_bad_n_or_best_of_is_a_400_naming_it(frontend, body, param, message):
    r = httpx.post(frontend.http_base + "/v1/completions", json={"prompt": "hi", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"]


def test_chat_refuses_best_of(frontend):
    body = {"messages": [{"role": "user", "content": "hi"}], "best_of": 2}
    r = httpx.post(frontend.http_base + "/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"


def test_generate_with_n_answers_a_list_like_sglang(frontend, tok):
    body = {"text": "hello", "rid": "g", "sampling_params": {"n": 2, "max_new_tokens": 3}}
    r = httpx.post(frontend.http_base + "/generate", json=body, timeout=20)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [o["meta_info"]["id"] for o in out] == ["g_0", "g_1"]
    assert [o["index"] for o in out] == [0, 1]
    assert all(o["meta_info"]["completion_tokens"] == 3 for o in out)


def test_generate_batch_with_n_lists_each_prompts_samples_in_a_row(frontend):
    body = {"text": ["hello", "world"], "sampling_params": {"n": 2, "max_new_tokens": 2}}
    out = httpx.post(frontend.http_base + "/generate", json=body, timeout=20).json()
    assert [o["index"] for o in out] == [0, 1, 0, 1]


def test_generate_stream_with_n_carries_the_index(frontend):
    body = {"text": "hello", "stream": True, "sampling_params": {"n": 3, "max_new_tokens": 4}}
    events = []
    with httpx.stream("POST", frontend.http_base + "/generate", json=body, timeout=20) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    assert {e["index"] for e in events} == {0, 1, 2}
    last = {e["index"]: e for e in events if e["meta_info"]["finish_reason"]}
    assert sorted(last) == [0, 1, 2] and all(len(e["output_ids"]) == 4 for e in last.values())


def test_generate_n_over_the_bound_names_it(frontend):
    body = {"text": "hello", "sampling_params": {"n": 500}}
    r = httpx.post(frontend.http_base + "/generate", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("sampling_params.n: must be in [1, 128]")


def test_grpc_n_streams_interleaved_samples_with_index(frontend):
    with grpc.insecure_channel(frontend.grpc_target) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        req = pb.GenerateRequest(
            text="hello", n=2, request_id="x", sampling=pb.SamplingParams(max_tokens=3)
        )
        msgs = list(stub.Generate(req, timeout=20))
    assert {m.index for m in msgs} == {0, 1}
    finals = sorted((m for m in msgs if m.finish_reason), key=lambda m: m.index)
    assert [(m.index, m.request_id, m.completion_tokens) for m in finals] == [
        (0, "x_0", 3),
        (1, "x_1", 3),
    ]


def test_cancelling_aborts_every_sample(frontend, fake):
    with grpc.insecure_channel(frontend.grpc_target) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        req = pb.GenerateRequest(text="hello", n=3, request_id="c", cache_salt="slow")
        call = stub.Generate(req, timeout=20)
        next(call)
        call.cancel()
    deadline = time.monotonic() + 5
    wanted = {"c_0", "c_1", "c_2"}
    while not wanted <= {a.rid for a, _ in fake.aborts}:
        assert time.monotonic() < deadline, [a.rid for a, _ in fake.aborts]
        time.sleep(0.02)


def test_samples_follow_their_prefill_to_its_engine(tok):
    fakes = [FakeScheduler(tok[1].encode(SCRIPT_TEXT), tok[1].vocab_size).start() for _ in "ab"]
    cfg = dataclasses.replace(
        frontend_config(tok[0], fakes, http=True), routing_policy="round_robin"
    )
    fe = FrontendThread(cfg).start().wait_ready()
    try:
        body = {"prompt": "hello", "max_tokens": 2, "n": 5}
        r = httpx.post(fe.http_base + "/v1/completions", json=body, timeout=20)
        assert r.status_code == 200, r.text
        counts = sorted(len(f.requests) for f in fakes)
        assert counts == [0, 6]  # round robin would have spread them
    finally:
        fe.stop()
        for f in fakes:
            f.stop()


def test_each_choice_echoes_the_prompt(client):
    res = client.completions.create(model="tiny", prompt="hello", max_tokens=2, n=2, echo=True)
    assert [c.index for c in res.choices] == [0, 1]
    assert all(c.text.startswith("hello") and len(c.text) > 5 for c in res.choices)


def test_best_of_keeps_the_highest_cumulative_logprobs_best_first(tok):
    from services.frontend.openai_answers import CompletionShape
    from services.frontend.openai_protocol import CompletionRequest

    body = CompletionRequest(prompt="x", n=2, best_of=4)
    shape = CompletionShape.of(body, tok[1], "tiny")

    def whole(*lps: float) -> pb.GenerateResponse:
        return pb.GenerateResponse(logprobs=[pb.TokenLogprob(logprob=v) for v in lps])

    wholes = [whole(-1, -1), whole(-0.1), whole(-3), whole(-0.5, -0.4)]
    assert shape._returned(wholes) == [1, 3]
