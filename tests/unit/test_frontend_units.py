"""Units of the frontend: detokenizer, stop strings, validation, routing."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixserve.v1 import generation_pb2 as pb
from services.common.grpc_util import add_health_and_reflection, set_serving
from services.frontend.detokenizer import IncrementalDetokenizer
from services.frontend.engine_client import route
from services.frontend.stop_strings import StopStringMatcher
from services.frontend.tokenizer import Tokenizer
from services.frontend.validation import ValidationError, validate_length, validate_request

try:
    from tests.fake_scheduler import EOS_ID, SCRIPT_TEXT, build_tokenizer
except ImportError:
    from fake_scheduler import EOS_ID, SCRIPT_TEXT, build_tokenizer

VOCAB = 320


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer(str(build_tokenizer(tmp_path_factory.mktemp("tok"))))


# ---- tokenizer -----------------------------------------------------------------------


def test_tokenizer_reads_eos_and_chat_template(tok):
    assert tok.eos_token_ids == [EOS_ID]
    assert tok.vocab_size == VOCAB
    text = tok.render_chat([("system", "be brief"), ("user", "hi")])
    assert text == "<|system|>be brief\n<|user|>hi\n<|assistant|>"
    assert tok.decode(tok.encode_chat([("user", "hi")])) == "<|user|>hi\n<|assistant|>"


# ---- detokenizer ---------------------------------------------------------------------


def _stream(
    tok: Tokenizer, ids: list[int], chunks: list[int] | None = None, prompt=()
) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt_ids=list(prompt))
    pieces, i, sizes = [], 0, iter(chunks or [])
    while i < len(ids):
        n = max(1, next(sizes, 1))
        pieces.append(detok.add(ids[i : i + n]))
        i += n
    pieces.append(detok.flush())
    return pieces


def test_detokenizer_never_splits_utf8(tok):
    ids = tok.encode(SCRIPT_TEXT)
    # The fixture only means something if some tokens hold part of a character.
    assert any("\ufffd" in tok.decode([t]) for t in ids)
    pieces = _stream(tok, ids, prompt=tok.encode("hello there"))
    assert "".join(pieces) == SCRIPT_TEXT
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces[:-1]  # some tokens had to wait for the rest of their character


def test_detokenizer_skips_special_tokens(tok):
    ids = tok.encode("hello") + [EOS_ID]
    assert "".join(_stream(tok, ids)) == "hello"


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ids=st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=40),
    chunks=st.lists(st.integers(1, 4), max_size=40),
    prompt=st.lists(st.integers(3, VOCAB - 1), max_size=8),
)
def test_detokenizer_increments_concatenate_to_decode(tok, ids, chunks, prompt):
    assert "".join(_stream(tok, ids, chunks, prompt)) == tok.decode(ids)


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(st.sampled_from(list("ab ö世🙂\n")), max_size=30))
def test_detokenizer_valid_text_pieces_are_whole_characters(tok, text):
    pieces = _stream(tok, tok.encode(text))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


# ---- stop strings --------------------------------------------------------------------


def _feed_all(stops: list[str], pieces: list[str]) -> tuple[str, str | None]:
    m = StopStringMatcher(stops)
    out = "".join(m.feed(p) for p in pieces)
    return out + m.flush(), m.matched


def test_stop_string_cut_before_match_across_pieces():
    assert _feed_all(["STOP"], ["the ST", "O", "P word"]) == ("the ", "STOP")


def test_stop_string_prefix_is_held_until_decided():
    m = StopStringMatcher(["STOP"])
    assert m.feed("abc ST") == "abc "  # "ST" could begin the stop string
    assert m.feed("AR") == "STAR"  # it did not
    assert m.feed("S") == ""
    assert m.flush() == "S"  # finished without a match: show it


def test_stop_strings_first_completed_wins():
    assert _feed_all(["world", "lo"], ["hello world"]) == ("hel", "lo")
    assert _feed_all(["\n\n", "."], ["a.b", "\n\nc"]) == ("a", ".")


def test_no_stop_strings_pass_through():
    assert _feed_all([], ["a", "b"]) == ("ab", None)


@given(
    text=st.text(st.sampled_from(list("abS")), max_size=40),
    stop=st.text(st.sampled_from(list("abS")), min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 40), max_size=8),
)
def test_stop_string_matches_reference(text, stop, cuts):
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    idx = text.find(stop)
    expected = (text, None) if idx < 0 else (text[:idx], stop)
    assert _feed_all([stop], pieces) == expected


# ---- validation ----------------------------------------------------------------------


def _req(**sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(**sampling))


BAD_REQUESTS = [
    (pb.GenerateRequest(), "input"),
    (pb.GenerateRequest(text=""), "text"),
    (pb.GenerateRequest(input_ids=pb.InputIds()), "input_ids"),
    (pb.GenerateRequest(input_ids=pb.InputIds(ids=[5, VOCAB])), "input_ids.ids[1]"),
    (pb.GenerateRequest(input_ids=pb.InputIds(ids=[-1])), "input_ids.ids[0]"),
    (pb.GenerateRequest(messages=pb.ChatMessages()), "messages"),
    (
        pb.GenerateRequest(
            messages=pb.ChatMessages(messages=[pb.ChatMessage(role="robot", content="x")])
        ),
        "messages[0].role",
    ),
    (pb.GenerateRequest(text="hi", request_id="x" * 300), "request_id"),
    (_req(max_tokens=-1), "sampling.max_tokens"),
    (_req(prompt_logprobs_start=-1), "sampling.prompt_logprobs_start"),
    (_req(temperature=-0.1), "sampling.temperature"),
    (_req(temperature=101), "sampling.temperature"),
    (_req(temperature=float("nan")), "sampling.temperature"),
    (_req(top_p=0), "sampling.top_p"),
    (_req(top_p=1.5), "sampling.top_p"),
    (_req(top_k=-1), "sampling.top_k"),
    (_req(min_p=1.5), "sampling.min_p"),
    (_req(repetition_penalty=0), "sampling.repetition_penalty"),
    (_req(repetition_penalty=2.5), "sampling.repetition_penalty"),
    (_req(frequency_penalty=-3), "sampling.frequency_penalty"),
    (_req(presence_penalty=2.1), "sampling.presence_penalty"),
    (_req(top_logprobs=21), "sampling.top_logprobs"),
    (_req(stop=[""]), "sampling.stop[0]"),
    (_req(stop=["x"] * 17), "sampling.stop"),
    (_req(stop_token_ids=[VOCAB + 5]), "sampling.stop_token_ids[0]"),
]


@pytest.mark.parametrize(("req", "field"), BAD_REQUESTS)
def test_validation_names_the_field(req, field):
    with pytest.raises(ValidationError) as e:
        validate_request(req, VOCAB)
    assert e.value.field == field
    assert str(e.value).startswith(field + ":")


def test_validation_accepts_edges():
    req = _req(
        max_tokens=1,
        temperature=0,
        top_p=1,
        top_k=0,
        min_p=1,
        repetition_penalty=2,
        frequency_penalty=-2,
        presence_penalty=2,
        top_logprobs=20,
        stop=["x"] * 16,
    )
    validate_request(req, VOCAB)
    validate_request(pb.GenerateRequest(input_ids=pb.InputIds(ids=[0, VOCAB - 1])), VOCAB)


def test_validation_length_against_max_model_len():
    validate_length(10, pb.SamplingParams(max_tokens=54), 64)
    validate_length(10, pb.SamplingParams(), 64)  # unset max_tokens is cut to fit by the engine
    with pytest.raises(ValidationError, match="max_model_len 64") as e:
        validate_length(10, pb.SamplingParams(max_tokens=55), 64)
    assert e.value.field == "sampling.max_tokens"
    with pytest.raises(ValidationError) as e:
        validate_length(64, pb.SamplingParams(), 64)
    assert e.value.field == "input"


# ---- routing -------------------------------------------------------------------------


def test_routing_keeps_shared_prefixes_together_and_spreads_others():
    system = list(range(100, 132))
    picks = {route("", system + [i, i + 1], 4) for i in range(50)}
    assert len(picks) == 1  # same first 32 tokens: same engine, whatever follows
    spread = {route("", [i, 7, 9], 4) for i in range(200)}
    assert spread == {0, 1, 2, 3}
    salted = {route(f"user{i}", system, 4) for i in range(50)}
    assert len(salted) > 1  # the salt is part of the key
    assert route("", system, 1) == 0


# ---- grpc_util on a synchronous server (the scheduler's and worker's kind) -------------


def test_health_and_reflection_on_sync_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health = add_health_and_reflection(server, ["radixserve.internal.v1.SchedulerControl"])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)

            def status(name: str) -> int:
                return stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status

            assert (
                status("")
                == status("radixserve.internal.v1.SchedulerControl")
                == health_pb2.HealthCheckResponse.SERVING
            )
            set_serving(health, ["radixserve.internal.v1.SchedulerControl"], False)
            assert (
                status("radixserve.internal.v1.SchedulerControl")
                == health_pb2.HealthCheckResponse.NOT_SERVING
            )
            assert status("") == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        server.stop(0)


def test_text_too_long_for_the_context_is_refused_before_tokenizing():
    from radixserve.v1 import generation_pb2 as pb
    from services.frontend.validation import (
        MAX_CHARS_PER_TOKEN,
        ValidationError,
        validate_text_size,
    )

    ok = pb.GenerateRequest(text="x" * (128 * MAX_CHARS_PER_TOKEN))
    validate_text_size(ok, max_model_len=128)
    too_long = pb.GenerateRequest(text="x" * (128 * MAX_CHARS_PER_TOKEN + 1))
    with pytest.raises(ValidationError, match="cannot fit max_model_len 128"):
        validate_text_size(too_long, max_model_len=128)
    chat = pb.GenerateRequest(
        messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="y" * 10**6)])
    )
    with pytest.raises(ValidationError) as e:
        validate_text_size(chat, max_model_len=128)
    assert e.value.field == "messages"
