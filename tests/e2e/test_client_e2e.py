"""radixserve.client against the three real processes on loopback: plain and streamed
generation, tokenize, model info, flush, errors, and typed structured output (a pydantic
model, a dataclass, a type dict) decoded under the server's grammar constraints."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import pydantic
import pytest

from radixserve.client import (
    AsyncClient,
    Client,
    InvalidArgument,
    StructuredOutputError,
    output_spec,
)
from radixserve.v1 import generation_pb2 as pb
from tests.server_util import Server, greedy

pytestmark = pytest.mark.slow

PROMPT = "Beautiful is better than"
JSON_PROMPT = "Beautiful is better than ugly. Give the answer:"
SEEDS = (1, 2, 3, 4)
MAX_TOKENS = 200


class Aphorism(pydantic.BaseModel):
    topic: str = pydantic.Field(max_length=12)
    better: bool
    score: int = pydantic.Field(ge=0, le=9)
    tags: list[Literal["zen", "python", "code"]] = pydantic.Field(max_length=3)


@dataclasses.dataclass
class Pair:
    left: Literal["simple", "complex"]
    right: Literal["flat", "nested"]


@dataclasses.dataclass
class Verdict:
    pair: Pair
    winner: Literal["left", "right"]
    sure: bool


TYPE_DICT = {
    "rule": Literal["explicit", "implicit", "sparse"],
    "count": int,
    "ok": bool,
    "parts": list[Literal["a", "b"]],
    "inner": {"flag": bool, "level": Literal[1, 2, 3]},
}


@pytest.fixture(scope="module")
def server():
    with Server("--max-total-tokens", "8192") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with Client(server.addr, timeout=120) as c:
        yield c


def test_generate_matches_the_raw_rpc(server, client):
    ids, text, last = server.generate(text=PROMPT, sampling=greedy(12))
    out = client.generate(PROMPT, max_tokens=12, temperature=0.0)
    assert out.token_ids == tuple(ids) and out.text == text
    assert out.finish_reason == last.finish_reason
    assert out.usage.prompt_tokens == last.prompt_tokens
    assert out.usage.completion_tokens == len(ids)
    assert out.usage.cached_tokens == out.usage.prompt_tokens - 1  # the raw call cached it
    assert out.timings.total_time > 0


def test_stream_joins_to_generate_and_reports_usage(client):
    chunks = list(client.stream(PROMPT + " ugly", max_tokens=10, temperature=0.0))
    assert len(chunks) >= 2
    last = chunks[-1]
    assert last.finish_reason in ("stop", "length") and last.usage is not None
    assert all(c.finish_reason is None for c in chunks[:-1])
    whole = client.generate(PROMPT + " ugly", max_tokens=10, temperature=0.0)
    assert "".join(c.text for c in chunks) == whole.text
    assert sum(len(c.token_ids) for c in chunks) == last.usage.completion_tokens


def test_logprobs(client):
    out = client.generate(PROMPT, max_tokens=4, temperature=0.0, top_logprobs=2)
    assert [lp.token_id for lp in out.logprobs] == list(out.token_ids)
    assert all(len(lp.top) == 2 and lp.top[0].token_id == lp.token_id for lp in out.logprobs)


def test_tokenize_model_info_flush(server, client):
    raw = server.stub.Tokenize(pb.TokenizeRequest(text=PROMPT))
    toks = client.tokenize(PROMPT)
    assert toks.ids == tuple(raw.ids) and toks.tokens == tuple(raw.tokens)
    info = client.model_info()
    raw_info = server.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.model_id == raw_info.model_id and info.vocab_size == raw_info.vocab_size > 0
    assert info.max_model_len > 0 and info.num_engines == 1
    client.generate("Flat is better than nested.", max_tokens=2)
    assert client.flush_cache().flushed
    again = client.generate("Flat is better than nested.", max_tokens=2)
    assert again.usage.cached_tokens == 0


def test_server_refusal_is_invalid_argument_with_its_message(client):
    with pytest.raises(InvalidArgument) as e:
        client.generate(PROMPT, max_tokens=-1)
    assert "max_tokens" in e.value.message


def test_async_client(server):
    async def main() -> tuple[str, str, int]:
        async with AsyncClient(server.addr, timeout=120) as c:
            out = await c.generate(PROMPT, max_tokens=8, temperature=0.0)
            chunks = c.stream(PROMPT, max_tokens=8, temperature=0.0)
            streamed = "".join([ch.text async for ch in chunks])
            info = await c.model_info()
            return out.text, streamed, info.vocab_size

    text, streamed, vocab = asyncio.run(main())
    assert text == streamed and vocab > 0


def _structured(client: Client, spec: object) -> list[object]:
    """Samples ``spec`` at temperature 1.0 over several seeds at once (one channel, many
    calls): each answer either parses or was cut by max_tokens (the documented
    StructuredOutputError); most must parse."""

    def one(seed: int) -> object:
        try:
            out = client.generate(
                JSON_PROMPT,
                structured_output=spec,
                max_tokens=MAX_TOKENS,
                temperature=1.0,
                seed=seed,
            )
        except StructuredOutputError as e:
            assert e.completion.finish_reason == "length", e
            return None
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), output_spec(spec).json_schema)
        return out.parsed

    with ThreadPoolExecutor(len(SEEDS)) as pool:
        parsed = [p for p in pool.map(one, SEEDS) if p is not None]
    assert len(parsed) >= len(SEEDS) - 1, f"only {len(parsed)}/{len(SEEDS)} finished"
    return parsed


def test_structured_output_pydantic_model(client):
    for got in _structured(client, Aphorism):
        assert isinstance(got, Aphorism)
        assert 0 <= got.score <= 9 and len(got.topic) <= 12


def test_structured_output_dataclass(client):
    for got in _structured(client, Verdict):
        assert isinstance(got, Verdict) and isinstance(got.pair, Pair)
        assert got.winner in ("left", "right")


def test_structured_output_type_dict(client):
    for got in _structured(client, TYPE_DICT):
        assert isinstance(got, dict) and set(got) == set(TYPE_DICT)
        assert isinstance(got["inner"], dict) and got["inner"]["level"] in (1, 2, 3)
        assert all(p in ("a", "b") for p in got["parts"])


def test_issue_type_dict_example_and_raw_constraints(client):
    spec = {"product_name": str, "price": float, "features": list[str], "in_stock": bool}
    try:
        got = client.generate(
            JSON_PROMPT, structured_output=spec, max_tokens=MAX_TOKENS, temperature=0.7, seed=2
        ).parsed
        assert set(got) == set(spec) and isinstance(got["in_stock"], bool)
    except StructuredOutputError as e:  # an unbounded string may run past max_tokens
        assert e.completion.finish_reason == "length"
    digits = client.generate(JSON_PROMPT, regex=r"[0-9]{3}-[a-z]{2}", max_tokens=20, seed=1)
    assert digits.finish_reason == "stop"
    assert len(digits.text) == 6 and digits.text[3] == "-" and digits.text[:3].isdigit()
    obj = client.generate(JSON_PROMPT, json_object=True, max_tokens=MAX_TOKENS, seed=3)
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)


def test_bad_schema_is_invalid_argument_and_the_client_still_works(client):
    with pytest.raises(InvalidArgument) as e:
        client.generate(JSON_PROMPT, structured_output={"type": "objec"}, max_tokens=8)
    assert "json_schema" in e.value.message
    assert client.generate(PROMPT, max_tokens=2).usage.completion_tokens >= 1


def _python_blocks(doc: str, section: str) -> list[str]:
    """The ```python blocks of one '## ' section of a Markdown file in the repository."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / doc).read_text()
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start : end if end > 0 else None], re.S)


@pytest.mark.parametrize(
    ("doc", "section", "count"),
    [
        ("README.md", "Structured output", 2),
        ("docs/client.md", "Structured output", 1),
        ("docs/structured-output.md", "Asking for it", 1),
    ],
)
def test_the_docs_structured_output_examples_run_as_written(server, doc, section, count):
    """Each example, with only the server's address changed, finishes and parses on the
    default model (issue 43: the README's never did: its strings never closed)."""
    blocks = [b for b in _python_blocks(doc, section) if "localhost:" in b][:count]
    assert len(blocks) == count, (doc, section)
    for code in blocks:
        code = code.replace("localhost:30000", server.addr)
        code = code.replace("localhost:30080", f"127.0.0.1:{server.http_port}")
        scope: dict[str, object] = {"__name__": "doc_example"}
        code_obj = compile(code, f"{doc}:{section}", "exec", dont_inherit=True)  # as a script
        exec(code_obj, scope)  # raises if the answer does not parse
        done = scope.get("done")
        if done is not None:  # the OpenAI example parses only after checking finish_reason
            assert done.choices[0].finish_reason == "stop" and "product" in scope
