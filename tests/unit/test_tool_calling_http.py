"""Tool calling and reasoning through the real frontend (HTTP, the official openai client)
over the scripted scheduler (tests/fake_scheduler.py): the script is what "the model" writes,
so every shape of answer is checked exactly; tests/e2e/test_tools_e2e.py has the model write
its calls itself under the constraint."""

from __future__ import annotations

import dataclasses
import json

import grpc
import httpx
import openai
import pytest

from radixserve.v1 import generation_pb2 as pb
from radixserve.v1 import generation_pb2_grpc
from services.common.transport import unpack_i32
from services.frontend.tokenizer import Tokenizer
from tests.fake_scheduler import FakeScheduler, FrontendThread, build_tokenizer, frontend_config
from tests.tool_models import set_chat_template

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now"}},
]
USER = [{"role": "user", "content": "Weather in Paris?"}]
PARIS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
    "</tool_call>"
)
NOW = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
THINK = "<think>The user wants the weather.</think>\n\n"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    plain = build_tokenizer(tmp_path_factory.mktemp("plain"))
    tools = set_chat_template(build_tokenizer(tmp_path_factory.mktemp("tools")))
    return plain, tools


@pytest.fixture(scope="module")
def tok(folders) -> Tokenizer:
    return Tokenizer(str(folders[1]))


@pytest.fixture(scope="module")
def fake(tok):
    f = FakeScheduler(tok.encode("hi"), tok.vocab_size, max_model_len=4096).start()
    yield f
    f.stop()


def _frontend(folder, fake, **flags):
    cfg = dataclasses.replace(frontend_config(folder, [fake], http=True), **flags)
    return FrontendThread(cfg).start().wait_ready()


@pytest.fixture(scope="module")
def fe(folders, fake):
    """The tool template (auto detects hermes), and Qwen3's reasoning parser."""
    f = _frontend(folders[1], fake, reasoning_parser="qwen3")
    yield f
    f.stop()


@pytest.fixture(scope="module")
def plain(folders, fake):
    """A template that renders no tools and shows no call format: no parser."""
    f = _frontend(folders[0], fake)
    yield f
    f.stop()


@pytest.fixture(scope="module")
def client(fe):
    return openai.OpenAI(base_url=fe.http_base + "/v1", api_key="x", max_retries=0, timeout=20)


def _say(fake: FakeScheduler, tok: Tokenizer, text: str) -> None:
    fake.script = tok.encode(text)


def _chat(client, **kw):
    kw.setdefault("max_tokens", 400)  # the fake's script, whole
    return client.chat.completions.create(model="tiny", messages=kw.pop("messages", USER), **kw)


def _prompt(fake: FakeScheduler, tok: Tokenizer) -> str:
    return tok.decode(list(unpack_i32(fake.requests[-1].input_ids)))


def _stream(client, **kw) -> dict:
    """A streamed answer put back together, and what its chunks looked like."""
    out: dict = {"reasoning": "", "content": "", "calls": {}, "finish": None, "chunks": 0}
    for chunk in _chat(client, stream=True, **kw):
        out["chunks"] += 1
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        out["reasoning"] += getattr(delta, "reasoning_content", None) or ""
        assert "<tool_call>" not in (delta.content or "")
        out["content"] += delta.content or ""
        for item in delta.tool_calls or []:
            call = out["calls"].setdefault(item.index, {"id": None, "name": "", "arguments": ""})
            if item.id:
                assert call["id"] is None and item.function.name  # id and name come first
                call["id"], call["name"] = item.id, item.function.name
            call["arguments"] += item.function.arguments or ""
        out["finish"] = choice.finish_reason or out["finish"]
    return out


def test_a_call_after_thinking_non_streamed(client, fake, tok):
    _say(fake, tok, THINK + PARIS)
    done = _chat(client, tools=TOOLS)
    choice = choice0 = done.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.reasoning_content == "The user wants the weather."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris", "unit": "c"},
    )
    # The engine was asked for the tools' grammar (free thinking first), the prompt has them.
    tag = json.loads(fake.requests[-1].sampling.constraint.structural_tag)
    assert tag["format"]["type"] == "or"  # qwen3: with or without a thinking part
    assert '"name": "get_weather"' in _prompt(fake, tok)
    assert choice0.message.model_dump()["tool_calls"][0]["function"]["name"] == "get_weather"


def test_the_stream_reassembles_to_the_whole_answer(client, fake, tok):
    _say(fake, tok, THINK + "Let me look.\n" + PARIS + "\n" + NOW)
    whole = _chat(client, tools=TOOLS).choices[0]
    streamed = _stream(client, tools=TOOLS)
    assert streamed["finish"] == whole.finish_reason == "tool_calls"
    assert streamed["reasoning"] == whole.message.reasoning_content
    assert streamed["content"] == whole.message.content and whole.message.content.strip()
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert calls == [("get_weather", '{"city":"Paris","unit":"c"}'), ("now", "{}")]
    assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == calls


def test_tool_choice_none_renders_the_tools_and_reads_no_calls(client, fake, tok):
    _say(fake, tok, PARIS)
    choice = _chat(client, tools=TOOLS, tool_choice="none").choices[0]
    assert (choice.finish_reason, choice.message.content) == ("stop", PARIS)
    assert choice.message.tool_calls is None
    assert not fake.requests[-1].sampling.HasField("constraint")
    assert "<tools>" in _prompt(fake, tok)


def test_required_and_named_send_their_grammar(client, fake, tok):
    _say(fake, tok, NOW)
    named = {"type": "function", "function": {"name": "now"}}
    for choice in ("required", named):
        done = _chat(client, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
        assert done.choices[0].message.tool_calls[0].function.name == "now"
        fmt = json.loads(fake.requests[-1].sampling.constraint.structural_tag)["format"]
        calls = fmt["elements"][1]  # (thinking, then calls) or calls
        assert calls["type"] == "tags_with_separator" and calls["stop_after_first"]


def test_an_agent_loop_feeds_calls_and_results_back(client, fake, tok):
    _say(fake, tok, PARIS)
    first = _chat(client, tools=TOOLS).choices[0].message
    _say(fake, tok, "It is sunny in Paris.")
    messages = [
        *USER,
        first.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "sunny, 21 C"},
    ]
    done = _chat(client, tools=TOOLS, messages=messages).choices[0]
    assert (done.finish_reason, done.message.content) == ("stop", "It is sunny in Paris.")
    prompt = _prompt(fake, tok)
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}' in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt


def test_a_call_cut_by_the_length_limit_stays_content(client, fake, tok):
    _say(fake, tok, PARIS)
    choice = _chat(client, tools=TOOLS, max_tokens=8).choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls


def test_logprobs_still_come_with_parsed_answers(client, fake, tok):
    _say(fake, tok, NOW)
    whole = _chat(client, tools=TOOLS, logprobs=True).choices[0]
    assert len(whole.logprobs.content) == len(tok.encode(NOW)) + 1  # and the EOS
    n = sum(
        len(c.choices[0].logprobs.content)
        for c in _chat(client, tools=TOOLS, logprobs=True, stream=True)
        if c.choices and c.choices[0].logprobs
    )
    assert n == len(whole.logprobs.content)


def _post(frontend, **body) -> httpx.Response:
    body = {"model": "tiny", "messages": USER, "max_tokens": 4, **body}
    return httpx.post(frontend.http_base + "/v1/chat/completions", json=body, timeout=20)


@pytest.mark.parametrize(
    ("where", "body", "param", "needle"),
    [
        ("plain", {"tools": TOOLS}, "tools", "--tool-call-parser"),
        ("plain", {"tools": TOOLS, "tool_choice": "none"}, "tools", "does not render tools"),
        ("fe", {"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format", ""),
        ("fe", {"functions": [{"name": "f"}]}, "functions", "use tools"),
        (
            "fe",
            {"tools": [{"type": "function", "function": {"name": "f", "description": "<s>"}}]},
            "tools",
            "special token",
        ),
        ("fe", {"tool_choice": "auto"}, "tool_choice", "needs tools"),
        (
            "fe",
            {
                "messages": [
                    {"role": "user", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}
                ]
            },
            "messages",
            "only assistant messages make calls",
        ),
    ],
)
def test_refusals_name_the_field(request, where, body, param, needle):
    r = _post(request.getfixturevalue(where), **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"], error


def test_grpc_refuses_tools_a_template_drops(plain):
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])
    chat.tools.add(name="now")
    with grpc.insecure_channel(plain.grpc_target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.Tokenize(pb.TokenizeRequest(messages=chat), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "messages.tools: the model's chat template does not render tools" in e.value.details()
