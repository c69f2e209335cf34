"""The OpenAI-compatible HTTP API, driven by the official openai client, against the real
frontend and a scripted scheduler on loopback."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

try:
    from tests.fake_scheduler import SCRIPT_TEXT
    from tests.http_frontend import openai_frontend_fixtures
except ImportError:
    from fake_scheduler import SCRIPT_TEXT
    from http_frontend import openai_frontend_fixtures

BEFORE_STOP = SCRIPT_TEXT[: SCRIPT_TEXT.index("STOP")]


tok, fake, frontend, client = openai_frontend_fixtures()


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].model_extra["max_model_len"] == 256


def test_completion(client, tok):
    res = client.completions.create(model="tiny", prompt="hello world", max_tokens=10)
    assert res.object == "text_completion"
    assert res.choices[0].text == tok[1].decode(tok[1].encode(SCRIPT_TEXT)[:10])
    assert res.choices[0].finish_reason == "length"
    n_prompt = len(tok[1].encode("hello world"))
    assert (res.usage.prompt_tokens, res.usage.completion_tokens, res.usage.total_tokens) == (
        n_prompt,
        10,
        n_prompt + 10,
    )
    assert res.usage.prompt_tokens_details.cached_tokens == n_prompt // 2
    # An extra field to the openai client: a plain dict.
    details = res.usage.prompt_tokens_details.cached_tokens_details
    assert details == {"device": n_prompt // 2, "host": 0, "storage": 0}


def test_completion_stream_with_usage(client):
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=[[5, 6, 7, 8]],
            stop="STOP",
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == BEFORE_STOP
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == 4
    assert all("\ufffd" not in c.choices[0].text for c in chunks if c.choices)


def test_chat_completion(client, fake, tok):
    res = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        stop=["STOP"],
        seed=3,
        logprobs=True,
        top_logprobs=1,
        extra_body={"top_k": 5, "repetition_penalty": 1.1},
    )
    choice = res.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == BEFORE_STOP
    assert choice.finish_reason == "stop"
    assert len(choice.logprobs.content) == res.usage.completion_tokens
    assert choice.logprobs.content[0].top_logprobs[0].logprob == pytest.approx(-0.5)
    sent = fake.requests[-1].sampling
    assert (sent.seed, sent.top_k, sent.logprobs, sent.top_logprobs) == (3, 5, True, 1)
    assert sent.repetition_penalty == pytest.approx(1.1)


def test_chat_stream(client, tok):
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[
                {"role": "system", "content": "x"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            ],
            max_completion_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert (
        chunks[0].object == "chat.completion.chunk"
        and chunks[0].choices[0].delta.role == "assistant"
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == tok[1].decode(tok[1].encode(SCRIPT_TEXT)[:24])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 24


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        (dict(top_p=2.0), "top_p"),
        (dict(n=129), "n"),
        (dict(max_tokens=1000), "max_tokens"),
        (dict(presence_penalty=-3), "presence_penalty"),
        (dict(stop=[""]), "stop"),
        (dict(extra_body={"top_k": -1}), "top_k"),
        (dict(messages=[{"role": "wizard", "content": "x"}]), "messages"),
        (dict(messages=[]), "messages"),
    ],
)
def test_bad_chat_params_are_400_naming_the_param(client, kw, param):
    args = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**args)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"
    assert e.value.body["code"] is None and e.value.body["message"]


def test_bad_completion_body_is_400(client, frontend):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="", max_tokens=3)
    assert e.value.body["param"] == "prompt"
    r = httpx.post(frontend.http_base + "/v1/completions", json={"model": "tiny"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi")


def test_health_metrics_openapi_flush(frontend, fake, client):
    base = frontend.http_base
    assert httpx.get(base + "/health").status_code == 200
    assert httpx.get(base + "/livez").json() == {"status": "alive"}
    client.completions.create(model="tiny", prompt="hi", max_tokens=2)
    metrics = httpx.get(base + "/metrics").text
    assert "python_info" in metrics  # the default registry
    assert 'radixserve:frontend_requests_total{finish_reason="length",model_name="tiny"}' in metrics
    assert 'radixserve:time_to_first_token_seconds_count{model_name="tiny"}' in metrics
    paths = httpx.get(base + "/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(paths)
    r = httpx.post(base + "/flush_cache")
    assert r.status_code == 200 and r.json()["message"] == "Cache flushed."
    fake.flush_refusal = "3 requests waiting"
    try:
        r = httpx.post(base + "/flush_cache")
    finally:
        fake.flush_refusal = ""
    assert r.status_code == 400 and "3 requests waiting" in r.json()["message"]


def test_stream_disconnect_aborts_at_scheduler(frontend, fake):
    body = {
        "model": "tiny",
        "prompt": "hi",
        "stream": True,
        "cache_salt": "slow",
        "request_id": "http-cancel",
    }
    with httpx.stream("POST", frontend.http_base + "/v1/completions", json=body, timeout=10) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    deadline = time.monotonic() + 3
    while not any(a.rid == "http-cancel" for a, _ in fake.aborts):
        assert time.monotonic() < deadline, "disconnect did not abort the request"
        time.sleep(0.01)


@pytest.mark.parametrize(
    "body, status, param, words",
    [
        ({"max_tokens": 2**40}, 400, "max_tokens", "less than or equal to 2147483647"),
        ({"top_k": -(2**40)}, 400, "top_k", "greater than or equal"),
        ({"prompt": [1, 2**33]}, 400, "prompt", "prompt"),
        ({"cache_salt": "s" * 5000}, 400, "cache_salt", "at most 1024 characters"),
        ({"stop": ["x" * 5000]}, 400, "stop", "at most 1024 characters"),
        ({"prompt": "\ud800"}, 400, None, "invalid Unicode"),
    ],
)
def test_hostile_values_get_400_in_openai_shape(frontend, body, status, param, words):
    model = httpx.get(frontend.http_base + "/v1/models").json()["data"][0]["id"]
    payload = {"model": model, "prompt": "hi", "max_tokens": 2, **body}
    # json.dumps escapes a lone surrogate as \ud800, which is how a client sends one.
    r = httpx.post(
        frontend.http_base + "/v1/completions",
        content=json.dumps(payload).encode(),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["type"] == "invalid_request_error"
    if param:
        assert error["param"] == param


def test_several_items_wrong_alike_name_the_first(frontend):
    # Found by schemathesis (tests/e2e/test_openapi_fuzz.py): two roles of the wrong type
    # at the same depth left body_error without a union to describe, and it answered 500.
    bad = [{"role": 1, "content": "a"}, {"role": 2, "content": "b"}]
    r = httpx.post(frontend.http_base + "/v1/chat/completions", json={"messages": bad})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("messages[0].role: Input should be")


def test_unknown_route_and_method_answer_in_openai_shape(frontend):
    r = httpx.get(frontend.http_base + "/v1/nope")
    assert r.status_code == 404 and "error" in r.json() and "detail" not in r.json()
    r = httpx.get(frontend.http_base + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["message"].startswith("Method Not Allowed")
    r = httpx.post(
        frontend.http_base + "/v1/completions",
        content=b'{"prompt": "\xff\xfe"}',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "error" in r.json()
