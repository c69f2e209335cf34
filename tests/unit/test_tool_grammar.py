"""Tool calls as structural tags (services/frontend/tool_grammar.py): each tag is compiled
by the worker's grammar compiler for the default model's vocabulary, and a GrammarMatcher
says which outputs it allows: valid calls in, wrong names, arguments that break the schema
and text where tool_choice allows none out."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from services.common.config import DEFAULT_MODEL_PATH
from services.frontend.tool_grammar import (
    CallMarkup,
    ToolGrammarError,
    tool_call_format,
    tool_structural_tag,
)
from services.worker.batch import Constraint
from services.worker.grammar.compiler import GrammarCompiler, TokenizerInfoSource

HERMES = CallMarkup(
    trigger="<tool_call>",
    begin='<tool_call>\n{"name": "{name}", "arguments": ',
    end="}\n</tool_call>",
)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now"}},  # no parameters: {} only
]
EOS = 0  # the default model's <|endoftext|>


def call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


PARIS = call("get_weather", '{"city": "Paris", "unit": "c"}')
NOW = call("now", "{}")


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(TokenizerInfoSource(DEFAULT_MODEL_PATH, 596, [EOS]), 32, 1)


def matcher(compiler: GrammarCompiler, tag: str | None) -> xgr.GrammarMatcher:
    assert tag is not None
    return xgr.GrammarMatcher(compiler.submit(Constraint("structural_tag", tag)).result(30))


def allows(compiler: GrammarCompiler, tag: str | None, output: str) -> bool:
    """Whether ``output`` is a whole output the tag allows (then EOS, or the grammar's end)."""
    m = matcher(compiler, tag)
    return m.accept_string(output) and (m.is_terminated() or m.accept_token(EOS))


def tag_for(choice, parallel: bool = True, tools=TOOLS) -> str | None:
    return tool_structural_tag(tools, choice, parallel, HERMES)


def test_auto_is_free_text_until_the_trigger_then_a_valid_call(compiler):
    tag = tag_for("auto")
    for ok in ("", "It is sunny.", PARIS, f"Let me look. {PARIS}", f"{PARIS}\n{NOW} done"):
        assert allows(compiler, tag, ok), ok
    for bad in (
        call("get_wether", '{"city": "Paris", "unit": "c"}'),  # no such function
        call("get_weather", '{"city": "Paris"}'),  # unit is required
        call("get_weather", '{"city": "Paris", "unit": "k"}'),  # not in the enum
        call("get_weather", '{"city": 3, "unit": "c"}'),  # not a string
        call("get_weather", '{"city": "Paris", "unit": "c", "x": 1}'),  # no such argument
        call("now", '{"a": 1}'),  # no parameters at all
        call("get_weather", '{"city": "Paris",     "unit": "c"}'),  # padding
    ):
        assert not allows(compiler, tag, bad), bad


def test_auto_without_parallel_calls_allows_one_call_and_nothing_after(compiler):
    tag = tag_for("auto", parallel=False)
    assert allows(compiler, tag, f"Sure. {PARIS}")
    assert not allows(compiler, tag, f"{PARIS}\n{NOW}")
    assert not allows(compiler, tag, f"{PARIS} and more text")


def test_required_is_calls_only(compiler):
    tag = tag_for("required")
    assert allows(compiler, tag, PARIS) and allows(compiler, tag, f"{PARIS}\n{NOW}")
    for bad in ("", "Sure.", f"Sure. {PARIS}", f"{PARIS} done", f"{PARIS}{NOW}"):
        assert not allows(compiler, tag, bad), bad
    one = tag_for("required", parallel=False)
    assert allows(compiler, one, NOW) and not allows(compiler, one, f"{PARIS}\n{NOW}")


def test_named_function_is_exactly_that_call(compiler):
    tag = tag_for({"type": "function", "function": {"name": "get_weather"}})
    assert allows(compiler, tag, PARIS)
    for bad in (NOW, f"{PARIS}\n{PARIS}", f"x{PARIS}", ""):
        assert not allows(compiler, tag, bad), bad


def test_markup_with_the_name_in_the_end_and_a_separator():
    llama = CallMarkup("<function=", "<function={name}>", "</function={name}>", separator="")
    fmt = tool_call_format(TOOLS[:1], "required", True, llama)
    assert fmt is not None and fmt["separator"] == ""
    (tag,) = fmt["tags"]
    assert (tag["begin"], tag["end"]) == ("<function=get_weather>", "</function=get_weather>")


def test_nothing_to_constrain_is_none():
    assert tag_for("none") is None
    assert tag_for("auto", tools=[]) is None


@pytest.mark.parametrize(
    ("tools", "choice", "param", "needle"),
    [
        ([], "required", "tool_choice", "at least one tool"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice", "'nope'"),
        (TOOLS, "sometimes", "tool_choice", "must be"),
        (TOOLS, {"type": "function"}, "tool_choice", "must be"),
        ([TOOLS[0], TOOLS[0]], "auto", "tools", "given twice"),
        ([{"type": "function", "function": {"name": 'a"b'}}], "auto", "tools", "tools[0]"),
        ([{"type": "retrieval"}], "auto", "tools", "'function'"),
        ([{"type": "function"}], "auto", "tools", "function is required"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
            "auto",
            "tools",
            "JSON Schema object",
        ),
    ],
)
def test_bad_tools_or_choice_name_the_param(tools, choice, param, needle):
    with pytest.raises(ToolGrammarError) as err:
        tag_for(choice, tools=tools)
    assert err.value.param == param and needle in str(err.value)


def test_a_begin_without_the_trigger_is_the_markups_fault():
    bad = CallMarkup("<tool_call>", '{"name": "{name}", "arguments": ', "}")
    with pytest.raises(ValueError, match="must start with"):
        tool_structural_tag(TOOLS, "auto", True, bad)


def test_the_tag_is_xgrammars_json():
    tag = json.loads(tag_for("auto") or "")
    assert tag["type"] == "structural_tag" and tag["format"]["type"] == "triggered_tags"
    assert xgr.StructuralTag.from_json(tag).format.type == "triggered_tags"
