"""The frontend's side of constrained decoding: validation, the engine copy of the
constraint, OpenAI's response_format / regex / ebnf, and errors naming the parameter."""

from __future__ import annotations

import json

import grpc
import pytest

from radixserve.internal.v1 import engine_pb2
from radixserve.v1 import generation_pb2 as pb
from services.frontend.engine_messages import sampling_to_engine
from services.frontend.openai_errors import ApiError, api_error
from services.frontend.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_to_request,
    completion_to_request,
)
from services.frontend.pipeline import FrontendError, _engine_error
from services.frontend.validation import (
    MAX_CONSTRAINT_CHARS,
    ValidationError,
    validate_sampling,
)


@pytest.mark.parametrize(
    ("kw", "field", "needle"),
    [
        ({"json_schema": "{oops"}, "sampling.json_schema", "not valid JSON"),
        ({"json_schema": "3"}, "sampling.json_schema", "object or a boolean"),
        ({"regex": ""}, "sampling.regex", "empty"),
        ({"ebnf": " \n"}, "sampling.ebnf", "empty"),
        ({"json_object": False}, "sampling.json_object", "must be true"),
        ({"regex": "a" * (MAX_CONSTRAINT_CHARS + 1)}, "sampling.regex", "at most"),
        ({"structural_tag": ""}, "sampling.structural_tag", "empty"),
        ({"structural_tag": "{oops"}, "sampling.structural_tag", "not valid JSON"),
        ({"structural_tag": "[]"}, "sampling.structural_tag", "JSON object, got list"),
        ({"structural_tag": '{"type": "structural_tag"}'}, "sampling.structural_tag", "format"),
    ],
)
def test_constraint_validation_names_the_field(kw, field, needle):
    with pytest.raises(ValidationError) as err:
        validate_sampling(pb.SamplingParams(**kw), vocab_size=100)
    assert err.value.field == field and needle in str(err.value)


def test_valid_constraints_pass_and_reach_the_engine():
    for kw in (
        {"json_schema": '{"type": "object"}'},
        {"json_schema": "true"},
        {"regex": r"\d+"},
        {"ebnf": 'root ::= "a"'},
        {"json_object": True},
        {"structural_tag": '{"type": "structural_tag", "format": {"type": "any_text"}}'},
    ):
        sp = pb.SamplingParams(**kw)
        validate_sampling(sp, vocab_size=100)
        out = sampling_to_engine(sp)
        (kind, value) = next(iter(kw.items()))
        assert out.constraint.WhichOneof("kind") == kind
        assert getattr(out.constraint, kind) == value
    assert not sampling_to_engine(pb.SamplingParams()).HasField("constraint")


def test_response_format_json_schema_and_object():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": schema, "strict": True},
            },
        }
    )
    req = chat_to_request(body)
    assert json.loads(req.sampling.json_schema) == schema
    body = CompletionRequest.model_validate(
        {"prompt": "x", "response_format": {"type": "json_object"}}
    )
    assert completion_to_request(body).sampling.json_object
    body = CompletionRequest.model_validate({"prompt": "x", "response_format": {"type": "text"}})
    assert completion_to_request(body).sampling.WhichOneof("constraint") is None


def test_response_format_structural_tag_is_the_tag_itself():
    fmt = {"type": "triggered_tags", "triggers": ["<f"], "tags": []}
    legacy = {"structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}], "triggers": ["<f"]}
    for given in ({"format": fmt}, legacy):
        rf = {"type": "structural_tag", **given}
        body = CompletionRequest.model_validate({"prompt": "x", "response_format": rf})
        assert json.loads(completion_to_request(body).sampling.structural_tag) == rf


def test_regex_and_ebnf_extra_body():
    req = completion_to_request(CompletionRequest.model_validate({"prompt": "x", "regex": "a+"}))
    assert req.sampling.regex == "a+"
    req = completion_to_request(
        CompletionRequest.model_validate({"prompt": "x", "ebnf": 'root ::= "a"'})
    )
    assert req.sampling.ebnf == 'root ::= "a"'


@pytest.mark.parametrize(
    ("extra", "param", "needle"),
    [
        ({"regex": "a", "ebnf": "b"}, "ebnf", "at most one"),
        ({"regex": "a", "response_format": {"type": "json_object"}}, "regex", "at most one"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "schema"),
        ({"response_format": {"type": "yaml"}}, "response_format", "yaml"),
        ({"response_format": {"type": "structural_tag"}}, "response_format", "needs format"),
        (
            {"response_format": {"type": "structural_tag", "format": {}}, "ebnf": "x"},
            "ebnf",
            "at most one",
        ),
    ],
)
def test_bad_constraint_bodies_are_400_naming_the_param(extra, param, needle):
    with pytest.raises(ApiError) as err:
        completion_to_request(CompletionRequest.model_validate({"prompt": "x", **extra}))
    assert err.value.status == 400 and err.value.param == param and needle in err.value.message


def test_engine_refusal_names_the_constraint_field_and_maps_to_the_param():
    sp = engine_pb2.SamplingParams()
    sp.constraint.json_schema = "{}"
    delta = engine_pb2.TokenDelta(
        rid="r", finish_reason="abort", error_code="INVALID_ARGUMENT", finish_message="bad type"
    )
    err = _engine_error(delta, sp)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.field == "sampling.json_schema" and "bad type" in err.message
    http = api_error(err, "prompt")
    assert http.status == 400 and http.param == "response_format"
    sp.constraint.regex = "["
    assert api_error(_engine_error(delta, sp), "prompt").param == "regex"
    sp.constraint.structural_tag = "{}"
    assert api_error(_engine_error(delta, sp), "prompt").param == "response_format"
    timeout = engine_pb2.TokenDelta(error_code="DEADLINE_EXCEEDED", finish_message="too slow")
    err = _engine_error(timeout, sp)
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED and err.field is None
    assert isinstance(err, FrontendError) and api_error(err, "prompt").status == 504
