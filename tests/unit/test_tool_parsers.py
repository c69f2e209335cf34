"""Tool-call parsers: recorded outputs of each format, whole and streamed over random splits."""

from __future__ import annotations

import itertools
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.frontend.tool_parsers import (
    TOOL_PARSERS,
    IdFactory,
    ParsedOutput,
    detect_parser,
    get_tool_parser,
    new_call_id,
)


def counter_ids() -> IdFactory:
    count = itertools.count()
    return lambda: f"call_{next(count):024x}"


def calls(out: ParsedOutput) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in out.tool_calls]


WEATHER = ("get_weather", '{"city":"Paris","unit":"celsius"}')
TIME = ("get_time", '{"tz":"Europe/Paris"}')
UNICODE = ("translate", '{"text":"Grüße, 世界 🌍","to":"ja"}')

# (text, content, calls): what the model wrote and what a client must see.
RECORDED: dict[str, list[tuple[str, str, list[tuple[str, str]]]]] = {
    "hermes": [
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "celsius"}}\n</tool_call>',
            "",
            [WEATHER],
        ),
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
            '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
            '{"tz": "Europe/Paris"}}\n</tool_call>\n',
            "",
            [WEATHER, TIME],
        ),
        (
            'Let me check.\n\n<tool_call>\n{"name": "get_time", "arguments": {"tz": '
            '"Europe/Paris"}}\n</tool_call>\nDone.',
            "Let me check.\n\nDone.",
            [TIME],
        ),
        ("The capital of France is Paris.", "The capital of France is Paris.", []),
        (  # a brace short: the JSON never closes before the end tag
            '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}\n</tool_call>',
            '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}\n</tool_call>',
            [],
        ),
        (  # cut at the length limit
            'Checking.\n<tool_call>\n{"name": "get_weather", "argum',
            'Checking.\n<tool_call>\n{"name": "get_weather", "argum',
            [],
        ),
        ("See <tool_", "See <tool_", []),
        (  # complete JSON, end tag cut: the call stands
            '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool',
            "",
            [TIME],
        ),
        (
            '<tool_call>\n{"name": "translate", "arguments": {"text": "Grüße, 世界 🌍", '
            '"to": "ja"}}\n</tool_call>',
            "",
            [UNICODE],
        ),
        (  # the end tag inside an argument string, escapes, a raw newline
            '<tool_call>\n{"name": "run", "arguments": {"code": "print(\\"</tool_call>\\")\n'
            'x = 1"}}\n</tool_call>',
            "",
            [("run", '{"code":"print(\\"</tool_call>\\")\\nx = 1"}')],
        ),
        (  # arguments as a JSON string
            '<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": \\"Europe/Paris\\"}"}'
            "\n</tool_call>",
            "",
            [TIME],
        ),
        (  # not the call shape (no arguments), then a good call
            '<tool_call>\n{"name": "x"}\n</tool_call><tool_call>{"name": "get_time", '
            '"arguments": {"tz": "Europe/Paris"}}</tool_call>',
            '<tool_call>\n{"name": "x"}\n</tool_call>',
            [TIME],
        ),
        ("<tool_call> is the tag I use.", "<tool_call> is the tag I use.", []),
    ],
    "llama3_json": [
        (
            '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
            "",
            [WEATHER],
        ),
        (
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
            '"celsius"}}; {"name": "get_time", "parameters": {"tz": "Europe/Paris"}}',
            "",
            [WEATHER, TIME],
        ),
        (
            'Sure. <|python_tag|>{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}',
            "Sure. ",
            [TIME],
        ),
        ("It is sunny in Paris.", "It is sunny in Paris.", []),
        ('{"answer": 42}', '{"answer": 42}', []),  # a JSON answer, not a call
        ('Use {"name": "x", "parameters": {}}', 'Use {"name": "x", "parameters": {}}', []),
        (
            '<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC",}}',
            '<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC",}}',
            [],
        ),
        (
            '{"name": "get_weather", "parameters": {"city": "Pa',
            '{"name": "get_weather", "parameters": {"city": "Pa',
            [],
        ),
        (
            '{"name": "translate", "parameters": {"text": "Grüße, 世界 🌍", "to": "ja"}}',
            "",
            [UNICODE],
        ),
        ("Done<|python", "Done<|python", []),
    ],
    "mistral": [
        (
            '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "celsius"}}]',
            "",
            [WEATHER],
        ),
        (
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
            '"celsius"}}, {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]',
            "",
            [WEATHER, TIME],
        ),
        (
            'I will look it up.[TOOL_CALLS][{"name": "get_time", "arguments": '
            '{"tz": "Europe/Paris"}}]',
            "I will look it up.",
            [TIME],
        ),
        ("Paris is in France.", "Paris is in France.", []),
        (  # a closing brace short: the list closes on an open object
            '[TOOL_CALLS] [{"name": "get_time", "arguments": {"tz": "UTC"}]',
            '[TOOL_CALLS] [{"name": "get_time", "arguments": {"tz": "UTC"}]',
            [],
        ),
        (
            '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}, {"name": "get_we',
            '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}, {"name": "get_we',
            [],
        ),
        (
            '[TOOL_CALLS] [{"name": "translate", "arguments": {"text": "Grüße, 世界 🌍", '
            '"to": "ja"}}]',
            "",
            [UNICODE],
        ),
        ("Answer [TOOL_", "Answer [TOOL_", []),
    ],
    "pythonic": [
        ('[get_weather(city="Paris", unit="celsius")]', "", [WEATHER]),
        (
            "[get_weather(city='Paris', unit='celsius'), get_time(tz=\"Europe/Paris\")]",
            "",
            [WEATHER, TIME],
        ),
        (
            'Let me look.<|python_start|>[get_time(tz="Europe/Paris")]<|python_end|>',
            "Let me look.",
            [TIME],
        ),
        ("See [1] and [get_weather].", "See [1] and [get_weather].", []),
        ("[1, 2, 3]", "[1, 2, 3]", []),
        ("[get_weather(city=Paris)]", "[get_weather(city=Paris)]", []),  # not a literal
        ('[get_weather("Paris")]', '[get_weather("Paris")]', []),  # positional
        ('[get_weather(city="Pa', '[get_weather(city="Pa', []),
        ('[translate(text="Grüße, 世界 🌍", to="ja")]', "", [UNICODE]),
        (
            "[search(q='a)b', opts={'n': [1, 2.5], 'safe': True, 'x': null})]",
            "",
            [("search", '{"q":"a)b","opts":{"n":[1,2.5],"safe":true,"x":null}}')],
        ),
        ("[get_weath", "[get_weath", []),
    ],
}
CASES = [(name, *case) for name, cases in RECORDED.items() for case in cases]


@pytest.mark.parametrize("parser_name, text, content, expected", CASES)
def test_recorded_outputs(parser_name, text, content, expected):
    out = get_tool_parser(parser_name).parse(text, counter_ids())
    assert (out.content, calls(out)) == (content, expected)
    assert [c.id for c in out.tool_calls] == [f"call_{i:024x}" for i in range(len(expected))]
    for call in out.tool_calls:
        assert json.loads(call.arguments) is not None
        assert call.to_openai()["function"] == {"name": call.name, "arguments": call.arguments}


def stream_parse(parser_name: str, pieces: list[str]) -> tuple[str, list[tuple[str, str, str]]]:
    """Content and (id, name, arguments) per call, rebuilt from the deltas as a client does."""
    stream = get_tool_parser(parser_name).stream(counter_ids())
    content, built = "", {}
    deltas = [d for piece in pieces for d in stream.feed(piece)] + stream.finish()
    for delta in deltas:
        if isinstance(delta, str):
            content += delta
            continue
        if "id" in delta:  # a call's first delta: index, id, type and the whole name
            assert delta["index"] == len(built) and delta["type"] == "function"
            built[delta["index"]] = [delta["id"], delta["function"]["name"], ""]
        else:
            assert set(delta["function"]) == {"arguments"}
            built[delta["index"]][2] += delta["function"]["arguments"]
    return content, [tuple(c) for c in built.values()]


def split_at(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def assert_stream_matches(parser_name: str, text: str, cuts: list[int]) -> None:
    whole = get_tool_parser(parser_name).parse(text, counter_ids())
    content, built = stream_parse(parser_name, split_at(text, cuts))
    assert content == whole.content
    assert built == [(c.id, c.name, c.arguments) for c in whole.tool_calls]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(CASES), st.data())
def test_stream_equals_whole_for_any_split(case, data):
    parser_name, text = case[0], case[1]
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text)))
    assert_stream_matches(parser_name, text, cuts)


def test_stream_char_by_char_holds_markup_back():
    text = RECORDED["hermes"][2][0]
    stream = get_tool_parser("hermes").stream(counter_ids())
    shown = "".join(d for ch in text for d in stream.feed(ch) if isinstance(d, str))
    assert "<" not in shown and shown.startswith("Let me check.")
    assert stream.tool_calls and stream.tool_calls[0].name == "get_time"


FRAGMENTS = [
    *"<tool_call> </tool_call> [TOOL_CALLS] <|python_tag|> <|python_start|> <|python_end|>".split(),
    *"{ } [ ] ( ) \" ' \\ , ; : = f( x=1 a".split(),
    ' "name": "f"',
    ' "arguments": {}',
    ' "parameters": {"x": 1}',
    " ",
    "\n",
    # whole calls of each format, so that calls, junk and cut markup meet
    '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>',
    '[TOOL_CALLS][{"name": "f", "arguments": {}}]',
    '{"name": "f", "parameters": {"s": "}"}}',
    "[f(x=1), g(s=']')]",
    "<|python_start|>[g()]<|python_end|>",
]


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(sorted(TOOL_PARSERS)),
    st.lists(st.sampled_from(FRAGMENTS), max_size=25).map("".join),
    st.data(),
)
def test_fuzzed_markup_never_raises_or_loses_text(parser_name, text, data):
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    assert_stream_matches(parser_name, text, cuts)
    out = get_tool_parser(parser_name).parse(text)
    if not out.tool_calls:
        assert out.content == text


def test_default_ids_look_like_openai():
    assert re.fullmatch(r"call_[0-9a-f]{24}", new_call_id())
    out = get_tool_parser("hermes").parse(RECORDED["hermes"][1][0])
    assert len({c.id for c in out.tool_calls}) == 2


@pytest.mark.parametrize(
    "parser_name, arguments",
    [
        ("hermes", '{"city": "Paris"}'),
        ("mistral", '{"city": "Paris"}'),
        ("llama3_json", '{"city": "Paris"}'),
        ("pythonic", 'city="Paris"'),
    ],
)
def test_grammar_markup_parses_back(parser_name, arguments):
    """What a constraint grammar built from trigger/begin/end makes, the parser reads."""
    parser = get_tool_parser(parser_name)
    begin = parser.begin("get_weather")
    assert begin.startswith(parser.trigger)
    one = begin + arguments + parser.call_end
    out = parser.parse(one + parser.separator + one)
    assert calls(out) == [("get_weather", '{"city":"Paris"}')] * 2 and out.content == ""


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")


@pytest.mark.parametrize(
    "template, expected",
    [
        (
            "{%- for tool in tools %}...<tool_call>\\n{{ tool_call | tojson }}\\n</tool_call>",
            "hermes",
        ),
        ("{{- '[TOOL_CALLS]' + tool_calls | tojson }}", "mistral"),
        ("{{- '<|python_tag|>' + tool_call.name }}", "llama3_json"),
        (
            'Respond in the format {"name": function name, "parameters": dictionary of '
            "argument name and its value}. Do not use variables.",
            "llama3_json",
        ),
        (
            "you MUST put it in the format of [func_name1(params_name1=params_value1, "
            "params_name2=params_value2...), func_name2(params)]",
            "pythonic",
        ),
        ("<tool_call>\\n<function={{ tool_call.name }}>", None),  # Qwen3-Coder's XML
        ("{{ message.content }}<|im_end|>", None),
    ],
)
def test_detect_parser(template, expected):
    assert detect_parser(template) == expected
