"""The stream's fast paths send the same bytes as the general ones: text-only chunks from a
template (sse.TextTemplate) and the Rust tokenizer's decode (Tokenizer.decode)."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from radixserve.v1 import generation_pb2 as pb
from services.frontend import sse
from services.frontend.native_answers import NativeShape
from services.frontend.native_protocol import parse_generate
from services.frontend.openai_answers import ChatShape, CompletionShape
from services.frontend.tokenizer import Tokenizer

try:
    from tests.fake_scheduler import build_tokenizer
except ImportError:
    from fake_scheduler import build_tokenizer

# JSON's escapes, quotes, a surrogate pair's character, control characters, U+2028.
TEXTS = ["plain", 'a "quoted" \\ slash', "line\nbreak\ttab", "é 世界 🙂", "\x00\x1f\x7f", "\u2028"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer(str(build_tokenizer(tmp_path_factory.mktemp("tok"))))


def _wire(chunks: list[BaseModel]) -> str:
    """The stream's format, written out independently of sse.py."""
    return "".join(
        f"data: {json.dumps(c.model_dump(exclude_unset=True), ensure_ascii=False)}\n\n"
        for c in chunks
    )


def _twins(make):
    """Two shapes of one answer: one to stream, one rendered the general way."""
    shape, ref = make(), make()
    ref.id, ref.created = shape.id, shape.created
    return shape, ref


def _responses(texts: list[str], logprobs_at: int = -1) -> list[pb.GenerateResponse]:
    out = [pb.GenerateResponse(request_id="r", token_ids=[i], text=t) for i, t in enumerate(texts)]
    out.insert(1, pb.GenerateResponse(request_id="r", token_ids=[9]))  # half a character
    if 0 <= logprobs_at < len(out):
        out[logprobs_at].logprobs.add(token_id=5, logprob=-0.5).top.add(token_id=5, logprob=-0.5)
    out.append(
        pb.GenerateResponse(
            request_id="r", text="end", finish_reason="length", prompt_tokens=3, cached_tokens=1
        )
    )
    return out


def _stream_both(shape, ref, responses: list[pb.GenerateResponse]) -> tuple[str, str]:
    fast = sse.events(shape.opening()) + "".join(shape.events(r) for r in responses)
    slow = _wire(ref.opening()) + "".join(_wire(ref.chunks(r)) for r in responses)
    return fast, slow


@pytest.mark.parametrize("usage", [False, True])
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_template_events_are_the_general_bytes(tok, kind, usage):
    cls = CompletionShape if kind == "completion" else ChatShape
    shape, ref = _twins(lambda: cls(tok, "tiny", usage))
    fast, slow = _stream_both(shape, ref, _responses(TEXTS, logprobs_at=3))
    assert fast == slow
    assert "_text_template" in vars(shape)  # built, so the text chunks came from it
    assert shape._text_template is not None


@pytest.mark.parametrize("prompt", ["echo me", [5, 6, 7]])
def test_echo_leads_the_first_chunk_then_the_template_takes_over(tok, prompt):
    shape, ref = _twins(lambda: CompletionShape(tok, "tiny", True, echo=prompt))
    responses = [pb.GenerateResponse(request_id="r", token_ids=[1])] + _responses(TEXTS)
    fast, slow = _stream_both(shape, ref, responses)
    assert fast == slow and vars(shape).get("_text_template") is not None


def test_a_model_name_holding_the_slot_falls_back_to_the_general_path(tok):
    name = sse._SLOT  # the template could not tell the text from the model's name
    shape, ref = _twins(lambda: CompletionShape(tok, name, False))
    fast, slow = _stream_both(shape, ref, _responses(TEXTS))
    assert fast == slow and "_text_template" in vars(shape) and shape._text_template is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=6))
def test_any_text_renders_the_same(texts):
    shape, ref = _twins(lambda: ChatShape(None, 'm\u00e9"del', False))  # type: ignore[arg-type]
    fast, slow = _stream_both(shape, ref, _responses(texts))
    assert fast == slow


def test_native_events_are_its_chunks(tok):
    item = parse_generate({"text": "x", "stream": True}).items[0]
    shape, ref = NativeShape(tok, item), NativeShape(tok, item)
    fast, slow = _stream_both(shape, ref, _responses(TEXTS))
    assert fast == slow and fast.count("data: ") == len(TEXTS) + 2


# ---- decode ----------------------------------------------------------------------------


@pytest.mark.parametrize("skip", [True, False])
def test_rust_decode_is_transformers_decode(tok, skip):
    assert tok._rust_decode is not None  # the test tokenizer takes the fast path
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 8))]
        assert tok.decode(ids, skip_special_tokens=skip) == tok.hf.decode(
            ids, skip_special_tokens=skip
        )


def test_clean_up_of_spaces_keeps_transformers_decode(tmp_path):
    path = build_tokenizer(tmp_path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["clean_up_tokenization_spaces"] = True
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer(str(path))
    assert tok._rust_decode is None
    ids = tok.encode("hello world , a stop")
    assert tok.decode(ids) == tok.hf.decode(ids, skip_special_tokens=True)
