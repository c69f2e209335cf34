"""Stop regexes (SGLang's stop_regex): the matcher over streamed pieces, its validation, and
the bodies that carry it."""

from __future__ import annotations

import pytest

from radixserve.v1 import generation_pb2 as pb
from services.frontend.native_protocol import parse_generate
from services.frontend.openai_protocol import CompletionRequest, completion_to_request
from services.frontend.stop_strings import (
    STOP_REGEX_LOOKBACK,
    StopRegexTimeout,
    StopStringMatcher,
    feed_tokens,
)
from services.frontend.validation import (
    MAX_STOP_REGEX,
    MAX_STOP_REGEX_CHARS,
    ValidationError,
    validate_sampling,
)


def feed_all(pieces: list[str], regexes: list[str], stops: list[str] = ()) -> tuple[str, str]:
    m = StopStringMatcher(list(stops), regexes)
    out = "".join(m.feed(p) for p in pieces)
    return out + m.flush(), m.matched


# ---- the matcher -------------------------------------------------------------------------


def test_cut_before_the_match_and_the_pattern_reported():
    assert feed_all(["Answer: 4", "2.", " Next"], [r"\d+\."]) == ("Answer: ", r"\d+\.")
    assert feed_all(["one two"], [r"\btwo\b", "o"]) == ("", "o")  # the earliest match wins


def test_a_partial_match_is_held_until_decided():
    m = StopStringMatcher([], [r"\n\n+"])
    assert m.feed("line\n") == "line"  # "\n" could start a match
    assert m.feed("more") == "\nmore"  # it did not
    assert m.feed("\n") == ""
    assert m.flush() == "\n"  # finished without a match: show it
    m = StopStringMatcher([], [r"\n\n+"])
    assert m.feed("a\n") + m.feed("\nb") == "a" and m.matched == r"\n\n+"


def test_strings_and_regexes_together_the_earliest_wins():
    assert feed_all(["say STOP or 42"], [r"\d+"], ["STOP"]) == ("say ", "STOP")
    assert feed_all(["say 42 or STOP"], [r"\d+"], ["STOP"]) == ("say ", r"\d+")


def test_lookbehind_and_anchors_see_the_text_already_shown():
    assert feed_all(["x = 1", "0;"], [r"(?<=1)0"]) == ("x = 1", r"(?<=1)0")
    # ^ is the start of the output only, even once the lookback dropped it.
    assert feed_all(["ab", "ab"], ["^ab"]) == ("", "^ab")
    long = ["a" * (STOP_REGEX_LOOKBACK + 10), "\nab", "c"]
    assert feed_all(long, ["^ab"]) == ("".join(long), None)
    assert feed_all(long, ["(?m)^ab"])[0] == long[0] + "\n"


def test_a_match_may_start_under_the_min_tokens_floor_but_not_end_there():
    pieces = ["x", "ST", "OP", "y", "z"]

    def run(min_tokens: int) -> str:
        m, shown = StopStringMatcher([], [r"S\w+P"]), ""
        for i in range(len(pieces)):
            if m.matched is None:
                shown += feed_tokens(m, lambda t: "".join(pieces[j] for j in t), [i], i, min_tokens)
        return shown + m.flush()

    assert run(2) == "x"  # the match ends in token 3: it counts
    assert run(3) == "xSTOPyz"  # it ends under the floor: it does not


def test_a_pattern_that_backtracks_too_long_ends_the_request():
    m = StopStringMatcher([], ["ok", r"(a|aa)+b"])
    with pytest.raises(StopRegexTimeout) as e:
        m.feed("a" * 40)
    assert e.value.index == 1 and "simplify it" in str(e.value)


# ---- validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("patterns", "field", "words"),
    [
        (["("], "sampling.stop_regex[0]", "not a valid regular expression"),
        (["a", "x*"], "sampling.stop_regex[1]", "matches the empty string"),
        (["a" * (MAX_STOP_REGEX_CHARS + 1)], "sampling.stop_regex[0]", "at most 256 characters"),
        (["a"] * (MAX_STOP_REGEX + 1), "sampling.stop_regex", "at most 32 patterns"),
    ],
)
def test_validation_names_the_pattern(patterns, field, words):
    with pytest.raises(ValidationError) as e:
        validate_sampling(pb.SamplingParams(stop_regex=patterns), 100)
    assert e.value.field == field and words in str(e.value)


# ---- the bodies --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "want"), [(None, []), ([], []), (r"\d", [r"\d"]), (["a", "b"], ["a", "b"])]
)
def test_native_and_openai_bodies_take_a_string_or_a_list(given, want):
    raw = {} if given is None else {"stop_regex": given}
    # SGLang 0.5.x's client sends "stop_regex": [] with every gen: the same as none.
    native = parse_generate({"text": "x", "sampling_params": raw}).items[0].req.sampling
    openai = completion_to_request(CompletionRequest(prompt="x", **raw)).sampling
    assert list(native.stop_regex) == list(openai.stop_regex) == want
