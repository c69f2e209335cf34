"""What a new user and an attacker found over HTTP: every probe name answers, a body that
is not JSON or holds a value of the wrong kind gets a message in the client's terms, and
OpenAI fields radixserve does not serve are refused by name instead of dropped."""

from __future__ import annotations

import httpx
import pytest

try:
    from tests.fake_scheduler import FakeScheduler, FrontendThread, build_tokenizer
    from tests.fake_scheduler import frontend_config as make_config
except ImportError:
    from fake_scheduler import FakeScheduler, FrontendThread, build_tokenizer
    from fake_scheduler import frontend_config as make_config

from services.frontend.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = build_tokenizer(tmp_path_factory.mktemp("model"))
    tok = Tokenizer(str(path))
    fake = FakeScheduler(tok.encode("hello there"), tok.vocab_size).start()
    fe = FrontendThread(make_config(path, [fake], http=True)).start().wait_ready()
    yield fe.http_base
    fe.stop()
    fake.stop()


@pytest.mark.parametrize("path", ["/health", "/healthz", "/ready", "/readyz", "/readiness"])
def test_every_readiness_name_answers(base, path):
    assert httpx.get(base + path).json() == {"status": "ok"}


@pytest.mark.parametrize("path", ["/livez", "/live", "/liveness"])
def test_every_liveness_name_answers(base, path):
    assert httpx.get(base + path).json() == {"status": "alive"}


def _post(base: str, body: bytes | str, route: str = "/v1/completions") -> httpx.Response:
    return httpx.post(base + route, content=body, headers={"content-type": "application/json"})


@pytest.mark.parametrize(
    "body, param, message",
    [
        ("not json", None, "the request body is not valid JSON: Expecting value (at character 0)"),
        ('{"prompt": "a",}', None, "not valid JSON"),
        ("[1, 2]", None, "the request body must be a JSON object"),
        (
            '{"prompt": [1180591620717411303424]}',
            "prompt",
            "prompt[0]: Input should be less than or equal to 2147483647"
            " (got 1180591620717411303424)",
        ),
        (
            '{"prompt": 5}',
            "prompt",
            "prompt: must be a string, a list of strings, a list of integers or a list of"
            " lists of integers (got 5)",
        ),
        ('{"prompt": [[1, "a"]]}', "prompt", "prompt[0][1]: Input should be a valid integer"),
        ('{"prompt": "a", "stop": [1]}', "stop", "stop[0]: Input should be a valid string"),
    ],
)
def test_bad_bodies_are_named_in_the_clients_terms(base, body, param, message):
    r = _post(base, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == param
    assert ".str" not in error["message"] and "constrained-int" not in error["message"]


def test_a_chat_message_without_role_names_its_position(base):
    r = _post(base, '{"messages": [{"content": "x"}]}', "/v1/chat/completions")
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "messages[0].role: Field required"


@pytest.mark.parametrize(
    "route, field, value",
    [
        ("/v1/chat/completions", "best_of", 3),  # /v1/completions serves it
        ("/v1/completions", "suffix", "tail"),
        ("/v1/chat/completions", "functions", [{"name": "f"}]),
        ("/v1/chat/completions", "function_call", "auto"),
        # Chat serves tools (test_tool_calling_http.py); completions has none to serve.
        ("/v1/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
        ("/v1/completions", "tool_choice", "required"),
        ("/v1/chat/completions", "modalities", ["text", "audio"]),
        ("/v1/chat/completions", "prediction", {"type": "content", "content": "x"}),
        ("/v1/chat/completions", "service_tier", "flex"),
        ("/v1/chat/completions", "store", True),
    ],
)
def test_unserved_openai_fields_are_refused_by_name(base, route, field, value):
    body = {"prompt": "hi"} if route == "/v1/completions" else {"messages": _user()}
    r = httpx.post(base + route, json={**body, "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and f"{field} is not supported" in error["message"]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_fields_are_refused_by_name_not_dropped(base, route):
    body = {"prompt": "hi"} if route == "/v1/completions" else {"messages": _user()}
    r = httpx.post(base + route, json={**body, "max_tokens": 2, "temprature": 0.5})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "temprature" and "unknown field 'temprature'" in error["message"]


@pytest.mark.parametrize(
    "field, value",
    [
        ("user", "u-1"),
        ("safety_identifier", "s-1"),
        ("metadata", {"team": "a"}),
        ("logit_bias", {}),
        ("best_of", 1),
        ("store", False),
        ("tools", []),
        ("tool_choice", "none"),
        ("modalities", ["text"]),
        ("service_tier", None),
    ],
)
def test_values_that_ask_for_nothing_are_accepted(base, field, value):
    body = {"messages": _user(), "max_tokens": 2, field: value}
    r = httpx.post(base + "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text


def _user() -> list[dict[str, str]]:
    return [{"role": "user", "content": "hi"}]


def test_an_overloaded_engine_is_429_with_retry_after(base):
    body = {"prompt": "hi", "max_tokens": 2, "cache_salt": "error:RESOURCE_EXHAUSTED"}
    r = httpx.post(base + "/v1/completions", json=body)
    assert r.status_code == 429 and r.headers["retry-after"] == "2"
    assert r.json()["error"]["message"] == "fake refusal: no room"
