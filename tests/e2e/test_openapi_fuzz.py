"""Schemathesis against one live server: requests generated from its own /openapi.json.

Every operation gets valid and invalid inputs; each answer must be no 5xx, have a status,
content type and body the schema declares, and carry no Python traceback. Afterwards the
server still completes a prompt and its KV pool is whole. bench/fuzz_http.py runs the
same with many more examples.
"""

from __future__ import annotations

import zlib
from collections import Counter
from typing import Any, NamedTuple

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.server_util import Server, greedy, idle_pool_is_whole

# A small pool and context, so whatever max_tokens a generated request asks stays cheap.
SERVER_FLAGS = ("--max-total-tokens", "2048", "--max-model-len", "128")
REQUEST_TIMEOUT_S = 30.0
EXAMPLES = 25  # per operation


def no_traceback(ctx: Any, response: schemathesis.Response, case: schemathesis.Case) -> None:
    """No answer may leak a Python traceback (a handler's exception shown to the client)."""
    if "Traceback (most recent call last)" in response.text:
        raise AssertionError("the body holds a Python traceback")


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    no_traceback,
]


def load_schema(server: Server) -> Any:
    return schemathesis.openapi.from_url(f"http://127.0.0.1:{server.http_port}/openapi.json")


def call_and_check(case: schemathesis.Case, model: str) -> int:
    """Sends the case (asking for the served model half the time, so generation runs
    rather than stopping at the model check), runs CHECKS on the answer: its status."""
    if isinstance(case.body, dict) and "model" in case.body:
        if zlib.crc32(repr(case.body).encode()) % 2:
            case.body["model"] = model
    response = case.call(timeout=REQUEST_TIMEOUT_S)
    case.validate_response(response, checks=CHECKS)
    return response.status_code


class FuzzResult(NamedTuple):
    tried: int
    failures: list[str]  # an operation's first failure each
    statuses: Counter[str]  # how many got each answer: "POST /v1/completions 200" or "... failed"


def fuzz(schema: Any, model: str, max_examples: int, derandomize: bool = False) -> FuzzResult:
    """Every operation on valid and invalid inputs, max_examples of each (the same ones on
    every run with ``derandomize``)."""
    out = FuzzResult(0, [], Counter())
    for result in schema.get_all_operations():
        _fuzz_operation(
            result.ok(), model, settings(max_examples=max_examples, derandomize=derandomize), out
        )
    return out._replace(tried=out.statuses.total())


def _fuzz_operation(op: Any, model: str, base: settings, out: FuzzResult) -> None:
    modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
    failed: list[str] = []

    @given(case=st.one_of([op.as_strategy(generation_mode=m) for m in modes]))
    @settings(
        base,
        deadline=None,
        database=None,
        phases=[Phase.generate],  # no shrinking: the first failure is reported as found
        suppress_health_check=list(HealthCheck),
    )
    def run(case: schemathesis.Case) -> None:
        try:
            out.statuses[f"{op.label} {call_and_check(case, model)}"] += 1
        except FailureGroup as e:
            out.statuses[f"{op.label} failed"] += 1
            failed.append(f"{op.label}: {e}")

    run()
    out.failures.extend(failed[:1])


def serves_and_pool_is_whole(server: Server) -> None:
    """A normal completion still works, then every KV token is back in the pool."""
    _, text, last = server.generate(text="Hello", sampling=greedy(4))
    assert last.completion_tokens == 4, text
    idle_pool_is_whole(server)


@pytest.fixture(scope="module")
def server():
    with Server(*SERVER_FLAGS, metrics=True) as s:
        yield s


@pytest.fixture(scope="module")
def model(server) -> str:
    import httpx

    return httpx.get(f"http://127.0.0.1:{server.http_port}/v1/models").json()["data"][0]["id"]


def test_openapi_fuzz(server, model):
    result = fuzz(load_schema(server), model, EXAMPLES, derandomize=True)
    assert not result.failures, "\n\n".join(result.failures)
    # Some generated requests got past validation and generated.
    generating = ("/v1/completions", "/v1/chat/completions", "/generate")
    assert any(result.statuses[f"POST {r} 200"] for r in generating), result.statuses


def test_serves_and_pool_is_whole_after_fuzz(server):
    serves_and_pool_is_whole(server)
