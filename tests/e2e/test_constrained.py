"""Constrained decoding end to end (issue 12): the three real processes on loopback, the
default model sampled at temperature 1.0 with several seeds; every output that finishes
validates (jsonschema / re.fullmatch). Over gRPC and over OpenAI HTTP with the official
client; bad constraints; mixed batches; retraction; cache hits."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import openai
import pytest
from openai import OpenAI

from radixserve.v1 import generation_pb2 as pb
from services.frontend.tool_grammar import CallMarkup, tool_call_format, tool_structural_tag
from tests.e2e.constrained_cases import ALL, EBNFS, REGEXES, SCHEMAS, Case, large_schema
from tests.server_util import Server, greedy

pytestmark = pytest.mark.slow

SEEDS = (1, 2, 3)
MAX_TOKENS = 160
PROMPT = "Beautiful is better than ugly. Give the answer:"


@pytest.fixture(scope="module")
def server():
    with Server("--max-total-tokens", "16384", "--max-running-requests", "64") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(
        base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="unused", max_retries=0
    )


def _sampling(case: Case, seed: int, max_tokens: int = MAX_TOKENS, **kw) -> pb.SamplingParams:
    sp = pb.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, **kw)
    if case.kind == "json_object":
        sp.json_object = True
    else:
        setattr(sp, case.kind, case.text)
    return sp


def _run_all(server: Server, jobs: list[tuple[Case, pb.SamplingParams]]):
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(lambda j: server.generate(text=PROMPT, sampling=j[1]), jobs))


def test_every_constraint_every_seed_validates_over_grpc(server):
    jobs = [(case, _sampling(case, seed)) for case in ALL for seed in SEEDS]
    results = _run_all(server, jobs)
    stopped = 0
    for (case, _), (_, text, last) in zip(jobs, results, strict=True):
        assert last.finish_reason in ("stop", "length"), (case.name, last.finish_reason)
        if last.finish_reason == "stop":
            stopped += 1
            case.check(text)
    assert len(ALL) >= 30
    assert stopped >= 0.8 * len(jobs), f"only {stopped}/{len(jobs)} finished by their grammar"


def test_seeded_constrained_output_is_reproducible(server):
    case = SCHEMAS[0]
    a = server.generate(text=PROMPT, sampling=_sampling(case, 11))
    b = server.generate(text=PROMPT, sampling=_sampling(case, 11))
    assert a[0] == b[0]


def test_openai_response_format_json_schema_chat_and_completions(server, client):
    model = client.models.list().data[0].id
    for case in SCHEMAS[:6]:
        schema = json.loads(case.text)
        done = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Beautiful is better than"}],
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=5,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": case.name, "schema": schema, "strict": True},
            },
        )
        choice = done.choices[0]
        if choice.finish_reason == "stop":
            case.check(choice.message.content)
    done = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=3,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert done.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(done.choices[0].text), dict)


def test_openai_regex_and_ebnf_extra_body_and_streaming(server, client):
    model = client.models.list().data[0].id
    for case in REGEXES[:3] + EBNFS[:3]:
        stream = client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=9,
            stream=True,
            extra_body={case.kind: case.text},
        )
        text, finish = "", None
        for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "stop", (case.name, finish, text)
        case.check(text)


BAD_GRPC = [
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", "[1, 2]", "object or a boolean"),
    ("json_schema", '{"type": "objec"}', "objec"),
    ("json_schema", '{"not": {"type": "string"}}', "'not'"),
    ("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}', "minimum"),
    ("json_schema", '{"$ref": "#/$defs/missing"}', "missing"),
    ("json_schema", json.dumps({"enum": ["x" * 100] * 2000}), "at most"),
    ("regex", "[a-", "Unclosed"),
    ("regex", "a(?=b)", "Lookahead"),
    ("regex", "   ", "empty"),
    ("ebnf", 'root ::= "a', "string literal"),
    ("ebnf", 'start ::= "a"', "root"),
    ("ebnf", "root ::= undefined_rule", "undefined_rule"),
    # Compile, but no output can complete them (issue 43: these were INTERNAL / HTTP 500).
    ("ebnf", "root ::= root", "accepts no finite string"),
    ("ebnf", "root ::= a\na ::= root", "rules 'root', 'a' never end"),
    ("ebnf", 'root ::= "a" root', "accepts no finite string"),
    ("structural_tag", "{bad", "not valid JSON"),
    ("structural_tag", '{"type": "structural_tag", "format": {"type": "nope"}}', "nope"),
]


@pytest.mark.parametrize(("field", "text", "needle"), BAD_GRPC)
def test_bad_constraint_is_invalid_argument_and_server_keeps_serving(server, field, text, needle):
    with pytest.raises(grpc.RpcError) as err:
        server.generate(text=PROMPT, sampling=pb.SamplingParams(max_tokens=8, **{field: text}))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"sampling.{field}" in err.value.details() and needle in err.value.details()
    ids, _, last = server.generate(text="Beautiful is", sampling=greedy(3))
    assert ids and last.finish_reason in ("length", "stop")


def test_json_object_false_is_refused(server):
    with pytest.raises(grpc.RpcError) as err:
        server.generate(text=PROMPT, sampling=pb.SamplingParams(max_tokens=8, json_object=False))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.json_object" in err.value.details()


@pytest.mark.parametrize(
    ("extra", "param", "needle"),
    [
        ({"regex": "[a-"}, "regex", "Unclosed"),
        ({"ebnf": 'root ::= "a'}, "ebnf", "string literal"),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf", "at most one constraint"),
        (
            {"regex": "a", "response_format": {"type": "json_object"}},
            "regex",
            "at most one constraint",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "json_schema.schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format", "xml"),
        (
            {"response_format": {"type": "structural_tag", "format": {"type": "nope"}}},
            "response_format",
            "nope",
        ),
        ({"ebnf": "root ::= root"}, "ebnf", "accepts no finite string"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"if": {}}},
                }
            },
            "response_format",
            "'if'",
        ),
    ],
)
def test_http_bad_constraint_is_400_naming_the_param(server, client, extra, param, needle):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(
            model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=8, extra_body=extra
        )
    body = err.value.body
    assert body["param"] == param and needle in body["message"], body
    assert (
        client.completions.create(
            model=client.models.list().data[0].id,
            prompt="Beautiful is",
            max_tokens=3,
            temperature=0,
        )
        .choices[0]
        .text
    )


HERMES = CallMarkup(
    "<tool_call>", '<tool_call>\n{"name": "{name}", "arguments": ', "}\n</tool_call>"
)
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now"}},
]
CALL = re.compile(
    r'<tool_call>\n\{"name": "(get_weather|now)", "arguments": (.*?)\}\n</tool_call>', re.S
)


def _check_calls(text: str, names: tuple[str, ...]) -> None:
    """``text`` is calls only, each of one of ``names`` with arguments its schema accepts."""
    calls = CALL.findall(text)
    assert calls and "\n".join(m.group(0) for m in CALL.finditer(text)) == text, text
    for name, args in calls:
        assert name in names
        jsonschema.validate(json.loads(args), WEATHER if name == "get_weather" else {"const": {}})


def test_structural_tag_tool_calls_over_native_generate_and_openai(server, client):
    """tool_grammar's tags through the real path: /generate's sampling_params.structural_tag
    (tool_choice required) and OpenAI's response_format (a named function)."""
    import httpx

    tag = tool_structural_tag(TOOLS, "required", True, HERMES)
    stopped = 0
    for seed in SEEDS:
        sp = {"max_new_tokens": MAX_TOKENS, "temperature": 1.0, "sampling_seed": seed}
        body = {"text": PROMPT, "sampling_params": {**sp, "structural_tag": tag}}
        r = httpx.post(f"http://127.0.0.1:{server.http_port}/generate", json=body, timeout=120)
        out = r.json()
        assert r.status_code == 200, out
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            stopped += 1
            _check_calls(out["text"], ("get_weather", "now"))
    assert stopped >= 2, f"only {stopped}/{len(SEEDS)} finished by their grammar"
    named = {"type": "function", "function": {"name": "get_weather"}}
    fmt = tool_call_format(TOOLS, named, False, HERMES)
    done = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=2,
        response_format={"type": "structural_tag", "format": fmt},
    )
    assert done.choices[0].finish_reason == "stop"
    _check_calls(done.choices[0].message.content or "", ("get_weather",))


def test_native_generate_refuses_a_grammar_that_never_ends(server):
    import httpx

    body = {"text": "hi", "sampling_params": {"max_new_tokens": 8, "ebnf": "root ::= root"}}
    r = httpx.post(f"http://127.0.0.1:{server.http_port}/generate", json=body, timeout=60)
    assert r.status_code == 400 and "accepts no finite string" in r.text, r.text


def test_mixed_batch_unconstrained_tokens_unchanged(server):
    """Unconstrained requests decoded beside constrained ones give the tokens they give alone."""
    free = [
        dict(text=t, sampling=greedy(48, ignore_eos=True))
        for t in ("Beautiful is better", "Explicit is better", "Simple is better")
    ]
    free.append(
        dict(
            text="Flat is better",
            sampling=pb.SamplingParams(max_tokens=48, temperature=1.0, seed=42, ignore_eos=True),
        )
    )
    alone = [server.generate(**kw)[0] for kw in free]
    constrained = [
        dict(text=PROMPT, sampling=_sampling(case, seed, max_tokens=96))
        for case in (SCHEMAS[0], SCHEMAS[21], REGEXES[1], EBNFS[3])
        for seed in (1, 2)
    ]
    jobs = constrained[:4] + free + constrained[4:]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda kw: server.generate(**kw)[0], jobs))
    assert together[4:8] == alone


def test_cache_hit_gives_the_same_constrained_output(server):
    case = SCHEMAS[21]
    assert server.stub.FlushCache(pb.FlushCacheRequest()).flushed
    cold = server.generate(text=PROMPT, sampling=_sampling(case, 4))
    warm = server.generate(text=PROMPT, sampling=_sampling(case, 4))
    assert cold[2].cached_tokens == 0 and warm[2].cached_tokens > 0
    assert warm[0] == cold[0]


def test_max_tokens_can_cut_json_with_length(server):
    _, text, last = server.generate(text=PROMPT, sampling=_sampling(SCHEMAS[21], 1, max_tokens=4))
    assert last.finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_retracted_constrained_requests_resume_right(server):
    """A small pool forces retraction; seeded constrained outputs equal those of the roomy
    module server (where nothing is retracted)."""
    # 120 tokens each (the vocabulary has no token mixing letters and digits) + EOS: two
    # running together outgrow the 256-slot pool.
    case = Case("long", "regex", r"([a-z][0-9]){60}", r"([a-z][0-9]){60}")
    jobs = [_sampling(case, seed, max_tokens=130) for seed in range(6)]
    want = [server.generate(text=PROMPT, sampling=sp)[0] for sp in jobs]
    with Server("--max-total-tokens", "256", "--chunked-prefill-size", "32") as small:
        with ThreadPoolExecutor(len(jobs)) as pool:
            got = list(pool.map(lambda sp: small.generate(text=PROMPT, sampling=sp), jobs))
        log = small.output()
    assert "Retract requests" in log
    assert [g[0] for g in got] == want
    for _, text, last in got:
        assert last.finish_reason == "stop"
        case.check(text)


def test_compile_timeout_names_the_flag_and_the_grammar_is_cached_after():
    """Past --grammar-compile-timeout the request fails with DEADLINE_EXCEEDED; the compile
    goes on, so the same schema is served from the cache later (not cached as invalid)."""
    schema = json.dumps(large_schema(1500))  # several seconds to compile, under the size cap
    with Server("--grammar-compile-timeout", "1") as s:
        with pytest.raises(grpc.RpcError) as err:
            s.generate(text=PROMPT, sampling=pb.SamplingParams(max_tokens=4, json_schema=schema))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "--grammar-compile-timeout" in err.value.details()
        ids, _, last = s.generate(text="Beautiful is", sampling=greedy(3))  # still serving
        assert ids
        deadline = time.monotonic() + 120
        while True:
            try:
                sp = pb.SamplingParams(max_tokens=4, temperature=0, json_schema=schema)
                _, _, last = s.generate(text=PROMPT, sampling=sp)
                break
            except grpc.RpcError as e:  # still compiling: each try waits 1 s more
                assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert time.monotonic() < deadline, "the timed-out compile never finished"
    assert last.finish_reason in ("length", "stop")
