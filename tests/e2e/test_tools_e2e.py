"""OpenAI tool calling over the three real processes, with the official openai client.

The model is a tiny random-weight Llama with a Hermes-style tool template
(tests/tool_models.py; ``--tool-call-parser auto`` finds ``hermes`` in it), so every call is
written by the model itself: at temperature 1.0 its text is noise, and only the constraint
built from the tools makes it a call that parses and matches its schema. Lean on purpose:
one server, short outputs, bounded strings.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from openai import OpenAI

from tests.server_util import Server
from tests.tool_models import make_tiny_tool_model

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
NO_ARGS = {"type": "object", "properties": {}, "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "now": NO_ARGS}
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": schema}}
    for name, schema in SCHEMAS.items()
]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
ONE_CALL = 120  # tokens: a call is ~80 of the default tokenizer's (the strings are bounded)


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_tool_model(tmp_path_factory.mktemp("tiny-tools"), seed=3)
    with Server(
        "--max-total-tokens", "16384", "--served-model-name", "tiny-tools", model=model
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(
        base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="x", max_retries=0, timeout=120
    )


def chat(client: OpenAI, **kw):
    kw.setdefault("messages", USER)
    kw.setdefault("temperature", 1.0)
    return client.chat.completions.create(model="tiny-tools", tools=TOOLS, **kw)


def checked_calls(message) -> list[tuple[str, dict]]:
    """The message's calls, each of a given tool with arguments its schema accepts."""
    calls = []
    for call in message.tool_calls or []:
        assert call.type == "function" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        calls.append((call.function.name, args))
    return calls


def streamed(client: OpenAI, **kw) -> tuple[str, list[tuple[str, dict]], str | None]:
    """(content, calls, finish_reason) of a streamed answer, its tool-call items reassembled."""
    content, calls, finish = "", {}, None
    for chunk in chat(client, stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for item in delta.tool_calls or []:
            if item.id:  # the head: index, id, type and name come first
                calls[item.index] = [item.function.name, ""]
            calls[item.index][1] += item.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [(name, json.loads(args)) for name, args in calls.values()], finish


def test_required_calls_parse_and_validate_for_every_seed(client):
    """tool_choice required at temperature 1.0: every answer is one valid call."""

    def one(seed: int):
        return chat(
            client,
            tool_choice="required",
            parallel_tool_calls=False,
            seed=seed,
            max_tokens=ONE_CALL,
        ).choices[0]

    with ThreadPoolExecutor(8) as pool:
        choices = list(pool.map(one, range(1, 9)))
    for choice in choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        assert len(checked_calls(choice.message)) == 1


def test_a_named_call_streamed_is_the_call_not_streamed(client):
    kw = dict(tool_choice=named("get_weather"), seed=5, max_tokens=ONE_CALL)
    whole = chat(client, **kw).choices[0]
    calls = checked_calls(whole.message)
    assert whole.finish_reason == "tool_calls" and [n for n, _ in calls] == ["get_weather"]
    assert streamed(client, **kw) == ("", calls, "tool_calls")  # the same seeded tokens


def test_parallel_calls_streamed_and_not(client):
    """min_tokens keeps EOS out past the first call, so the grammar's only way on is a
    second call; the seeds are tried until one ends by the grammar within max_tokens."""
    for seed in range(1, 9):
        kw = dict(tool_choice="required", seed=seed, max_tokens=480, extra_body={"min_tokens": 100})
        whole = chat(client, **kw).choices[0]
        if whole.finish_reason == "tool_calls":
            break
    calls = checked_calls(whole.message)
    assert whole.finish_reason == "tool_calls" and len(calls) >= 2, whole
    assert streamed(client, **kw) == ("", calls, "tool_calls")


def test_auto_and_none_answer_in_their_shape(client):
    """auto: free text, a call only once the model opens one; none: never a call (the
    noise model opens none: the scripted-scheduler tests show auto's calls)."""
    for choice in ("auto", "none"):
        answer = chat(client, tool_choice=choice, seed=2, max_tokens=24).choices[0]
        assert answer.finish_reason in ("stop", "length"), answer
        assert answer.message.content is not None and not answer.message.tool_calls
        assert "<tool_call>" not in answer.message.content
        checked_calls(answer.message)


def test_a_three_step_agent_loop(client):
    """Call, result, call, result, answer: each step's prompt holds the whole history,
    rendered by the template, and reuses the earlier steps' KV from the radix cache."""
    messages = list(USER)
    usage = []
    for step, choice in enumerate([named("get_weather"), named("now"), "none"]):
        done = chat(client, messages=messages, tool_choice=choice, seed=step, max_tokens=ONE_CALL)
        usage.append(done.usage)
        message = done.choices[0].message
        if choice == "none":
            assert message.content is not None and not message.tool_calls
            break
        (name, args), *_ = checked_calls(message)
        assert name == choice["function"]["name"]
        messages.append(message.model_dump(exclude_none=True))
        result = {"get_weather": "sunny, 21 C", "now": "12:00"}[name]
        messages.append(
            {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": result}
        )
    assert len(usage) == 3
    prompts = [u.prompt_tokens for u in usage]
    assert prompts == sorted(prompts) and len(set(prompts)) == 3
    for u in usage[1:]:
        assert u.prompt_tokens_details.cached_tokens > 0
