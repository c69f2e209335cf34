"""The OpenAI HTTP API against the three real processes, and proof that it reaches the same
radix cache as gRPC."""

from __future__ import annotations

import pytest
from openai import OpenAI

from radixserve.v1 import generation_pb2
from tests.server_util import Server, greedy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    with Server("--max-total-tokens", "8192") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(
        base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="unused", max_retries=0
    )


def test_grpc_then_http_hits_the_same_cache(server, client):
    """A published write-up claims an OpenAI layer bypasses the radix cache; here it must not."""
    text = "Sparse is better than dense. Readability counts. Special cases aren't special enough"
    prompt = len(server.stub.Tokenize(generation_pb2.TokenizeRequest(text=text)).ids)
    ids, grpc_text, last = server.generate(text=text, sampling=greedy(8))
    assert last.cached_tokens == 0
    model = client.models.list().data[0].id
    done = client.completions.create(model=model, prompt=text, max_tokens=8, temperature=0)
    assert done.usage.prompt_tokens == prompt
    assert done.usage.prompt_tokens_details.cached_tokens == prompt - 1
    assert done.choices[0].text == grpc_text  # same greedy tokens through either door


def test_http_streaming_chat_and_usage(server, client):
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Beautiful is better"}],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    assert text.startswith(" than ugly.") or text.startswith("than ugly.")
    assert usage is not None and usage.completion_tokens >= 1


def test_logit_bias_forces_a_token_through_http(server, client):
    (nested,) = server.stub.Tokenize(generation_pb2.TokenizeRequest(text=" nested")).ids
    model = client.models.list().data[0].id
    done = client.completions.create(
        model=model,
        prompt="Beautiful is better than",  # greedily " ugly."
        max_tokens=3,
        temperature=0,
        logit_bias={str(nested): 100},
    )
    assert done.choices[0].text == " nested nested nested"


def test_http_bad_parameter_names_it(client):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(
            model=client.models.list().data[0].id, prompt="x", max_tokens=8, temperature=5000
        )
    assert "temperature" in str(err.value)


def test_oversized_body_is_refused_with_413_and_the_server_keeps_serving(server, client):
    import httpx

    url = f"http://127.0.0.1:{server.http_port}/v1/completions"
    body = b'{"model": "m", "prompt": "' + b"a" * (9 << 20) + b'"}'
    r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413
    assert "--max-request-bytes" in r.json()["error"]["message"]
    model = client.models.list().data[0].id
    ok = client.completions.create(model=model, prompt="Beautiful is", max_tokens=2)
    assert ok.choices[0].text is not None
