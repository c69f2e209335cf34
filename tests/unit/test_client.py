"""radixserve.client against a scripted in-process Generation server on loopback: spec ->
JSON Schema conversion (checked with the jsonschema package), parsing into the caller's
types, request building, error mapping, sync and asyncio, streaming and cancellation."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any, Literal, Optional, Union

import grpc
import jsonschema
import pydantic
import pytest

from radixserve.client import (
    AsyncClient,
    Client,
    Completion,
    DeadlineExceeded,
    InvalidArgument,
    RadixServeError,
    ResourceExhausted,
    StructuredOutputError,
    Unauthenticated,
    Unavailable,
    output_spec,
)
from radixserve.client.requests import generate_request
from radixserve.v1 import generation_pb2 as pb
from radixserve.v1 import generation_pb2_grpc

# --- specs used throughout ------------------------------------------------------------------


class Review(pydantic.BaseModel):
    stars: int = pydantic.Field(ge=1, le=5)
    text: str


class Product(pydantic.BaseModel):
    name: str
    price: float
    tags: list[str]
    size: Literal["S", "M", "L"]
    reviews: list[Review]
    discount: Optional[float] = None  # noqa: UP045 (the spelling users write)


@dataclasses.dataclass
class Point:
    x: float
    y: float


@dataclasses.dataclass
class Route:
    name: str
    stops: list[Point]
    kind: Literal["walk", "bike"]
    note: str | None = None


VARIANT = {"sku": str, "qty": Optional[int]}  # noqa: UP045 (the spelling users write)
TYPE_DICT = {
    "product_name": str,
    "price": float,
    "features": list[str],
    "in_stock": bool,
    "dims": {"w": int, "unit": Literal["cm", "in"]},
    "variants": list[VARIANT],  # a nested dict spec inside list[...]
    "meta": dict[str, Union[int, str]],  # noqa: UP007
    "_id": str,
}
TYPE_DICT_VALUE = {
    "product_name": "lamp",
    "price": 19.5,
    "features": ["dimmable", "usb"],
    "in_stock": True,
    "dims": {"w": 30, "unit": "cm"},
    "variants": [{"sku": "L-1", "qty": None}, {"sku": "L-2", "qty": 4}],
    "meta": {"origin": "NL", "year": 2024},
    "_id": "p-1",
}
PRODUCT_VALUE = {
    "name": "mug",
    "price": 7.25,
    "tags": ["kitchen"],
    "size": "M",
    "reviews": [{"stars": 5, "text": "ok"}],
    "discount": None,
}
ROUTE_VALUE = {"name": "r", "stops": [{"x": 1, "y": 2.5}, {"x": 0, "y": 0}], "kind": "bike"}


def check_schema(schema: dict, valid: list[Any], invalid: list[Any]) -> None:
    """The schema is a valid JSON Schema that accepts ``valid`` and refuses ``invalid``."""
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    validator = cls(schema)
    for v in valid:
        validator.validate(v)
    for v in invalid:
        assert not validator.is_valid(v), f"schema accepted {v!r}"


# --- spec -> schema -> parsed value ---------------------------------------------------------


def test_json_schema_dict_is_sent_as_is_and_parses_to_json():
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0}},
        "required": ["a"],
        "title": "A",
    }
    spec = output_spec(schema)
    assert spec.json_schema == schema
    assert json.loads(spec.schema_text) == schema
    assert spec.parse('{"a": 3}') == {"a": 3}
    assert "'A'" in spec.name
    # An empty dict is the JSON Schema that accepts anything.
    assert output_spec({}).parse("[1, 2]") == [1, 2]


def test_pydantic_model():
    spec = output_spec(Product)
    check_schema(
        spec.json_schema,
        valid=[PRODUCT_VALUE, {**PRODUCT_VALUE, "discount": 0.1}],
        invalid=[
            {**PRODUCT_VALUE, "size": "XL"},
            {**PRODUCT_VALUE, "reviews": [{"stars": 9, "text": "x"}]},
            {k: v for k, v in PRODUCT_VALUE.items() if k != "price"},
            {**PRODUCT_VALUE, "tags": "kitchen"},
        ],
    )
    got = spec.parse(json.dumps(PRODUCT_VALUE))
    assert isinstance(got, Product) and isinstance(got.reviews[0], Review)
    assert got == Product.model_validate(PRODUCT_VALUE)


def test_nested_dataclass():
    spec = output_spec(Route)
    check_schema(
        spec.json_schema,
        valid=[ROUTE_VALUE, {**ROUTE_VALUE, "note": "n"}],
        invalid=[{**ROUTE_VALUE, "kind": "car"}, {**ROUTE_VALUE, "stops": [{"x": 1}]}],
    )
    got = spec.parse(json.dumps(ROUTE_VALUE))
    assert got == Route("r", [Point(1.0, 2.5), Point(0.0, 0.0)], "bike")
    assert isinstance(got.stops[0], Point)


def test_type_dict_every_key_required_no_extras():
    spec = output_spec(TYPE_DICT)
    schema = spec.json_schema
    assert sorted(schema["required"]) == sorted(TYPE_DICT)
    check_schema(
        schema,
        valid=[TYPE_DICT_VALUE],
        invalid=[
            {**TYPE_DICT_VALUE, "extra": 1},
            {k: v for k, v in TYPE_DICT_VALUE.items() if k != "_id"},
            {**TYPE_DICT_VALUE, "price": "cheap"},
            {**TYPE_DICT_VALUE, "in_stock": "yes"},
            {**TYPE_DICT_VALUE, "dims": {"w": 30, "unit": "mm"}},
            {**TYPE_DICT_VALUE, "dims": {"w": 1.5, "unit": "cm"}},
            {**TYPE_DICT_VALUE, "variants": [{"sku": "x"}]},
            {**TYPE_DICT_VALUE, "variants": [{"sku": "x", "qty": None, "more": 1}]},
            {**TYPE_DICT_VALUE, "meta": {"k": [1]}},
        ],
    )
    got = spec.parse(json.dumps(TYPE_DICT_VALUE))
    assert got == TYPE_DICT_VALUE
    assert type(got) is dict and type(got["dims"]) is dict and type(got["variants"][0]) is dict
    assert isinstance(got["price"], float)


def test_issue_example_type_dict():
    spec = output_spec(
        {"product_name": str, "price": float, "features": list[str], "in_stock": bool}
    )
    value = {"product_name": "x", "price": 1.0, "features": [], "in_stock": False}
    check_schema(spec.json_schema, [value], [{**value, "features": [1]}, {"product_name": "x"}])
    assert spec.parse(json.dumps(value)) == value


@pytest.mark.parametrize(
    "tp, valid, invalid, parsed",
    [
        (int, [3, -1], [1.5, "3", None], 3),
        (float, [1.5, 2], ["x", None], 1.5),
        (bool, [True], [1, "true"], True),
        (str, ["hi"], [1, None], "hi"),
        (list[int], [[1, 2], []], [[1.5], {}], [1, 2]),
        (Optional[str], ["a", None], [1], None),  # noqa: UP045
        (Literal["yes", "no"], ["yes"], ["maybe"], "yes"),
        (Union[int, list[str]], [1, ["a"]], ["a", [1]], ["a"]),  # noqa: UP007
        (int | None, [1, None], ["1"], 1),
        (dict[str, float], [{"a": 1.5}, {}], [{"a": "x"}, []], {"a": 1.5}),
    ],
)
def test_plain_types(tp, valid, invalid, parsed):
    spec = output_spec(tp)
    check_schema(spec.json_schema, valid, invalid)
    got = spec.parse(json.dumps(parsed))
    assert got == parsed and type(got) is type(parsed)


@pytest.mark.parametrize(
    "spec",
    [Product, Route, TYPE_DICT, list[int], Literal["yes", "no"], dict, {"type": "object"}],
    ids=["pydantic", "dataclass", "type-dict", "list", "literal", "dict", "json-schema"],
)
def test_the_engine_grammar_compiler_takes_every_schema(spec):
    """What the client sends is a schema xgrammar (the worker's compiler) accepts."""
    xgrammar = pytest.importorskip("xgrammar")
    grammar = xgrammar.Grammar.from_json_schema(output_spec(spec).schema_text)
    assert "root" in str(grammar)


def test_parse_refuses_what_does_not_fit():
    with pytest.raises(ValueError):
        output_spec(Product).parse('{"name": "mug"}')
    with pytest.raises(ValueError):
        output_spec(TYPE_DICT).parse('{"product_name": "lamp", "pri')
    with pytest.raises(ValueError):
        output_spec({"type": "object"}).parse("{")


def test_not_a_spec():
    with pytest.raises(TypeError, match="json.loads"):
        output_spec('{"type": "object"}')
    with pytest.raises(TypeError, match="not a JSON Schema dict"):
        output_spec(object())
    with pytest.raises(TypeError, match="keys must be strings"):
        output_spec({1: int, "a": str})


# --- request building ------------------------------------------------------------------------


def test_request_prompt_kinds_and_sampling():
    req = generate_request(
        "hi", None, {"max_tokens": 5, "temperature": 0.0, "seed": 7, "stop": "\n", "top_k": 3}
    )
    assert req.text == "hi"
    sp = req.sampling
    assert (sp.max_tokens, sp.temperature, sp.seed, list(sp.stop), sp.top_k) == (
        5,
        0.0,
        7,
        ["\n"],
        3,
    )
    assert not sp.HasField("top_p")  # unset stays unset: the server's default applies
    assert sp.WhichOneof("constraint") is None
    chat = generate_request([{"role": "user", "content": "yo"}], None, {"top_logprobs": 2})
    assert chat.messages.messages[0].content == "yo"
    assert chat.sampling.logprobs and chat.sampling.top_logprobs == 2
    ids = generate_request([5, 6, 7], None, {"stop": ["a", "b"], "cache_salt": "s"})
    assert list(ids.input_ids.ids) == [5, 6, 7] and list(ids.sampling.stop) == ["a", "b"]
    assert ids.cache_salt == "s"


@pytest.mark.parametrize(
    "spec, options, field, value",
    [
        (output_spec(Product), {}, "json_schema", output_spec(Product).schema_text),
        (None, {"regex": r"\d+"}, "regex", r"\d+"),
        (None, {"ebnf": 'root ::= "a"'}, "ebnf", 'root ::= "a"'),
        (None, {"json_object": True}, "json_object", True),
        (None, {"structural_tag": '{"format": {}}'}, "structural_tag", '{"format": {}}'),
    ],
)
def test_request_constraint_kinds(spec, options, field, value):
    sp = generate_request("p", spec, options).sampling
    assert sp.WhichOneof("constraint") == field
    assert getattr(sp, field) == value


def test_request_misuse_is_refused_before_sending():
    with pytest.raises(ValueError, match="at most one constraint"):
        generate_request("p", output_spec(int), {"regex": "a"})
    with pytest.raises(ValueError, match="regex and ebnf"):
        generate_request("p", None, {"regex": "a", "ebnf": "root ::= x"})
    with pytest.raises(TypeError, match="unknown option"):
        generate_request("p", None, {"max_new_tokens": 3})  # type: ignore[typeddict-unknown-key]
    with pytest.raises(ValueError, match="empty"):
        generate_request([], None, {})
    with pytest.raises(TypeError, match="role"):
        generate_request([{"content": "x"}], None, {})


# --- a scripted Generation server ------------------------------------------------------------

Script = Callable[[pb.GenerateRequest], Iterator[pb.GenerateResponse]]


def final(
    text: str = "",
    ids: tuple[int, ...] = (),
    reason: str = "stop",
    prompt: int = 4,
    cached: int = 2,
    completion: int = 0,
) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id="r-1",
        text=text,
        token_ids=ids,
        finish_reason=reason,
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=completion,
        timings=pb.Timings(queue_time=0.1, prefill_time=0.2, decode_time=0.3, total_time=0.6),
    )


def text_reply(text: str, pieces: int = 3, reason: str = "stop") -> Script:
    """Replies ``text`` in ``pieces`` messages, one token id per character."""

    def script(req: pb.GenerateRequest) -> Iterator[pb.GenerateResponse]:
        step = max(1, len(text) // pieces)
        parts = [text[i : i + step] for i in range(0, len(text), step)] or [""]
        for part in parts[:-1]:
            yield pb.GenerateResponse(request_id="r-1", text=part, token_ids=[ord(c) for c in part])
        last = parts[-1]
        yield final(last, tuple(ord(c) for c in last), reason, completion=len(text))

    return script


class Servicer(generation_pb2_grpc.GenerationServicer):
    """Records every request and its metadata; replies what ``script`` says; refuses with a
    status when ``fail`` is set; ``hang`` keeps a stream open until it is cancelled."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.requests: list[Any] = []
        self.metadata: list[dict[str, str]] = []
        self.script: Script = text_reply("Hello, world")
        self.fail: tuple[grpc.StatusCode, str] | None = None
        self.hang = False
        self.cancelled = threading.Event()

    def _note(self, request: Any, context: grpc.ServicerContext) -> None:
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        if self.fail is not None:
            context.abort(*self.fail)

    def Generate(self, request, context):
        self._note(request, context)
        context.add_callback(self.cancelled.set)
        yield from self.script(request)
        while self.hang and context.is_active():  # a stream that never ends by itself
            time.sleep(0.01)
        if self.hang:
            return

    def Tokenize(self, request, context):
        self._note(request, context)
        src = request.text or "".join(m.content for m in request.messages.messages)
        return pb.TokenizeResponse(ids=[ord(c) for c in src], tokens=list(src))

    def GetModelInfo(self, request, context):
        self._note(request, context)
        return pb.GetModelInfoResponse(
            model_id="tiny",
            max_model_len=512,
            vocab_size=300,
            page_size=1,
            max_total_num_tokens=4096,
            num_engines=1,
            architecture="LlamaForCausalLM",
        )

    def FlushCache(self, request, context):
        self._note(request, context)
        return pb.FlushCacheResponse(flushed=True, message="Cache flushed.")


@pytest.fixture(scope="module")
def server_addr() -> Iterator[tuple[str, Servicer]]:
    servicer = Servicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(grace=None)


@pytest.fixture
def fake(server_addr) -> Servicer:
    """The shared servicer, reset for each test."""
    servicer = server_addr[1]
    servicer.reset()
    return servicer


@pytest.fixture
def client(server_addr, fake) -> Iterator[Client]:
    with Client(server_addr[0], timeout=10) as c:
        yield c


# --- sync client -------------------------------------------------------------------------------


def test_generate_joins_the_stream(client, fake):
    out = client.generate("Say hi", max_tokens=20, temperature=0.0, seed=3, stop=["\n"])
    assert out.text == "Hello, world"
    assert out.token_ids == tuple(ord(c) for c in "Hello, world")
    assert out.finish_reason == "stop" and out.request_id == "r-1"
    assert (out.usage.prompt_tokens, out.usage.cached_tokens, out.usage.completion_tokens) == (
        4,
        2,
        12,
    )
    assert out.usage.total_tokens == 16
    assert out.timings.total_time == pytest.approx(0.6)
    assert out.parsed is None and out.logprobs == ()
    (req,) = fake.requests
    assert req.text == "Say hi" and req.sampling.max_tokens == 20 and req.sampling.seed == 3
    assert req.sampling.WhichOneof("constraint") is None


def test_logprobs_come_back(client, fake):
    def script(req):
        yield pb.GenerateResponse(
            token_ids=[7],
            text="a",
            logprobs=[pb.TokenLogprob(token_id=7, logprob=-0.5, top=[pb.TopLogprob(token_id=7)])],
        )
        yield final("b", (8,), completion=2)

    fake.script = script
    out = client.generate("p", logprobs=True, top_logprobs=1)
    assert out.logprobs[0].token_id == 7 and out.logprobs[0].logprob == pytest.approx(-0.5)
    assert out.logprobs[0].top[0].token_id == 7
    assert fake.requests[0].sampling.top_logprobs == 1


def prompt_scores_script(req: pb.GenerateRequest) -> Iterator[pb.GenerateResponse]:
    """Prompt logprobs on the first message (as the server sends them), then the end."""
    start = max(req.sampling.prompt_logprobs_start, 1)
    scored = [
        pb.TokenLogprob(
            token_id=t, logprob=-0.25 * k, top=[pb.TopLogprob(token_id=1, logprob=-0.1)]
        )
        for k, t in enumerate(req.input_ids.ids[start:])
    ]
    yield pb.GenerateResponse(
        token_ids=[9], text="4", prompt_logprobs=scored, prompt_logprobs_start=start
    )
    yield final("2", (10,), completion=2)


def check_prompt_scores(out: Completion, fake: Servicer) -> None:
    assert out.prompt_logprobs_start == 2
    assert [lp.token_id for lp in out.prompt_logprobs] == [7, 8]
    assert [lp.logprob for lp in out.prompt_logprobs] == pytest.approx([0.0, -0.25])
    assert out.prompt_logprobs[1].top[0].token_id == 1
    sp = fake.requests[-1].sampling
    assert sp.prompt_logprobs and sp.prompt_logprobs_start == 2 and sp.top_logprobs == 1
    assert sp.min_tokens == 3


def test_prompt_logprobs_and_min_tokens(client, fake):
    fake.script = prompt_scores_script
    options = {"prompt_logprobs": True, "prompt_logprobs_start": 2, "top_logprobs": 1}
    out = client.generate([5, 6, 7, 8], min_tokens=3, **options)
    check_prompt_scores(out, fake)
    assert out.text == "42"
    chunks = list(client.stream([5, 6, 7, 8], min_tokens=3, **options))
    assert chunks[0].prompt_logprobs_start == 2 and not chunks[1].prompt_logprobs
    out = client.generate([5, 6, 7, 8], structured_output=int, min_tokens=3, **options)
    check_prompt_scores(out, fake)  # carried through to the parsed completion too
    assert out.parsed == 42
    fake.script = text_reply("plain")
    plain = client.generate("p")
    assert plain.prompt_logprobs == () and plain.prompt_logprobs_start == 0
    assert not fake.requests[-1].sampling.HasField("min_tokens")


def test_async_prompt_logprobs_and_min_tokens(server_addr, fake):
    fake.script = prompt_scores_script

    async def main() -> Completion:
        async with AsyncClient(server_addr[0], timeout=10) as c:
            return await c.generate(
                [5, 6, 7, 8],
                min_tokens=3,
                prompt_logprobs=True,
                prompt_logprobs_start=2,
                top_logprobs=1,
            )

    check_prompt_scores(asyncio.run(main()), fake)


def test_structured_output_pydantic(client, fake):
    fake.script = text_reply(json.dumps(PRODUCT_VALUE), pieces=5)
    out = client.generate("A mug as JSON", structured_output=Product, max_tokens=200)
    assert isinstance(out, Completion)
    product: Product = out.parsed
    assert isinstance(product, Product) and product.reviews[0].stars == 5
    sent = fake.requests[0].sampling
    assert sent.WhichOneof("constraint") == "json_schema"
    assert json.loads(sent.json_schema) == Product.model_json_schema()


def test_structured_output_dataclass_and_type_dict(client, fake):
    fake.script = text_reply(json.dumps(ROUTE_VALUE))
    route = client.generate("a route", structured_output=Route).parsed
    assert route == Route("r", [Point(1.0, 2.5), Point(0.0, 0.0)], "bike")
    fake.script = text_reply(json.dumps(TYPE_DICT_VALUE))
    got = client.generate("a product", structured_output=TYPE_DICT).parsed
    assert got == TYPE_DICT_VALUE
    schemas = [json.loads(r.sampling.json_schema) for r in fake.requests]
    assert schemas == [output_spec(Route).json_schema, output_spec(TYPE_DICT).json_schema]


def test_cut_json_raises_and_never_retries(client, fake):
    cut = json.dumps(PRODUCT_VALUE)[:25]
    fake.script = text_reply(cut, reason="length")
    with pytest.raises(StructuredOutputError) as e:
        client.generate("p", structured_output=Product, max_tokens=25)
    msg = str(e.value)
    assert "'length'" in msg and "max_tokens" in msg and "Product" in msg
    assert e.value.completion.text == cut and e.value.completion.finish_reason == "length"
    assert len(fake.requests) == 1  # one request: the client does not try again


def test_complete_but_invalid_output_says_so(client, fake):
    fake.script = text_reply('{"name": "mug"}')
    with pytest.raises(StructuredOutputError, match="complete .finish_reason 'stop'.") as e:
        client.generate("p", structured_output=Product)
    assert "price" in str(e.value)  # the validator's word on what is wrong


def test_stream_yields_chunks_and_the_last_has_usage(client, fake):
    fake.script = text_reply("abcdef", pieces=3)
    chunks = list(client.stream("p", max_tokens=6))
    assert [c.text for c in chunks] == ["ab", "cd", "ef"]
    assert all(c.finish_reason is None and c.usage is None for c in chunks[:-1])
    assert chunks[-1].finish_reason == "stop" and chunks[-1].usage.completion_tokens == 6


def test_stream_with_structured_output_sends_the_schema(client, fake):
    fake.script = text_reply("[1, 2, 3]")
    text = "".join(c.text for c in client.stream("p", structured_output=list[int]))
    assert output_spec(list[int]).parse(text) == [1, 2, 3]
    assert json.loads(fake.requests[0].sampling.json_schema) == {
        "type": "array",
        "items": {"type": "integer"},
    }


def test_leaving_a_stream_early_cancels_it(client, fake):
    fake.script = lambda req: iter([pb.GenerateResponse(text="a", token_ids=[97])])
    fake.hang = True
    stream = client.stream("p")
    assert next(stream).text == "a"
    stream.close()  # what leaving a for loop does once the generator is dropped
    assert fake.cancelled.wait(5)


def test_stream_cut_without_final_message_is_an_error(client, fake):
    fake.script = lambda req: iter([pb.GenerateResponse(text="a", token_ids=[97])])
    with pytest.raises(RadixServeError, match="without a final message"):
        client.generate("p")


@pytest.mark.parametrize(
    "code, cls",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhausted),
        (grpc.StatusCode.UNAUTHENTICATED, Unauthenticated),
        (grpc.StatusCode.DATA_LOSS, RadixServeError),
    ],
)
def test_server_errors_keep_code_and_message(client, fake, code, cls):
    fake.fail = (code, "sampling.json_schema: unsupported keyword 'foo'")
    with pytest.raises(cls) as e:
        client.generate("p", structured_output={"type": "object"})
    assert e.value.code == code
    assert e.value.message == "sampling.json_schema: unsupported keyword 'foo'"
    assert code.name in str(e.value)
    with pytest.raises(cls):
        client.tokenize("p")


def test_deadline_and_unreachable_server(server_addr, fake):
    fake.script = lambda req: iter([pb.GenerateResponse(text="a", token_ids=[97])])
    fake.hang = True
    with Client(server_addr[0], timeout=0.3) as c, pytest.raises(DeadlineExceeded):
        c.generate("p")
    with Client(server_addr[0]) as c, pytest.raises(DeadlineExceeded):
        c.generate("p", timeout=0.3)  # the call's own timeout
    with socket_closed_port() as addr, Client(addr, timeout=5) as c:
        with pytest.raises(Unavailable) as e:
            c.model_info()
        assert e.value.code == grpc.StatusCode.UNAVAILABLE


def socket_closed_port():
    import contextlib
    import socket

    @contextlib.contextmanager
    def cm():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        yield f"127.0.0.1:{port}"

    return cm()


def test_api_key_and_metadata_reach_the_server(server_addr, fake):
    with Client(server_addr[0], api_key="sk-1", metadata={"X-Team": "blue"}, timeout=10) as c:
        c.generate("p")
        c.model_info()
    for md in fake.metadata:
        assert md["authorization"] == "Bearer sk-1" and md["x-team"] == "blue"


def test_tokenize_model_info_flush(client, fake):
    toks = client.tokenize("hey")
    assert toks.ids == (104, 101, 121) and toks.tokens == ("h", "e", "y")
    chat = client.tokenize([{"role": "user", "content": "hi"}])
    assert chat.ids == (104, 105) and fake.requests[1].messages.messages[0].role == "user"
    info = client.model_info()
    assert (info.model_id, info.max_model_len, info.architecture) == (
        "tiny",
        512,
        "LlamaForCausalLM",
    )
    flushed = client.flush_cache()
    assert flushed.flushed and flushed.message == "Cache flushed."


def test_context_manager_closes_the_channel(server_addr, fake):
    with Client(server_addr[0]) as c:
        c.model_info()
    with pytest.raises(ValueError, match="closed channel"):
        c.model_info()


# --- asyncio client -----------------------------------------------------------------------------


def test_async_generate_stream_structured_and_errors(server_addr, fake):
    async def main() -> None:
        async with AsyncClient(server_addr[0], api_key="k", timeout=10) as c:
            out = await c.generate("p", max_tokens=12)
            assert out.text == "Hello, world" and out.usage.cached_tokens == 2

            fake.script = text_reply("abcdef", pieces=3)
            chunks = [ch async for ch in c.stream("p")]
            assert [ch.text for ch in chunks] == ["ab", "cd", "ef"]
            assert chunks[-1].finish_reason == "stop"

            fake.script = text_reply(json.dumps(TYPE_DICT_VALUE))
            typed = await c.generate("p", structured_output=TYPE_DICT)
            assert typed.parsed == TYPE_DICT_VALUE

            fake.script = text_reply(json.dumps(ROUTE_VALUE)[:10], reason="length")
            with pytest.raises(StructuredOutputError, match="'length'"):
                await c.generate("p", structured_output=Route)

            assert (await c.tokenize("ab")).ids == (97, 98)
            assert (await c.model_info()).vocab_size == 300
            assert (await c.flush_cache()).flushed

            fake.fail = (grpc.StatusCode.INVALID_ARGUMENT, "regex: unbalanced parenthesis")
            with pytest.raises(InvalidArgument, match="unbalanced parenthesis") as e:
                await c.generate("p", regex="(a")
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(InvalidArgument):
                await c.model_info()

    asyncio.run(main())
    generates = [r for r in fake.requests if isinstance(r, pb.GenerateRequest)]
    assert generates[-1].sampling.regex == "(a"
    assert all(md["authorization"] == "Bearer k" for md in fake.metadata)


def test_async_stream_left_early_is_cancelled(server_addr, fake):
    fake.script = lambda req: iter([pb.GenerateResponse(text="a", token_ids=[97])])
    fake.hang = True

    async def main() -> None:
        async with AsyncClient(server_addr[0], timeout=10) as c:
            stream = c.stream("p")
            async for chunk in stream:
                assert chunk.text == "a"
                break
            await stream.aclose()  # type: ignore[attr-defined]

    asyncio.run(main())
    assert fake.cancelled.wait(5)
