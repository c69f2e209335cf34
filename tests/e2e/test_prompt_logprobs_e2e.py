"""Prompt logprobs and max_tokens 0 over the three real processes, against transformers.

The model is a tiny random Llama built with transformers' own classes (tests/conftest.py)
with the default model's tokenizer beside it, so text prompts work; its logprobs are
compared with log_softmax of the same model's logits in transformers (within 1e-4), and its
top-n with torch.topk of them. The server chunks prefills at 16 tokens, so a long prompt
is scored across chunks and a short one in one.
"""

from __future__ import annotations

import random
import threading
import time

import grpc
import httpx
import pytest
import torch

from radixserve.v1 import generation_pb2 as pb
from tests.conftest import ZEN_VOCAB, load_hf_model, make_tiny_zen_model
from tests.server_util import Server, idle_pool_is_whole, scrape_metrics

pytestmark = pytest.mark.slow

CHUNK = 16
TOP = 3
VOCAB = ZEN_VOCAB  # the default model's tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_zen_model(tmp_path_factory.mktemp("tiny-zen-tok"), seed=3)


@pytest.fixture(scope="module")
def hf(model_dir):
    return load_hf_model(model_dir)


@pytest.fixture(scope="module")
def server(model_dir):
    flags = ("--chunked-prefill-size", str(CHUNK), "--max-total-tokens", "6000")
    with Server(*flags, model=model_dir, metrics=True) as s:
        yield s


def ref_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def generate(server: Server, ids: list[int], **sampling) -> list[pb.GenerateResponse]:
    req = pb.GenerateRequest(
        input_ids=pb.InputIds(ids=ids), sampling=pb.SamplingParams(temperature=0.0, **sampling)
    )
    return list(server.stub.Generate(req, timeout=120))


def assert_parity(first: pb.GenerateResponse, ref: torch.Tensor, ids: list[int], start: int):
    s = max(start, 1)
    assert first.prompt_logprobs_start == s
    entries = list(first.prompt_logprobs)
    assert [e.token_id for e in entries] == ids[s:]
    for k, e in enumerate(entries):
        row = ref[s + k - 1]
        assert e.logprob == pytest.approx(row[ids[s + k]].item(), abs=1e-4), k
        best = row.topk(TOP)
        assert [t.token_id for t in e.top] == best.indices.tolist(), k
        got = torch.tensor([t.logprob for t in e.top])
        torch.testing.assert_close(got, best.values, atol=1e-4, rtol=0)


@pytest.mark.parametrize("n,start", [(12, 0), (12, 5), (75, 0), (75, 33)])
def test_prompt_logprobs_equal_transformers(server, hf, n, start):
    ids = prompt(n, seed=n + start)
    out = generate(
        server,
        ids,
        max_tokens=2,
        prompt_logprobs=True,
        prompt_logprobs_start=start,
        top_logprobs=TOP,
    )
    assert_parity(out[0], ref_logprobs(hf, ids), ids, start)
    assert not any(r.prompt_logprobs for r in out[1:])


def test_cached_prefix_before_the_start(server, hf):
    ids = prompt(70, seed=99)
    generate(server, ids, max_tokens=1)  # caches the prompt
    out = generate(
        server, ids, max_tokens=1, prompt_logprobs=True, prompt_logprobs_start=40, top_logprobs=TOP
    )
    assert out[-1].cached_tokens == 39  # the cache supplies only what no scored token needs
    assert_parity(out[0], ref_logprobs(hf, ids), ids, 40)


# 33 = 16 + 16 + 1: the last prompt token runs alone, as a one-token step.
@pytest.mark.parametrize("n", [40, 33])
def test_max_tokens_zero_then_the_prompt_is_cached(server, hf, n):
    ids = prompt(n, seed=7)
    (only,) = generate(server, ids, max_tokens=0, prompt_logprobs=True, top_logprobs=TOP)
    assert (only.finish_reason, only.prompt_tokens, only.completion_tokens) == ("length", n, 0)
    assert not only.token_ids
    assert_parity(only, ref_logprobs(hf, ids), ids, 0)
    (again,) = generate(server, ids, max_tokens=0)
    assert again.cached_tokens == n - 1 and again.finish_reason == "length"
    idle_pool_is_whole(server)


def test_abort_during_long_prompt_logprob_prefill_leaves_the_pool_clean(server):
    calls = []
    for i in range(4):
        req = pb.GenerateRequest(
            input_ids=pb.InputIds(ids=prompt(480, seed=1000 + i)),
            sampling=pb.SamplingParams(max_tokens=5, prompt_logprobs=True, top_logprobs=20),
        )
        calls.append(server.stub.Generate(req, timeout=120))

    answered: list[int] = []

    def drain(call) -> None:
        try:
            for _ in call:
                answered.append(1)  # the first response comes only after the prefill
        except grpc.RpcError:
            pass

    threads = [threading.Thread(target=drain, args=(c,)) for c in calls]
    for t in threads:
        t.start()
    # Cancel as soon as the scheduler runs them: a 480-token prompt is 30 chunks of 16, so
    # the first answer is still far off (a fixed sleep raced faster scheduler steps).
    deadline = time.monotonic() + 30
    while not scrape_metrics(server.sched_metrics)["radixserve:num_running_reqs"]:
        assert time.monotonic() < deadline, "the requests were never admitted"
        time.sleep(0.005)
    mid_prefill = not answered
    for c in calls:
        c.cancel()
    for t in threads:
        t.join(60)
    assert mid_prefill, "the prefills ended before the cancel: make the prompts longer"
    idle_pool_is_whole(server)
    m = scrape_metrics(server.sched_metrics)
    assert m["radixserve:num_running_reqs"] == 0
    (ok,) = generate(server, prompt(20, seed=5), max_tokens=0)  # still serving
    assert ok.finish_reason == "length"


def test_completions_echo_with_logprobs(server, hf):
    text = "Beautiful is better than ugly."
    ids = list(server.stub.Tokenize(pb.TokenizeRequest(text=text)).ids)
    body = {"prompt": text, "max_tokens": 3, "echo": True, "logprobs": 2, "temperature": 0}
    r = httpx.post(f"http://127.0.0.1:{server.http_port}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"].startswith(text)
    lp = choice["logprobs"]
    n = len(ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = ref_logprobs(hf, ids)
    for q in range(1, n):
        assert lp["token_logprobs"][q] == pytest.approx(ref[q - 1, ids[q]].item(), abs=1e-4)
        assert len(lp["top_logprobs"][q]) <= 2
    body = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0}
    r = httpx.post(f"http://127.0.0.1:{server.http_port}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["completion_tokens"] == 0
    assert out["choices"][0]["logprobs"]["token_logprobs"][0] is None
    assert len(out["choices"][0]["logprobs"]["token_logprobs"]) == n
