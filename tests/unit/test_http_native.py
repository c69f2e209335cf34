"""SGLang's native API (services/frontend/http_native.py): the body parsing and the answer
shape alone, then the routes on the real frontend against a scripted scheduler."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from radixserve.v1 import generation_pb2 as pb
from services.frontend.native_answers import NativeShape
from services.frontend.native_protocol import MAX_BATCH, native_error, parse_generate
from services.frontend.openai_errors import ApiError
from services.frontend.pipeline import Frontend
from services.frontend.tokenizer import Tokenizer
from tests.fake_scheduler import (
    EOS_ID,
    SCRIPT_TEXT,
    FakeScheduler,
    FrontendThread,
    build_tokenizer,
    frontend_config,
)

# What SGLang's RuntimeEndpoint.generate sends for a plain sgl.gen (its defaults).
CLIENT_DEFAULTS = {
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "max_new_tokens": 128,
    "min_new_tokens": 0,
    "n": 1,
    "stop": [],
    "stop_token_ids": [],
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "ignore_eos": False,
    "regex": None,
    "json_schema": None,
}


# ---- parsing ---------------------------------------------------------------------------


def test_client_defaults_parse_to_the_engine_defaults():
    body = parse_generate({"text": "hi", "sampling_params": CLIENT_DEFAULTS})
    assert not body.batch and not body.stream
    (item,) = body.items
    req, sp = item.req, item.req.sampling
    assert req.text == "hi" and item.input_param == "text"
    assert sp.max_tokens == 128 and sp.temperature == 1.0
    assert not sp.HasField("top_k")  # -1 is SGLang's "off", radixserve's unset
    assert sp.WhichOneof("constraint") is None
    assert not sp.logprobs and not sp.prompt_logprobs


def test_every_sampling_name_maps_to_the_public_field():
    raw = {
        "max_new_tokens": 0,
        "min_new_tokens": 0,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 7,
        "min_p": 0.1,
        "frequency_penalty": 0.2,
        "presence_penalty": -0.3,
        "repetition_penalty": 1.1,
        "stop": "END",
        "stop_token_ids": [3, 4],
        "ignore_eos": True,
        "sampling_seed": 11,
        "regex": "[ab]+",
        "stream_interval": 4,
    }
    sp = parse_generate({"input_ids": [5, 6], "sampling_params": raw}).items[0].req.sampling
    assert (sp.max_tokens, sp.top_k, sp.seed, sp.regex) == (0, 7, 11, "[ab]+")
    assert sp.HasField("min_tokens") and sp.min_tokens == 0
    assert list(sp.stop) == ["END"] and list(sp.stop_token_ids) == [3, 4] and sp.ignore_eos
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty"):
        assert getattr(sp, name) == pytest.approx(raw[name])
    assert sp.repetition_penalty == pytest.approx(1.1)
    schema = {"type": "object"}
    sp = parse_generate({"text": "x", "sampling_params": {"json_schema": schema}}).items[0]
    assert json.loads(sp.req.sampling.json_schema) == schema


def test_structural_tag_is_served_as_text_or_object():
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}
    for given in (tag, json.dumps(tag)):
        body = {"text": "x", "sampling_params": {"structural_tag": given}}
        assert json.loads(parse_generate(body).items[0].req.sampling.structural_tag) == tag
    with pytest.raises(ApiError, match="at most one"):
        parse_generate({"text": "x", "sampling_params": {"regex": "a", "structural_tag": "{}"}})


@pytest.mark.parametrize(
    ("start", "engine_start"), [(0, 1), (1, 1), (5, 5)]
)  # position 0 has no logit: the engine starts at 1 and the answer adds a null entry
def test_logprob_start_len_maps_to_prompt_logprobs(start, engine_start):
    item = parse_generate(
        {"text": "x", "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": 3}
    ).items[0]
    sp = item.req.sampling
    assert sp.logprobs and sp.top_logprobs == 3
    assert sp.prompt_logprobs and sp.prompt_logprobs_start == engine_start


def test_logprob_start_minus_one_means_output_tokens_only():
    sp = parse_generate({"text": "x", "return_logprob": True}).items[0].req.sampling
    assert sp.logprobs and not sp.prompt_logprobs
    sp = parse_generate({"text": "x", "logprob_start_len": 0}).items[0].req.sampling
    assert not sp.logprobs and not sp.prompt_logprobs  # nothing asked without return_logprob


def test_a_batch_broadcasts_or_spreads_its_options():
    body = parse_generate(
        {
            "text": ["a", "b", "c"],
            "rid": "job",
            "sampling_params": [{"max_new_tokens": i} for i in (1, 2, 3)],
            "return_logprob": True,
            "logprob_start_len": [0, 1, -1],
        }
    )
    assert body.batch and len(body.items) == 3
    assert [i.req.request_id for i in body.items] == ["job_0", "job_1", "job_2"]
    assert [i.req.sampling.max_tokens for i in body.items] == [1, 2, 3]
    assert [i.req.sampling.prompt_logprobs for i in body.items] == [True, True, False]
    ids = parse_generate({"input_ids": [[1, 2], [3]], "rid": ["p", "q"]})
    assert [list(i.req.input_ids.ids) for i in ids.items] == [[1, 2], [3]]
    assert [i.req.request_id for i in ids.items] == ["p", "q"]
    assert ids.items[0].input_param == "input_ids"


def test_unknown_top_level_keys_are_ignored():
    body = parse_generate({"text": "x", "log_metrics": True, "whatever": {"a": 1}})
    assert body.items[0].req.text == "x"


BAD_BODIES = [
    ({}, "text", "exactly one of text or input_ids"),
    ({"text": "x", "input_ids": [1]}, "text", "exactly one"),
    ({"text": 5}, "text", "string or a list of strings"),
    ({"text": []}, "text", "the batch is empty"),
    ({"text": ["x"] * (MAX_BATCH + 1)}, "text", f"at most {MAX_BATCH} prompts"),
    ({"input_ids": []}, "input_ids", "non-empty list of token ids"),
    ({"input_ids": [[1], []]}, "input_ids[1]", "non-empty list"),
    ({"input_ids": [1, "a"]}, "input_ids", "token ids"),
    ({"input_ids": [1, 2**40]}, "input_ids", "token ids"),
    ({"sampling_params": {"max_tokens": 5}}, "sampling_params.max_tokens", "unknown sampling"),
    (
        {"sampling_params": {"max_new_tokens": -1}},
        "sampling_params.max_new_tokens",
        "greater than or equal to 0",
    ),
    ({"sampling_params": {"max_new_tokens": 1.5}}, "sampling_params.max_new_tokens", "integer"),
    ({"sampling_params": {"temperature": "hot"}}, "sampling_params.temperature", "number"),
    (
        {"sampling_params": {"min_new_tokens": 2**31}},
        "sampling_params.min_new_tokens",
        "2147483647",
    ),
    ({"sampling_params": {"n": 0}}, "n must be at least 1", "n must be at least 1"),
    ({"sampling_params": {"top_k": 0}}, "top_k", "-1 (off) or >= 1"),
    ({"sampling_params": {"skip_special_tokens": False}}, "skip_special_tokens", "always"),
    ({"sampling_params": {"regex": "a", "ebnf": "b"}}, "regex and ebnf", "at most one"),
    ({"sampling_params": {"logit_bias": {"x": 2.0}}}, "sampling_params.logit_bias", "token ids"),
    ({"sampling_params": {"logit_bias": [1]}}, "sampling_params.logit_bias", "dictionary"),
    ({"sampling_params": {"stop_regex": 5}}, "sampling_params.stop_regex", "string"),
    ({"sampling_params": [{}]}, "sampling_params", "must be an object"),
    ({"image_data": "cat.png"}, "image_data", "not supported"),
    ({"lora_path": "adapter"}, "lora_path", "not supported"),
    ({"stream": "yes"}, "stream", "true or false"),
    ({"return_logprob": True, "logprob_start_len": -2}, "logprob_start_len", "-1"),
    ({"return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num", "20"),
    ({"rid": 5}, "rid", "must be a string"),
    ({"text": "\ud800"}, "text", "lone surrogate"),
]


@pytest.mark.parametrize(("patch", "field", "words"), BAD_BODIES)
def test_bad_bodies_are_400_naming_the_field(patch, field, words):
    body = {"text": "x", **patch}
    if "input_ids" in patch and "text" not in patch:
        del body["text"]
    if patch == {}:
        body = {}
    with pytest.raises(ApiError) as e:
        parse_generate(body)
    assert e.value.status == 400
    assert field in e.value.message and words in e.value.message, e.value.message


def test_batch_shape_errors_name_the_field():
    for body, words in [
        ({"text": ["a", "b"], "rid": ["x"]}, "rid: has 1 entries for 2 prompts"),
        ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params: has 1 entries"),
        ({"text": ["a", "b"], "stream": True}, "stream: streaming a batch"),
        ({"text": ["a"], "sampling_params": [{"foo": 1}]}, "sampling_params[0].foo"),
        ({"text": ["a", "b"], "logprob_start_len": [0, -5]}, "logprob_start_len[1]: "),
        ({"text": "a", "return_logprob": [True]}, "return_logprob: Input should be a valid"),
    ]:
        with pytest.raises(ApiError) as e:
            parse_generate(body)
        assert words in e.value.message


def test_pipeline_errors_are_renamed_to_sglang_fields():
    e = native_error(ApiError(400, "sampling.max_tokens: prompt + max_tokens exceeds", "x"), 2)
    assert e.message.startswith("prompt 2: sampling_params.max_new_tokens: prompt")
    assert e.param == "sampling_params"
    e = native_error(ApiError(400, "sampling.prompt_logprobs_start: must be < 4", None))
    assert e.message.startswith("logprob_start_len: must be < 4")
    e = native_error(ApiError(400, "sampling.min_tokens: must be <= max_tokens (4)", None))
    assert e.message.startswith("sampling_params.min_new_tokens: must be <= max_tokens (4)")
    e = native_error(ApiError(400, "input_ids.ids[3]: token id 999 is outside", None))
    assert e.message.startswith("input_ids[3]: token id")


# ---- the answer shape ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = build_tokenizer(tmp_path_factory.mktemp("model"))
    return path, Tokenizer(str(path))


def _lp(token_id: int, logprob: float, top: int = 0) -> pb.TokenLogprob:
    lp = pb.TokenLogprob(token_id=token_id, logprob=logprob)
    for k in range(top):
        lp.top.add(token_id=token_id + k, logprob=logprob - k)
    return lp


def _shape(tok, body, first_id=None) -> NativeShape:
    return NativeShape(tok[1], parse_generate(body).items[0], first_id)


def test_whole_answer_with_prompt_logprobs_from_position_zero(tok):
    shape = _shape(
        tok,
        {
            "text": "x",
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 2,
            "return_text_in_logprobs": True,
        },
        first_id=9,
    )
    final = pb.GenerateResponse(
        request_id="r1",
        token_ids=[20, 21],
        finish_reason="length",
        prompt_tokens=3,
        cached_tokens=1,
        completion_tokens=2,
        prompt_logprobs=[_lp(10, -1.5, 2), _lp(11, -2.5, 2)],
        prompt_logprobs_start=1,
        logprobs=[_lp(20, -0.1, 2), _lp(21, -0.2, 2)],
        timings=pb.Timings(total_time=0.25),
    )
    out = shape.whole("ab", final.logprobs, final).model_dump(exclude_unset=True)
    assert out["text"] == "ab" and out["output_ids"] == [20, 21]
    meta = out["meta_info"]
    assert list(meta) == [
        "id",
        "finish_reason",
        "prompt_tokens",
        "input_token_logprobs",
        "output_token_logprobs",
        "input_top_logprobs",
        "output_top_logprobs",
        "completion_tokens",
        "cached_tokens",
        "cached_tokens_details",
        "e2e_latency",
    ]
    assert meta["cached_tokens_details"] == {"device": 1, "host": 0, "storage": 0}
    assert meta["finish_reason"] == {"type": "length", "length": 2}
    assert (meta["prompt_tokens"], meta["cached_tokens"], meta["e2e_latency"]) == (3, 1, 0.25)
    text = lambda i: tok[1].decode([i], skip_special_tokens=False)  # noqa: E731
    assert meta["input_token_logprobs"] == [
        [None, 9, text(9)],
        [-1.5, 10, text(10)],
        [-2.5, 11, text(11)],
    ]
    assert meta["input_top_logprobs"][0] is None
    assert meta["input_top_logprobs"][1] == [[-1.5, 10, text(10)], [-2.5, 11, text(11)]]
    assert [e[:2] for e in meta["output_token_logprobs"]] == [
        [pytest.approx(-0.1), 20],
        [pytest.approx(-0.2), 21],
    ]
    assert len(meta["output_top_logprobs"]) == 2 and len(meta["output_top_logprobs"][0]) == 2


def test_logprob_entries_have_null_text_unless_asked(tok):
    shape = _shape(tok, {"text": "x", "return_logprob": True, "logprob_start_len": 3})
    final = pb.GenerateResponse(
        finish_reason="length", prompt_logprobs=[_lp(4, -1.0)], prompt_logprobs_start=3
    )
    meta = shape.whole("", [], final).model_dump()["meta_info"]
    assert meta["input_token_logprobs"] == [[-1.0, 4, None]]
    assert meta["output_token_logprobs"] == [] and "input_top_logprobs" not in meta


@pytest.mark.parametrize(
    ("resp", "reason"),
    [
        (
            pb.GenerateResponse(token_ids=[5], finish_reason="stop", matched_stop="STOP"),
            {"type": "stop", "matched": "STOP"},
        ),
        (
            pb.GenerateResponse(token_ids=[5, 1], finish_reason="stop", matched_stop="</s>"),
            {"type": "stop", "matched": 1},  # a stop token as its id, as SGLang says it
        ),
        (
            pb.GenerateResponse(token_ids=[5], finish_reason="stop"),
            {"type": "stop", "matched": None},  # a grammar that completed
        ),
        (
            pb.GenerateResponse(finish_reason="length", completion_tokens=0),
            {"type": "length", "length": 0},
        ),
        (
            pb.GenerateResponse(finish_reason="abort"),
            {"type": "abort", "message": "the request was aborted"},
        ),
    ],
)
def test_finish_reasons_in_sglang_shape(tok, resp, reason):
    shape = _shape(tok, {"text": "x", "sampling_params": {"stop": ["STOP"]}})
    assert shape.whole("", [], resp).model_dump()["meta_info"]["finish_reason"] == reason


def test_stream_events_carry_cumulative_text_and_ids(tok):
    shape = _shape(tok, {"text": "x", "stream": True})
    events = []
    for resp in [
        pb.GenerateResponse(request_id="r", token_ids=[1], text="He"),
        pb.GenerateResponse(request_id="r", token_ids=[2], text=""),  # half a character
        pb.GenerateResponse(request_id="r", token_ids=[3], text="llo"),
        pb.GenerateResponse(
            request_id="r", finish_reason="length", completion_tokens=3, prompt_tokens=2
        ),
    ]:
        events += [c.model_dump(exclude_unset=True) for c in shape.chunks(resp)]
    assert [e["text"] for e in events] == ["He", "He", "Hello", "Hello"]
    assert [e["output_ids"] for e in events] == [[1], [1, 2], [1, 2, 3], [1, 2, 3]]
    assert [e["meta_info"]["finish_reason"] for e in events][:-1] == [None] * 3
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert events[-1]["meta_info"]["prompt_tokens"] == 2
    assert [e["meta_info"]["completion_tokens"] for e in events] == [1, 2, 3, 3]


# ---- the routes, on the real frontend --------------------------------------------------


@pytest.fixture(scope="module")
def fake(tok):
    f = FakeScheduler(tok[1].encode(SCRIPT_TEXT), tok[1].vocab_size).start()
    yield f
    f.stop()


@pytest.fixture(scope="module")
def base(tok, fake):
    fe = FrontendThread(frontend_config(tok[0], [fake], http=True)).start().wait_ready()
    yield fe.http_base
    fe.stop()


def test_generate_whole(base, tok, fake):
    r = httpx.post(
        base + "/generate",
        json={"text": "hello world", "sampling_params": {**CLIENT_DEFAULTS, "stop": "STOP"}},
        timeout=20,
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["text"] == SCRIPT_TEXT[: SCRIPT_TEXT.index("STOP")]
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": "STOP"}
    assert meta["prompt_tokens"] == len(tok[1].encode("hello world"))
    assert meta["completion_tokens"] == len(out["output_ids"]) > 0
    assert meta["cached_tokens"] == meta["prompt_tokens"] // 2  # the fake's answer
    assert meta["e2e_latency"] > 0 and len(meta["id"]) > 0
    assert fake.requests[-1].sampling.max_tokens == 128


def test_generate_ends_on_eos_with_its_id(base, tok):
    out = httpx.post(base + "/generate", json={"input_ids": [5, 6, 7]}, timeout=20).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS_ID}
    assert out["output_ids"][:-1] == tok[1].encode(SCRIPT_TEXT)
    assert out["text"] == SCRIPT_TEXT


def test_generate_stream_is_cumulative_and_ends_with_done(base):
    body = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 12}}
    with httpx.stream("POST", base + "/generate", json=body, timeout=20) as r:
        assert r.status_code == 200
        lines = [x for x in r.iter_lines() if x.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(x[5:]) for x in lines[:-1]]
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert len(events[-1]["output_ids"]) == 12


def test_generate_batch_is_a_list_in_order(base, fake):
    body = {
        "text": ["one", "two", "three"],
        "rid": "b",
        "sampling_params": [{"max_new_tokens": n} for n in (1, 2, 3)],
    }
    r = httpx.post(base + "/generate", json=body, timeout=20)
    assert r.status_code == 200, r.text
    outs = r.json()
    assert [o["meta_info"]["id"] for o in outs] == ["b_0", "b_1", "b_2"]
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [1, 2, 3]


def test_a_failing_prompt_fails_the_batch_naming_it(base):
    body = {"input_ids": [[5], [5, 9999]]}
    r = httpx.post(base + "/generate", json=body, timeout=20)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert message.startswith("prompt 1: input_ids[1]") and "vocabulary" in message


def test_bad_bodies_over_http_are_400_and_the_frontend_keeps_serving(base):
    for content in [b"not json", b"[1, 2]", b'{"text": "x", "sampling_params": {"nope": 1}}']:
        r = httpx.post(base + "/generate", content=content, timeout=20)
        assert r.status_code == 400 and r.json()["error"]["message"], content
    r = httpx.post(
        base + "/generate",
        json={"text": "hi", "sampling_params": {"max_new_tokens": 10_000}},
        timeout=20,
    )
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("sampling_params.max_new_tokens:")
    ok = httpx.post(
        base + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    )
    assert ok.status_code == 200


def test_model_and_server_info_and_flush(base, fake):
    info = httpx.get(base + "/get_model_info").json()
    assert info == {
        "model_path": "tiny",
        "tokenizer_path": "tiny",
        "is_generation": True,
        "preferred_sampling_params": None,
    }
    for path in ("/server_info", "/get_server_info"):
        server = httpx.get(base + path).json()
        assert server["context_length"] == 256 and server["max_total_num_tokens"] == 4096
        assert server["model_path"] == "tiny" and server["version"]
    flushes = fake.flushes
    assert httpx.get(base + "/flush_cache").status_code == 200
    assert httpx.post(base + "/flush_cache").status_code == 200
    assert fake.flushes == flushes + 2


def test_sglang_client_with_an_api_key(tok, fake):
    """SGLang's own client sends its api_key as a Bearer token, which --api-key accepts."""
    import dataclasses

    import sglang as sgl

    cfg = dataclasses.replace(frontend_config(tok[0], [fake], http=True), api_key="sekret")
    fe = FrontendThread(cfg).start()
    try:
        with pytest.raises(RuntimeError):
            sgl.RuntimeEndpoint(fe.http_base)  # no key: refused
        backend = sgl.RuntimeEndpoint(fe.http_base, api_key="sekret")
        assert backend.get_model_name() == "tiny"
        deadline = time.monotonic() + 10
        while True:  # the engines answer the new frontend shortly
            try:
                backend.cache_prefix("hello world")  # /generate with max_new_tokens 0
                break
            except RuntimeError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert fake.requests[-1].sampling.max_tokens == 0
    finally:
        fe.stop()


# ---- stop_regex and /abort_request, on the real frontend --------------------------------


def test_generate_stops_at_a_regex_and_tells_the_engine(base, fake):
    body = {
        "text": "hi",
        "rid": "regex-stop",
        "sampling_params": {**CLIENT_DEFAULTS, "stop_regex": [r"S\w+P", r"\d"]},
    }
    r = httpx.post(base + "/generate", json=body, timeout=20)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["text"] == SCRIPT_TEXT[: SCRIPT_TEXT.index("STOP")]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": r"S\w+P"}
    assert ("regex-stop", "stop string matched") in [(a.rid, a.reason) for a, _ in fake.aborts]


def test_abort_request_ends_a_running_request_and_frees_it_at_its_engine(base, fake):
    # The fake runs a "slow" request until it is aborted; the OpenAI body can set the salt.
    body = {"prompt": "hi", "max_tokens": 200, "cache_salt": "slow", "request_id": "to-abort"}
    with httpx.Client(base_url=base, timeout=20) as http:
        done: dict = {}
        reader = threading.Thread(
            target=lambda: done.update(http.post("/v1/completions", json=body).json())
        )
        reader.start()
        deadline = time.monotonic() + 10
        while not any(r.rid == "to-abort" for r in fake.requests):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        r = http.post("/abort_request", json={"rid": "to-abort"})
        reader.join(20)
        assert r.status_code == 200 and r.json() == {"aborted": ["to-abort"]}
        assert done["choices"][0]["finish_reason"] == "abort", done
        assert ("to-abort", "aborted by /abort_request") in [
            (a.rid, a.reason) for a, _ in fake.aborts
        ]
        assert http.post("/abort_request", json={"rid": "nobody"}).json() == {"aborted": []}
        for bad, field in [({}, "rid"), ({"rid": 5}, "rid"), ({"abort_all": "yes"}, "abort_all")]:
            r = http.post("/abort_request", json=bad)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


class _Engines:
    """What Frontend.abort uses of EngineClient."""

    def __init__(self, rids: list[str]) -> None:
        self.rids, self.aborted = rids, []

    def in_flight(self) -> list[str]:
        return list(self.rids)

    def abort(self, rid: str, reason: str) -> None:
        self.aborted.append(rid)


RIDS = ["b", "b_0", "b_1", "b_10", "bc", "b_x", "b_1_0"]


@pytest.mark.parametrize(
    ("rid", "want"),
    [
        # a batch's prompts go with the rid they had, and their samples (n > 1)
        ("b", ["b", "b_0", "b_1", "b_10", "b_1_0"]),
        ("b_1", ["b_1", "b_1_0"]),  # not b_10, which SGLang's prefix rule would take
        ("x", []),
        (None, RIDS),  # abort_all
    ],
)
def test_abort_takes_the_rid_and_its_batch_only(rid, want):
    fe = Frontend.__new__(Frontend)  # only its engines are used
    fe.engines = engines = _Engines(RIDS)  # type: ignore[assignment]
    assert fe.abort(rid, "test") == engines.aborted == want
