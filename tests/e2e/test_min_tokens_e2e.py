"""min_tokens over the three real processes, token for token against transformers.

A tiny random Llama whose EOS is made the greedy next token of the test prompt (its
generation_config names that token, which both the frontend and the worker read): without
min_tokens the answer is EOS at once; with min_tokens N it equals transformers' greedy
``generate(min_new_tokens=N)``, which masks EOS the same way. Several requests with
different floors run together, so the mask is applied to some rows of a batch and not others.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
import torch

from radixserve.v1 import generation_pb2 as pb
from tests.conftest import ZEN_VOCAB, load_hf_model, make_tiny_zen_model
from tests.server_util import Server

pytestmark = pytest.mark.slow

VOCAB = ZEN_VOCAB  # the default model's tokenizer
MAX_NEW = 12
PROMPT = [random.Random(5).randrange(3, VOCAB) for _ in range(9)]


def _greedy_next(folder) -> int:
    with torch.no_grad():
        return int(load_hf_model(folder)(torch.tensor([PROMPT])).logits[0, -1].argmax())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = make_tiny_zen_model(tmp_path_factory.mktemp("tiny-min-tokens"), seed=7)
    eos = _greedy_next(folder)  # the weights do not depend on which id is EOS
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        cfg = json.loads(path.read_text())
        cfg["eos_token_id"] = eos
        path.write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module")
def hf(model_dir):
    return load_hf_model(model_dir)


@pytest.fixture(scope="module")
def server(model_dir):
    with Server(model=model_dir) as s:
        yield s


def ours(server: Server, **sampling) -> tuple[list[int], str]:
    req = pb.GenerateRequest(
        input_ids=pb.InputIds(ids=PROMPT),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=MAX_NEW, **sampling),
    )
    ids: list[int] = []
    reason = ""
    for resp in server.stub.Generate(req, timeout=120):
        ids.extend(resp.token_ids)
        reason = resp.finish_reason or reason
    return ids, reason


def reference(hf, min_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([PROMPT]),
            attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
            do_sample=False,
            max_new_tokens=MAX_NEW,
            min_new_tokens=min_tokens,
            pad_token_id=0,
        )
    return out[0, len(PROMPT) :].tolist()


def test_eos_is_the_greedy_next_token(server, hf):
    eos = hf.generation_config.eos_token_id
    assert ours(server) == ([eos], "stop")
    assert reference(hf, 0) == [eos]


def test_min_tokens_equals_transformers_min_new_tokens(server, hf):
    floors = [0, 1, 4, 7, MAX_NEW, 3]
    with ThreadPoolExecutor(len(floors)) as pool:  # one batch, different floors per row
        got = list(pool.map(lambda n: ours(server, min_tokens=n), floors))
    eos = hf.generation_config.eos_token_id
    for n, (ids, reason) in zip(floors, got, strict=True):
        ref = reference(hf, n)
        assert ids == ref, f"min_tokens={n}"
        assert eos not in ids[:n] and len(ids) >= min(n + 1, MAX_NEW)
        assert reason == ("stop" if ids[-1] == eos else "length")


def test_stop_token_ids_are_held_off_too(server, hf):
    """A stop id that is the greedy choice of a later step cannot end the output early."""
    free = reference(hf, MAX_NEW)  # EOS masked all the way: ordinary tokens only
    stop = free[2]
    ids, reason = ours(server, min_tokens=MAX_NEW, stop_token_ids=[stop])
    assert len(ids) == MAX_NEW and reason == "length"
    assert stop not in ids  # masked, so the text differs from `free` from its first use on


def test_http_routes_take_min_tokens(server, hf):
    base = f"http://127.0.0.1:{server.http_port}"
    ref = reference(hf, 5)
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": MAX_NEW, "min_new_tokens": 5, "temperature": 0},
    }
    r = httpx.post(f"{base}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == ref
    body = {"prompt": PROMPT, "max_tokens": MAX_NEW, "min_tokens": 5, "temperature": 0}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == len(ref)


@pytest.mark.parametrize(
    ("sampling", "words"),
    [
        ({"min_tokens": -1}, "sampling.min_tokens: must be >= 0"),
        ({"min_tokens": 5, "max_tokens": 4}, "sampling.min_tokens: must be <= max_tokens (4)"),
    ],
)
def test_bad_min_tokens_over_grpc(server, sampling, words):
    req = pb.GenerateRequest(
        input_ids=pb.InputIds(ids=PROMPT), sampling=pb.SamplingParams(**sampling)
    )
    with pytest.raises(grpc.RpcError) as e:
        list(server.stub.Generate(req, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in e.value.details()


@pytest.mark.parametrize(
    ("route", "body", "param", "words"),
    [
        ("/v1/completions", {"max_tokens": 4, "min_tokens": 5}, "min_tokens", "<= max_tokens (4)"),
        ("/v1/completions", {"min_tokens": -2}, "min_tokens", "must be >= 0"),
        (
            "/v1/chat/completions",
            {"max_completion_tokens": 2, "min_tokens": 3},
            "min_tokens",
            "<= max_tokens (2)",
        ),
        (
            "/generate",
            {"sampling_params": {"max_new_tokens": 2, "min_new_tokens": 3}},
            "sampling_params.min_new_tokens",
            "<= max_tokens (2)",
        ),
    ],
)
def test_bad_min_tokens_over_http(server, route, body, param, words):
    full = {"prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}], "text": "Hi", **body}
    if route == "/v1/completions":
        full = {k: v for k, v in full.items() if k not in ("messages", "text")}
    elif route == "/v1/chat/completions":
        full = {k: v for k, v in full.items() if k not in ("prompt", "text")}
    else:
        full = {k: v for k, v in full.items() if k not in ("prompt", "messages")}
    r = httpx.post(f"http://127.0.0.1:{server.http_port}{route}", json=full, timeout=60)
    assert r.status_code == 400, r.text
    text = r.text
    assert param in text and words in text, text
    assert ours(server, min_tokens=1)[0]  # still serving
