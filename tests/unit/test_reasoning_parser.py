"""Reasoning parsers: recorded outputs split whole and streamed over random splits."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.frontend.reasoning_parser import (
    REASONING_PARSERS,
    ReasoningSplit,
    get_reasoning_parser,
)

# (parser, text, reasoning, content)
RECORDED = [
    (
        "deepseek_r1",
        "Okay, 2+2.\nThat is 4.\n</think>\n\nThe answer is 4.",
        "Okay, 2+2.\nThat is 4.",
        "The answer is 4.",
    ),
    ("deepseek_r1", "<think>\nHmm.\n</think>\n\nHello!", "Hmm.", "Hello!"),
    (
        "deepseek_r1",
        "Still thinking when the length limit",
        "Still thinking when the length limit",
        "",
    ),
    ("deepseek_r1", "</think>Direct.", "", "Direct."),
    ("deepseek_r1", "a </thi", "a </thi", ""),
    ("deepseek_r1", "Ünïcode 思考\n</think>\n答え", "Ünïcode 思考", "答え"),
    (
        "qwen3",
        "<think>\nThe user greets me.\n</think>\n\nHi there!",
        "The user greets me.",
        "Hi there!",
    ),
    ("qwen3", "\n<think>\n\n</think>\n\nHi", "", "Hi"),
    ("qwen3", "Hi there!", "", "Hi there!"),
    ("qwen3", "  Hi </think> there", "", "  Hi </think> there"),  # never opened: all content
    ("qwen3", "<think>\nCut off mid-thou", "Cut off mid-thou", ""),
    ("qwen3", "<thi", "", "<thi"),
    ("qwen3", "<think>a</think>b</think>c", "a", "b</think>c"),
    ("qwen3", "<think>x</think>\n<tool_call>\n{}", "x", "<tool_call>\n{}"),
]


@pytest.mark.parametrize("name, text, reasoning, content", RECORDED)
def test_recorded_outputs(name, text, reasoning, content):
    assert get_reasoning_parser(name).split(text) == ReasoningSplit(reasoning, content)


def stream_split(name: str, pieces: list[str]) -> ReasoningSplit:
    stream = get_reasoning_parser(name).stream()
    parts = [stream.feed(p) for p in pieces] + [stream.finish()]
    return ReasoningSplit("".join(p.reasoning for p in parts), "".join(p.content for p in parts))


def split_at(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(RECORDED), st.data())
def test_stream_equals_whole_for_any_split(case, data):
    name, text = case[0], case[1]
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text)))
    assert stream_split(name, split_at(text, cuts)) == get_reasoning_parser(name).split(text)


FRAGMENTS = ["<think>", "</think>", "<thi", "</th", "<", "/", ">", "a", "b", " ", "\n"]


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(sorted(REASONING_PARSERS)),
    st.lists(st.sampled_from(FRAGMENTS), max_size=20).map("".join),
    st.data(),
)
def test_fuzzed_tags_split_alike_and_never_leak(name, text, data):
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    whole = get_reasoning_parser(name).split(text)
    assert stream_split(name, split_at(text, cuts)) == whole
    assert "</think>" not in whole.reasoning
    if text.lstrip().startswith("<think>") and text.count("<think>") == 1:
        # (any other <think> is only text the model wrote)
        assert "<think>" not in whole.reasoning
    if not whole.reasoning and "</think>" not in text:
        assert whole.content in (text, text.lstrip().removeprefix("<think>").lstrip())


def test_stream_holds_a_possible_tag_back():
    stream = get_reasoning_parser("qwen3").stream()
    assert stream.feed("<thi") == ReasoningSplit("", "")
    assert stream.feed("nk>Plan") == ReasoningSplit("Plan", "")
    assert stream.feed(" </th") == ReasoningSplit("", "")
    assert stream.feed("ink>\n\nAns") == ReasoningSplit("", "Ans")
    assert stream.finish() == ReasoningSplit("", "")


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="deepseek_r1"):
        get_reasoning_parser("nope")
