"""/v1/completions ``echo`` (+ ``logprobs``) and gRPC prompt logprobs through the real
frontend, against the scripted scheduler (tests/fake_scheduler.py), which reports the
logprob of the prompt token at position q as fake_prompt_logprob(q)."""

from __future__ import annotations

import grpc
import pytest

from radixserve.v1 import generation_pb2 as pb
from radixserve.v1 import generation_pb2_grpc
from services.frontend.tokenizer import Tokenizer
from tests.fake_scheduler import SCRIPT_TEXT, fake_prompt_logprob
from tests.http_frontend import openai_frontend_fixtures

PROMPT = "hello world, hello cache"


tok, fake, frontend, client = openai_frontend_fixtures()


def _strings(t: Tokenizer, ids: list[int]) -> list[str]:
    return [t.decode([i], skip_special_tokens=False) for i in ids]


def test_echo_prepends_the_prompt(client, tok):
    res = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, echo=True)
    completion = tok[1].decode(tok[1].encode(SCRIPT_TEXT)[:4])
    assert res.choices[0].text == PROMPT + completion
    assert res.choices[0].logprobs is None


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_covers_prompt_then_completion(client, tok, fake, stream):
    t = tok[1]
    ids = t.encode(PROMPT)
    out = t.encode(SCRIPT_TEXT)[:3]
    args = dict(model="tiny", prompt=PROMPT, max_tokens=3, echo=True, logprobs=2)
    if stream:
        chunks = list(client.completions.create(**args, stream=True))
        text = "".join(c.choices[0].text for c in chunks)
        lps = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
        tokens = [s for lp in lps for s in lp.tokens]
        token_logprobs = [x for lp in lps for x in lp.token_logprobs]
        top = [x for lp in lps for x in lp.top_logprobs]
        assert chunks[0].choices[0].text.startswith(PROMPT)  # the echo leads the first chunk
    else:
        res = client.completions.create(**args)
        text = res.choices[0].text
        lp = res.choices[0].logprobs
        tokens, token_logprobs, top = lp.tokens, lp.token_logprobs, lp.top_logprobs
    assert text == PROMPT + t.decode(out)
    assert tokens == _strings(t, ids) + _strings(t, out)
    n = len(ids)
    assert token_logprobs[0] is None and top[0] is None  # nothing precedes the first token
    assert token_logprobs[1:n] == [pytest.approx(fake_prompt_logprob(q)) for q in range(1, n)]
    assert token_logprobs[n:] == [pytest.approx(-0.5)] * 3
    assert all(isinstance(d, dict) and len(d) >= 1 for d in top[1:])
    sent = fake.requests[-1].sampling
    assert sent.prompt_logprobs and sent.top_logprobs == 2


def test_echo_max_tokens_zero_scores_the_prompt(client, tok):
    ids = [5, 6, 7, 8, 9]
    res = client.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=0)
    choice = res.choices[0]
    assert choice.text == tok[1].decode(ids)
    assert choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs == [None] + [
        pytest.approx(fake_prompt_logprob(q)) for q in range(1, 5)
    ]
    assert choice.logprobs.tokens == _strings(tok[1], ids)
    assert (res.usage.prompt_tokens, res.usage.completion_tokens) == (5, 0)


def test_grpc_prompt_logprobs_on_the_first_response(frontend, fake):
    with grpc.insecure_channel(frontend.grpc_target) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        req = pb.GenerateRequest(
            input_ids=pb.InputIds(ids=[5, 6, 7, 8, 9, 10]),
            sampling=pb.SamplingParams(
                max_tokens=3, prompt_logprobs=True, prompt_logprobs_start=2, top_logprobs=1
            ),
        )
        out = list(stub.Generate(req, timeout=20))
    first = out[0]
    assert first.prompt_logprobs_start == 2
    assert [lp.token_id for lp in first.prompt_logprobs] == [7, 8, 9, 10]
    assert [lp.logprob for lp in first.prompt_logprobs] == [
        pytest.approx(fake_prompt_logprob(q)) for q in range(2, 6)
    ]
    assert all(len(lp.top) == 1 for lp in first.prompt_logprobs)
    assert not any(r.prompt_logprobs for r in out[1:])
    assert fake.requests[-1].sampling.prompt_logprobs_start == 2


def test_grpc_max_tokens_zero_is_one_response(frontend):
    with grpc.insecure_channel(frontend.grpc_target) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        req = pb.GenerateRequest(
            input_ids=pb.InputIds(ids=[5, 6, 7]), sampling=pb.SamplingParams(max_tokens=0)
        )
        (only,) = list(stub.Generate(req, timeout=20))
    assert (only.finish_reason, only.prompt_tokens, only.completion_tokens) == ("length", 3, 0)
    assert not only.token_ids and not only.prompt_logprobs


def test_bad_prompt_logprobs_start_is_400_or_invalid_argument(frontend):
    with grpc.insecure_channel(frontend.grpc_target) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        req = pb.GenerateRequest(
            input_ids=pb.InputIds(ids=[5, 6, 7]),
            sampling=pb.SamplingParams(prompt_logprobs=True, prompt_logprobs_start=3),
        )
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(req, timeout=20))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.prompt_logprobs_start" in e.value.details()
